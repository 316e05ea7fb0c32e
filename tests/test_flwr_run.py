"""`flwr run . --stream`, Flower's own entry point to the simulation: the CLI starts its managed
local SuperLink (simulation mode), which runs fedrl's ServerApp and ClientApps from
pyproject's [tool.flwr.app]. As the README says to run it: with
FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1, so the run uses this install, not packages
Flower would fetch for it. The SuperLink the CLI leaves running is stopped here."""

import json
import os
import re
import subprocess
from pathlib import Path

import psutil
import pytest

from fedrl.deploy.federation import tool
from fedrl.ports import free_port
from fedrl.runtime_env import DISABLE
from fedrl.strategies.best_adapter import best_adapter_note

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def superlinks_of(flwr_home: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if "flower-superlink" in cmdline and str(flwr_home) in cmdline:
            found.append(proc)
    return found


def test_flwr_run_streams_the_runs_progress_and_writes_its_report(tmp_path):
    home, out = tmp_path / "flwr-home", tmp_path / "run"
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1", **{DISABLE: "1"})
    # the managed SuperLink's ports, free ones (Flower's defaults may be a user's own local SuperLink)
    env.update(
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port("127.0.0.1")),
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port("127.0.0.1")),
    )
    argv = [tool("flwr"), "run", str(ROOT), "--stream", "-c", f'versions=4 out-dir="{out}"']
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        said = done.stdout + done.stderr
        assert done.returncode == 0, said[-3000:]
        # an eval every 4th version (the start's error is the tiny base's, which differs by CPU)
        first = re.search(
            r"fedrl: version 0 of 4: held-out error \d\.\d{3} at 0\.0 s on the virtual clock", said
        )
        assert first and "fedrl: version 4 of 4: held-out error" in said, said[-3000:]
        finished = [line for line in said.splitlines() if line.startswith("fedrl: finished: held-out error")]
        assert len(finished) == 1, said[-3000:]
        out = out.resolve()  # the line names it absolute
        assert (out / "report.html").exists() and (out / "summary.json").exists()
        files = f"report {out / 'report.html'}, adapter {out / 'adapter'}"
        note = best_adapter_note(json.loads((out / "summary.json").read_text()))  # when not the final
        assert finished[0].endswith(files + (f"; {note}" if note else "")), finished
        assert "installed for it from the package index" not in said  # this install, as asked
    finally:
        for proc in superlinks_of(home):
            proc.terminate()
            proc.wait(30)
    assert not superlinks_of(home)
