"""What a ServerApp run under Flower's CLI tells its user (`flwr run --stream`, `flwr log`): a line
per held-out evaluation, then the result and where it is; and a warning first when the run
imports packages Flower installed for it instead of the user's own (fedrl.runtime_env)."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from fake_grid import FakeGrid, small_config
from flwr.app import Context, RecordDict

from fedrl.clients.client_app import app as client_app
from fedrl.runtime_env import DISABLE, installed_for_the_run, runtime_env_warning
from fedrl.strategies.best_adapter import best_adapter_note
from fedrl.strategies.progress_log import eval_line, finished_line


@pytest.fixture
def fedrl_logger():
    """`start_log` configures the "fedrl" logger for the process, as a ServerApp's is: put back."""
    logger = logging.getLogger("fedrl")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = handlers, level


def test_the_deployment_server_app_logs_each_eval_then_the_result(tmp_path, caplog, fedrl_logger):
    from fedrl.strategies.server_app import make_server_app

    cfg = small_config(tmp_path, versions=4, eval_every=2, min_nodes=2)
    run_config = {k.replace("_", "-"): v for k, v in cfg.model_dump().items()}  # as `flwr run` hands it
    context = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with caplog.at_level(logging.INFO, logger="fedrl"):
        make_server_app()(FakeGrid(2, client_app), context)
    lines = [r.getMessage() for r in caplog.records if r.name == "fedrl.progress"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # versions 0, 2 and 4, each once, in order (each hook call logs only the evals it has not),
    # then the final eval, made once the replies in flight were merged
    evaluated = [0, 2, 4] + ([summary["versions"]] if summary["versions"] not in (0, 2, 4) else [])
    assert [line.split(":")[1] for line in lines[:-1]] == [f" version {v} of 4" for v in evaluated], lines
    assert f"held-out error {summary['final_eval']:.3f} at" in lines[-2]
    assert all("on the real clock" in line and "replies" in line for line in lines[:-1])
    assert lines[-1].startswith("fedrl: finished: held-out error ")
    said = f"summary in {(tmp_path / 'run' / 'summary.json').resolve()}"
    assert lines[-1].endswith(said + (f"; {note}" if (note := best_adapter_note(summary)) else "")), lines[-1]
    assert (tmp_path / "run" / "summary.json").exists()  # where the line says


def test_the_lines_say_the_figures():
    evaluation = {"version": 4, "error": 0.6406, "t": 7.24}
    assert eval_line(evaluation, 12, "virtual", 10, 1) == (
        "fedrl: version 4 of 12: held-out error 0.641 at 7.2 s on the virtual clock (10 replies, 1 refused)"
    )
    summary = {"initial_eval": 0.69, "final_eval": 0.25, "versions": 13, "time_s": 329.66, "clock": "virtual"}
    done = finished_line({**summary, "stop_reason": ""}, "report r.html")
    assert done == (
        "fedrl: finished: held-out error 0.690 -> 0.250 in 13 versions, 329.7 s on the virtual clock; "
        "report r.html"
    )
    stalled = finished_line({**summary, "stop_reason": "every reply refused"}, "x")
    assert "clock (stopped early: every reply refused); x" in stalled
    best = {"version": 9, "error": 0.125, "adapter_dir": "/r/adapter-best"}  # not the final version
    swung = finished_line({**summary, "best_adapter": best}, "x")
    assert swung.endswith("; x; the held-out error was lowest, 0.125 at v9, in the adapter /r/adapter-best")


def test_a_module_from_an_environment_activated_over_the_interpreters_own_is_told_apart(tmp_path):
    own, run_env = tmp_path / "venv", tmp_path / "runtime-envs" / "42"
    module = run_env / "lib" / "site-packages" / "torch" / "__init__.py"
    assert installed_for_the_run(str(own), str(run_env), str(module))
    assert not installed_for_the_run(str(own), None, str(module))  # no environment activated
    assert not installed_for_the_run(str(own), "", str(module))
    assert not installed_for_the_run(str(own), str(own), str(own / "lib" / "torch.py"))  # the user's venv
    elsewhere = tmp_path / "site" / "torch" / "__init__.py"  # activated, but the module is not from it
    assert not installed_for_the_run(str(own), str(run_env), str(elsewhere))


def test_the_warning_names_torch_its_environment_and_the_setting(monkeypatch):
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    assert runtime_env_warning() is None
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)  # the user's own venv, activated
    assert runtime_env_warning() is None
    # what Flower's runtime environment looks like from inside: VIRTUAL_ENV holds the torch this
    # process imported, and the interpreter's prefix is elsewhere
    packages = str(Path(torch.__file__).parents[1])
    monkeypatch.setenv("VIRTUAL_ENV", packages)
    monkeypatch.setattr(sys, "prefix", str(Path(packages) / "no-such-prefix"))
    warning = runtime_env_warning()
    assert warning.startswith(f"this run imports torch {torch.__version__} and fedrl's other dependencies")
    assert packages in warning and f"{DISABLE}=1" in warning
