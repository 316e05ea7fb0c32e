"""The deployment's pieces that need no running service: the app's run config, certificates
and node keys, and the clear errors of bad input (unknown keys, busy ports, missing files)."""

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
from compose_file import service_argv, services
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedrl.certs import make_deployment_credentials, make_node_key, make_server_cert
from fedrl.cli.main import build_parser
from fedrl.deploy.federation import (
    STATUS_EVERY_S,
    DeployError,
    Federation,
    app_config,
    failure_of,
    run_config,
)
from fedrl.ports import check_port_free
from fedrl.strategies.run_config import RunConfig


def test_the_deployment_app_accepts_every_run_config_key_with_its_default():
    app = {k.replace("-", "_"): v for k, v in app_config().items()}
    assert app == RunConfig().model_dump()
    RunConfig.from_mapping(app_config())  # and Flower's values parse as they are


def test_run_id_in_a_directory_becomes_flowers_run_id():
    """`flwr run .` twice made the same out-dir, and the second run was refused as a rerun of
    the first: its default out-dir now holds the run id. A fixed one still resumes its run."""
    cfg = RunConfig(out_dir="runs/flwr-{run_id}", checkpoint_dir="ck/{run_id}/c").in_run(42)
    assert (cfg.out_dir, cfg.checkpoint_dir, cfg.state_dir) == ("runs/flwr-42", "ck/42/c", "")
    assert RunConfig(out_dir="run").in_run(42).out_dir == "run"
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "{run_id}" in pyproject["tool"]["flwr"]["app"]["config"]["out-dir"]


def test_run_config_refuses_unknown_keys_and_takes_ints_for_floats():
    assert run_config({"deadline_s": 60, "versions": 3}) == {"deadline-s": 60.0, "versions": 3}
    with pytest.raises(ValueError, match="unknown run config keys \\['no-such-key'\\]"):
        run_config({"no-such-key": 1})


def test_a_run_config_with_several_mistakes_is_told_all_of_them_at_once():
    """Before: the first check that failed, then the next once it was fixed, and so on."""
    bad = {"mode": "ring", "lr": -1.0, "buffer_size": 0, "wire_dtype": "int7", "gate_tolerance": 2.0}
    with pytest.raises(ValueError) as err:
        RunConfig.parse(bad, "run config")
    said = str(err.value)
    assert said.startswith("run config: ") and "\n" not in said
    told = ["mode must be one of", "lr must be a finite number > 0", "buffer_size must be >= 1, got 0"]
    told += ["wire_dtype must be one of", "gate_tolerance is a drop in mean reward"]
    assert [problem in said for problem in told] == [True] * len(told), said
    fixed = {
        "mode": "parablock",
        "lr": 1e-4,
        "buffer_size": 1,
        "wire_dtype": "bfloat16",
        "gate_tolerance": 0.5,
    }
    RunConfig.parse(fixed)  # each fixed: none left


def test_a_busy_port_and_a_missing_ca_are_clear_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match=f"port 127.0.0.1:{s.getsockname()[1]}: Address already in use"):
            check_port_free("127.0.0.1", s.getsockname()[1])
    with pytest.raises(DeployError, match="not found"):
        Federation(tmp_path / "home", "127.0.0.1:1", tmp_path / "ca.pem")


def test_certificates_chain_to_the_ca_and_name_their_hosts(tmp_path):
    folder = make_deployment_credentials(tmp_path / "c", ["127.0.0.1", "superlink"], ["node-1"])
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["superlink"]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ssl.create_default_context(cafile=str(folder / "ca.pem")).load_cert_chain(
        folder / "server.pem", folder / "server.key"
    )  # the pair loads as a TLS server identity
    # node keys: OpenSSH private key and public key of one EC P-384 pair, private to the owner
    private = serialization.load_ssh_private_key((folder / "nodes" / "node-1.key").read_bytes(), None)
    public = serialization.load_ssh_public_key((folder / "nodes" / "node-1.pub").read_bytes())
    assert private.public_key().public_numbers() == public.public_numbers()
    assert private.curve.name == "secp384r1"
    assert (folder / "nodes" / "node-1.key").stat().st_mode & 0o077 == 0
    assert (folder / "store.secret").stat().st_mode & 0o077 == 0


def test_certificates_are_kept_and_remade_only_for_new_hosts(tmp_path):
    folder = make_deployment_credentials(tmp_path, ["127.0.0.1"])
    before = (folder / "server.pem").read_bytes(), (folder / "ca.pem").read_bytes()
    make_server_cert(folder, ["127.0.0.1"])
    assert (folder / "server.pem").read_bytes() == before[0]
    make_server_cert(folder, ["127.0.0.1", "store.example.org"])
    assert (folder / "server.pem").read_bytes() != before[0]
    assert (folder / "ca.pem").read_bytes() == before[1]  # same CA: nodes keep trusting it
    with pytest.raises(ValueError, match="node name"):
        make_node_key(folder, "../escape")


def test_fedrl_certs_and_patch_store_errors_on_the_command_line(tmp_path):
    def fedrl(*args):
        return subprocess.run([sys.executable, "-m", "fedrl.cli", *args], capture_output=True, text=True)

    out = fedrl("certs", "--dir", str(tmp_path / "c"), "--nodes", "a", "b")
    assert out.returncode == 0 and "nodes/a.pub" in out.stdout
    (tmp_path / "short").write_text("x")
    out = fedrl("patch-store", "--secret-file", str(tmp_path / "short"))
    assert out.returncode == 2 and "holds 1 bytes" in out.stderr
    out = fedrl(
        "patch-store",
        "--secret-file",
        str(tmp_path / "c" / "store.secret"),
        "--certfile",
        str(tmp_path / "missing.pem"),
        "--keyfile",
        str(tmp_path / "missing.key"),
    )
    assert out.returncode == 2 and "cannot be loaded" in out.stderr


def test_deploy_local_on_a_busy_port_says_so_and_leaves_nothing_running(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = subprocess.run(
            [sys.executable, "-m", "fedrl.cli", "deploy", "local", "--nodes", "1"]
            + ["--dir", str(tmp_path), "--port", str(s.getsockname()[1])],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2 and "superlink: port" in out.stderr and "already in use" in out.stderr
    store_pid = subprocess.run(["pgrep", "-f", f"--secret-file {tmp_path}"], capture_output=True, text=True)
    assert store_pid.stdout == ""  # the patch store it had started is gone


def test_the_compose_entry_points_refuse_bad_input_before_waiting(tmp_path):
    def fedrl(*args):
        cmd = [sys.executable, "-m", "fedrl.cli", "deploy", *args, "--home", str(tmp_path / "h")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    out = fedrl("submit", "--certs", str(tmp_path), "--set", "bogus=1")
    assert out.returncode == 2 and "unknown run config keys ['bogus']" in out.stderr
    out = fedrl("node", "--certs", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and "ca.pem not found" in out.stderr


def test_every_fedrl_command_of_the_compose_file_parses():
    parser = build_parser()
    commands = {name: service_argv(name, {}) for name, service in services().items() if "command" in service}
    fedrl = {name: argv for name, argv in commands.items() if argv[0] == "fedrl"}
    assert {"patch-store", "supernode", "submit", "invite", "approver"} <= set(fedrl)
    for name, argv in fedrl.items():
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"compose service {name}: `{' '.join(argv)}` does not parse")


def test_the_exception_a_failed_run_ended_with_is_read_from_its_log():
    log = """Using SuperLink: fedrl (127.0.0.1:52299)
ERROR :     ServerApp raised an exception
Traceback (most recent call last):
  File "/work/main/strategies/coordinator.py", line 375, in resume
    raise ValueError(
ValueError: the run in /tmp/dl1/run finished at v5, and versions=4 asks for no more
ERROR :     Exit Code: 201

An unhandled exception occurred in the ServerApp.
"""
    assert (
        failure_of(log)
        == "ValueError: the run in /tmp/dl1/run finished at v5, and versions=4 asks for no more"
    )
    assert failure_of(log.replace("ValueError", "fedrl.schema.SchemaError")).startswith(
        "fedrl.schema.SchemaError: "
    )
    assert failure_of("INFO : Start `flwr-serverapp` process\n") == ""


def test_waiting_for_a_run_asks_the_superlink_rarely_and_sees_the_end_in_its_events(tmp_path):
    """`flwr ls` costs about a CPU-second: asked once, then not again until the run's events say
    the coordinator finished (an earlier run's end, in the file before the run started it
    afresh, does not count); without the events the end would be seen at the next ask."""
    (tmp_path / "ca.pem").write_text("not read here")
    events = tmp_path / "events.jsonl"
    events.write_text((json.dumps({"kind": "finished", "wall": time.time() - 60}) + "\n") * 3)
    asked, ended = [], threading.Event()

    class Watched(Federation):
        def run_status(self, run_id):
            asked.append(time.monotonic())
            return "finished:completed" if ended.is_set() else "running"

    def finish() -> None:  # the new run's file: a start, then the coordinator's last event
        events.write_text(json.dumps({"kind": "started", "wall": time.time()}) + "\n")
        with events.open("a") as f:
            f.write(json.dumps({"kind": "finished", "wall": time.time()}) + "\n")
        ended.set()

    seen = []
    threading.Timer(1.5, finish).start()
    start = time.monotonic()
    status = Watched(tmp_path / "flwr", "127.0.0.1:9", tmp_path / "ca.pem").wait_run(
        7, 60, seen.append, events
    )
    assert status == "finished:completed" and len(asked) == 2, asked
    assert asked[1] - start < STATUS_EVERY_S - 2  # seen in the events, not at the next ask
    assert seen and set(seen) == {"running"}  # progress every second in between


def test_a_run_that_does_not_end_in_time_names_the_coordinators_last_events(tmp_path):
    """A stalled run's error says what the coordinator last did (a CI run once waited 500 s on a
    run and said only "still running")."""
    (tmp_path / "ca.pem").write_text("not read here")
    events = tmp_path / "events.jsonl"

    class Stalled(Federation):
        def run_status(self, run_id):
            return "running"

    federation = Stalled(tmp_path / "flwr", "127.0.0.1:9", tmp_path / "ca.pem")
    with pytest.raises(
        DeployError, match="still running after 1 s; the coordinator's last events: none written"
    ):
        federation.wait_run(7, 1, events=events)
    lines = [{"t": float(i), "kind": "reply", "node": 42, "version": i} for i in range(10)]
    lines.append({"t": 10.0, "kind": "left", "node": 42, "version": 9, "reason": "withdrew"})
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    with pytest.raises(DeployError) as err:
        federation.wait_run(7, 1, events=events)
    said = str(err.value).partition("last events: ")[2].split(" | ")
    assert len(said) == 8 and said[0] == "3.0 reply 42 3" and said[-1] == "10.0 left 42 9 withdrew", said


def test_a_local_deployments_nodes_share_the_cores_and_a_clientapp_keeps_to_its_threads(tmp_path):
    """Two nodes of `fedrl deploy local --nodes 2` with torch's default threads (every core each)
    trained 10-18x slower on 2 cores than with one each: OpenMP's threads spun in their waits. The
    coordinator gets the cores the nodes leave."""
    import torch
    from fake_grid import FakeGrid, small_config

    from fedrl.clients.client_app import app as client_app
    from fedrl.cores import usable_cores
    from fedrl.deploy.local import LocalDeployment
    from fedrl.strategies.coordinator import run_coordinator

    cores = usable_cores()
    # the nodes' threads within the cores (one each where there are too few), the coordinator's the rest
    for nodes in sorted({0, 1, 2, cores, cores + 1, 3 * cores}):
        d = LocalDeployment(tmp_path / "d", nodes=nodes)
        assert nodes * d.node_threads() <= max(cores, nodes) and d.node_threads() >= 1, nodes
        assert d.server_threads() == max(1, cores - nodes * d.node_threads()), nodes
    assert LocalDeployment(tmp_path / "d", nodes=1).node_threads() == cores  # one node: every core
    # a service started with threads has them in OMP_NUM_THREADS (the SuperLink, for its ServerApp)
    d = LocalDeployment(tmp_path / "d", nodes=2)
    omp = [
        sys.executable,
        "-c",
        "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])",
    ]
    d.start("omp", omp, threads=3).wait(30)
    assert (d.logs / "omp.log").read_text().strip() == "3 3"
    threads = []

    def script(node, msg, reply):  # right after the node's ClientApp returned, in this process
        threads.append(torch.get_num_threads())
        return reply

    grid = FakeGrid(1, client_app, script)
    grid.contexts[1].node_config["max-threads"] = 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_coordinator(grid, small_config(tmp_path, min_nodes=1, versions=1, buffer_size=1, sync=False))
    finally:
        torch.set_num_threads(before)
    assert threads and set(threads) == {1}, threads
