"""A helper process goes when the process that started it goes (fedrl.deploy.parent_watch); on a
volunteer's real SuperNode: tests/test_volunteer_processes.py; on `fedrl deploy local`'s
services: tests/test_deploy_orphans.py."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from waiting import wait_for

from fedrl.deploy.parent_watch import guarded, orphaned
from fedrl.deploy.supernode_timing import split_args, supernode_argv

CHILD = """
import signal, sys, time
from fedrl.deploy.parent_watch import interrupt_when_orphaned
try:
    interrupt_when_orphaned(int(sys.argv[1]), every_s=0.05)
    time.sleep(60)
except KeyboardInterrupt:  # the SIGINT it sent itself, as Flower's SuperNode takes Ctrl-C
    open(sys.argv[2], "w").write("interrupted")
"""


@pytest.mark.parametrize("sigint", ["default", "ignored", "blocked"])
def test_a_watched_process_is_interrupted_once_its_starter_is_killed(tmp_path, sigint):
    # the starter: a process that starts the child with its own pid, then waits to be killed; a
    # SIGINT it ignores or blocks (as a shell script's background job does) the child inherits
    starter_code = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        if {sigint!r} == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if {sigint!r} == "blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT}})
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}, str(os.getpid()), sys.argv[1]])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    done = tmp_path / "done"
    starter = subprocess.Popen(
        [sys.executable, "-c", starter_code, str(done)], stdout=subprocess.PIPE, text=True
    )
    child = psutil.Process(int(starter.stdout.readline()))
    try:
        assert not done.exists() and child.is_running()
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        wait_for(lambda: done.exists(), 30, "the orphaned child interrupted")
        assert done.read_text() == "interrupted"
        child.wait(10)
    finally:
        if child.is_running():
            child.kill()


def test_orphaned_is_about_the_parent_of_this_process():
    assert not orphaned(os.getppid())
    assert orphaned(os.getpid())  # a process is not its own child: a wrong pid counts as gone


def test_the_parent_pid_travels_to_the_supernodes_process():
    argv = supernode_argv(["--superlink", "h:1"], parent_pid=4321)
    timing, rest = split_args(argv[3:])
    assert timing.parent_pid == 4321 and rest == ["--superlink", "h:1"]
    assert split_args(supernode_argv(["--superlink", "h:1"])[3:])[0].parent_pid is None


# what the guard runs: a service that starts a helper of its own (in its process group, as the
# SuperLink starts its ServerApp) and writes down the signal that stops it
SERVICE = """
import signal, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(helper.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("SIGTERM"), sys.exit(0)))
time.sleep(60)
"""


def test_the_guard_stops_its_command_and_what_that_started_once_its_starter_is_killed(tmp_path):
    done = tmp_path / "done"
    # the starter: starts the guard in a session of its own (as a deployment starts a service)
    starter_code = textwrap.dedent(f"""
        import subprocess, sys, time
        from fedrl.deploy.parent_watch import guarded
        argv = guarded([sys.executable, "-c", {SERVICE!r}, sys.argv[1]])
        guard = subprocess.Popen(argv, start_new_session=True)
        print(guard.pid, flush=True)
        time.sleep(60)
    """)
    starter = subprocess.Popen(
        [sys.executable, "-c", starter_code, str(done)], stdout=subprocess.PIPE, text=True
    )
    guard = psutil.Process(int(starter.stdout.readline()))
    helper = psutil.Process(int(starter.stdout.readline()))  # the service's line, through the guard
    service = wait_for(lambda: guard.children(), 10, "the guarded service")[0]
    processes = (guard, service, helper)
    try:
        assert all(p.is_running() for p in processes) and not done.exists()
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        gone, alive = psutil.wait_procs(processes, timeout=20)
        assert not alive, alive
        assert done.read_text() == "SIGTERM"  # asked to stop, not killed
    finally:
        for p in processes:
            if p.is_running():
                p.kill()


def test_the_guard_returns_its_commands_exit_code_and_says_a_signal_as_a_shell_does():
    def run(code: str) -> int:
        return subprocess.run(guarded([sys.executable, "-c", code]), timeout=30).returncode

    assert run("import sys; sys.exit(3)") == 3
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)") == 128 + signal.SIGKILL
    missing = subprocess.run(guarded([]), capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "give the command to run" in missing.stderr
