"""The compose file's volunteer services, `invite` and `approver`, run for real without Docker
(the suite starts no engine; `VOLUNTEERS=V deploy/compose-test.sh` runs them in Docker). Their
commands are rendered from docker-compose.yml as compose would, with the host-network settings
of compose-test.sh, and each container path is mapped onto a folder of a real local deployment
(a path that is not one of the service's volumes fails the test: the container would not see
it). The invite they write works: a key enrolled with it is registered with the SuperLink by
the approver and marked approved."""

import asyncio
import signal
import subprocess

import pytest
from compose_file import service_argv
from waiting import wait_for

from fedrl.certs import make_node_key
from fedrl.deploy.federation import tool
from fedrl.deploy.local import LocalDeployment
from fedrl.invite import load_invite
from fedrl.store_client import PatchStoreClient

pytestmark = pytest.mark.slow


def fedrl_argv(name: str, env: dict, mounts: dict) -> list[str]:
    argv = service_argv(name, env, mounts)
    assert argv[0] == "fedrl"
    return [tool("fedrl"), *argv[1:]]


def test_the_compose_volunteer_services_invite_and_approve_a_key(tmp_path):
    with LocalDeployment(tmp_path / "stack", nodes=0) as d:
        d.up()
        env = {
            "RUN_NAME": "compose-vt",
            "PUBLIC_HOST": d.host,
            "SUPERLINK_ADDR": d.host,
            "STORE_ADDR": d.host,
            "SUPERLINK_PORT": d.superlink_port,
            "SUPERLINK_PUBLISH": d.superlink_port,
            "STORE_PORT": d.store_port,
            "STORE_PUBLISH": d.store_port,
            "RUN_CONFIG": "versions=4 model=tiny-base lr=0.001 deadline-s=60",
        }
        mounts = {"/certs": d.certs, "/invites": tmp_path / "invites"}
        mounts["/var/lib/fedrl/state"] = tmp_path / "state"
        mounts["/invites"].mkdir()

        made = subprocess.run(fedrl_argv("invite", env, mounts), capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr[-1500:]
        invite = load_invite(str(tmp_path / "invites" / "invite.txt"))
        assert (invite.run, invite.superlink, invite.store_url) == (
            "compose-vt",
            f"{d.host}:{d.superlink_port}",
            d.store_url,
        )
        assert (invite.model, invite.lr) == ("tiny-base", 0.001)  # RUN_CONFIG's learner settings
        bad = subprocess.run(
            fedrl_argv("invite", env | {"RUN_CONFIG": "versoins=4"}, mounts),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2 and "unknown run config keys ['versoins']" in bad.stderr

        log = open(tmp_path / "approver.log", "wb")
        approver = subprocess.Popen(
            fedrl_argv("approver", env, mounts),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # a SIGINT ignored in this process (as some earlier test leaves it) is inherited, and
            # Python then installs no Ctrl-C handler: the approver would never stop
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            _, public = make_node_key(tmp_path / "volunteer", "laptop")

            def store() -> PatchStoreClient:  # as the volunteer reaches it, with the invite's credential
                return PatchStoreClient(
                    invite.store_url, invite.principal, invite.token, ca_file=str(d.certs / "ca.pem")
                )

            async def enroll() -> dict:
                async with store() as s:
                    return await s.enroll(public.read_text().strip(), "laptop")

            async def status(fingerprint: str) -> str:
                async with store() as s:
                    return (await s.enrollment(fingerprint))["status"]

            entry = asyncio.run(enroll())
            fingerprint = entry["fingerprint"]
            wait_for(
                lambda: asyncio.run(status(fingerprint)) == "approved",
                90,
                "the approver service to approve the enrolled key",
            )
            assert list(d.federation.node_status().values()) == ["registered"]  # the SuperLink knows it
            assert (tmp_path / "state" / "approver" / "keys" / f"{fingerprint[:32]}.pub").is_file()
        finally:
            approver.send_signal(signal.SIGINT)
            code = approver.wait(30)
            log.close()
        assert code == 0, (tmp_path / "approver.log").read_text()[-1500:]
        assert f"approved volunteer key {fingerprint[:16]}" in (tmp_path / "approver.log").read_text()
