"""`fedrl deploy local` killed outright (SIGKILL, the OOM killer) takes its services along: the
store and the SuperLink under fedrl.deploy.parent_watch's guard, the SuperNode and the warm
ClientApp launcher by watching for themselves. Before, all of them went on running, the
SuperLink holding its port and the SuperNode its key's session. Run from the venv's scripts
without the venv on PATH, it starts at all (before, its SuperLink found no `flower-superexec`)."""

import os
import signal
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

from fedrl.deploy.federation import tool

pytestmark = pytest.mark.slow


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_a_local_deployment_killed_outright_takes_every_service_along(tmp_path):
    # run by its path with this environment off PATH, as `.venv/bin/fedrl` is without activating
    # the venv: Flower's tools start each other by name (a SuperLink its `flower-superexec`)
    path = os.pathsep.join(
        d for d in os.environ["PATH"].split(os.pathsep) if d != str(Path(tool("fedrl")).parent)
    )
    deploy = subprocess.Popen(
        [tool("fedrl"), "deploy", "local", "--nodes", "1", "--dir", str(tmp_path), "--set", "versions=50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PATH=path),
        start_new_session=True,  # so that the test can sweep up after a failure
    )
    services: list[psutil.Process] = []
    try:
        lines = []
        for line in deploy.stdout:  # its first lines say where the SuperLink and the store listen
            lines.append(line)
            if "SuperNodes online" in line:
                break
        text = "".join(lines)
        assert "SuperNodes online" in text, text
        ports = [int(line.rsplit(":", 1)[1].split()[0]) for line in lines if "https://127.0.0.1:" in line]
        assert len(ports) == 2 and all(listening(p) for p in ports), text
        services = psutil.Process(deploy.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in services)
        for service in ("flower-superlink", "patch-store", "supernode", "warm_clientapp"):
            assert service in names, names
        os.kill(deploy.pid, signal.SIGKILL)
        deploy.wait(10)
        # the SuperNode stops as on Ctrl-C and the SuperLink gets a SIGTERM's grace: well within 60 s
        _, alive = psutil.wait_procs(services, timeout=60)
        assert not alive, [" ".join(p.cmdline()[:3]) for p in alive]
        assert not any(listening(p) for p in ports)
    finally:
        if deploy.poll() is None:
            deploy.kill()
        for proc in services:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
