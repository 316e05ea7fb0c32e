"""The coordinator: block-coordinate rounds over Flower's Grid, never blocking on one client.

It keeps clients busy with push_messages/pull_messages, handles replies in the order of the
run's clock (fedrl.clock: wall arrival, or a virtual clock injected by the simulation),
treats error replies, lost replies, late replies from departed nodes and unknown replies as
events, ingests each reported delta from the patch store (bound to the uploading node,
verified, staleness-checked, NaN-checked), aggregates per block (sync: at the round
barrier; async: after `buffer_size` arrivals), publishes every new global version as
signed patches, checkpoints in the background and can resume. Nodes come and go: each keeps
a stable client id (strategies.membership), and every message has a wall-clock watchdog.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.serde import message_to_proto

from fedrl.adapter_record import BEST_DIR, FINAL_DIR, write_record
from fedrl.blocks import ALL_BLOCKS, adapter_difference
from fedrl.clock import Clock, RealClock
from fedrl.credentials import (
    ADMIN,
    NODE_TOKEN_TTL_S,
    load_or_create_secret,
    node_principal,
    read_secret,
    token_expires,
    token_for,
    token_source,
)
from fedrl.failpoints import check_env as check_failpoint_env
from fedrl.failpoints import failpoint
from fedrl.ledger import Ledger
from fedrl.lora import build_adapter_model
from fedrl.monitor import MonitorServer
from fedrl.node_files import write_json
from fedrl.patch import PatchLimits, apply_patch, state_hash
from fedrl.patch_chain import PatchPublisher, in_catalog, published
from fedrl.patch_errors import PatchError
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.protocol import (
    MESSAGE_TYPE,
    LearnerSettings,
    TrainInstruction,
    TrainReport,
    split_instruction,
)
from fedrl.rollout import greedy_eval
from fedrl.run_events import EventLog, read_events
from fedrl.run_metrics import RunMetrics
from fedrl.schema import OTHER_VERSION, SchemaError
from fedrl.signing import load_or_create_signing_key, public_key_pem
from fedrl.store_client import BlockingStoreClient, StoreError, put_signed_patches
from fedrl.strategies.aggregation import (
    Update,
    aggregate_block,
    clip_limit,
    feedback_window,
    norm_bound,
    older_base,
    outlier_reason,
    peak_step,
    rejection_reason,
    step_floor,
)
from fedrl.strategies.best_adapter import BestAdapter
from fedrl.strategies.checkpoint import Checkpointer, CheckpointError, load_checkpoints
from fedrl.strategies.direction import DirectionCheck, NoTextAnswers, rest_rounds
from fedrl.strategies.gate import VerificationGate
from fedrl.strategies.membership import Membership
from fedrl.strategies.reputation import Reputation
from fedrl.strategies.run_config import RunConfig
from fedrl.strategies.run_lock import hold_run_lock, release
from fedrl.tasks import get_task

log = logging.getLogger("fedrl.coordinator")
RECENT_NORMS = 64  # the adaptive clip's memory: norms of the last updates, any block
NOTICE_TTL_S = 60.0  # a goodbye or the run's end is answered at once, or expires unanswered
# a node of another fedrl version refuses every instruction: it is asked again this much later
# on the run's clock (its owner may have upgraded it), not every round
OTHER_VERSION_REST_S = 60.0


@dataclass
class Dispatch:
    node: int
    block: int
    action: str
    version: int
    steps: int  # what the scheduler asked for (a node keeps to its own probe's cap)
    sent: float  # on the run's clock
    watchdog: float  # time.monotonic() after which the message is given up
    settings_id: str  # the settings the instruction went with
    arrived: bool = False  # the Grid delivered the reply; the clock decides when it is handled
    expired: bool = False  # the round outlasted the deadline on the run's clock


def wire_bytes(msg: Message) -> int:
    """A Flower message's size as the Grid carries it (protobuf; gRPC and TLS framing not counted)."""
    return message_to_proto(msg).ByteSize()


def idle_wait_s(quiet_s: float) -> float:
    """How long the loop sleeps when no reply is due, `quiet_s` seconds after the last reply came or
    message went: 20 ms at first, then a tenth of the quiet so far, at most half a second. A reply
    is noticed within about a tenth of its wait, and a deployment's SuperLink, for which each pull
    is an RPC, is asked about 20 times a second in rounds of 1.5 s and twice a second in long ones,
    instead of 50 (the SuperLink of a 90 s `fedrl deploy local --nodes 2 --set versions=8` used
    17.5 s of CPU at a steady 20 ms, 10.9 s with this wait)."""
    return min(0.5, max(0.02, quiet_s / 10))


def activations(grid, nodes) -> dict[int, str]:
    """When the Grid last activated each of `nodes` (Flower's `NodeInfo.last_activated_at`: a
    SuperNode's new session gets a new one); "" or absent where the Grid does not say, as a
    simulation's does not."""
    get_nodes = getattr(grid, "get_nodes", None)
    infos = get_nodes() if get_nodes else ()
    return {info.node_id: info.last_activated_at for info in infos if info.node_id in nodes}


class Rejected(ValueError):
    """An upload that is refused, with a short cause (a metrics label) beside the reason."""

    def __init__(self, cause: str, reason: str):
        super().__init__(reason)
        self.cause = cause


def upload_limits(tensors: list) -> PatchLimits:
    """What an honest upload of these tensors can take: every value changed, with its index
    (8 bytes at most each), plus a header. A bigger patch or body is refused before it is
    downloaded or decompressed (no decompression bombs)."""
    raw = sum(t.numel() * t.element_size() for t in tensors)
    bound = 2 * raw + 8 * sum(t.numel() for t in tensors) + (1 << 20)
    return PatchLimits(max_patch_bytes=bound, max_body_bytes=bound)


SPENT = ("bytes_up", "bytes_down", "control_up", "control_down")  # traffic, per client and in all
# what a checkpointed adapter means, so a resume keeps them: the model it adapts and its shape and
# scale; the seed (v0 is never checkpointed: the seeded build stands for it); the task of its evals
RESUME_KEEPS = ("model", "seed", "lora_rank", "lora_alpha", "task", "task_params")


def kept_setting(key: str, value):
    """A setting as a resume compares it: task parameters as the JSON they are, whatever their spacing."""
    return json.loads(value) if key == "task_params" else value


class Coordinator:
    """Use as a context manager: everything it starts (store, clients, threads) is closed on exit,
    also when setting up fails half way."""

    refresh_every_s = 1.0  # how often the Grid is asked which nodes are connected (run-clock seconds)

    def __init__(self, grid, cfg: RunConfig, clock: Clock | None = None, progress=None):
        check_failpoint_env()
        self.grid, self.cfg, self.progress = grid, cfg, progress
        self.clock = clock or RealClock()
        self.resources = ExitStack()
        try:
            self._setup()
        except BaseException:
            self.resources.close()
            raise

    def _setup(self) -> None:
        cfg = self.cfg
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.hold(self.out_dir)  # before anything in it is read or written
        self.best = BestAdapter(self.out_dir / BEST_DIR)
        self.adapter = build_adapter_model(
            cfg.model, cfg.lora_rank, cfg.lora_alpha, cfg.num_blocks
        )  # our own instance
        self.task = get_task(cfg.task, **json.loads(cfg.task_params))
        if cfg.final_eval_size and not hasattr(self.task, "num_eval"):
            raise ValueError(f"final_eval_size: task {cfg.task!r} has no held-out set size (num_eval)")
        self.global_state = dict(self.adapter.initial)
        self.origin_hash = state_hash(self.wire(self.global_state))  # a node that builds v0 needs no download
        self.version = 0
        self.scheduler = cfg.block_scheduler()
        self.agg = cfg.aggregation()
        self.recent_norms: collections.deque = collections.deque(maxlen=RECENT_NORMS)  # accepted unit norms
        self.step_peak = 0.0  # the largest median of recent_norms so far (peak_step)
        # top-k uploads: the steps of the latest uploads of a (client id, block), which its residual carries
        self.feedback_steps: dict[tuple[int, int], collections.deque] = {}
        self.gate = (
            VerificationGate(self.adapter, self.task, cfg.gate_probe, cfg.gate_tolerance, cfg.seed)
            if cfg.gate_probe
            else None
        )
        self.direction, self.direction_off = None, ""
        if cfg.direction_probe:
            try:
                self.direction = DirectionCheck(
                    self.adapter,
                    self.task,
                    cfg.direction_probe,
                    cfg.seed,
                    cfg.direction_weighting,
                    cfg.direction_test,
                    cfg.direction_threshold,
                    cfg.direction_false_refusal,
                )
            except NoTextAnswers as err:  # the digits bandit: bad settings fail in RunConfig
                self.direction_off = str(err)
        self.reputation = Reputation()
        anchor_every = 1 if cfg.mode == "fedavg-lora" else cfg.anchor_every  # fedavg sends full adapters
        self.publisher = PatchPublisher(anchor_every=anchor_every, keep_recent=cfg.max_staleness + 2)
        # keys live in the state dir and survive restarts: clients pin the coordinator's public key
        state_dir = Path(cfg.state_dir or self.out_dir / "state")
        self.signing_key = load_or_create_signing_key(state_dir / "coordinator.key")
        self.public_key = public_key_pem(self.signing_key).decode()
        if cfg.store_url:
            self.secret = read_secret(cfg.store_secret_file)
            self.store_url = cfg.store_url
        else:
            self.secret = load_or_create_secret(state_dir / "store.secret")
            store = self.resources.enter_context(PatchStoreServer(StoreState(self.secret)))
            self.store_url = store.url
        self.admin = BlockingStoreClient(
            self.store_url, ADMIN, token_source(self.secret), ca_file=cfg.store_ca_file or None
        )
        self.resources.callback(self.admin.close)
        # every base a delta may still be judged against survives a restart (max_staleness + 1)
        checkpoints = Path(cfg.checkpoint_dir or self.out_dir / "checkpoints")
        if cfg.checkpoint_dir:  # a folder of its own: held too, before its leftovers are cleared
            checkpoints.mkdir(parents=True, exist_ok=True)
            self.hold(checkpoints)
        self.checkpointer = Checkpointer(
            checkpoints,
            keep=cfg.max_staleness + 1,
            on_saved=lambda v: self.event("checkpoint", saved_version=v),
        )
        self.resources.callback(self.checkpointer.close)
        # one record of the run (fedrl.run_events): the summary, events.jsonl, /metrics and the dashboard
        resuming = cfg.resume and any(self.checkpointer.directory.glob("ckpt-*.json"))
        events_file = self.out_dir / "events.jsonl"
        # each node's ledger counts the run's earlier lives too: they are in the file, not in memory
        self.ledger, self.ledger_refused = Ledger(), False
        for e in read_events(events_file)[0] if resuming and events_file.exists() else ():
            self.ledger.observe(e)
        self.log = EventLog(cfg.run_name or self.out_dir.name, events_file, append=resuming)
        self.resources.callback(self.log.close)
        self.metrics = RunMetrics()
        self.log.listeners += [self.metrics.observe, self.ledger.observe]
        self.events, self.counts = self.log.events, self.log.counts
        if cfg.monitor_port >= 0:
            monitor = MonitorServer(self.log, self.metrics, cfg.monitor_host, cfg.monitor_port)
            self.resources.enter_context(monitor)
            urls = monitor.urls()
            write_json(self.out_dir / "monitor.json", urls)  # where tests and scripts find a port-0 monitor
            log.info("dashboard: %s  metrics: %s", urls["dashboard"], urls["metrics"])
        self.members = Membership()
        self.refs: list[dict] = []
        self.in_flight: dict[str, Dispatch] = {}
        self.buffer: list[Update] = []
        self.pending_nodes: set[int] = set()  # parablock clients holding an unsent delta
        # nodes that said they leave -> when the Grid had last activated them (see refresh_nodes)
        self.withdrawn: dict[int, str] = {}
        self.unavailable: set[int] = set()  # nodes Flower said are unreachable: no dispatch until a refresh
        # node -> when it may be asked again (run's clock): it runs another version, or the
        # direction check refused its last update
        self.resting: dict[int, float] = {}
        self.refusals_in_a_row: dict[int, int] = {}  # client id -> direction refusals since it was accepted
        self.rounds: dict[int, int] = {}  # node -> messages sent
        # node -> the version it said it holds (also after it left: it may come back with it)
        self.synced: dict[int, int] = {}
        self.tokens: dict[int, str] = {}  # node -> its store credential, renewed at half its life
        self.settings_held: dict[int, str] = {}  # node -> id of the settings a reply showed it holds
        self.eval_cpu_s = 0.0  # held-out evaluations, kept apart from the coordinator's own cost
        self.loop: dict = {}
        self.evals: list[dict] = []
        self.clients: dict[int, dict] = {}
        self.replies_at_version = 0
        self.stop_reason = ""
        self.last_refresh = float("-inf")
        self.started_at = time.time()  # wall clock, so a deployment's logs can be lined up with events
        self.wall_start = time.monotonic()  # max_wall_s counts from here
        self.quiet_since = self.wall_start  # the last reply pulled or message sent (idle_wait_s)
        # what the run's earlier lives spent (a resumed run): its records count from the run's start
        self.earlier = dict.fromkeys(SPENT, 0) | {"messages": 0, "time_s": 0.0, "wall_s": 0.0}

    def hold(self, directory: Path) -> None:
        """This coordinator's lock on a run folder, until it closes (strategies/run_lock.py)."""
        self.resources.callback(release, hold_run_lock(directory))

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.resources.close()

    # ------------------------------------------------------------------ helpers

    def now(self) -> float:
        return self.clock.now()

    def clock_stands_still(self) -> bool:
        """A virtual clock with nothing out: only a reply moves it, so no time will pass."""
        return self.clock.virtual and not self.in_flight

    def run_time(self) -> float:
        """Seconds on the run's clock since the run started, its earlier lives included: what
        records and `max_time_s` count (the clock itself starts at 0 in every life)."""
        return self.earlier["time_s"] + self.now()

    def run_wall_s(self) -> float:
        return self.earlier["wall_s"] + time.monotonic() - self.wall_start

    def event(self, kind: str, counted: tuple[str, ...] = (), **fields) -> None:
        self.log.emit(kind, self.run_time(), self.version, counted, **fields)

    def traffic(self) -> dict[str, int]:
        """Bytes every client moved since the run started, its earlier lives included: patches
        (counted with the reply of their round) and Flower messages (instructions as they are
        sent, replies as they come)."""
        return {k: self.earlier[k] + sum(c[k] for c in self.clients.values()) for k in SPENT}

    def spent(self) -> dict:
        """What the run spent so far, all lives: bytes, messages, time on its clock and wall time."""
        messages = self.earlier["messages"] + sum(c["messages"] for c in self.clients.values())
        times = {"time_s": self.run_time(), "wall_s": self.run_wall_s()}
        return {**self.traffic(), "messages": messages, **times}

    def evaluate(self) -> float:
        """The global adapter's greedy error on the task's held-out set (and its format errors,
        for tasks that tell them apart), recorded in `evals` with the bytes moved by then, and
        as an event; the adapter is kept in `adapter-best` when no eval before it did better."""
        cpu = time.process_time()
        self.adapter.part.set_all(self.adapter.lm.model, self.global_state)
        result = greedy_eval(self.adapter.lm, self.task)
        save = self.adapter.lm.model.save_pretrained  # the model holds the evaluated state
        # adapter-best names only a version whose checkpoint is on disk: killed in between, a resumed
        # run would make that version again while adapter-best held the weights of its lost making
        if self.checkpointer.settled():
            self.best.offer(result["error"], self.version, save, self.adapter_record())
        self.eval_cpu_s += time.process_time() - cpu
        wall_s = round(self.run_wall_s(), 1)
        spent = self.traffic()
        moved = {
            "bytes_up": spent["bytes_up"] + spent["control_up"],
            "bytes_down": spent["bytes_down"] + spent["control_down"],
        }
        self.evals.append(
            {"t": round(self.run_time(), 3), "wall_s": wall_s, "version": self.version, **moved, **result}
        )
        extra = {"format_error": result["format_error"]} if "format_error" in result else {}
        self.event("eval", metric="greedy_error", value=result["error"], **extra)
        return result["error"]

    def adapter_record(self) -> dict:
        """What an exported adapter was trained on, so that `fedrl eval --adapter DIR` needs nothing else."""
        return dict(model=self.cfg.model, task=self.cfg.task, task_params=self.cfg.task_params)

    def evaluate_final_set(self) -> dict | None:
        """The final adapter on a larger held-out set (`final_eval_size` problems), if asked."""
        if not self.cfg.final_eval_size:
            return None
        task = dataclasses.replace(self.task, num_eval=self.cfg.final_eval_size)
        self.adapter.part.set_all(self.adapter.lm.model, self.global_state)  # a probe may have set others
        result = {"problems": self.cfg.final_eval_size, **greedy_eval(self.adapter.lm, task)}
        self.event("eval", metric="greedy_error_final_set", value=result["error"])
        return result

    def publish(self) -> None:
        self.refs += put_signed_patches(
            self.admin,
            self.publisher.publish(self.wire(self.global_state), self.version, self.held_versions()),
            self.signing_key,
        )
        failpoint("publish")
        self.refs = [
            r
            for r in self.refs
            if in_catalog(r["base_version"], r["target_version"], self.version, self.publisher)
        ]
        self.admin.publish({"latest": self.version, "refs": self.refs, "public_key": self.public_key})
        self.publish_ledger()

    def publish_ledger(self) -> None:
        """The ledger rows that changed since, to the store, where each node reads its own (its
        owner's status line shows it). A store that cannot take them (briefly away, or of a fedrl
        before the ledger) costs the nodes their row, not the run: they go again next version."""
        changed = self.ledger.take_changed()
        if not changed:
            return
        try:
            self.admin.publish_ledger({node_principal(int(node)): row for node, row in changed.items()})
        except StoreError as err:
            self.ledger.changed.update(changed)
            if not self.ledger_refused:
                log.warning(
                    "the patch store did not take the nodes' ledger rows (%s); retrying each version", err
                )
            self.ledger_refused = True

    def held_versions(self) -> set[int]:
        """The versions nodes hold or are syncing to: the next version is patched from each (as
        far as the publisher keeps them), so a node that fell far behind still skips in one patch."""
        return set(self.synced.values()) | {d.version for d in self.in_flight.values() if d.action == "train"}

    def wire(self, state: dict) -> dict:
        """The global state as it is published: cast to the run's wire dtype (bfloat16 halves
        every download and makes the ulp distances of a step small), while the coordinator keeps
        and merges into the full-precision state. float32: the state itself."""
        return published(state, self.cfg.wire_dtype)

    def store_usage(self) -> dict:
        """What the patch store holds now (for the metrics); nothing if it cannot say."""
        try:
            health = self.admin.json("GET", "/health")
            return {"store_objects": int(health["objects"]), "store_bytes": int(health["bytes"])}
        except (StoreError, KeyError, TypeError, ValueError):
            return {}

    def checkpoint(self) -> None:
        meta = {
            "scheduler": self.scheduler.state_dict(),
            "members": self.members.state_dict(),
            "counts": self.counts,
            "in_flight": len(self.in_flight),
            "evals": self.evals,
            "recent_unit_norms": list(self.recent_norms),
            "step_peak": self.step_peak,
            "feedback_steps": [[c, b, list(steps)] for (c, b), steps in self.feedback_steps.items()],
            "reputation": self.reputation.state_dict(),
            "direction": self.direction.state_dict() if self.direction else {},
            "rounds": {str(node): n for node, n in self.rounds.items()},  # seeds of clients' sampling
            "spent": self.spent(),
            "config": self.cfg.model_dump(),
        }
        self.checkpointer.save_async(self.version, self.global_state, meta)

    def misfit(self, tensors: dict, made: dict) -> str:
        """Why a checkpoint (its tensors, the config it was made with) is not this run's to resume;
        "" when it is."""
        changed = [
            f"{k}={made[k]!r}"
            for k in RESUME_KEEPS
            if k in made and kept_setting(k, made[k]) != kept_setting(k, getattr(self.cfg, k))
        ]
        return (
            f"made with {', '.join(changed)}" if changed else adapter_difference(tensors, self.global_state)
        )

    def resume(self) -> bool:
        """Continue from the newest checkpoint. The older ones kept beside it are retained as
        bases, so deltas clients computed on them before the restart are judged, not lost."""
        skipped: list[str] = []
        found = list(load_checkpoints(self.checkpointer.directory, skipped))
        for reason in skipped:  # a resume from an older one, or from v0, says why
            self.event("checkpoint-skipped", reason=reason)
        if not found:
            return False
        for version, tensors, meta in found:  # refused, and left as they are
            if reason := self.misfit(tensors, meta.get("config", {})):
                raise ValueError(
                    f"checkpoint v{version} in {self.checkpointer.directory} does not fit this run "
                    f"({reason}): run with the settings it was made with, or give another out_dir or "
                    "checkpoint_dir"
                )
        version, tensors, meta = found[0]
        if version >= self.cfg.versions and (self.out_dir / "summary.json").exists():
            # rerunning a finished run's command would go on for no version and overwrite its summary
            raise ValueError(
                f"the run in {self.out_dir} finished at v{version}, and versions={self.cfg.versions} asks "
                f"for no more: give versions > {version} to go on from it, or another out_dir"
            )
        older = {v: state for v, state, _ in found[1:]}
        older.setdefault(0, dict(self.adapter.initial))  # v0 is never checkpointed; the seeded build is it
        for v in sorted(older):
            if version - self.agg.max_staleness <= v < version:
                self.publisher.retain(self.wire(older[v]), v)
        self.version, self.global_state = version, tensors
        self.scheduler.load_state_dict(meta["scheduler"])
        self.members.load_state_dict(meta.get("members", {"ids": []}))
        self.evals = meta.get("evals", [])
        self.best.resume()
        # a window is kept only beside the peak that floors it: one saved in a quiet spell without
        # its peak (as before the peak was kept) would refuse every update of the usual size, so
        # such a run starts both again, as a new run does (older ones kept raw norms: dropped too)
        if isinstance(meta.get("recent_unit_norms"), list) and "step_peak" in meta:
            self.recent_norms.extend(float(n) for n in meta["recent_unit_norms"])
        self.step_peak = float(meta.get("step_peak", 0.0))
        self.feedback_steps = {  # older checkpoints kept one running total
            (int(c), int(b)): self.feedback_rounds(n if isinstance(n, list) else [n])
            for c, b, n in meta.get("feedback_steps", [])
        }
        self.reputation.load_state_dict(meta.get("reputation", {}))
        if self.direction:
            self.direction.load_state_dict(meta.get("direction", {}))
        # a node's round numbers seed its sampling: restarting them would replay the same prompts
        self.rounds = {int(node): int(n) for node, n in meta.get("rounds", {}).items()}
        self.earlier.update(meta.get("spent", {}))  # older checkpoints did not keep it: counted from here
        self.event("resumed", from_version=version)
        return True

    def refresh_nodes(self) -> None:
        """Take the Grid's current nodes (at most once a second on the run's clock, so a virtual
        run retries a node that was unavailable at the same virtual time however fast the machine
        runs; on a virtual clock at once when nothing is out, since nothing else would move it);
        joins and departures are events, ids stay stable. A node that withdrew counts as gone
        while the Grid still lists it in the session it left from; once it is no longer listed, or
        listed as activated again (its owner joined again before a refresh saw the gap, or its
        old session was held by a SuperLink that never got its goodbye), it may come back as any
        node does."""
        if self.now() - self.last_refresh < self.refresh_every_s and not self.clock_stands_still():
            return
        self.last_refresh = self.now()
        self.unavailable.clear()
        listed = set(self.grid.get_node_ids())
        self.withdrawn = {node: at for node, at in self.withdrawn.items() if node in listed}
        if self.withdrawn:  # listed still: back only if activated again since it withdrew
            now = activations(self.grid, self.withdrawn)
            for node in [n for n, at in self.withdrawn.items() if at and now.get(n) and now[n] != at]:
                del self.withdrawn[node]
        joined, left = self.members.refresh(listed - set(self.withdrawn))
        for node in joined:
            self.event("joined", node=node, client=self.members.client_id(node))
        for node in left:
            self.event("left", node=node, client=self.members.client_id(node))
            self.forget(node)

    def withdraw(self, node: int, leaving: str) -> None:
        """A node said it leaves: nothing more is scheduled for it, at once. "after-flush": it
        holds a delta it wants to hand in; it gets a flush first and leaves with its reply."""
        if node not in self.members.present:
            return
        if leaving == "after-flush" and self.cfg.mode == "parablock":
            self.event("leaving", node=node, reason="withdrawing: collecting its last delta")
            self.dispatch(node, action="flush")
            return
        self.withdrawn[node] = activations(self.grid, {node}).get(node, "")
        self.members.present.discard(node)
        # `activated`: the session it left from, as the Grid stamps it ("" where it does not say)
        self.event(
            "left",
            node=node,
            client=self.members.client_id(node),
            reason="withdrew",
            activated=self.withdrawn[node],
        )
        # its owner waits for this before stopping the node (Flower answers NODE_UNAVAILABLE for a
        # message whose node is gone, even when its reply had arrived). Nothing waits for the
        # answer, which is never pulled: a node already gone costs nothing.
        self.notify(node, "goodbye")
        self.forget(node)

    def announce_end(self) -> None:
        """Every node still here learns that the run is over and its replies were pulled, before
        the final evaluation: an owner who withdraws after that need not wait for a goodbye that
        will never come. Nothing waits for the answers, as for a goodbye."""
        for node in sorted(self.members.present):
            self.notify(node, "run-over")

    def notify(self, node: int, action: str, rest_s: float = 0.0) -> None:
        """An instruction off the schedule (a goodbye, the run's end, a rest): it trains no block."""
        block = ALL_BLOCKS if self.cfg.mode == "fedavg-lora" else 0
        self.push(node, self.instruction(node, block, 0, action, rest_s), NOTICE_TTL_S)

    def forget(self, node: int) -> None:
        """What a node that left held goes with it: its unsent delta, and the settings (if it comes
        back, it is most likely a new ClientApp: its first instruction carries them rather than
        costing a round trip to learn it lost them)."""
        self.pending_nodes.discard(node)
        self.settings_held.pop(node, None)

    def wait_for_nodes(self) -> None:
        deadline = time.monotonic() + self.cfg.node_wait_s
        while len(list(self.grid.get_node_ids())) < self.cfg.min_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fewer than {self.cfg.min_nodes} nodes connected after {self.cfg.node_wait_s} s"
                )
            time.sleep(0.2)

    # ------------------------------------------------------------------ dispatch and replies

    def instruction(
        self, node: int, block: int, steps: int, action: str, rest_s: float = 0.0
    ) -> TrainInstruction:
        cfg = self.cfg
        principal = node_principal(node)
        token = self.tokens.get(node)
        # renewed at half its life, not every round: the settings it travels in stay the same
        if token is None or token_expires(token) - time.time() < NODE_TOKEN_TTL_S / 2:
            token = self.tokens[node] = token_for(self.secret, principal)
        return TrainInstruction(
            **LearnerSettings.of(cfg),
            action=action,
            mode=cfg.mode,
            block=block,
            steps=steps,
            version=self.version,
            store_url=self.store_url,
            principal=principal,
            token=token,
            public_key=self.public_key,
            seed=cfg.seed,
            client_id=self.members.client_id(node),
            data_shards=cfg.shards,
            round=self.rounds.get(node, 0),  # a notice (goodbye, run-over, rest) is no round of its own
            upload_density=cfg.upload_density,
            wire_dtype=cfg.wire_dtype,
            origin_hash=self.origin_hash,
            rest_s=rest_s,
        )

    def dispatch(self, node: int, action: str = "train") -> None:
        if self.cfg.mode == "fedavg-lora":
            block = ALL_BLOCKS
        elif action == "flush":  # uploads the pending delta only; the block is not used
            block = 0
        else:
            block = self.scheduler.assign_block(node, self.members.client_id(node))
        steps = 0 if action == "flush" else self.scheduler.steps_for(node)
        self.rounds[node] = self.rounds.get(node, 0) + 1
        instr = self.instruction(node, block, steps, action)
        # the message's ttl is the wall-clock watchdog; on a virtual clock the deadline is virtual
        ttl = self.cfg.watchdog_s if self.clock.virtual else self.cfg.deadline_s
        msg_id, settings = self.push(node, instr, ttl)
        if not msg_id:
            if action == "train" and block >= 0:
                self.scheduler.release(block)
            return
        self.quiet_since = time.monotonic()
        self.in_flight[msg_id] = Dispatch(
            node,
            block,
            action,
            self.version,
            steps,
            self.now(),
            time.monotonic() + ttl + 5,
            settings,
        )
        self.clock.sent(msg_id, instr)

    def push(self, node: int, instr: TrainInstruction, ttl: float) -> tuple[str, str]:
        """Send one instruction; its message id ("" and an error event if the SuperLink refused it)
        and its settings id. The run's settings go with it until a reply shows the node holds them."""
        head, settings = split_instruction(instr)
        content = RecordDict({"instruction": ConfigRecord(head.to_packed())})
        if self.settings_held.get(node) != head.settings_id:
            content["settings"] = ConfigRecord(settings)
        msg = Message(
            content, dst_node_id=node, message_type=MESSAGE_TYPE, ttl=ttl, group_id=str(self.version)
        )
        size = wire_bytes(msg)  # before a simulation's Grid stamps it
        ids = list(self.grid.push_messages([msg]))
        if not ids or not ids[0]:
            self.event("error", node=node, reason="message not accepted by the SuperLink")
            return "", head.settings_id
        self.client_entry(node)["control_down"] += size + 2 + len(ids[0])  # + the id it was given
        return ids[0], head.settings_id

    def close_dispatch(self, msg_id: str) -> Dispatch | None:
        d = self.in_flight.pop(msg_id, None)
        if d is not None and d.action == "train" and d.block >= 0:
            self.scheduler.release(d.block)
        return d

    def expire_overdue(self) -> None:
        """Give up messages whose reply has not come within their wall-clock watchdog."""
        now = time.monotonic()
        if any(not d.arrived and now > d.watchdog for d in self.in_flight.values()):
            # a reply the Grid holds came in time: the loop was busy handling others (the
            # clock pulls only when nothing is due), and a loaded machine made that long
            self.pull()
        for msg_id, d in list(self.in_flight.items()):
            if not d.arrived and now > d.watchdog:
                self.close_dispatch(msg_id)
                self.clock.forget(msg_id)
                self.event("lost", ("lost",), node=d.node, reason="no reply within the watchdog")

    def handle(self, msg_id: str, reply: Message) -> None:
        d = self.close_dispatch(msg_id)
        if d is None:  # given up already, or never ours
            self.event("unknown", ("unknown",), reason=f"reply to unknown message {msg_id[:12]}")
            return
        self.client_entry(d.node)["control_up"] += wire_bytes(reply)
        if d.expired:
            self.event(
                "error",
                ("replies", "errors"),
                node=d.node,
                reason=f"deadline {self.cfg.deadline_s} s exceeded",
            )
            return
        if reply.has_error():
            if reply.error.code == ErrorCode.NODE_UNAVAILABLE:  # not again before the next refresh
                self.unavailable.add(d.node)
            reason = str(reply.error.reason)
            # whatever went wrong, its next message carries the settings: a node restarted within
            # its heartbeat patience never leaves the Grid's list, and shows only as an error (its
            # message lost, or SETTINGS_UNKNOWN). Sending them costs bytes; a refusal, a round trip
            self.settings_held.pop(d.node, None)
            other_version = OTHER_VERSION in reason  # it cannot read what this coordinator sends
            if other_version:
                self.resting[d.node] = self.now() + OTHER_VERSION_REST_S
            self.event(
                "error",
                ("replies", "errors"),
                node=d.node,
                code=int(reply.error.code),
                reason=reason[:300],
                **({"cause": "version", "asked_again_in_s": OTHER_VERSION_REST_S} if other_version else {}),
            )
            return
        try:
            report = TrainReport.from_packed(reply.content["report"], "report")
        except (KeyError, TypeError, SchemaError) as err:
            self.event(
                "rejected",
                ("replies", "rejected"),
                node=d.node,
                client=self.members.client_id(d.node),
                cause="malformed",
                reason=f"malformed reply: {str(err)[:240]}",
            )
            return
        if d.node in self.members.present:
            self.settings_held[d.node] = d.settings_id  # it answered: it holds them
        else:  # what it held went with it
            self.event("late", node=d.node, reason="reply from a node that has left; its work still counts")
        if report.steps:
            self.scheduler.observe_speed(d.node, report.compute_s / report.steps)
        probe = report.probe
        if probe is not None:
            self.scheduler.observe_probe(d.node, probe.step_s, probe.steps_per_round)
        self.record_client(d, report, probe)
        holds_delta = d.action == "train" and report.steps and report.leaving != "now"
        if holds_delta and self.cfg.mode == "parablock" and d.node in self.members.present:
            self.pending_nodes.add(d.node)
        if d.action == "flush" or report.leaving == "now":
            self.pending_nodes.discard(d.node)
        if report.upload_key:
            self.rest_if_refused(d, self.ingest(d.node, report))
        if report.leaving:
            self.withdraw(d.node, report.leaving)

    def rest_if_refused(self, d: Dispatch, cause: str) -> None:
        """A client whose update the direction check refused sits out rounds (`rest_rounds`: 1,
        2, 4, ... of this round's length on the run's clock) rather than spend samples on updates
        that would be refused too; an accepted update ends its streak. Not checkpointed: a
        restarted coordinator starts every streak afresh."""
        client = self.members.client_id(d.node)
        if cause == "":
            self.refusals_in_a_row.pop(client, None)
        if cause != "direction":
            return
        refusals = self.refusals_in_a_row[client] = self.refusals_in_a_row.get(client, 0) + 1
        rounds = rest_rounds(refusals, self.cfg.direction_rest_cap)
        if not rounds:
            return
        rest_s = rounds * (self.now() - d.sent)
        self.resting[d.node] = self.now() + rest_s
        self.event(
            "resting",
            node=d.node,
            client=client,
            rounds=rounds,
            rest_s=round(rest_s, 3),
            reason=f"{refusals} update(s) in a row refused for their direction: sits out {rounds} round(s)",
        )
        if rest_s > 0:  # else its owner sees a node that gets no work, and no why
            self.notify(d.node, "rest", rest_s)

    def client_entry(self, node: int) -> dict:
        return self.clients.setdefault(
            node,
            {
                "client_id": self.members.client_id(node),
                "messages": 0,
                "compute_s": 0.0,
                "comm_s": 0.0,
                "overlap_s": 0.0,
                "duration_s": 0.0,
                "bytes_up": 0,  # patches, to and from the store
                "bytes_down": 0,
                "control_up": 0,  # Flower messages: replies, and instructions down
                "control_down": 0,
                "timeline": [],
            },
        )

    def record_client(self, d: Dispatch, r: TrainReport, probe=None) -> None:
        node = d.node
        self.synced[node] = r.synced_version
        c = self.client_entry(node)
        c["messages"] += 1
        for k in ("compute_s", "comm_s", "overlap_s", "duration_s", "bytes_up", "bytes_down"):
            c[k] += getattr(r, k)
        # what the client measured of itself, as last reported
        if r.steps:
            c["step_s"] = round(r.compute_s / r.steps, 4)
            c["prompts"] = r.prompts  # fewer than the run's: its probe's cap, or it ran out of memory
        if r.link_bytes_per_s:
            c["link_bytes_per_s"] = round(r.link_bytes_per_s)
        c["memory_mb"] = round(r.memory_mb, 1)
        if probe is not None:
            c["hardware"] = probe.model_dump()
        c["timeline"].append(
            {
                "end": round(self.run_time(), 3),
                "duration_s": r.duration_s,
                "compute_s": r.compute_s,
                "comm_s": r.comm_s,
                "overlap_s": r.overlap_s,
            }
        )
        self.event(
            "reply",
            ("replies",),
            node=node,
            client=c["client_id"],
            reward=r.reward,
            steps=r.steps,
            assigned_steps=d.steps,
            prompts=r.prompts,
            staleness=r.staleness,
            synced_version=r.synced_version,
            bytes_up=r.bytes_up,
            bytes_down=r.bytes_down,
            full_sync_bytes=r.full_sync_bytes,
            sync_patches=r.sync_patches,
            duration_s=r.duration_s,
            compute_s=r.compute_s,
            comm_s=r.comm_s,
            overlap_s=r.overlap_s,
        )

    def ingest(self, node: int, r: TrainReport) -> str:
        """Fetch, verify and queue one client delta; anything wrong is rejected with a reason.
        The cause of the rejection, or "" when the delta was queued."""
        client, probe = self.members.client_id(node), {}
        try:
            staleness = self.version - r.upload_base_version
            if not 0 <= staleness <= self.agg.max_staleness:  # cheap checks before any download
                raise Rejected("staleness", f"staleness {staleness} is outside [0, {self.agg.max_staleness}]")
            most = self.cfg.max_steps * self.cfg.prompts * self.cfg.samples
            if r.upload_samples > most:  # the weighted mean must not belong to one boastful node
                raise Rejected(
                    "samples", f"{r.upload_samples} samples claimed; a round yields at most {most}"
                )
            if r.upload_steps * self.cfg.samples > r.upload_samples:  # a step takes a prompt at least
                raise Rejected(
                    "samples",
                    f"{r.upload_steps} steps claimed on {r.upload_samples} samples "
                    f"({self.cfg.samples} a prompt, a prompt a step at least)",
                )
            if not ALL_BLOCKS <= r.upload_block < self.cfg.num_blocks:
                raise Rejected("block", f"upload block {r.upload_block} does not exist")
            if (r.upload_block == ALL_BLOCKS) != (self.cfg.mode == "fedavg-lora"):
                kind = "whole-adapter upload" if r.upload_block == ALL_BLOCKS else "block upload"
                raise Rejected("block", f"a {kind} in {self.cfg.mode} mode")
            meta = self.admin.meta(r.upload_key)
            if node_principal(node) not in meta["uploaders"]:
                raise Rejected("uploader", f"object was uploaded by {meta['uploaders']}, not by node {node}")
            published = self.publisher.state(r.upload_base_version)
            if published is None:
                raise Rejected(
                    "staleness", f"base version {r.upload_base_version} is no longer retained (too stale)"
                )
            names = (
                list(self.global_state)
                if r.upload_block == ALL_BLOCKS
                else self.adapter.part.names(r.upload_block)
            )
            # the values the client held, in the wire dtype every upload comes in (the client's
            # residual keeps the rounding)
            base = {n: published[n] for n in names}
            limits = upload_limits([base[n] for n in names])
            if meta["size"] > limits.max_patch_bytes:  # refused before the download
                raise Rejected("size", f"upload of {meta['size']} bytes, more than the block can need")
            blob = self.admin.get(r.upload_key, max_bytes=limits.max_patch_bytes)
            new = apply_patch(None if r.upload_block == ALL_BLOCKS else base, blob, limits=limits)
            # an anchor upload decides its own names and shapes: a wrong one would crash or broadcast
            if difference := adapter_difference(new, base):
                raise Rejected("shape", f"the upload is not the block's tensors: {difference}")
            delta = {n: new[n].float() - base[n].float() for n in names}
            weight = self.reputation.weight(client) if self.cfg.reputation else 1.0
            # the steps behind it: as the node says (a node at fewer prompts a step, by its probe's
            # cap or after running out of memory, takes as many), at most max_steps; from the
            # samples it claims when it does not say. A top-k upload also carries what its residual
            # kept from the client's earlier rounds on the block
            counted = r.upload_samples // (self.cfg.prompts * self.cfg.samples)
            steps = max(1, min(r.upload_steps, self.cfg.max_steps) if r.upload_steps else counted)
            feedback = self.cfg.upload_density < 1  # its residual may carry whole entries, not only rounding
            if feedback:
                rounds = self.feedback_steps.setdefault((client, r.upload_block), self.feedback_rounds([]))
                rounds.append(steps)
                steps = sum(rounds)
            update = Update(node, r.upload_block, delta, r.upload_samples, staleness, weight, steps, feedback)
            reason = rejection_reason(update, self.agg)
            if reason:
                raise Rejected("update", reason)
            queued = [u.unit_norm for u in self.buffer]
            floor = step_floor(self.step_peak)
            reason = outlier_reason(update.unit_norm, [*self.recent_norms, *queued], self.agg, floor)
            if reason:
                raise Rejected("norm", reason)
            older = older_base(new, r.upload_base_version, self.publisher.retained())
            if older is not None:
                raise Rejected(
                    "rollback",
                    f"the upload is nearer version {older} than the base version {r.upload_base_version} "
                    f"it names: applied to that base it would move the block back toward version {older} "
                    "(as an update made on an older state and labelled newer does)",
                )
            if self.direction:
                cosine, evidence, reason = self.direction.check(
                    client, self.version, self.global_state, delta
                )
                # the bar it was judged and weighed against, with this cosine among the recent
                probe = {"cosine": round(cosine, 4), "bar": round(self.direction.bar(), 4)}
                probe |= {} if evidence is None else {"evidence": round(evidence, 3)}
                if reason:
                    raise Rejected("direction", reason)
                update.weight *= self.direction.weight(cosine)
            if self.gate:
                before, after, reason = self.gate.check(self.version, self.global_state, delta)
                probe |= {"probe_before": round(before, 4), "probe_after": round(after, 4)}
                if reason:
                    raise Rejected("gate", reason)
        except (StoreError, PatchError, ValueError) as err:
            cause = getattr(err, "cause", "other")
            if isinstance(err, (StoreError, PatchError)):
                cause = "store" if isinstance(err, StoreError) else "patch"
            self.reputation.record(client, accepted=False, cause=cause)
            fields = probe if cause in ("gate", "direction") else {}
            self.event(
                "rejected",
                ("rejected",),
                node=node,
                client=client,
                cause=cause,
                reason=str(err)[:300],
                **fields,
            )
            return cause
        finally:
            try:
                self.admin.delete(r.upload_key, node_principal(node))
            except StoreError:
                pass
        self.reputation.record(client, accepted=True)
        self.event(
            "accepted",
            ("accepted",),
            node=node,
            client=client,
            samples=update.num_samples,
            block=r.upload_block,
            staleness=staleness,
            steps=update.steps,
            norm=round(update.norm, 6),
            weight=round(update.weight, 4),
            **probe,
        )
        self.buffer.append(update)
        return ""

    def feedback_rounds(self, steps: list) -> collections.deque:
        return collections.deque((int(n) for n in steps), maxlen=feedback_window(self.cfg.upload_density))

    def aggregate(self) -> None:
        if not self.buffer:
            return
        by_block: dict[int, list[Update]] = {}
        for u in self.buffer:
            if u.block == ALL_BLOCKS:  # a whole-adapter update contributes to every block
                for b in range(self.cfg.num_blocks):
                    names = self.adapter.part.names(b)
                    by_block.setdefault(b, []).append(
                        dataclasses.replace(u, block=b, delta={n: u.delta[n] for n in names})
                    )
            else:
                by_block.setdefault(u.block, []).append(u)
        new_state = dict(self.global_state)  # tensors are replaced, never mutated (lazy checkpoint copies)
        norms = {b: [u.unit_norm for u in us] for b, us in by_block.items()}
        clipped = 0
        for block, updates in by_block.items():
            # the clip's reference: recent norms and this aggregation's other updates, of any block
            # (blocks are alike in size), so a block with two updates, one an attacker's, still
            # has an honest median
            others = [n for b, ns in norms.items() if b != block for n in ns]
            reference = [*self.recent_norms, *others]
            bound = norm_bound(norms[block], self.agg, reference, step_floor(self.step_peak))
            for name, delta in aggregate_block(updates, self.agg, bound).items():
                new_state[name] = self.global_state[name] + delta
            clipped += sum(u.norm > clip_limit(u, self.agg, bound) for u in updates)
            self.scheduler.record_update(block, self.version + 1)
        failpoint("aggregate")
        # as they arrived, not clipped: a clipped norm is at most the median, so a history of
        # them could never rise with honest norms that grow (top-k uploads' error feedback
        # grew 3.4x in 15 virtual s, and the stuck median refused over a third of the replies);
        # the median of accepted norms moves only as far as the honest majority's own norms
        self.recent_norms.extend(n for ns in norms.values() for n in ns)
        self.step_peak = peak_step(self.step_peak, self.recent_norms)
        self.global_state, self.version = new_state, self.version + 1
        self.replies_at_version = self.counts["replies"]
        updates, self.buffer = len(self.buffer), []
        self.publish()
        self.event("version", updates=updates, clipped=clipped, blocks=sorted(by_block), **self.store_usage())
        self.checkpoint()  # first, so a kill during the eval loses no version
        if self.version % self.cfg.eval_every == 0:
            self.evaluate()
            self.checkpoint()  # again, with the eval in its record: a kill before the next version keeps it
        if self.progress:
            self.progress(self)

    def pull(self) -> int:
        """Hand the Grid's new replies to the clock, with each round's length on the run's clock."""
        waiting = [i for i, d in self.in_flight.items() if not d.arrived]
        if not waiting:
            return 0
        replies = list(self.grid.pull_messages(waiting))
        if replies:
            self.quiet_since = time.monotonic()
        for reply in replies:
            msg_id = reply.metadata.reply_to_message_id
            d = self.in_flight.get(msg_id)
            if d is None or d.arrived:
                self.event("unknown", ("unknown",), reason=f"reply to unknown message {str(msg_id)[:12]}")
                continue
            d.arrived = True
            duration = self.cfg.deadline_s  # an error reply is noticed at the deadline
            if not reply.has_error():
                try:
                    duration = float(TrainReport.unpack(reply.content["report"])["duration_s"])
                except (KeyError, TypeError, ValueError):
                    duration = 0.0  # malformed: handled (and rejected) as soon as it is due
            if not 0 <= duration <= self.cfg.deadline_s:  # NaN included
                d.expired, duration = True, self.cfg.deadline_s
            self.clock.arrived(msg_id, reply, duration)
        return len(replies)

    def next_reply(self) -> tuple[str, Message] | None:
        """The next reply due on the run's clock, pulling from the Grid when none is."""
        due = self.clock.next_due()
        if due is None and self.pull():
            due = self.clock.next_due()
        return due

    def handle_next_reply(self) -> None:
        """Handle the next reply due, or wait a little (idle_wait_s) when there is none."""
        due = self.next_reply()
        if due is None:
            time.sleep(idle_wait_s(time.monotonic() - self.quiet_since))
        else:
            self.handle(*due)

    # ------------------------------------------------------------------ the loop

    def should_stop(self) -> bool:
        if self.cfg.max_time_s and self.run_time() > self.cfg.max_time_s:
            self.stop_reason = f"max_time_s {self.cfg.max_time_s} reached on the run's clock"
        elif self.cfg.max_wall_s and time.monotonic() - self.wall_start > self.cfg.max_wall_s:
            self.stop_reason = f"max_wall_s {self.cfg.max_wall_s} wall-clock seconds reached"
        elif self.cfg.target_error and self.evals and self.evals[-1]["error"] <= self.cfg.target_error:
            self.stop_reason = f"target error {self.cfg.target_error} reached"
        elif self.counts["replies"] - self.replies_at_version >= self.cfg.stall_replies:
            self.stop_reason = f"{self.cfg.stall_replies} replies without an accepted update"
        if self.stop_reason:
            self.event("stopped", reason=self.stop_reason)
        return bool(self.stop_reason)

    def step(self, round_open: bool) -> bool:
        """One turn of the loop: refresh members, dispatch to idle nodes, handle one due reply."""
        self.refresh_nodes()
        self.expire_overdue()
        self.resting = {n: t for n, t in self.resting.items() if t > self.now()}
        if self.clock_stands_still() and self.members.present <= set(self.resting):
            self.resting = {}  # only a reply moves a virtual clock: no rest would ever end
        if self.cfg.sync:
            if not round_open:
                for node in sorted(self.members.present - set(self.resting)):
                    self.dispatch(node)
                round_open = True
        else:
            busy = {d.node for d in self.in_flight.values()}
            for node in sorted(self.members.present - busy - self.unavailable - set(self.resting)):
                self.dispatch(node)
        self.handle_next_reply()
        if self.cfg.sync and round_open and not self.in_flight:
            self.aggregate()
            round_open = False
        elif not self.cfg.sync and len(self.buffer) >= self.cfg.buffer_size:
            self.aggregate()
        return round_open

    def run(self) -> dict:
        if self.direction_off:
            self.event("direction-off", reason=f"the direction check is off: {self.direction_off}")
        if self.cfg.resume:  # before the wait for nodes: a checkpoint that does not fit fails at once
            self.resume()
        self.wait_for_nodes()
        self.publish()
        initial = self.evaluate() if not self.evals else self.evals[0]["error"]
        loop_cpu, loop_eval_cpu = time.process_time(), self.eval_cpu_s
        failure = None
        try:
            round_open = False
            while self.version < self.cfg.versions and not self.should_stop():
                round_open = self.step(round_open)
            loop_time = self.now()  # the simulated span; draining waits out lost messages' watchdogs
            self.drain()
            if self.cfg.mode == "parablock" and self.pending_nodes:
                self.last_refresh = float("-inf")
                self.refresh_nodes()
                for node in sorted(self.pending_nodes & self.members.present):
                    self.dispatch(node, action="flush")
                self.drain()
            self.aggregate()  # whatever arrived after the last aggregation
            self.checkpointer.flush()
        except CheckpointError as err:  # the run cannot be resumed past this point: stop and say why
            failure, self.stop_reason = err, str(err)
            self.event("stopped", reason=self.stop_reason)
            loop_time = self.now()
        self.announce_end()
        # the coordinator's own cost: the process's CPU over the loop (its thread, the patch store's and
        # the checkpointer's), held-out evaluations excluded; with in-process clients, theirs too
        self.loop = {
            "cpu_s": time.process_time() - loop_cpu - (self.eval_cpu_s - loop_eval_cpu),
            "time_s": loop_time,
        }
        # the final version's error; its eval is made already when eval_every divided its number
        final = self.evals[-1]["error"] if self.evals[-1]["version"] == self.version else self.evaluate()
        if self.progress:  # the last draw shows the final eval, not the one before the replies in flight
            self.progress(self)
        summary = self.finish(initial, final, self.evaluate_final_set())
        self.event("finished", initial_eval=initial, final_eval=final, stop_reason=self.stop_reason)
        if failure:  # results are saved; the caller still learns that the run failed
            raise failure
        return summary

    def drain(self) -> None:
        """Handle every reply still due; each message's watchdog bounds the wait."""
        while self.in_flight:
            self.expire_overdue()
            self.handle_next_reply()

    def finish(self, initial: float, final: float, final_set: dict | None = None) -> dict:
        self.adapter.part.set_all(self.adapter.lm.model, self.global_state)
        adapter_dir = self.out_dir / FINAL_DIR
        self.adapter.lm.model.save_pretrained(adapter_dir)
        write_record(adapter_dir, **self.adapter_record(), version=self.version, final_eval=final)
        spent = self.spent()
        summary = {
            "config": self.cfg.model_dump(),
            "initial_eval": initial,
            "final_eval": final,
            "final_set_eval": final_set,
            "wall_s": round(spent["wall_s"], 1),
            "metric": "greedy_error",
            "rounds": spent["messages"],
            "versions": self.version,
            "bytes_up": spent["bytes_up"],
            "bytes_down": spent["bytes_down"],
            "control_bytes_up": spent["control_up"],
            "control_bytes_down": spent["control_down"],
            "clock": "virtual" if self.clock.virtual else "real",
            "started_at": self.started_at,
            "time_s": round(spent["time_s"], 2),
            "loop": self.loop,
            "stop_reason": self.stop_reason,
            "counts": self.counts,
            "evals": self.evals,
            "clients": {str(k): v for k, v in self.clients.items()},
            "ledger": self.ledger.rows,
            "gate": {"updates_scored": self.gate.scored, "cpu_s": round(self.gate.cpu_s, 3)}
            if self.gate
            else None,
            "direction": {"references": self.direction.computed, "cpu_s": round(self.direction.cpu_s, 3)}
            if self.direction
            else None,
            "reputation": {str(k): round(self.reputation.weight(k), 4) for k in self.members.ids.values()},
            "events": self.events,
            "adapter_dir": str(adapter_dir),
            "best_adapter": self.best.summary(),
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def run_coordinator(grid, cfg: RunConfig, clock: Clock | None = None, progress=None) -> dict:
    import numpy as np
    import torch

    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    with Coordinator(grid, cfg, clock, progress) as coordinator:
        return coordinator.run()
