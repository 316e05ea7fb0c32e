"""Volunteers on a real local deployment: `fedrl patch-store` (TLS), `flower-superlink` (TLS,
SuperNode auth) and the operator's approver, no SuperNodes of the operator's own. Two
volunteers join with `fedrl volunteer join INVITE` as processes. During one run, volunteer B is
SIGKILLed mid-round and restarted (its cache is intact; it rejoins once Flower releases its old
session and works again), volunteer A is withdrawn with SIGINT mid-round (exit 0 once the
coordinator, which records "left" at once, says goodbye), then B withdraws (`fedrl volunteer
leave` from another shell) and A joins again (it resumes from its cached state: with the run's
top-1% uploads it pulls a small fraction of an anchor). One volunteer at a time works through
each comeback, so the run cannot end before it. At the end the coordinator tells A the run is
over, and A's withdrawal then waits for nothing.
Limits: learner threads, the upload cap and the memory cap (the kernel's, on each process of the
node) are kept to.
Then a session killed outright takes its node along, and a revoked key, a bad invite and an
unreachable coordinator fail clearly."""

import io
import json
import os
import re
import signal
import subprocess

import psutil
import pytest
from refusals import refused_by_cause, refused_not_by_chance
from rich.console import Console
from waiting import wait_for

from fedrl.clients.disk_state import load_from_disk
from fedrl.deploy.federation import CONNECTION, tool
from fedrl.deploy.local import LocalDeployment
from fedrl.invite import load_invite
from fedrl.node_files import PROBE, STATUS, read_json
from fedrl.protocol import SETTINGS_UNKNOWN
from fedrl.volunteer.home import VolunteerHome
from fedrl.volunteer.session import Session

pytestmark = pytest.mark.slow

UPLOAD_KBPS = 800.0
MAX_MEMORY_MB = 3000
HEARTBEAT_S = 10.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with LocalDeployment(tmp_path_factory.mktemp("vdeploy"), nodes=0) as d:
        d.up()
        d.start_approver(say=lambda text: None)
        invite = d.invite("vt", model="tiny-base")
        (d.root / "invite.txt").write_text(invite.encode() + "\n")
        yield d


class Volunteer:
    def __init__(self, deployment, name: str, *extra: str):
        self.deployment, self.name, self.extra = deployment, name, extra
        self.home_dir = deployment.root / f"home-{name}"
        self.home = VolunteerHome.for_run("vt", self.home_dir)
        self.proc = None

    def join(self) -> None:
        log = open(self.deployment.logs / f"volunteer-{self.name}.log", "ab")
        argv = [tool("fedrl"), "volunteer", "join", str(self.deployment.root / "invite.txt")]
        argv += ["--home", str(self.home_dir), "--max-cpu", "1", *self.extra]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def status(self) -> dict:
        return read_json(self.home.state_dir / STATUS) or {}

    def working(self, rounds: int) -> bool:
        """At work on a round after `rounds` done; fails at once if the volunteer has exited."""
        assert self.alive(), f"volunteer {self.name} exited: {self.log()[-1500:]}"
        status = self.status()
        return status.get("rounds", 0) >= rounds and status.get("phase") == "working"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def node_id(self) -> int:
        return int(re.findall(r"as node (\d+)", self.log())[-1])

    def log(self) -> str:
        return (self.deployment.logs / f"volunteer-{self.name}.log").read_text()

    def kill(self) -> None:
        """SIGKILL the volunteer and everything it started (the SuperNode has a group of its own),
        as a power cut would."""
        if not self.proc or self.proc.poll() is not None:
            return
        tree = [self.proc.pid] + [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def test_volunteers_join_withdraw_rejoin_and_survive_a_kill(deployment):
    # A gives rounds of at most 0.05 s of compute: its probe caps it at one step per round
    a = Volunteer(
        deployment, "a", "--upload-kbps", str(UPLOAD_KBPS), "--on-exit", "flush", "--round-s", "0.05"
    )
    # B heartbeats every few seconds: its killed session goes in 20 s, not Flower's minute
    b = Volunteer(deployment, "b", "--max-memory", str(MAX_MEMORY_MB), "--heartbeat-s", str(HEARTBEAT_S))
    try:
        a.join()
        b.join()
        run_id = deployment.submit(
            versions=8,
            min_nodes=2,
            base_steps=2,
            max_steps=3,
            prompts=4,
            samples=4,
            buffer_size=2,
            eval_every=4,
            node_wait_s=180.0,
            deadline_s=30.0,  # B's message lost with its kill waits this long for a reply
            task_params=json.dumps({"length": 8, "num_eval": 64}),
            upload_density=0.01,
        )
        # B: SIGKILLed mid-round and restarted at once; its cache survives. It gets back in only
        # once the SuperLink lets its old session go (two missed heartbeats: 20 s)
        wait_for(lambda: b.working(2) and b.status()["synced_version"] >= 1, 240, "B working on v1")
        intervals = deployment.heartbeat_intervals()  # what each node registered with
        assert intervals == {b.node_id(): HEARTBEAT_S, a.node_id(): 30.0}, intervals
        # B's memory cap is the kernel's on every process of its node, the ClientApp included
        node_procs = psutil.Process(b.proc.pid).children(recursive=True)
        limits = {p.rlimit(psutil.RLIMIT_DATA)[0] for p in node_procs}
        assert len(node_procs) >= 2 and limits == {MAX_MEMORY_MB << 20}, (node_procs, limits)
        b.kill()
        kept = load_from_disk(b.home.state_dir, deployment.store_url)
        assert kept is not None and kept.held_version >= 1
        b_rounds = b.status()["rounds"]
        b.join()

        # A: withdrawn with SIGINT while it works on a round (its second or later). Nobody else
        # works until B is back, so the run cannot end without B's comeback
        wait_for(lambda: a.working(2), 240, "A working")
        a.proc.send_signal(signal.SIGINT)
        assert a.proc.wait(120) == 0, a.log()[-2000:]
        assert a.status()["phase"] == "left" and a.status()["acknowledged"] is True
        assert "left the federation cleanly (left, the coordinator said goodbye)" in a.log()
        assert a.log().count("to leave cleanly: Ctrl-C here, or `fedrl volunteer leave`") == 1  # told once
        wait_for(lambda: b.status().get("rounds", 0) > b_rounds, 240, "B back at work")
        # its comeback restarted the SuperNode while the SuperLink held the old session, each time
        # with the one launcher its session keeps (importing torch and peft takes seconds of CPU)
        node_log, held = (b.home.logs / "supernode.log").read_text(), b.log().count("still holds")
        assert node_log.count("Starting Flower SuperNode") == 2 + held, node_log[-3000:]
        assert node_log.count("warm ClientApp launcher ready") == 2, node_log[-3000:]  # one a session

        # B withdraws in turn, from another shell, and A joins again: the run cannot end without
        # A's comeback either
        leave = [tool("fedrl"), "volunteer", "leave", "--home", str(b.home_dir)]
        left = subprocess.run(leave, capture_output=True, text=True, timeout=180)
        assert left.returncode == 0, left.stdout + left.stderr
        assert f"(pid {b.proc.pid}) left the federation cleanly (left, " in left.stdout, left.stdout
        assert b.proc.wait(30) == 0, b.log()[-2000:]
        a.join()  # it holds its last version on disk

        def a_at_work(status: str) -> None:  # A alone can end the run: if it exits, say why at once
            assert a.alive(), f"A exited while the run was {status}: {a.log()[-1500:]}"

        # a stall's error names the coordinator's last events
        status = deployment.federation.wait_run(run_id, 500, a_at_work, deployment.run_dir / "events.jsonl")
        assert status == "finished:completed"
        # the coordinator told A the run was over: withdrawing now waits for nothing
        wait_for(lambda: a.status().get("run_over"), 30, "A told the run is over")
        a.proc.send_signal(signal.SIGINT)
        assert a.proc.wait(30) == 0, a.log()[-2000:]
        assert "left the federation cleanly (idle, the run was over)" in a.log()
    finally:
        for v in (a, b):
            if v.proc and v.proc.poll() is None:
                v.proc.send_signal(signal.SIGINT)
        for v in (a, b):
            try:
                v.proc.wait(90)
            except subprocess.TimeoutExpired:
                v.kill()
    summary = deployment.summary()
    events = summary["events"]
    withdrew = [e for e in events if e["kind"] == "left" and e.get("reason") == "withdrew"]
    assert withdrew, [e for e in events if e["kind"] in ("left", "leaving", "joined", "lost")]
    node_a = withdrew[0]["node"]
    # the SuperLink stamps each session of a node: a comeback is seen even while the old one is listed
    assert withdrew[0]["activated"] and withdrew[-1]["activated"], withdrew
    assert not [e for e in events if e["kind"] == "lost" and e["node"] == node_a]  # no deadline wait
    replies_a = [e for e in events if e["kind"] == "reply" and e["node"] == node_a]
    t_left = withdrew[0]["t"]
    comeback = [e for e in replies_a if e["t"] > t_left][0]
    # it synced from the version it cached, not from nothing: with top-1% uploads the versions it
    # missed changed a few entries, and it pulled those alone (about 1/13 of an anchor here)
    full_sync = comeback["full_sync_bytes"]
    assert full_sync > 0 and 4 * comeback["bytes_down"] < full_sync, comeback
    # the probe travelled and was used: once the coordinator had A's probe (with its first
    # reply) it asked for no more steps than the cap; A never did more; the hardware is reported
    client_a = summary["clients"][str(node_a)]
    # its owner saw its ledger row, as the coordinator had published it by A's last round
    shown, row = a.status().get("ledger"), summary["ledger"][str(node_a)]
    assert shown and shown["client"] == row["client"] and 1 <= shown["accepted"] <= row["accepted"], shown
    probe_a = read_json(a.home.state_dir / PROBE)
    assert probe_a["steps_per_round"] == 1 and client_a["hardware"]["steps_per_round"] == 1
    assert client_a["hardware"]["threads"] == 1
    trained = [e for e in replies_a if e["assigned_steps"]]
    assert trained[0]["assigned_steps"] > 1  # asked before the probe was known
    assert all(e["assigned_steps"] == 1 for e in trained[1:]) and all(e["steps"] <= 1 for e in trained)
    # the upload cap: measured through the capped link, within 20% of it and never above
    cap = UPLOAD_KBPS * 1000 / 8
    assert 0.8 * cap <= probe_a["up_bytes_s"] <= 1.2 * cap, probe_a["up_bytes_s"]
    assert not refused_not_by_chance(summary) and summary["versions"] >= 8, refused_by_cause(summary)
    # each comeback got the settings with its first message: none was refused for want of them
    errors = [e["reason"] for e in events if e["kind"] == "error"]
    assert not [r for r in errors if r.startswith(SETTINGS_UNKNOWN)], errors


def test_a_node_that_crashes_rejoins_and_a_session_killed_outright_takes_its_node_along(deployment):
    """SIGKILL to the SuperNode's process group alone (Flower's process crashed): the session
    starts it again, and while the SuperLink still holds the dead node's session (until two
    heartbeats are missed: 20 s here) its refusals are retried, not taken for a revoked key.
    Then SIGKILL to the session alone (the OOM killer, a crash): its SuperNode stops as on Ctrl-C,
    which tells the SuperLink (the node is offline at once, so the volunteer's next join can
    connect: 5 s in a trial), and the launcher and Flower's SuperExec follow. Before, the
    SuperNode worked on unsupervised and kept the key's session online, and the next join waited
    on "the SuperLink still holds this node's session" for over 150 s."""
    c = Volunteer(deployment, "c", "--heartbeat-s", str(HEARTBEAT_S))
    try:
        c.join()
        wait_for(lambda: "as node" in c.log(), 180, "C connected")
        node, session = c.node_id(), c.proc.pid
        children = psutil.Process(session).children()
        (supernode,) = [p for p in children if "--auth-supernode-private-key" in p.cmdline()]
        os.killpg(supernode.pid, signal.SIGKILL)
        wait_for(lambda: c.log().count("as node") == 2 or not c.alive(), 180, "C connected again")
        assert c.alive() and "still holds this node's last session" in c.log(), c.log()[-1500:]
        assert c.node_id() == node
        node_procs = psutil.Process(session).children(recursive=True)
        assert len(node_procs) >= 2, node_procs  # the SuperNode and the launcher, at least
        os.kill(session, signal.SIGKILL)
        c.proc.wait(30)
        wait_for(lambda: not [p for p in node_procs if running(p)], 60, "C's node processes gone")
        assert deployment.federation.node_status()[node] == "offline"
    finally:
        c.kill()


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_revoked_key_is_refused_clearly(deployment):
    # a key of its own, enrolled and approved (not the other test's: pytest-xdist may run the
    # two on different workers, each with a deployment of its own)
    r = Volunteer(deployment, "r")
    invite = load_invite(str(deployment.root / "invite.txt"))
    r.home.remember(invite)
    before = set(deployment.federation.node_status())
    Session(invite, r.home, console=Console(file=io.StringIO())).enroll()
    registered = set(deployment.federation.node_status()) - before
    assert len(registered) == 1, registered
    deployment.federation.call("supernode", "unregister", str(*registered), CONNECTION)  # revoked
    r.join()
    assert r.proc.wait(120) == 3, r.log()[-1500:]
    assert "refused this node's key" in r.log()
    # joined again: refused at once too. Its last session never connected, so no session of it can
    # be held (before, that session counted as a crash and the join retried for 150 s)
    r.join()
    assert r.proc.wait(60) == 3, r.log()[-1500:]
    assert r.log().count("refused this node's key") == 2 and "still holds" not in r.log()
