"""`fedrl volunteer leave`: one signal to a running volunteer, none to one already leaving, a
second with `--now`; then it says how the volunteer left. The signal protocol is tested here
against a stand-in process that keeps a session's files as `Session` does; the real session is
withdrawn this way in tests/test_volunteer_processes.py, and a real session asked to leave while
it waits for approval exits at once below."""

import io
import signal
import subprocess
import sys
import threading
import time

import pytest
from cli_process import run_main_light
from rich.console import Console
from test_volunteer import LEARNER

from fedrl.certs import make_ca, make_server_cert
from fedrl.credentials import new_secret
from fedrl.invite import InviteError, make_invite
from fedrl.node_files import LEAVE, STATUS, read_json, write_json
from fedrl.patch_store import PatchStoreServer, StoreState, ssl_context
from fedrl.volunteer.home import VolunteerHome
from fedrl.volunteer.node_status import EXIT_FAILED, EXIT_OK, how_it_left
from fedrl.volunteer.session import Session
from fedrl.volunteer.withdrawal import withdraw

# A volunteer's session as its files show it: its pid in session.json, LEAVE written on the first
# signal (and removed as a session starts and ends), and on leaving its last status and a clean
# session; a second signal stops it at once.
STAND_IN = """
import json, os, signal, sys, time
home, state, mode = sys.argv[1], sys.argv[2], sys.argv[5]
leave = os.path.join(state, "leave.json")
def write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
signals = []
def on_signal(signum, frame):
    signals.append(signum)
    with open(os.path.join(home, "signals"), "a") as f:
        f.write("TERM\\n")
    if len(signals) == 1:
        write(leave, {"on_exit": "flush", "at": time.time()})
    elif mode != "stubborn":
        os._exit(130)
signal.signal(signal.SIGTERM, on_signal)
if os.path.exists(leave):  # the last session's request
    os.remove(leave)
write(os.path.join(home, "session.json"), {"pid": os.getpid(), "started": time.time(), "clean": False})
open(os.path.join(home, "ready"), "w").close()
deadline = time.time() + 60
while time.time() < deadline:
    leaving = os.path.exists(leave)
    if leaving and mode in ("clean", "crash"):
        time.sleep(0.5)  # the round being finished and handed in
        if mode == "crash":
            sys.exit(1)
        write(os.path.join(state, "status.json"), {"phase": "left", "acknowledged": True})
        write(os.path.join(home, "session.json"), {"pid": os.getpid(), "ended": time.time(), "clean": True})
        os.remove(leave)
        sys.exit(0)
    time.sleep(0.05)
"""


@pytest.fixture
def home(tmp_path):
    home = VolunteerHome.for_run("r", tmp_path)
    for d in (home.config, home.state_dir, home.logs):
        d.mkdir(parents=True, exist_ok=True)
    return home


def stand_in(home: VolunteerHome, mode: str) -> subprocess.Popen:
    """The stand-in, named as `fedrl volunteer join` is (the home checks a pid's command line)."""
    argv = [sys.executable, "-c", STAND_IN, str(home.data), str(home.state_dir), "volunteer", "join", mode]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 30
    while not (home.data / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not start"
        time.sleep(0.05)
    return proc


def signals(home: VolunteerHome) -> int:
    path = home.data / "signals"
    return len(path.read_text().split()) if path.exists() else 0


def said(run) -> tuple[int, str]:
    out = io.StringIO()
    code = run(Console(file=out, width=400))
    return code, out.getvalue()


def test_with_no_volunteer_running_there_is_nothing_to_withdraw(home):
    assert said(lambda c: withdraw(home, console=c)) == (
        EXIT_OK,
        f"no volunteer runs on {home.data}: nothing to leave\n",
    )
    write_json(home.session, {"pid": 999_999_999, "clean": False})  # a crashed volunteer's session
    assert said(lambda c: withdraw(home, console=c))[0] == EXIT_OK


def test_one_signal_asks_the_volunteer_to_leave_and_its_way_out_is_reported(home):
    proc = stand_in(home, "clean")
    code, text = said(lambda c: withdraw(home, console=c))
    assert proc.wait(10) == 0 and code == EXIT_OK, text
    assert signals(home) == 1  # a second would have stopped it at once
    assert f"(pid {proc.pid}) left the federation cleanly (left, the coordinator said goodbye)" in text


def test_the_sdks_leave_finds_the_volunteer_by_its_invite_or_as_the_one_federation_joined(home, tmp_path):
    from fedrl.volunteer import leave

    make_ca(tmp_path)
    invite = make_invite(
        "r", "127.0.0.1:9", "https://127.0.0.1:9", tmp_path / "ca.pem", new_secret(), **LEARNER
    )
    with pytest.raises(InviteError, match="none joined yet"):
        leave(home=tmp_path)
    home.remember(invite)  # as join does
    for given in (invite, None):  # None: the one federation this machine joined
        proc = stand_in(home, "clean")
        code, text = said(lambda c, given=given: leave(given, home=tmp_path, console=c))
        assert proc.wait(10) == 0 and code == EXIT_OK and signals(home) == 1, text
        assert f"(pid {proc.pid}) left the federation cleanly" in text
        for mark in ("signals", "ready"):  # the next stand-in's
            (home.data / mark).unlink()


def test_a_volunteer_already_leaving_is_not_signalled_again(home):
    proc = stand_in(home, "clean")
    write_json(home.state_dir / LEAVE, {"on_exit": "flush", "at": time.time()})  # a Ctrl-C where it runs
    code, text = said(lambda c: withdraw(home, console=c))
    assert proc.wait(10) == 0 and code == EXIT_OK and signals(home) == 0, text
    assert "is already leaving" in text and "left the federation cleanly" in text


def test_now_is_the_second_signal_once_the_first_was_taken(home):
    proc = stand_in(home, "slow")  # it never finishes leaving by itself
    code, text = said(lambda c: withdraw(home, now=True, console=c))
    assert proc.wait(10) == 130 and code == EXIT_OK and signals(home) == 2, text
    assert f"(pid {proc.pid}) stopped at once; its cached work stays in {home.data}" in text


def test_a_volunteer_still_leaving_at_the_timeout_is_left_to_it_and_said(home):
    proc = stand_in(home, "stubborn")
    try:
        code, text = said(lambda c: withdraw(home, timeout_s=1.0, console=c))
        assert code == EXIT_FAILED and proc.poll() is None and signals(home) == 1, text
        assert "is still leaving after 1 s" in text and "fedrl volunteer leave --now" in text
    finally:
        proc.kill()
        proc.wait()


def test_a_volunteer_that_exits_without_leaving_cleanly_is_reported(home):
    proc = stand_in(home, "crash")
    code, text = said(lambda c: withdraw(home, console=c))
    assert proc.wait(10) == 1 and code == EXIT_FAILED, text
    assert "exited without leaving cleanly" in text and str(home.logs) in text


def test_a_session_asked_to_leave_while_it_waits_for_approval_exits_at_once(tmp_path):
    """Before, the request waited out the approval timeout (600 s by default), then the probe."""
    make_ca(tmp_path)
    make_server_cert(tmp_path, ["127.0.0.1"])
    secret = new_secret()
    tls = ssl_context(str(tmp_path / "server.pem"), str(tmp_path / "server.key"))
    with PatchStoreServer(StoreState(secret), tls=tls) as server:
        invite = make_invite("r", "127.0.0.1:9", server.url, tmp_path / "ca.pem", secret, **LEARNER)
        home = VolunteerHome.for_run(invite.run, tmp_path / "volunteer")
        out = io.StringIO()
        session = Session(invite, home, console=Console(file=out, width=400), approval_timeout_s=120.0)
        session.preflight = lambda: None  # no SuperLink here; the enrollment is the real one
        session.probe = lambda: pytest.fail("probed after it was asked to leave")
        asked = threading.Timer(1.0, lambda: signal.raise_signal(signal.SIGTERM))
        start = time.monotonic()
        asked.start()
        try:
            assert session.run() == EXIT_OK, out.getvalue()
        finally:
            asked.cancel()
    assert time.monotonic() - start < 10, out.getvalue()
    text = out.getvalue()
    assert "waiting for the operator to approve" in text and "left before the node started" in text
    assert home.last_session()["clean"] is True and not (home.state_dir / LEAVE).exists()
    status = read_json(home.state_dir / STATUS)
    assert (
        status["phase"] == "connecting" and how_it_left(status) == "before its node started"
    )  # as `leave` says


def test_status_and_leave_answer_without_importing_torch(tmp_path):
    """Before: 2.3 s for `fedrl volunteer status`, torch and peft imported with the join."""
    make_ca(tmp_path)
    invite = make_invite(
        "r", "127.0.0.1:9", "https://127.0.0.1:9", tmp_path / "ca.pem", new_secret(), **LEARNER
    )
    VolunteerHome.for_run(invite.run, tmp_path / "v").remember(invite)
    for action, said in (("status", "volunteer: not running"), ("leave", "nothing to leave")):
        rc, heavy, text = run_main_light("volunteer", action, "--home", str(tmp_path / "v"))
        assert (rc, heavy) == (0, []) and said in text, text
