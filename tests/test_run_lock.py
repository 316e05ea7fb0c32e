"""One coordinator a run folder (strategies/run_lock.py): a second one, in this process or
another, is refused with the holder named and touches nothing, even once the holder's record is
deleted; a holder killed outright (SIGKILL) leaves the folder free for the resume."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from fake_grid import FakeGrid, small_config

from fedrl.clients.client_app import app as client_app
from fedrl.strategies.coordinator import Coordinator, run_coordinator
from fedrl.strategies.run_lock import LOCK_FILE, RunLockedError, hold_run_lock, release

HOLDER = textwrap.dedent("""
    import sys, time
    from fedrl.strategies.run_lock import hold_run_lock
    hold_run_lock(sys.argv[1])
    print("held", flush=True)
    time.sleep(120)
""")


def test_a_folder_held_by_a_process_killed_outright_is_free_again(tmp_path):
    argv = [sys.executable, "-c", HOLDER, str(tmp_path)]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid} on .*another out_dir"):
            hold_run_lock(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (tmp_path / LOCK_FILE).exists()  # the killed holder's record stays behind...
    lock = hold_run_lock(tmp_path)  # ...but the kernel let go of the lock with the process
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
    release(lock)


def test_a_folder_whose_holder_record_was_deleted_or_cut_short_is_still_locked(tmp_path):
    lock = hold_run_lock(tmp_path)
    try:
        (tmp_path / LOCK_FILE).write_text('{"pid": 12')  # as a holder between its lock and its record
        with pytest.raises(RunLockedError, match="left no record"):
            hold_run_lock(tmp_path)
        (tmp_path / LOCK_FILE).unlink()  # a user tidying the folder while the run goes on
        with pytest.raises(RunLockedError, match="left no record"):
            hold_run_lock(tmp_path)
        assert not (tmp_path / LOCK_FILE).exists()  # the refused one wrote nothing
    finally:
        release(lock)
    release(hold_run_lock(tmp_path))
    assert not (tmp_path / LOCK_FILE).exists()  # a coordinator that let go takes its record along


def test_a_second_coordinator_on_a_run_folder_is_refused_and_touches_nothing(tmp_path):
    cfg = small_config(tmp_path, checkpoint_dir=str(tmp_path / "shared-checkpoints"))
    with Coordinator(FakeGrid(3, client_app), cfg):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on "):
            Coordinator(FakeGrid(3, client_app), cfg)
        # another out_dir, the same checkpoint_dir: refused before it clears the folder's leftovers
        leftover = tmp_path / "shared-checkpoints" / "ckpt-00000001.safetensors.tmp"  # a write under way
        leftover.write_bytes(b"half a checkpoint")
        with pytest.raises(RunLockedError, match="shared-checkpoints is another coordinator's"):
            Coordinator(FakeGrid(3, client_app), cfg.replace(out_dir=str(tmp_path / "other")))
        assert leftover.read_bytes() == b"half a checkpoint"
        leftover.unlink()
    # closed, it let go: the same run goes on in the same folder
    summary = run_coordinator(FakeGrid(3, client_app), cfg.replace(versions=2))
    assert summary["versions"] >= 2 and not summary["stop_reason"], summary["stop_reason"]


def test_where_a_folder_cannot_be_locked_its_record_is_the_lock(tmp_path, monkeypatch):
    import errno
    import fcntl
    import stat

    from fedrl.strategies import run_lock

    real_flock = fcntl.flock

    def flock(fd, operation):  # as NFS answers a lock on a descriptor not open for writing
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real_flock(fd, operation)

    monkeypatch.setattr(run_lock.fcntl, "flock", flock)
    lock = hold_run_lock(tmp_path)
    try:
        assert stat.S_ISREG(os.fstat(lock.fd).st_mode)
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on "):
            hold_run_lock(tmp_path)
    finally:
        release(lock)
    release(hold_run_lock(tmp_path))
