"""The warm ClientApp launcher (fedrl.deploy.warm_clientapp) and its `flwr-clientapp` shim, as real
processes: a launch runs in a forked child with the launching process's argv, environment,
working directory and standard streams and ends with its exit code; signals reach the child;
a bad request or a failing app leaves the launcher serving; without a launcher the shim runs
Flower's own command; a launcher goes when its parent does. The real thing (Flower's
`flwr_clientapp` after torch, transformers and peft) runs in the deployment tests."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from waiting import wait_for

from fedrl.deploy.warm_clientapp import QUICK_DEATHS, RESTART_S, LauncherKeeper, WarmLauncher, prune_killed

TESTS = str(Path(__file__).parent)


def launcher_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(autouse=True)
def own_temp_root(monkeypatch, tmp_path_factory):
    """Launchers made here, and the prunes they run, stay in a root of this test's own: tests
    run in parallel (pytest-xdist) make and prune launchers of their own in the system's."""
    tmp_path_factory.getbasetemp()  # pytest's own root first, in the system's (this one goes)
    root = tempfile.mkdtemp(prefix="fw-")  # short: a launcher's socket path must fit AF_UNIX's 108 bytes
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def launcher():
    warm = WarmLauncher.create(entry="warm_entry:report", preload=("warm_entry",))
    proc = warm.start(launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(warm.ready, 60, "the launcher")
    yield warm, proc
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(warm.directory, ignore_errors=True)  # a killed launcher leaves it


def launch(warm: WarmLauncher, *args: str, stdin: str = "", cwd: str = "/", **popen):
    env = warm.env({**os.environ, "PROBE": "handed-over"})
    return subprocess.run(
        ["flwr-clientapp", *args], input=stdin, capture_output=True, text=True, env=env, cwd=cwd, **popen
    )


def test_a_launch_runs_forked_with_the_launchers_argv_env_cwd_and_streams(launcher, tmp_path):
    warm, proc = launcher
    done = launch(warm, "3", "--token", "t", stdin="hello\n", cwd=str(tmp_path), timeout=30)
    assert done.returncode == 3, done
    handed = f"argv=['3', '--token', 't'] probe=handed-over cwd={tmp_path} stdin=hello fresh=True"
    assert handed in done.stdout
    assert done.stderr.strip() == "on stderr"
    child = int(done.stdout.split("pid=")[1])
    assert child != proc.pid and proc.poll() is None
    # a failing app ends its own launch only; the next one is served
    failed = launch(warm, "raise", timeout=30)
    assert failed.returncode == 1 and "RuntimeError: the app failed" in failed.stderr
    assert launch(warm, "0", timeout=30).returncode == 0


def waiting_launch(warm: WarmLauncher) -> tuple[subprocess.Popen, int]:
    """A shim whose child waits (60 s) once it has reported; the child's pid."""
    shim = subprocess.Popen(
        ["flwr-clientapp", "wait"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env=warm.env(dict(os.environ)),
    )
    assert "argv=['wait']" in shim.stdout.readline()
    return shim, int(shim.stdout.readline().split("pid=")[1])


def test_a_signal_to_the_shim_reaches_the_child(launcher):
    shim, _ = waiting_launch(launcher[0])
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(30) == 7  # the child's own SIGTERM handler chose the code


def test_a_child_goes_at_once_with_its_shim_killed_as_a_supernodes_group_is(launcher):
    warm, proc = launcher
    shim, child = waiting_launch(warm)
    shim.kill()  # SIGKILL: nothing is forwarded
    shim.wait(10)
    wait_for(lambda: not psutil.pid_exists(child), 5, "the child gone with its shim")
    assert proc.poll() is None and launch(warm, "0", timeout=30).returncode == 0  # serving on


def test_a_malformed_request_is_refused_and_the_launcher_serves_on(launcher):
    warm, proc = launcher
    for payload in (b"", b"F", b"F\x00\x00\x00\x05{bad}", b"F\xff\xff\xff\xff"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(warm.socket_path))
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100) == b""  # no child: nothing comes back
    assert proc.poll() is None
    assert launch(warm, "0", timeout=30).returncode == 0


def test_without_a_launcher_the_shim_runs_flowers_own_command_and_its_directory_is_pruned(launcher):
    warm, proc = launcher
    proc.kill()
    proc.wait(10)
    done = launch(warm, "--help", timeout=60)
    assert done.returncode == 0 and "--runtime-api-address" in done.stdout
    # what the killed launcher left goes when the next one is made; a live one's stays
    assert warm.directory.exists()
    alive = WarmLauncher.create(entry="warm_entry:report", preload=())
    other = alive.start(launcher_env())
    wait_for(alive.ready, 60, "another launcher")
    assert not warm.directory.exists()
    prune_killed()
    assert alive.ready()
    other.terminate()
    other.wait(10)


def test_a_launcher_goes_with_its_parent_and_takes_its_directory():
    warm = WarmLauncher.create(entry="warm_entry:report", preload=())
    starts_then_waits = "import subprocess, sys; subprocess.Popen(sys.argv[1:]); input()"
    parent = subprocess.Popen(
        [sys.executable, "-c", starts_then_waits, *warm.argv()],
        stdin=subprocess.PIPE,
        env=launcher_env(),
    )
    wait_for(warm.ready, 60, "the launcher")
    parent.stdin.close()  # the parent exits
    parent.wait(10)
    wait_for(lambda: not warm.directory.exists(), 15, "the launcher to go")


def test_fedrl_supernode_hands_every_argument_to_flower_supernode():
    for asked, answer in (("-V", "Flower version"), ("--help", "--superlink")):
        shown = subprocess.run(["fedrl", "supernode", asked], capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and answer in shown.stdout, shown
        # Flower answers and exits: no launcher is warmed (it held the output open while it preloaded)
        assert "warm ClientApp launcher ready" not in shown.stdout + shown.stderr, shown


def test_a_launcher_started_elsewhere_is_used_only_from_its_own_private_directory(launcher, tmp_path):
    """`fedrl supernode --warm-launcher DIR` (a volunteer's session keeps one launcher across its
    SuperNode's restarts) takes a launcher's 0700 directory of this user's, and nothing else."""
    warm, _ = launcher
    assert WarmLauncher.running_at(warm.directory).socket_path == warm.socket_path
    open_dir = tmp_path / "open"
    (open_dir / "bin").mkdir(parents=True)
    (open_dir / "bin" / "flwr-clientapp").write_text("#!/bin/sh\n")
    open_dir.chmod(0o755)  # another user could put a socket of theirs here
    for bad in (open_dir, tmp_path / "missing", tmp_path):
        with pytest.raises(ValueError, match="not the directory of a launcher"):
            WarmLauncher.running_at(bad)
    refused = subprocess.run(
        ["fedrl", "supernode", "--warm-launcher", str(open_dir), "--superlink", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "not the directory of a launcher" in refused.stderr, refused
    assert "Starting Flower SuperNode" not in refused.stdout + refused.stderr


def test_a_launch_waits_for_a_launcher_that_is_still_importing(tmp_path):
    """A message that comes while the launcher preloads is forked from it once it is ready, not
    started cold beside it."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(3)\n")
    warm = WarmLauncher.create(entry="warm_entry:report", preload=("slow_import", "warm_entry"))
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = warm.start(env)
    try:
        wait_for(lambda: (warm.directory / "pid").exists(), 30, "the launcher to start")
        assert not warm.ready()
        done = launch(warm, "0", timeout=60)
        # warm_entry answered, forked from the launcher: Flower's own command knows no "0"
        assert done.returncode == 0 and "argv=['0']" in done.stdout, done
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def started():
    """How a keeper here starts a launcher, and every launcher it started (killed at the end)."""
    procs = []

    def start(argv):
        procs.append(
            subprocess.Popen(argv, env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        return procs[-1]

    yield start, procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_a_kept_launcher_that_dies_is_started_again_where_its_shims_look(started):
    start, procs = started
    keeper = LauncherKeeper(start, make=lambda: WarmLauncher.create(entry="warm_entry:report", preload=()))
    assert keeper.ensure() is None and keeper.ensure() is None  # started once
    warm = keeper.warm  # what a SuperNode was handed: its shim and socket by this path

    def served(code: str) -> bool:
        """A launch through the SuperNode's shim, served warm: Flower's own command, which
        the shim falls back to, knows nothing of this argv."""
        wait_for(warm.ready, 60, "the launcher")
        done = launch(warm, code, timeout=60)
        return done.returncode == int(code) and f"argv=['{code}']" in done.stdout

    assert served("3") and len(procs) == 1
    # SIGKILLed: its directory stays; started again, but not twice within RESTART_S
    procs[-1].kill()
    procs[-1].wait(10)
    keeper.started_at = time.monotonic() - RESTART_S / 2
    assert keeper.ensure() is None and len(procs) == 1
    keeper.started_at -= RESTART_S
    assert keeper.ensure() == "the warm ClientApp launcher exited with -9: started again"
    assert keeper.warm is warm and served("4") and len(procs) == 2
    assert keeper.quick_deaths == 0  # it had lived longer than RESTART_S
    # exited cleanly, its directory with it: made again, 0700, where the shims look
    procs[-1].terminate()
    procs[-1].wait(10)
    assert not warm.directory.exists()
    keeper.started_at -= RESTART_S
    assert keeper.ensure() == "the warm ClientApp launcher exited with 0: started again"
    assert warm.directory.stat().st_mode & 0o777 == 0o700 and served("5")
    # the name taken meanwhile by a directory others may enter: never served there again
    procs[-1].terminate()
    procs[-1].wait(10)
    warm.directory.mkdir(mode=0o755)
    warm.directory.chmod(0o755)
    keeper.started_at -= RESTART_S
    note = keeper.ensure()
    assert note.startswith("the warm ClientApp launcher exited with 0: started again in a new directory")
    assert keeper.warm.directory != warm.directory and not (warm.directory / "bin").exists()
    wait_for(keeper.warm.ready, 60, "the new launcher")
    assert launch(keeper.warm, "6", timeout=60).returncode == 6


def test_a_launcher_directory_is_made_again_only_where_it_is_still_this_users_own(tmp_path):
    warm = WarmLauncher.create(entry="warm_entry:report", preload=())
    (warm.directory / "pid").write_text("1")  # a dead launcher's, as a SIGKILL leaves it
    warm.revive()  # there and 0700: kept, its stale pid gone, the shim in place
    assert not (warm.directory / "pid").exists() and (warm.directory / "bin" / "flwr-clientapp").is_file()
    shutil.rmtree(warm.directory)
    warm.revive()  # gone with its launcher: made again, 0700
    assert warm.directory.stat().st_mode & 0o777 == 0o700
    shutil.rmtree(warm.directory)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    warm.directory.symlink_to(mine)  # a link planted at the name, even to a directory of ours
    with pytest.raises(ValueError, match="no longer this user's launcher directory"):
        warm.revive()
    assert list(mine.iterdir()) == []
    with pytest.raises(ValueError, match="not the directory of a launcher"):
        WarmLauncher.running_at(warm.directory)
    warm.directory.unlink()


def test_a_kept_launcher_that_keeps_dying_at_its_imports_is_left_down(started):
    start, procs = started
    broken = LauncherKeeper(start, make=lambda: WarmLauncher.create(preload=("no_such_module",)))
    assert broken.ensure() is None
    notes = []
    for _ in range(QUICK_DEATHS):
        procs[-1].wait(60)  # dead at its imports
        assert broken.ensure() is None  # too soon: seen dead, not started again
        broken.started_at -= RESTART_S  # the time since its start, not how long it lived
        broken.died_at -= RESTART_S
        notes.append(broken.ensure())
    started_again = "the warm ClientApp launcher exited with 1: started again"
    left_down = (
        f"the warm ClientApp launcher exited with 1, {QUICK_DEATHS} in a row within 30 s of their start"
    )
    assert notes == [started_again] * (QUICK_DEATHS - 1) + [left_down + ": left down"]
    assert len(procs) == QUICK_DEATHS
    broken.started_at -= RESTART_S
    assert broken.ensure() is None and len(procs) == QUICK_DEATHS  # never again
