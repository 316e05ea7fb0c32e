"""`LocalDeployment.kill` reaches what a service started in a session of its own, as Flower's
SuperLink starts its SuperExec (and that one the ServerApps): a signal to the service's process
group missed them, and a ServerApp left behind wrote checkpoints for some seconds after the
kill, after the one the killed-SuperLink test read (tests/test_deploy_processes.py)."""

import os
import subprocess
import sys
import textwrap

import psutil
from waiting import wait_for

from fedrl.deploy.local import has_exited, kill_tree

# a service that starts a child in a new session (the SuperExec), which starts a grandchild (a
# ServerApp) in its own group, then all wait to be killed
SERVICE = textwrap.dedent("""
    import subprocess, sys, time
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    starts = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(120)"
    starter = [sys.executable, "-c", starts]
    subprocess.Popen(starter + sleeper, start_new_session=True)
    time.sleep(120)
""")


def test_kill_tree_kills_descendants_in_other_sessions():
    service = subprocess.Popen([sys.executable, "-c", SERVICE], start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        root = psutil.Process(service.pid)
        tree = wait_for(lambda: len(t := root.children(recursive=True)) == 2 and t, 30, "its two descendants")
        assert {os.getsid(p.pid) for p in tree} == {tree[0].pid}  # a session of their own

        kill_tree(service.pid)
        service.wait(10)
        assert all(has_exited(p) for p in tree)
    finally:
        for p in tree:
            if not has_exited(p):
                p.kill()
        if service.poll() is None:
            service.kill()


def test_kill_tree_of_a_process_gone_is_a_no_op():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(30)
    kill_tree(done.pid)  # reaped: no such process, nothing to do
