"""Failures surface with their reason and leave nothing running: checkpoint writes, compute
errors beside a running comm thread, busy ports, half-done set-ups."""

import json
import shutil
import socket
import threading
import time

import pytest
import torch
from fake_grid import FakeGrid, small_config

from fedrl.clients.client_app import app as client_app
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.strategies.checkpoint import Checkpointer, CheckpointError
from fedrl.strategies.coordinator import Coordinator, run_coordinator


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def _break(directory):
    shutil.rmtree(directory)
    directory.write_text("not a directory")  # every later write fails, even for root


def test_a_failed_checkpoint_write_is_raised_by_the_next_save_and_by_flush(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    ck.save_async(1, {"w": torch.ones(2)}, {})
    ck.flush()
    _break(tmp_path / "ck")
    ck.save_async(2, {"w": torch.ones(2)}, {})
    with pytest.raises(CheckpointError, match="version 2 .* failed"):
        ck.flush()
    with pytest.raises(CheckpointError, match="version 2"):
        ck.save_async(3, {"w": torch.ones(2)}, {})
    ck.close()
    assert not ck._thread.is_alive()


def test_the_run_stops_with_the_checkpoint_error_and_keeps_its_results(tmp_path):
    class BreakingGrid(FakeGrid):
        def pull_messages(self, ids):
            if (tmp_path / "run" / "checkpoints").is_dir() and list(
                (tmp_path / "run" / "checkpoints").glob("*.json")
            ):
                _break(tmp_path / "run" / "checkpoints")
            return super().pull_messages(ids)

    cfg = small_config(tmp_path, versions=20, buffer_size=1)
    before = set(threading.enumerate())
    with pytest.raises(CheckpointError, match="failed"):
        run_coordinator(BreakingGrid(3, client_app), cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "failed" in summary["stop_reason"] and summary["versions"] < 20
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    names = ("checkpointer", "patch-store", "store-client")
    assert not [t for t in set(threading.enumerate()) - before if t.name in names]


def test_a_busy_port_is_a_clear_error_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(OSError, match=f"could not listen on 127.0.0.1:{port}"):
            PatchStoreServer(StoreState(b"s" * 32), port=port).start()
        assert time.monotonic() - start < 10  # before: a bare "did not start" after 30 s
    assert not [t for t in threading.enumerate() if t.name == "patch-store"]


def test_a_failing_setup_closes_what_it_started(tmp_path, monkeypatch):
    def no_checkpoints(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr("fedrl.strategies.coordinator.Checkpointer", no_checkpoints)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(OSError, match="disk gone"):
        Coordinator(FakeGrid(3, client_app), small_config(tmp_path))
    time.sleep(0.2)
    leaked = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not leaked & {"patch-store", "store-client"}


def test_a_compute_error_joins_the_comm_thread_first(tmp_path, monkeypatch):
    """Before: the exception left handle() while the comm thread still ran."""
    from fedrl.clients import block_worker
    from fedrl.clients.block_worker import handle
    from fedrl.clients.runtime import use_runtime
    from fedrl.sim.bench.overlap import Federation
    from fedrl.sim.profiles import ClientProfile
    from fedrl.sim.simulated_client import SimulatedRuntime

    def fail_at_once(*args, **kwargs):  # every instruction that can be built trains
        raise ValueError("compute failed at once")

    monkeypatch.setattr(block_worker, "train_steps", fail_at_once)
    fed = Federation()
    try:
        instr = fed.instruction("parablock", steps=2)
        slow = ClientProfile(up_bytes_s=20e3, down_bytes_s=20e3)  # the upload takes ~1 s
        with use_runtime(SimulatedRuntime(slow, virtual=False, step_s=1.0)):
            with pytest.raises(ValueError, match="compute failed at once"):
                handle(instr, fed.state, fed.models)
        assert not [t for t in threading.enumerate() if t.name == "comm"]
    finally:
        fed.close()
