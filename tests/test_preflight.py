"""The volunteer's preflight: each check's verdict from its facts, and the facts measured for
real against a TLS patch store on loopback (its clock, its certificate, a closed port)."""

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_volunteer import LEARNER

from fedrl.certs import make_ca, make_server_cert
from fedrl.credentials import CLOCK_SKEW_S, new_secret
from fedrl.invite import make_invite
from fedrl.patch_store import PatchStoreServer, StoreState, ssl_context
from fedrl.volunteer.preflight import (
    FAIL,
    PASS,
    WARN,
    clock_check,
    disk_check,
    failed,
    memory_check,
    preflight_table,
    python_check,
    reach_check,
    run_preflight,
    store_clock,
    tls_handshake,
)
from fedrl.volunteer.probe import Limits


@pytest.mark.parametrize(
    "check,verdict",
    [
        (python_check((3, 10, 4)), FAIL),
        (python_check((3, 11, 9)), PASS),
        (memory_check(16_000, 9_000, 0), PASS),
        (memory_check(16_000, 9_000, 4_000), PASS),
        (memory_check(16_000, 9_000, 32_000), FAIL),  # a cap above what the machine has
        (memory_check(16_000, 600, 0), WARN),
        (memory_check(16_000, 600, 500), PASS),  # the cap the volunteer set fits in what is free
        (disk_check(100, Path("/x")), FAIL),
        (disk_check(5_000, Path("/x")), PASS),
        (clock_check(None, "no store"), WARN),
        (clock_check(2.0), PASS),
        (clock_check(-0.6 * CLOCK_SKEW_S), WARN),
        (clock_check(CLOCK_SKEW_S + 1), FAIL),  # Flower's node auth and the store's tokens refuse it
        (clock_check(-(CLOCK_SKEW_S + 1)), FAIL),
        (reach_check("SuperLink", "h:1", None, "refused"), FAIL),
        (reach_check("SuperLink", "h:1", 0.01), PASS),
    ],
)
def test_each_check_says_pass_warn_or_fail_from_its_facts(check, verdict):
    assert check.verdict == verdict, check


@pytest.fixture
def tls_store(tmp_path):
    make_server_cert(tmp_path, ["127.0.0.1", "localhost"])
    tls = ssl_context(str(tmp_path / "server.pem"), str(tmp_path / "server.key"))
    with PatchStoreServer(StoreState(new_secret()), tls=tls) as server:
        yield server.url.replace("http://", "https://"), tmp_path / "ca.pem"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_store_clock_and_tls_are_measured_against_the_run_ca(tls_store, tmp_path):
    url, ca = tls_store
    seconds, skew = asyncio.run(store_clock(url, str(ca)))
    assert 0 < seconds < 5 and abs(skew) < 2.5, (seconds, skew)  # one clock: the Date header's second
    port = int(url.rsplit(":", 1)[1])
    assert 0 < tls_handshake("127.0.0.1", port, str(ca)) < 5
    other = tmp_path / "other"
    other.mkdir()
    make_ca(other)  # a CA that did not sign the store's certificate
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        tls_handshake("127.0.0.1", port, str(other / "ca.pem"))
    with pytest.raises(ConnectionRefusedError):
        tls_handshake("127.0.0.1", closed_port(), str(ca))


def test_a_preflight_passes_with_both_services_up_and_names_the_one_that_is_not(tls_store, tmp_path):
    url, ca = tls_store
    port = url.rsplit(":", 1)[1]
    # any TLS server with the run's certificate stands in for the SuperLink's handshake
    invite = make_invite("r", f"127.0.0.1:{port}", url, ca, new_secret(), **LEARNER)
    checks = run_preflight(invite, str(ca), Limits(), tmp_path / "home")
    verdicts = {c.name: c.verdict for c in checks}
    assert verdicts["patch store"] == verdicts["SuperLink"] == verdicts["clock"] == PASS, checks
    assert not failed(checks) or {c.name for c in failed(checks)} <= {"disk"}, checks
    down = make_invite("r", f"127.0.0.1:{closed_port()}", url, ca, new_secret(), **LEARNER)
    checks = run_preflight(down, str(ca), Limits(), tmp_path / "home")
    assert [c.name for c in failed(checks)] == ["SuperLink"], checks
    assert "cannot reach the SuperLink" in preflight_table(checks)


def test_the_cli_prints_the_preflight_and_fails_on_an_unreachable_store(tmp_path):
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    make_ca(ca_dir)
    port = closed_port()
    invite = make_invite(
        "r", f"127.0.0.1:{port}", f"https://127.0.0.1:{port}", ca_dir / "ca.pem", new_secret(), **LEARNER
    )
    fedrl = [sys.executable, "-m", "fedrl.cli"]
    out = subprocess.run(
        [*fedrl, "volunteer", "preflight", invite.encode(), "--home", str(tmp_path / "home")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    lines = {line.split()[1]: line.split()[0] for line in out.stdout.splitlines() if len(line.split()) > 1}
    assert lines["python"] == PASS and lines["patch"] == FAIL and lines["SuperLink"] == FAIL, out.stdout


@pytest.mark.parametrize(
    "limits, message",
    [
        (dict(upload_kbps=float("nan")), "limits must be finite numbers >= 0"),
        (dict(max_memory_mb=-1.0), "limits must be finite numbers >= 0"),
        (dict(round_s=float("nan")), "round_s must be a finite number > 0, got nan"),
        (dict(round_s=0.0), "round_s must be a finite number > 0, got 0.0"),
    ],
)
def test_limits_that_bound_nothing_are_refused(limits, message):
    """Before: NaN passed every `< 0` check, so `--round-s nan` reached the probe."""
    with pytest.raises(ValueError, match=message):
        Limits(**limits)
