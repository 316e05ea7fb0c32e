"""Failpoints: the N-th pass through a named moment SIGKILLs the process, nothing else does."""

import os
import signal
import subprocess
import sys

import pytest
from fake_grid import FakeGrid, small_config

from fedrl.clients.client_app import app as client_app
from fedrl.failpoints import ENV, parse
from fedrl.strategies.coordinator import run_coordinator

PASSES = """
from fedrl.failpoints import failpoint
for i in range(5):
    failpoint("publish")
    print(i, flush=True)
"""


def run(spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV: spec}
    return subprocess.run([sys.executable, "-c", PASSES], env=env, capture_output=True, text=True, timeout=60)


def test_the_nth_pass_kills_the_process_with_sigkill():
    done = run("publish:3")
    assert done.returncode == -signal.SIGKILL and done.stdout.split() == ["0", "1"]
    assert run("publish").stdout.split() == []  # N defaults to 1
    other = run("aggregate:1")  # another failpoint's name: this one never fires
    assert other.returncode == 0 and other.stdout.split() == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("spec", ["bogus", "publish:0", "publish:x", "checkpoint-write:-1"])
def test_a_malformed_spec_is_a_clear_error(spec):
    with pytest.raises(ValueError, match=ENV):
        parse(spec)


def test_the_coordinator_refuses_a_malformed_spec_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "aggregat:2")
    with pytest.raises(ValueError, match="unknown failpoint 'aggregat'"):
        run_coordinator(FakeGrid(3, client_app), small_config(tmp_path))
    assert not (tmp_path / "run" / "checkpoints").exists()
