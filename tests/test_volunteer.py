"""The volunteer's pieces without processes: invites, enrollment and probes at the store, the
node's state on disk, a withdrawal through the coordinator's loop (the real ClientApp), the
scheduler keeping to a probe's cap, and the CLI's clear failures."""

import asyncio
import base64
import io
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from fake_grid import FakeGrid, at_protocol, instruction_record, small_config

from fedrl.certs import make_ca, make_node_key
from fedrl.clients.block_worker import ClientState, Pending
from fedrl.clients.client_app import app as client_app
from fedrl.clients.client_app import record_status
from fedrl.clients.disk_state import load_from_disk, save_to_disk, state_path
from fedrl.clients.runtime import NodeRuntime
from fedrl.credentials import ADMIN, invite_principal, new_secret, token_for
from fedrl.invite import PREFIX, VERSION, InviteError, load_invite, make_invite
from fedrl.ledger import entry
from fedrl.link import RateLimitedLink
from fedrl.node_files import LEAVE, STATUS, read_json, write_json
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.protocol import NO_UPLOAD, TrainReport
from fedrl.schema import PROTOCOL
from fedrl.store_client import PatchStoreClient, StoreError
from fedrl.strategies.coordinator import run_coordinator
from fedrl.strategies.scheduler import BlockScheduler
from fedrl.volunteer.node_status import print_status, status_text

LEARNER = dict(
    model="tiny",
    task="reversal",
    task_params='{"length": 8}',
    num_blocks=3,
    lora_rank=8,
    lora_alpha=16.0,
    lr=5e-4,
    prompts=8,
    samples=8,
    method="dg",
)


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


@pytest.fixture
def ca(tmp_path):
    make_ca(tmp_path)
    return tmp_path / "ca.pem"


def test_an_invite_round_trips_through_a_string_and_a_file(tmp_path, ca):
    invite = make_invite("run-1", "10.0.0.1:9092", "https://10.0.0.1:8443", ca, new_secret(), **LEARNER)
    assert load_invite(invite.encode()) == invite
    (tmp_path / "invite.txt").write_text("\n" + invite.encode() + "\n")
    assert load_invite(str(tmp_path / "invite.txt")) == invite
    assert invite.principal == invite_principal("run-1")


def test_bad_invites_say_what_is_wrong(tmp_path, ca):
    good = make_invite("r", "h:1", "https://h:2", ca, new_secret(), **LEARNER)
    data = json.loads(base64.urlsafe_b64decode(good.encode().removeprefix(PREFIX)))
    encode = lambda d: PREFIX + base64.urlsafe_b64encode(json.dumps(d).encode()).decode()  # noqa: E731
    cases = {
        "not a fedrl invite": "hello",
        "damaged": good.encode()[:-7] + "%%%",
        "upgrade fedrl": encode({**data, "version": VERSION + 1}),
        "ask the operator for a new invite": encode({**data, "version": VERSION - 1}),
        "invite version None": encode([1, 2]),
        rf"speaks fedrl protocol {PROTOCOL + 1} \(fedrl 9.9\), this fedrl protocol {PROTOCOL}.*fedrl==9.9": (
            encode({**data, "protocol": PROTOCOL + 1, "fedrl_version": "9.9"})
        ),
        "not a PEM certificate": encode({**data, "ca_pem": "nope"}),
        "must be host:port": encode({**data, "superlink": "nohost"}),
        "https": encode({**data, "store_url": "http://h:2"}),
        "token": encode({k: v for k, v in data.items() if k != "token"}),
    }
    for expected, text in cases.items():
        with pytest.raises(InviteError, match=expected):
            load_invite(text)
    with pytest.raises(InviteError, match="cannot read the CA"):
        make_invite("r", "h:1", "https://h:2", tmp_path / "missing.pem", new_secret(), **LEARNER)


def test_an_invite_may_enroll_and_probe_but_nothing_else(tmp_path):
    secret = new_secret()
    _, pub = make_node_key(tmp_path, "v")
    key_line = pub.read_text().strip()

    async def go(url):
        cap = 400_000.0  # bytes/s
        invited = PatchStoreClient(url, invite_principal("r"), token_for(secret, invite_principal("r")))
        admin = PatchStoreClient(url, ADMIN, token_for(secret, ADMIN))
        async with invited as c, admin as a:
            entry = await c.enroll(key_line, "laptop")
            assert (
                entry["status"] == "pending"
                and (await c.enroll(key_line))["fingerprint"] == entry["fingerprint"]
            )
            assert [e["fingerprint"] for e in await a.enrollments()] == [entry["fingerprint"]]
            await a.decide(entry["fingerprint"], "approved")
            assert (await c.enrollment(entry["fingerprint"]))["status"] == "approved"
            for refused in (
                c.enrollments(),
                c.put(b"x"),
                c.publish({"refs": []}),
                c.enroll("ssh-rsa nonsense"),
            ):
                with pytest.raises(StoreError, match="HTTP 4"):
                    await refused
            c.link = RateLimitedLink(cap, cap)
            assert await c.probe_up(200_000) == 200_000 and await c.probe_down(200_000) == 200_000
            assert c.link.bytes_up == c.link.bytes_down == 200_000
            with pytest.raises(StoreError, match="HTTP 400"):
                await c.probe_down(1 << 30)

    with PatchStoreServer(StoreState(secret)) as server:
        asyncio.run(go(server.url))


def test_enrollments_and_decisions_survive_a_restart_of_the_store(tmp_path):
    """With a state folder, a restarted store still knows who enrolled and what the operator
    decided: an approved volunteer is not sent back to waiting for approval."""
    secret = new_secret()
    keys = [make_node_key(tmp_path, name)[1].read_text().strip() for name in ("v1", "v2")]
    path = tmp_path / "store" / "enrollments.json"

    async def enroll_and_decide(url):
        invited = PatchStoreClient(url, invite_principal("r"), token_for(secret, invite_principal("r")))
        admin = PatchStoreClient(url, ADMIN, token_for(secret, ADMIN))
        async with invited as c, admin as a:
            first = await c.enroll(keys[0], "laptop")
            await c.enroll(keys[1], "desktop")
            await a.decide(first["fingerprint"], "approved")
            return first["fingerprint"]

    async def statuses(url):
        admin = PatchStoreClient(url, ADMIN, token_for(secret, ADMIN))
        async with admin as a:
            return {e["name"]: e["status"] for e in await a.enrollments()}

    with PatchStoreServer(StoreState(secret, enrollments_file=path)) as server:
        asyncio.run(enroll_and_decide(server.url))
    restarted = StoreState(secret, enrollments_file=path)
    restarted.load_enrollments()
    with PatchStoreServer(restarted) as server:
        assert asyncio.run(statuses(server.url)) == {"laptop": "approved", "desktop": "pending"}
    with PatchStoreServer(StoreState(secret)) as server:  # no state folder: memory only, as before
        assert asyncio.run(statuses(server.url)) == {}
    path.write_text('{"enrollments": [{"fingerprint": "x"}]}')
    with pytest.raises(ValueError, match="does not hold the store's enrollments"):
        StoreState(secret, enrollments_file=path).load_enrollments()
    path.write_text("{not json")
    (tmp_path / "secret").write_bytes(secret.hex().encode())
    cli = [sys.executable, "-m", "fedrl.cli", "patch-store", "--secret-file", str(tmp_path / "secret")]
    done = subprocess.run(cli + ["--state-dir", str(path.parent)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "enrollments.json cannot be read" in done.stderr, done.stderr


def test_the_node_state_survives_on_disk_bound_to_its_store(tmp_path):
    t = lambda v: {"a": torch.full((2, 3), v), "b": torch.arange(4.0) * v}  # noqa: E731
    pending = Pending(1, 6, {"a": torch.ones(2, 3)}, {"a": torch.zeros(2, 3)}, 64, 3)
    moments = {"a:step": torch.tensor(3.0), "a:exp_avg": torch.full((2, 3), 0.5)}
    state = ClientState(t(1.0), t(2.0), 7, pending, residual={"a": torch.full((2, 3), 1e-4)}, moments=moments)
    save_to_disk(tmp_path, "https://store", state)
    back = load_from_disk(tmp_path, "https://store")
    assert back.held_version == 7 and (
        back.pending.block,
        back.pending.base_version,
        back.pending.samples,
        back.pending.steps,
    ) == (1, 6, 64, 3)
    assert all(torch.equal(back.held[k], state.held[k]) for k in state.held)
    assert torch.equal(back.pending.new["a"], state.pending.new["a"])
    assert torch.equal(back.residual["a"], state.residual["a"])  # what top-k uploads still owe
    assert back.moments.keys() == moments.keys() and all(
        torch.equal(back.moments[k], moments[k]) for k in moments
    )
    assert load_from_disk(tmp_path, "https://another-store") is None  # another federation's state
    state_path(tmp_path).write_bytes(b"\x00" * 5)  # a torn file (never written so: writes are atomic)
    assert load_from_disk(tmp_path, "https://store") is None


def test_the_scheduler_never_exceeds_a_probe_cap():
    s = BlockScheduler(3, base_steps=6, min_steps=2, max_steps=24)
    s.observe_probe(1, seconds_per_step=0.01, steps_cap=3)
    s.observe_speed(2, 1.0)
    assert s.steps_for(1) == 3  # the fastest node would get 24; its owner allows 3
    s.observe_speed(1, 0.01)
    assert s.steps_for(1) == 3
    s2 = BlockScheduler(3)
    s2.load_state_dict(s.state_dict())
    assert s2.steps_for(1) == 3


@pytest.mark.parametrize("on_exit,when", [("flush", "mid-round"), ("drop", "mid-round"), ("flush", "idle")])
def test_a_volunteer_that_leaves_is_dropped_at_once(tmp_path, monkeypatch, on_exit, when):
    """The real ClientApp with a state dir on one node; its owner asks it to leave during its
    second message (after its first step) or between messages. flush mid-round: the round is
    finished, then a flush collects its delta; drop: it stops after the step and hands in
    nothing new; idle: the next message hands in the pending delta. Each time the coordinator
    records "left" at once (no deadline, nothing lost), sends it a goodbye, which the node
    writes to its status for its owner, and nothing more."""
    cfg = small_config(tmp_path, versions=4, buffer_size=1, min_nodes=3)
    grid = FakeGrid(3, client_app)
    volunteer = sorted(grid.contexts)[0]
    state_dir = tmp_path / "volunteer"
    grid.contexts[volunteer].node_config = {"state-dir": str(state_dir)}
    messages = lambda: len([n for n, _ in grid.sent if n == volunteer])  # noqa: E731
    ask = lambda: write_json(state_dir / LEAVE, {"on_exit": on_exit})  # noqa: E731 (the first Ctrl-C)

    def pace(runtime, step_s):
        if when == "mid-round" and messages() == 2 and not (state_dir / LEAVE).exists():
            ask()

    def script(node, msg, reply):
        if when == "idle" and node == volunteer and messages() == 2:
            ask()
        return reply

    monkeypatch.setattr(NodeRuntime, "pace", pace)
    grid.script = script
    summary = run_coordinator(grid, cfg)
    events = [e for e in summary["events"] if e.get("node") == volunteer]
    kinds = [e["kind"] for e in events]
    left = kinds.index("left")
    assert events[left]["reason"] == "withdrew" and "lost" not in kinds and "error" not in kinds
    sent = [instr["action"] for node, instr in grid.sent if node == volunteer]
    expected = {"mid-round": {"flush": ["train", "train", "flush"], "drop": ["train", "train"]}}
    assert sent == [*expected.get(when, {}).get(on_exit, ["train", "train", "train"]), "goodbye"]
    assert ("leaving" in kinds) == (on_exit == "flush" and when == "mid-round")
    assert kinds[left - 1] == "accepted"  # the delta it held was handed in before it left
    replies = [e for e in events if e["kind"] == "reply"]
    if on_exit == "drop":
        assert replies[-1]["steps"] == 1  # abandoned after the step it was in
    assert summary["versions"] >= 4
    status = json.loads((state_dir / "status.json").read_text())
    assert status["phase"] == "left" and status["acknowledged"] is True
    # the nodes that stayed were told that the run was over, once, as their last message
    for node in sorted(grid.contexts)[1:]:
        actions = [instr["action"] for n, instr in grid.sent if n == node]
        assert actions[-1] == "run-over" and actions.count("run-over") == 1, actions


def test_a_volunteer_that_joins_again_while_still_listed_is_taken_back(tmp_path):
    """A withdrawn node counts as gone while the Grid lists it in the session it left from (its
    SuperNode still stopping, or held by a SuperLink that never got its goodbye). Its owner may
    join again before any refresh saw it unlisted: the Grid then lists it as activated anew, and
    it is taken back. Before, it stayed "withdrawn" for as long as it was listed, and was asked
    nothing again: a run that needed it, as this one does, never ended."""
    cfg = small_config(tmp_path, versions=6, buffer_size=1, min_nodes=3, max_wall_s=60.0)  # a stall ends
    grid = FakeGrid(3, client_app)
    volunteer = sorted(grid.contexts)[0]
    state_dir = tmp_path / "volunteer"
    grid.contexts[volunteer].node_config = {"state-dir": str(state_dir)}
    actions = lambda: [instr["action"] for node, instr in grid.sent if node == volunteer]  # noqa: E731

    def script(node, msg, reply):
        if node == volunteer and actions() == ["train"]:
            write_json(state_dir / LEAVE, {"on_exit": "flush"})  # leaves with its next reply
        elif node != volunteer and actions()[-1:] == ["goodbye"] and grid.activated[volunteer] == 1:
            (state_dir / LEAVE).unlink()  # its owner joins again, at once, and the others go:
            grid.join(volunteer)  # the run cannot end without it
            for other in sorted(grid.contexts)[1:]:
                grid.leave(other)
        return reply

    grid.script = script
    summary = run_coordinator(grid, cfg)
    events = [e for e in summary["events"] if e.get("node") == volunteer]
    kinds = [e["kind"] for e in events]
    left = kinds.index("left")
    assert events[left]["reason"] == "withdrew" and events[left]["activated"] == "activation 1"
    assert "joined" in kinds[left:] and "lost" not in kinds and "error" not in kinds, kinds
    sent = actions()
    goodbye = sent.index("goodbye")
    assert sent[:goodbye] == ["train", "train"] and "train" in sent[goodbye:], sent
    assert summary["versions"] >= 6


def test_a_fedavg_run_says_goodbye_to_a_volunteer_and_tells_the_others_it_is_over(tmp_path):
    """In fedavg-lora no block is assigned: a goodbye and the run's end are instructions for every
    block (a goodbye with block 0 was refused by its own schema there, and the coordinator
    crashed). A node that stayed to the end marks its status, and its owner may leave at once."""
    cfg = small_config(tmp_path, versions=6, buffer_size=1, min_nodes=3, mode="fedavg-lora")
    grid = FakeGrid(3, client_app)
    leaver, stayer = sorted(grid.contexts)[:2]
    for node in (leaver, stayer):
        grid.contexts[node].node_config = {"state-dir": str(tmp_path / str(node))}

    def script(node, msg, reply):
        if node == leaver:  # asked to leave during its first message
            write_json(tmp_path / str(leaver) / LEAVE, {"on_exit": "flush"})
        return reply

    grid.script = script
    summary = run_coordinator(grid, cfg)
    left = [e for e in summary["events"] if e["kind"] == "left"]
    assert [(e["node"], e["reason"]) for e in left] == [(leaver, "withdrew")]
    sent = {node: [instr["action"] for n, instr in grid.sent if n == node] for node in grid.contexts}
    assert sent[leaver][-1] == "goodbye" and "run-over" not in sent[leaver]
    assert all(sent[node][-1] == "run-over" for node in grid.contexts if node != leaver), sent
    assert all(instr["block"] == -1 for _, instr in grid.sent)
    leaver_status = json.loads((tmp_path / str(leaver) / "status.json").read_text())
    assert leaver_status["acknowledged"] is True and not leaver_status.get("run_over")
    stayer_status = json.loads((tmp_path / str(stayer) / "status.json").read_text())
    assert stayer_status["run_over"] is True and stayer_status["phase"] == "idle"
    assert "(run over)" in status_text(stayer, stayer_status)


def test_a_rest_notice_tells_the_volunteer_why_it_gets_no_work_and_until_when(tmp_path):
    """A node whose updates the direction check refused is asked nothing for a while; the
    coordinator's notice puts that in its status, so its owner's status line says why and until
    when, and the run's end afterwards shows it idle."""
    from fedrl.clients.client_app import NOTICE_STATUS
    from fedrl.protocol import NOTICES
    from fedrl.strategies.coordinator import Coordinator

    assert set(NOTICE_STATUS) == set(NOTICES)
    grid = FakeGrid(3, client_app)
    grid.contexts[1].node_config = {"state-dir": str(tmp_path / "node")}
    (tmp_path / "node").mkdir()
    with Coordinator(grid, small_config(tmp_path)) as coordinator:
        before = time.time()
        coordinator.notify(1, "rest", 90.0)
        status = json.loads((tmp_path / "node" / STATUS).read_text())
        assert status["phase"] == "resting" and before + 90 <= status["rest_until"] <= time.time() + 90
        line = status_text(1, status)
        until = time.strftime("%H:%M:%S", time.localtime(status["rest_until"]))
        assert f"resting until {until} (updates refused for their direction)" in line, line
        coordinator.notify(1, "run-over")
    status = json.loads((tmp_path / "node" / STATUS).read_text())
    assert status["phase"] == "idle" and "resting" not in status_text(1, status)
    assert [instr["action"] for _, instr in grid.sent] == ["rest", "run-over"]


@pytest.mark.parametrize(
    "action, rest_s", [("rest", 0.0), ("rest", -1.0), ("rest", float("inf")), ("train", 5.0)]
)
def test_an_instruction_with_a_rest_that_does_not_fit_its_action_is_refused(action, rest_s):
    from fedrl.protocol import TrainInstruction

    with pytest.raises(ValueError, match="rest_s must be > 0 and finite in a rest notice and 0 otherwise"):
        TrainInstruction(**instruction_record(action=action, rest_s=rest_s))


def test_the_cli_fails_clearly_on_a_bad_invite_and_an_unreachable_store(tmp_path, ca):
    fedrl = [sys.executable, "-m", "fedrl.cli"]
    bad = subprocess.run(
        [*fedrl, "volunteer", "join", "not-an-invite", "--home", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a fedrl invite" in bad.stderr
    invite = make_invite("r", "127.0.0.1:9", "https://127.0.0.1:9", ca, new_secret(), **LEARNER)
    down = subprocess.run(
        [*fedrl, "volunteer", "join", invite.encode(), "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 4 and "cannot reach the patch store" in down.stderr, down.stderr[-800:]
    assert "cannot connect to 127.0.0.1:9: Connection refused" in down.stderr  # the reason, nothing else
    assert "SSLContext" not in down.stderr


def test_status_from_another_shell_reads_the_node_files(tmp_path, ca):
    from fedrl.node_files import STATUS, update_status
    from fedrl.volunteer.home import VolunteerHome
    from fedrl.volunteer.node_status import print_status

    invite = make_invite("r", "127.0.0.1:9", "https://127.0.0.1:9", ca, new_secret(), **LEARNER)
    home = VolunteerHome.for_run(invite.run, tmp_path)
    home.remember(invite)
    row = entry() | {
        "client": 2,
        "replies": 4,
        "accepted": 3,
        "refused": {"norm": 1},
        "samples": 192,
        "weightless": 1,
    }
    update_status(
        home.state_dir, phase="idle", version=5, synced_version=5, rounds=3, bytes_down=1234, ledger=row
    )
    write_json(home.session, {"pid": 999_999_999, "clean": False})  # a crashed volunteer's session
    out = io.StringIO()
    assert print_status(home, out) == 0
    text = out.getvalue()
    assert "not running" in text and "rounds: 3" in text and "synced_version: 5" in text
    assert "ledger: uploads accepted 3 (1 at weight 0), refused 1 (1 norm), 192 samples credited" in text
    assert (home.state_dir / STATUS).exists()


def test_a_second_join_on_a_running_volunteers_home_is_refused(tmp_path, ca, capsys):
    """Before: it started a second SuperNode on the same key and the same node state."""
    from fedrl.volunteer.home import VolunteerHome
    from fedrl.volunteer.session import EXIT_BAD_INPUT, EXIT_UNREACHABLE, join

    invite = make_invite("r", "127.0.0.1:9", "https://127.0.0.1:9", ca, new_secret(), **LEARNER)
    home = VolunteerHome.for_run(invite.run, tmp_path)
    home.remember(invite)
    script = "import time; time.sleep(120)"
    volunteer = subprocess.Popen([sys.executable, "-c", script, "fedrl", "volunteer", "join"])
    other = subprocess.Popen([sys.executable, "-c", script])  # alive, but no volunteer: a pid given out again
    try:
        write_json(home.session, {"pid": volunteer.pid, "started": 0.0, "clean": False})
        assert join(invite, home=tmp_path) == EXIT_BAD_INPUT
        said = " ".join(capsys.readouterr().err.split())  # as one line, however the console wrapped it
        assert f"a volunteer already runs for this federation (pid {volunteer.pid}" in said
        assert read_json(home.session)["pid"] == volunteer.pid  # its session is left as it was
        out = io.StringIO()
        print_status(home, out)
        assert f"volunteer: running (pid {volunteer.pid})" in out.getvalue()
        write_json(home.session, {"pid": other.pid, "started": 0.0, "clean": False})
        assert join(invite, home=tmp_path) == EXIT_UNREACHABLE  # it went on, to the store it cannot reach
    finally:
        for proc in (volunteer, other):
            proc.kill()
            proc.wait()


def test_a_refused_activation_is_the_last_sessions_hold_for_two_heartbeats_and_a_margin(tmp_path):
    """Flower keeps a node online until it misses two heartbeats, and its SuperNode's goodbye
    (sent once on a clean stop, a failure ignored) may not arrive: until then a refused
    activation is the last session's hold, after it a refused key. Before, a refusal after a
    clean session, or after the SuperNode died mid-session, was taken for a revoked key at once."""
    from fedrl.deploy.supernode_timing import HEARTBEAT_S, HOLD_MARGIN_S
    from fedrl.volunteer.home import VolunteerHome

    home = VolunteerHome.for_run("r", tmp_path)
    home.data.mkdir(parents=True)
    assert home.key_held_until() == 0.0  # never joined from here: a refusal is the key's
    write_json(home.session, {"pid": 1, "clean": True, "ended": 1000.0, "heartbeat_s": 10.0})
    assert home.key_held_until() == 1000.0 + 2 * 10.0 + HOLD_MARGIN_S
    for heartbeat in ({}, {"heartbeat_s": "ten"}):  # a session file of an older fedrl, or a bad one
        write_json(home.session, {"pid": 1, "clean": True, "ended": 1000.0, **heartbeat})
        assert home.key_held_until() == 1000.0 + 2 * HEARTBEAT_S + HOLD_MARGIN_S
    for ended in ({"clean": True, "ended": 1000.0}, {"clean": False}):  # left, or gave up (refused)
        write_json(home.session, {"pid": 1, **ended, "connected": False})
        assert home.key_held_until() == 0.0  # it never connected: it held nothing
    write_json(home.session, {"pid": 1, "clean": False, "started": 5.0, "heartbeat_s": 60.0})
    before = time.time()  # a crash: it stopped at an unknown moment, now at the latest
    held = home.key_held_until()
    assert before + 2 * 60.0 + HOLD_MARGIN_S <= held <= time.time() + 2 * 60.0 + HOLD_MARGIN_S


def test_what_a_volunteer_is_told_is_printed_as_written(tmp_path, ca):
    """Messages quote logs and errors: a closing tag in them ("[/v1/...]" of a Flower log line)
    raised rich's MarkupError, and "[red]" vanished."""
    from rich.console import Console

    from fedrl.volunteer.home import VolunteerHome
    from fedrl.volunteer.session import Session

    invite = make_invite("r", "127.0.0.1:9", "https://127.0.0.1:9", ca, new_secret(), **LEARNER)
    out = io.StringIO()
    session = Session(
        invite, VolunteerHome.for_run(invite.run, tmp_path), console=Console(file=out, width=200)
    )
    said = "the SuperNode exited with 1: [/v1/fleet/pull-messages][ApiError:23] and [red]x[/red]"
    session.say(said)
    assert out.getvalue() == said + "\n"


def report(steps: int, reward: float, prompts: int = 4) -> TrainReport:
    """A node's report of a round of `steps` (0: a round that trained nothing)."""
    zero = dict.fromkeys(
        ("loss", "gate_mean", "comm_s", "overlap_s", "duration_s", "link_bytes_per_s", "memory_mb"), 0.0
    )
    return TrainReport(
        upload_key="",
        upload_block=NO_UPLOAD,
        upload_base_version=0,
        upload_samples=0,
        synced_version=1,
        reward=reward,
        steps=steps,
        compute_s=0.5 * steps,
        bytes_up=0,
        bytes_down=10,
        staleness=0,
        prompts=prompts if steps else 0,
        **zero,
    )


def test_a_round_that_trains_nothing_keeps_the_last_reward_and_step_time_and_memory_retries_show(tmp_path):
    asked = SimpleNamespace(version=1, prompts=4)
    record_status(str(tmp_path), asked, report(steps=2, reward=0.75), holds_delta=True)
    record_status(str(tmp_path), SimpleNamespace(version=2, prompts=4), report(0, 0.0), holds_delta=False)
    status = read_json(tmp_path / STATUS)
    assert (status["reward"], status["step_s"], status["rounds"], status["version"]) == (0.75, 0.5, 1, 2)
    assert status["prompts"] == 4 and status["memory_retries"] == 0
    assert "out of memory" not in status_text(7, status)
    # a round that ran out of memory and went on with 2 prompts a step: counted and shown
    record_status(str(tmp_path), SimpleNamespace(version=3, prompts=4), report(2, 0.5, 2), holds_delta=True)
    status = read_json(tmp_path / STATUS)
    assert status["prompts"] == 2 and status["memory_retries"] == 1
    assert "out of memory 1x: 2 prompts a step" in status_text(7, status)


def test_an_instruction_of_another_fedrl_version_is_refused_and_shown_until_a_round_goes_through(tmp_path):
    """What a volunteer on an old fedrl sees: its ClientApp refuses the newer coordinator's
    instruction by name, and its status (the live line, `fedrl volunteer status`) says why."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedrl.protocol import MESSAGE_TYPE, InstructionHead
    from fedrl.volunteer.home import VolunteerHome

    home = VolunteerHome.for_run("r", tmp_path)
    home.state_dir.mkdir(parents=True, exist_ok=True)
    head = InstructionHead(
        action="train", block=0, steps=1, version=0, round=1, seed=0, client_id=0, settings_id="ab" * 8
    ).to_packed()
    head = at_protocol(head, PROTOCOL + 1)  # as a newer coordinator would send it
    msg = Message(RecordDict({"instruction": ConfigRecord(head)}), dst_node_id=1, message_type=MESSAGE_TYPE)
    node = {"state-dir": str(home.state_dir)}
    reply = client_app(msg, Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={}))
    said = f"the peer speaks fedrl protocol {PROTOCOL + 1}, this fedrl protocol {PROTOCOL}"
    assert reply.has_error() and said in reply.error.reason
    status = read_json(home.state_dir / STATUS)
    assert said in status["error"] and said in status_text(7, status)
    out = io.StringIO()
    assert print_status(home, out) == 0 and said in out.getvalue()
    record_status(str(home.state_dir), SimpleNamespace(version=1, prompts=4), report(2, 0.5), False)
    status = read_json(home.state_dir / STATUS)
    assert status["error"] == "" and "refused" not in status_text(7, status)
    out = io.StringIO()
    assert print_status(home, out) == 0 and "error" not in out.getvalue()


@pytest.mark.parametrize(
    "on_exit,status,log,waited_s,stops",
    [
        ("flush", {"phase": "left"}, "", 0, True),  # answered "leaving", nothing else started
        ("flush", {"phase": "left"}, "STARTED", 0, False),  # its reply is not sent yet
        ("flush", {"phase": "left"}, "STARTED SENT", 0, True),
        ("flush", {"phase": "left", "updated_at": -2}, "STARTED SENT", 0, False),  # no goodbye yet
        ("flush", {"phase": "left", "updated_at": -20}, "STARTED SENT", 0, False),
        ("flush", {"phase": "left", "acknowledged": True}, "STARTED SENT STARTED SENT", 0, True),  # goodbye
        ("flush", {"phase": "left", "acknowledged": True}, "STARTED SENT STARTED", 0, False),  # answering it
        ("flush", {"phase": "left", "updated_at": -35}, "STARTED SENT", 0, True),  # none came: gone anyway
        ("flush", {"phase": "working"}, "STARTED", 60, False),  # finishing its round
        ("flush", {"phase": "idle", "holds_delta": True}, "STARTED SENT", 5, False),  # waits for a message
        ("flush", {"phase": "idle", "holds_delta": True}, "STARTED SENT", 35, True),  # none came
        ("flush", {"phase": "idle", "holds_delta": True}, "STARTED SENT STARTED", 35, False),  # one came
        ("drop", {"phase": "idle", "holds_delta": True}, "STARTED SENT", 0, True),  # abandons the delta
        ("flush", {"phase": "idle", "holds_delta": False}, "STARTED SENT", 0, True),  # nothing to hand in
        ("flush", {"phase": "connecting"}, "", 0, True),
        ("flush", {"phase": "idle", "run_over": True}, "STARTED SENT STARTED SENT", 0, True),  # run ended
        ("flush", {"phase": "idle", "run_over": True, "holds_delta": True}, "STARTED SENT", 0, True),
        ("flush", {"phase": "idle", "run_over": True}, "STARTED SENT STARTED", 0, False),  # answering it
        ("flush", {"phase": "idle", "run_over": True}, "STARTED SENT STARTED DROPPED", 0, True),  # too late
        # resting: its refused reply was pulled and it is asked nothing for a while
        ("flush", {"phase": "resting", "holds_delta": True}, "STARTED SENT STARTED SENT", 0, True),
        ("flush", {"phase": "resting"}, "STARTED SENT STARTED", 0, False),  # answering the notice
    ],
)
def test_a_withdrawal_stops_the_supernode_only_once_nothing_is_left_to_send(
    tmp_path, ca, on_exit, status, log, waited_s, stops
):
    from fedrl.volunteer.home import VolunteerHome
    from fedrl.volunteer.session import DROPPED, SENT, STARTED, Session

    invite = make_invite("r", "127.0.0.1:9", "https://127.0.0.1:9", ca, new_secret(), **LEARNER)
    session = Session(invite, VolunteerHome.for_run(invite.run, tmp_path), on_exit=on_exit)
    session.leave_at = time.monotonic() - waited_s
    if "updated_at" in status:  # given as seconds ago
        status = status | {"updated_at": time.time() + status["updated_at"]}
    log = log.replace("STARTED", STARTED).replace("SENT", SENT).replace("DROPPED", DROPPED)
    assert session.left(status, log) is stops


def test_an_expired_invite_enrolls_nothing_but_an_approved_node_still_rejoins(tmp_path, ca):
    from rich.console import Console

    from fedrl.node_files import APPROVED, write_atomic
    from fedrl.signing import key_fingerprint_ssh
    from fedrl.volunteer.home import VolunteerHome
    from fedrl.volunteer.session import EXIT_REFUSED, Session, VolunteerError

    invite = make_invite(
        "r", "127.0.0.1:9", "https://127.0.0.1:9", ca, new_secret(), valid_days=1e-5, **LEARNER
    )
    time.sleep(1.0)
    assert invite.expired()
    home = VolunteerHome.for_run(invite.run, tmp_path)
    session = Session(invite, home, console=Console(file=io.StringIO()))
    with pytest.raises(VolunteerError, match="invite expired on") as err:
        session.enroll()  # refused before any request: the store would refuse it too
    assert err.value.code == EXIT_REFUSED
    public = home.node_key()[1].read_text()
    write_atomic(home.state_dir / APPROVED, key_fingerprint_ssh(public).encode())
    session.enroll()  # approved earlier: the SuperLink, not the invite, decides from here
    with pytest.raises(InviteError, match="valid_days"):
        make_invite("r", "h:1", "https://h:2", ca, new_secret(), valid_days=0, **LEARNER)


def test_the_node_is_refused_memory_past_the_cap_by_the_kernel_and_lives_on():
    """--max-memory is a hard cap on each of the node's processes (they inherit it from the
    SuperNode): an allocation past it fails in that process, which goes on; below it all is as usual."""
    from fedrl.volunteer.session import confinement

    code = (
        "small = bytearray(50 << 20)\n"
        "try:\n    big = bytearray(400 << 20)\n    print('allocated')\n"
        "except MemoryError:\n    print('refused')\n"
        "import resource; print(resource.getrlimit(resource.RLIMIT_DATA)[0] >> 20)\n"
    )
    capped = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=confinement(None, 300)
    )
    assert capped.returncode == 0 and capped.stdout.split() == ["refused", "300"], capped
    free = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=confinement(None, 0)
    )
    assert free.returncode == 0 and free.stdout.split()[0] == "allocated", free


def test_a_node_with_an_owner_shows_it_its_ledger_row_as_the_coordinator_published_it(tmp_path):
    """Each round a volunteer's node (it has a state dir) reads its own row of the run's ledger
    from the patch store and puts it in its status; its owner's status line shows it. A node of
    the simulation (no owner) reads none: its bytes stay the benchmarks'."""
    from fedrl.strategies.coordinator import run_coordinator

    grid = FakeGrid(3, client_app)
    grid.contexts[1].node_config = {"state-dir": str(tmp_path / "node")}
    (tmp_path / "node").mkdir()
    summary = run_coordinator(grid, small_config(tmp_path, versions=4))
    row = summary["ledger"]["1"]
    shown = json.loads((tmp_path / "node" / STATUS).read_text())["ledger"]
    # as of its last round: the coordinator judged that round's upload after the node read it
    assert shown["client"] == row["client"] and 1 <= shown["accepted"] <= row["accepted"], (shown, row)
    assert shown["replies"] < row["replies"] and shown["samples"] <= row["samples"]
    line = status_text(1, json.loads((tmp_path / "node" / STATUS).read_text()))
    assert f"uploads accepted {shown['accepted']}" in line  # then how many at weight 0, if any
    assert f"refused 0, {shown['samples']:,} samples credited" in line
    # a node without an owner (the simulation's: no state dir) reads no row: its bytes stay the benchmarks'
    from fedrl.clients.runtime import REAL_WORLD, NodeRuntime

    assert not REAL_WORLD.shows_ledger() and not NodeRuntime(up_bytes_s=1e6).shows_ledger()


def test_a_store_that_does_not_take_the_ledger_costs_the_rows_a_while_not_the_run(tmp_path, caplog):
    """A store briefly away (or of a fedrl before the ledger) refuses the rows: the coordinator
    warns once, keeps them, and sends them with the next version's."""
    from fedrl.strategies.coordinator import Coordinator

    with Coordinator(FakeGrid(3, client_app), small_config(tmp_path)) as coordinator:
        sent, publish = [], coordinator.admin.publish_ledger

        def refused_once(rows):
            sent.append(sorted(rows))
            if len(sent) == 1:
                raise StoreError("POST /ledger: 404 Not Found")
            return publish(rows)

        coordinator.admin.publish_ledger = refused_once
        coordinator.ledger.observe({"kind": "accepted", "node": 7, "client": 0, "samples": 64})
        with caplog.at_level("WARNING", logger="fedrl.coordinator"):
            coordinator.publish_ledger()  # refused
            coordinator.ledger.observe({"kind": "reply", "node": 8, "client": 1})
            coordinator.publish_ledger()  # node 7's row again, with node 8's
            coordinator.publish_ledger()  # nothing changed: nothing sent
        node = PatchStoreClient(coordinator.store_url, "node-7", token_for(coordinator.secret, "node-7"))
        row = asyncio.run(_read_ledger(node))
    assert sent == [["node-7"], ["node-7", "node-8"]]
    said = [r.getMessage() for r in caplog.records]
    warned = [m for m in said if "did not take the nodes' ledger rows" in m]
    assert len(warned) == 1 and "(POST /ledger: 404 Not Found); retrying each version" in warned[0], warned
    assert row["accepted"] == 1 and row["samples"] == 64


async def _read_ledger(client: PatchStoreClient) -> dict | None:
    async with client:
        return await client.ledger()
