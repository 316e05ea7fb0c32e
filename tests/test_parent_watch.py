"""A helper process goes when the process that started it goes (fedrl.deploy.parent_watch); on a
volunteer's real SuperNode: tests/test_volunteer_processes.py."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
from waiting import wait_for

from fedrl.deploy.parent_watch import orphaned
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


def test_a_watched_process_is_interrupted_once_its_starter_is_killed(tmp_path):
    # the starter: a process that starts the child with its own pid, then waits to be killed
    starter_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
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
