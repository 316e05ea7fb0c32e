import argparse
import json
import socket
import subprocess
import sys

import pytest
from cli_process import run_fedrl, run_main_light

from fedrl.cli.main import main


def test_help_lists_subcommands():
    out = run_fedrl("--help")
    assert out.returncode == 0
    for name in ("models", "prepare", "eval", "sim", "bench"):
        assert name in out.stdout


def test_eval_prints_json_metric():
    out = run_fedrl(
        "eval",
        "--model",
        "tiny-base",
        "--task",
        "reversal",
        "--task-params",
        '{"length": 4}',
        "--limit",
        "32",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["problems"] == 16 and result["greedy_error"] <= 0.1


def test_bad_task_is_a_clear_error_before_the_model_loads():
    """Before: 10.5 s to say so, the model loaded first."""
    code = (
        "import sys; from fedrl.cli.main import main; rc = main(['eval', '--task', 'chess']); "
        "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2 []" and "unknown task 'chess'" in out.stderr, out.stdout + out.stderr
    out = subprocess.run(
        [sys.executable, "-c", code.replace("'chess'", "'reversal', '--task-params', '{bad'")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "2 []" and "--task-params must be JSON, got '{bad'" in out.stderr, out.stderr


def test_sim_lists_scenarios_and_refuses_unknown_ones_clearly():
    out = run_fedrl("sim", "--list")
    assert out.returncode == 0 and "mixed-volunteers" in out.stdout and "default" in out.stdout
    out = run_fedrl("sim", "--scenario", "atlantis")
    assert out.returncode == 2 and "unknown scenario 'atlantis'" in out.stderr


def test_help_imports_no_heavy_module():
    """Before: 3.6 s, every benchmark imported (torch, flwr) just to build the parser."""
    code = (
        "import sys; from fedrl.cli.main import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in ('torch', 'flwr', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_wrong_override_type_is_one_line():
    out = run_fedrl("sim", "--set", "versions=many")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (
        "versions: Input should be a valid integer" in out.stderr
        and len(out.stderr.strip().splitlines()) == 1
    )


def test_a_benchmarks_wrong_override_is_one_line_naming_the_run_config(capsys):
    """Before: `RunConfig: ...` from `--set`, and a bad budget several lines of pydantic's."""
    assert main(["bench", "methods", "--quick", "--set", "versions=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("run config: versions must be >= 1, got 0") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sim", "--clients", "0"], "argument --clients: must be >= 1, got 0"),
        (["eval", "--limit", "-3"], "argument --limit: must be >= 0, got -3"),
        (["eval", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["bench", "methods", "--clients", "0"], "argument --clients: must be >= 1, got 0"),
        (["bench", "dg", "--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
        (["bench", "chaos", "--kills", "x"], "argument --kills: expected an integer, got 'x'"),
        (["bench", "scale", "--clients", "10", "0"], "argument --clients: must be >= 1, got 0"),
        (["dashboard", ".", "--port", "99999"], "argument --port: must be <= 65535, got 99999"),
        (["bench", "methods", "--buggy", "2"], "argument --buggy: must be <= 1.0, got 2.0"),
        (
            ["bench", "methods", "--mismatched", "nan"],
            "argument --mismatched: must be a finite number, got nan",
        ),
        (["bench", "chaos", "--step-s", "-1"], "argument --step-s: must be >= 0.0, got -1.0"),
        (["bench", "pulse", "--level", "99"], "argument --level: must be <= 22, got 99"),
        (["volunteer", "join", "x", "--until", "2020-01-01"], "argument --until: 2020-01-01 is in the past"),
        (["volunteer", "join", "x", "--until", "soon"], "argument --until: expected an ISO 8601 time"),
        (["volunteer", "join", "x", "--hours", "-1"], "argument --hours: must be >= 0.0, got -1.0"),
        (["sim", "--dashboard", "-1"], "argument --dashboard: must be >= 0, got -1"),
        (["patch-store", "--secret-file", "s", "--max-node-mb", "0"], "argument --max-node-mb: must be >= 1"),
        (["bench", "async", "--budget-s", "0"], "argument --budget-s: must be > 0.0, got 0.0"),
        (["bench", "async", "--budget-s", "inf"], "argument --budget-s: must be a finite number, got inf"),
        (["bench", "async", "--target", "2"], "argument --target: must be <= 1.0, got 2.0"),
        (["bench", "async", "--upload-density", "0"], "argument --upload-density: must be > 0.0, got 0.0"),
        (["bench", "async", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["bench", "methods", "--lr", "0"], "argument --lr: must be > 0.0, got 0.0"),
        (["bench", "methods", "--strength", "1.5"], "argument --strength: must be <= 1.0, got 1.5"),
        (["bench", "scale", "--messages-per-client", "-1"], "argument --messages-per-client: must be > 0.0"),
        (["invite", "--valid-days", "-1"], "argument --valid-days: must be > 0.0, got -1.0"),
    ],
)
def test_a_count_or_port_out_of_range_is_refused_not_read_as_the_default(argv, message, capsys):
    """Before: `--clients 0` ran the default number of clients, `--limit -3` all problems but 3,
    `--port 99999` ended in a traceback from bind(), `bench async --budget-s 0` ran with no budget,
    `--target 2` was reached by every strategy at its first eval, and a negative `--seed` ended in
    a validation error several lines long."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_shares_of_faulty_clients_over_one_are_refused(capsys):
    """Before: `--buggy 0.6 --noisy 0.6` made 0.6 of the clients buggy and the rest noisy."""
    assert main(["bench", "methods", "--quick", "--buggy", "0.6", "--noisy", "0.6"]) == 2
    assert "shares of buggy, noisy, stale and mismatched clients add up to 1.2 > 1" in capsys.readouterr().err
    from fedrl.sim.bench.methods import volunteer_frictions

    shares = dict(buggy=0.05, noisy=0.55, stale=0.3, mismatched=0.1)  # in floats, 1.0000000000000002
    settings = dict(strength=0.3, actor_staleness=8, lag_across_rounds=False, logit_noise=0.5)
    frictions = volunteer_frictions(argparse.Namespace(**shares, **settings))
    assert [share for _, share, _ in frictions] == list(shares.values())


def test_a_local_deployment_without_nodes_or_volunteers_is_refused_before_it_starts(tmp_path, capsys):
    assert main(["deploy", "local", "--nodes", "0", "--dir", str(tmp_path)]) == 2
    assert "--nodes 0 leaves the run no node to train on" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_a_server_on_a_taken_port_announces_nothing_and_says_why(tmp_path):
    """Before: the store printed its URL (what a launcher waits for) and the dashboard its link,
    then failed to bind."""
    (tmp_path / "secret").write_bytes(b"s" * 64)
    (tmp_path / "events.jsonl").write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv in (
            ["patch-store", "--secret-file", str(tmp_path / "secret"), "--port", port],
            ["dashboard", str(tmp_path), "--port", port],
        ):
            out = run_fedrl(*argv, timeout=60)
            assert out.returncode == 2 and out.stdout == "", (argv, out.stdout)
            assert "address already in use" in out.stderr and "Traceback" not in out.stderr, out.stderr
        # the simulation starts Ray before its dashboard: it failed 18 s in, its link already printed
        out = run_fedrl("sim", "--dashboard", port, "--out", str(tmp_path / "sim"), timeout=60)
        assert out.returncode == 2 and "live dashboard" not in out.stdout, (out.stdout, out.stderr)
        assert f"port 127.0.0.1:{port}: Address already in use" in out.stderr, out.stderr
        assert not (tmp_path / "sim").exists()


def test_a_simulation_whose_output_path_cannot_be_a_folder_fails_before_it_starts(tmp_path):
    """Before: it failed 13 s in, once Ray was up and its progress bar shown."""
    (tmp_path / "a-file").write_text("")
    out = run_fedrl("sim", "--out", str(tmp_path / "a-file" / "run"), timeout=60)
    assert out.returncode == 2 and "Not a directory" in out.stderr and "%|" not in out.stderr, out.stderr


def test_service_commands_answer_without_importing_torch(tmp_path):
    """The operator's commands that serve or write files need none of torch, transformers, peft or
    flwr: before, `fedrl patch-store` imported torch (1.5 s), and `fedrl invite` and every
    `fedrl deploy` all four (2.6 s) just to read `--set`."""
    from fedrl.certs import make_ca
    from fedrl.credentials import load_or_create_secret

    make_ca(tmp_path)
    load_or_create_secret(tmp_path / "secret")
    store = ("--store-url", "https://127.0.0.1:9", "--ca-file", str(tmp_path / "ca.pem"))
    secret, none = ("--secret-file", str(tmp_path / "secret")), str(tmp_path / "none")
    invite = tmp_path / "invite.txt"
    link = ("--superlink", "127.0.0.1:9")
    for args, code, said in (
        (
            ("invite", "--run", "r", *link, *store, *secret, "--out", str(invite), "--set", "lr=0.001"),
            0,
            "invite for run 'r' written",
        ),
        (("patch-store", "--secret-file", none), 2, "cannot read the secret file"),
        (("approve", *link, *store[:2], "--ca-file", none, *secret), 2, "not found"),
        (("deploy", "submit", "--certs", str(tmp_path), "--set", "bogus=1"), 2, "unknown run config keys"),
        (("deploy", "node", "--certs", none), 2, "not found"),
    ):
        rc, heavy, text = run_main_light(*args)
        assert (rc, heavy) == (code, []) and said in text, (args, rc, heavy, text)
    assert invite.read_text().startswith("fedrl-invite:")
