"""The coordinator: block-coordinate rounds over Flower's Grid, never blocking on one client.

It keeps clients busy with push_messages/pull_messages, handles replies in the order of the
run's clock (arrival on the wall clock, or virtual arrival time in simulation: fedrl.sim.clock),
treats error replies (TTL expiry, node gone, client crash or dropout) as events, ingests each reported delta from the patch store
(bound to the uploading node, verified, staleness-checked, NaN-checked), aggregates per
block (sync: at the round barrier; async: after `buffer_size` arrivals), publishes every
new global version as signed patches, checkpoints in the background and can resume.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedrl.blocks import ALL_BLOCKS
from fedrl.credentials import ADMIN, new_secret, node_principal, token_for
from fedrl.patch import PatchError, apply_patch
from fedrl.patch_chain import PatchPublisher
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.protocol import MESSAGE_TYPE, ProtocolError, TrainInstruction, TrainReport
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.rollout import greedy_error, rollout, score
from fedrl.signing import generate_signing_key, public_key_pem
from fedrl.store_client import BlockingStoreClient, StoreError, put_signed_patches
from fedrl.sim.clock import make_clock
from fedrl.sim.profiles import ClientProfile
from fedrl.strategies.aggregation import AggregationConfig, Update, aggregate_block, rejection_reason
from fedrl.strategies.checkpoint import Checkpointer, load_latest
from fedrl.strategies.run_config import RunConfig
from fedrl.strategies.scheduler import BlockScheduler
from fedrl.tasks import get_task

log = logging.getLogger("fedrl.coordinator")


# In virtual mode the real ttl only guards against lost messages; deadlines are virtual.
VIRTUAL_MODE_TTL_S = 12 * 3600.0


@dataclass
class Dispatch:
    node: int
    block: int
    action: str
    version: int
    sent: float
    arrived: bool = False  # the Grid delivered the reply; the clock decides when it is handled
    expired: bool = False  # virtual clock: the round outlasted the deadline


class Coordinator:
    def __init__(self, grid, cfg: RunConfig, progress=None):
        from fedrl.clients.block_worker import initial_adapter, peft_model

        self.grid, self.cfg, self.progress = grid, cfg, progress
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lm, self.part = peft_model(cfg.model, cfg.lora_rank, cfg.lora_alpha, cfg.num_blocks, 0)
        self.lm = lm
        self.task = get_task(cfg.task, **json.loads(cfg.task_params))
        self.global_state = initial_adapter(cfg.model, cfg.lora_rank, cfg.lora_alpha, cfg.num_blocks, 0)
        self.version = 0
        self.scheduler = BlockScheduler(cfg.num_blocks, cfg.schedule, cfg.base_steps, cfg.min_steps, cfg.max_steps, cfg.seed)
        self.agg = AggregationConfig(cfg.alpha, cfg.max_staleness, cfg.clip_norm or None, cfg.robust)
        anchor_every = 1 if cfg.mode == "fedavg-lora" else cfg.anchor_every  # fedavg sends full adapters
        self.publisher = PatchPublisher(anchor_every=anchor_every, keep_recent=cfg.max_staleness + 2)
        self.signing_key = generate_signing_key()
        self.public_key = public_key_pem(self.signing_key).decode()
        self.store_server = None
        if cfg.store_url:
            self.secret = Path(cfg.store_secret_file).read_bytes().strip()
            self.store_url = cfg.store_url
        else:
            self.secret = new_secret()
            self.store_server = PatchStoreServer(StoreState(self.secret)).start()
            self.store_url = self.store_server.url
        self.admin = BlockingStoreClient(self.store_url, ADMIN, token_for(self.secret, ADMIN))
        self.refs: list[dict] = []
        self.in_flight: dict[str, Dispatch] = {}
        self.buffer: list[Update] = []
        self.pending_nodes: set[int] = set()  # parablock clients holding an unsent delta
        self.checkpointer = Checkpointer(cfg.checkpoint_dir or self.out_dir / "checkpoints")
        self.clock = make_clock(cfg.clock)
        self.step_s = cfg.step_s
        self.ranks: dict[int, int] = {}
        self.profiles: list[ClientProfile] = []
        self.rounds: dict[int, int] = {}  # node -> messages sent
        self.eval_cpu_s = 0.0  # held-out evaluations, kept apart from the coordinator's own cost
        self.loop: dict = {}
        self.events: list[dict] = []  # timeline for the report
        self.evals: list[dict] = []
        self.clients: dict[int, dict] = {}
        self.counts = {"replies": 0, "errors": 0, "accepted": 0, "rejected": 0}
        self.replies_at_version = 0

    # ------------------------------------------------------------------ helpers

    def now(self) -> float:
        return self.clock.now()

    def event(self, kind: str, **fields) -> None:
        self.events.append({"t": round(self.now(), 3), "kind": kind, "version": self.version, **fields})
        if kind in ("rejected", "error"):  # expected events under heterogeneity: counted, logged quietly
            log.info("%s: %s", kind, fields)

    def evaluate(self) -> float:
        cpu = time.process_time()
        self.part.set_all(self.lm.model, self.global_state)
        error = greedy_error(self.lm, self.task)
        self.eval_cpu_s += time.process_time() - cpu
        self.evals.append({"t": round(self.now(), 3), "version": self.version, "error": error})
        return error

    def publish(self) -> None:
        self.refs += put_signed_patches(self.admin, self.publisher.publish(self.global_state, self.version),
                                        self.signing_key)
        oldest = self.version - self.publisher.keep_recent
        anchors = set(self.publisher.anchors)
        self.refs = [r for r in self.refs if (r["base_version"] is None and r["target_version"] in anchors)
                     or (r["base_version"] is not None and r["base_version"] >= oldest)]
        self.admin.publish({"latest": self.version, "refs": self.refs, "public_key": self.public_key})

    def checkpoint(self) -> None:
        meta = {"scheduler": self.scheduler.state_dict(), "counts": self.counts, "in_flight": len(self.in_flight),
                "evals": self.evals, "config": self.cfg.__dict__}
        self.checkpointer.save_async(self.version, self.global_state, meta)

    def resume(self) -> bool:
        found = load_latest(self.checkpointer.directory)
        if found is None:
            return False
        version, tensors, meta = found
        if set(tensors) != set(self.global_state):
            raise ValueError(f"checkpoint in {self.checkpointer.directory} is for another adapter")
        self.version, self.global_state = version, tensors
        self.scheduler.load_state_dict(meta["scheduler"])
        self.evals = meta.get("evals", [])
        self.event("resumed", from_version=version)
        return True

    def refresh_nodes(self) -> dict[int, int]:
        """Each node's rank (its client id) and profile; ranks follow sorted node ids."""
        ids = sorted(self.grid.get_node_ids())
        if len(ids) != len(self.ranks) or any(n not in self.ranks for n in ids):
            self.ranks = {n: i for i, n in enumerate(ids)}
            self.profiles = self.cfg.client_profiles(max(len(ids), 1))
        return self.ranks

    def measure_step_s(self) -> float:
        """Seconds of one local DG step on this machine: the virtual clock's unit of work."""
        cfg = self.cfg
        block = ALL_BLOCKS if cfg.mode == "fedavg-lora" else 0
        learner = Learner(self.part.make_trainable(self.lm.model, block), LearnerConfig(cfg.method, lr=cfg.lr))
        rng, gen = np.random.default_rng(cfg.seed), torch.Generator().manual_seed(cfg.seed)
        times = []
        for _ in range(4):  # the first is a warm-up
            start = time.perf_counter()
            batch = score(self.task, rollout(self.lm, self.task, self.task.sample(cfg.prompts, rng), cfg.samples, generator=gen))
            lm_update(learner, self.lm.model, batch)
            times.append(time.perf_counter() - start)
        self.part.set_all(self.lm.model, self.global_state)
        return float(np.median(times[1:]))

    def wait_for_nodes(self) -> None:
        deadline = time.monotonic() + self.cfg.node_wait_s
        while len(list(self.grid.get_node_ids())) < self.cfg.min_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {self.cfg.min_nodes} nodes connected after {self.cfg.node_wait_s} s")
            time.sleep(0.2)

    # ------------------------------------------------------------------ dispatch and replies

    def instruction(self, node: int, rank: int, block: int, steps: int, action: str) -> TrainInstruction:
        cfg = self.cfg
        self.rounds[node] = self.rounds.get(node, 0) + 1
        return TrainInstruction(
            action=action, mode=cfg.mode, block=block, steps=steps, version=self.version,
            store_url=self.store_url, principal=node_principal(node), token=token_for(self.secret, node_principal(node)),
            public_key=self.public_key, model=cfg.model, task=cfg.task, task_params=cfg.task_params,
            num_blocks=cfg.num_blocks, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lr=cfg.lr,
            prompts=cfg.prompts, samples=cfg.samples, method=cfg.method, seed=cfg.seed, client_id=rank,
            num_clients=max(len(self.ranks), 1), round=self.rounds[node], profile=self.profiles[rank].to_json(),
            clock=cfg.clock, step_s=self.step_s, now_s=self.now(),
        )

    def dispatch(self, node: int, rank: int, action: str = "train") -> None:
        if action == "flush":
            block = -1 if self.cfg.mode == "fedavg-lora" else 0
            instr = self.instruction(node, rank, block, 0, "flush")
        elif self.cfg.mode == "fedavg-lora":
            block = -1
            instr = self.instruction(node, rank, -1, self.scheduler.steps_for(node), action)
        else:
            block = self.scheduler.assign_block(node, rank)
            instr = self.instruction(node, rank, block, self.scheduler.steps_for(node), action)
        content = RecordDict({"instruction": ConfigRecord(instr.to_record())})
        ttl = VIRTUAL_MODE_TTL_S if self.clock.virtual else self.cfg.deadline_s
        msg = Message(content, dst_node_id=node, message_type=MESSAGE_TYPE, ttl=ttl, group_id=str(self.version))
        ids = list(self.grid.push_messages([msg]))
        if not ids or not ids[0]:
            self.event("error", node=node, reason="message not accepted by the SuperLink")
            return
        self.in_flight[ids[0]] = Dispatch(node, block, action, self.version, self.now())
        # no reply can come before the round's compute is done (nor after the deadline)
        self.clock.sent(ids[0], min(instr.steps * self.step_s / self.profiles[rank].speed, self.cfg.deadline_s))

    def handle(self, reply: Message) -> None:
        d = self.in_flight.pop(reply.metadata.reply_to_message_id, None)
        if d is None:
            return
        if d.action == "train" and d.block >= 0:
            self.scheduler.release(d.block)
        self.counts["replies"] += 1
        if d.expired:
            self.counts["errors"] += 1
            self.event("error", node=d.node, reason=f"deadline {self.cfg.deadline_s} s exceeded (virtual clock)")
            return
        if reply.has_error():
            self.counts["errors"] += 1
            self.event("error", node=d.node, code=int(reply.error.code), reason=str(reply.error.reason)[:300])
            return
        try:
            report = TrainReport.from_record(reply.content["report"])
        except (KeyError, TypeError, ProtocolError) as err:
            self.counts["rejected"] += 1
            self.event("rejected", node=d.node, reason=f"malformed reply: {err}")
            return
        if report.steps:
            self.scheduler.observe_speed(d.node, report.compute_s / report.steps)
        self.record_client(d.node, report)
        if d.action == "train" and self.cfg.mode == "parablock":
            self.pending_nodes.add(d.node)
        if d.action == "flush":
            self.pending_nodes.discard(d.node)
        if report.upload_key:
            self.ingest(d.node, report)

    def record_client(self, node: int, r: TrainReport) -> None:
        c = self.clients.setdefault(node, {"profile": self.profiles[self.ranks[node]].name, "messages": 0,
                                           "compute_s": 0.0, "comm_s": 0.0, "overlap_s": 0.0, "duration_s": 0.0,
                                           "bytes_up": 0, "bytes_down": 0, "timeline": []})
        c["messages"] += 1
        for k in ("compute_s", "comm_s", "overlap_s", "duration_s", "bytes_up", "bytes_down"):
            c[k] += getattr(r, k)
        c["timeline"].append({"end": round(self.now(), 3), "duration_s": r.duration_s, "compute_s": r.compute_s,
                              "comm_s": r.comm_s, "overlap_s": r.overlap_s})
        self.event("reply", node=node, reward=r.reward, steps=r.steps, staleness=r.staleness,
                   bytes_up=r.bytes_up, bytes_down=r.bytes_down)

    def ingest(self, node: int, r: TrainReport) -> None:
        """Fetch, verify and queue one client delta; anything wrong is rejected with a reason."""
        try:
            staleness = self.version - r.upload_base_version
            if not 0 <= staleness <= self.agg.max_staleness:  # cheap checks before any download
                raise ValueError(f"staleness {staleness} is outside [0, {self.agg.max_staleness}]")
            meta = self.admin.meta(r.upload_key)
            if node_principal(node) not in meta["uploaders"]:
                raise ValueError(f"object was uploaded by {meta['uploaders']}, not by node {node}")
            base = self.publisher.state(r.upload_base_version)
            if base is None:
                raise ValueError(f"base version {r.upload_base_version} is no longer retained (too stale)")
            if r.upload_block == -1:
                names = list(self.global_state)
                new = apply_patch(None, self.admin.get(r.upload_key))
            else:
                names = self.part.names(r.upload_block)
                new = apply_patch({n: base[n] for n in names}, self.admin.get(r.upload_key))
            if set(new) != set(names):
                raise ValueError("the upload does not carry exactly the block's tensors")
            delta = {n: new[n].float() - base[n].float() for n in names}
            update = Update(node, r.upload_block, delta, r.upload_samples, staleness)
            reason = rejection_reason(update, self.agg)
            if reason:
                raise ValueError(reason)
        except (StoreError, PatchError, ValueError) as err:
            self.counts["rejected"] += 1
            self.event("rejected", node=node, reason=str(err)[:300])
            return
        finally:
            try:
                self.admin.delete(r.upload_key, node_principal(node))
            except StoreError:
                pass
        self.counts["accepted"] += 1
        self.event("accepted", node=node, block=r.upload_block, staleness=staleness)
        self.buffer.append(update)

    def aggregate(self) -> None:
        if not self.buffer:
            return
        by_block: dict[int, list[Update]] = {}
        for u in self.buffer:
            if u.block == -1:  # a whole-adapter update contributes to every block
                for b in range(self.cfg.num_blocks):
                    names = self.part.names(b)
                    by_block.setdefault(b, []).append(Update(u.node, b, {n: u.delta[n] for n in names}, u.num_samples, u.staleness))
            else:
                by_block.setdefault(u.block, []).append(u)
        new_state = dict(self.global_state)  # tensors are replaced, never mutated (lazy checkpoint copies)
        for block, updates in by_block.items():
            for name, delta in aggregate_block(updates, self.agg).items():
                new_state[name] = self.global_state[name] + delta
            self.scheduler.record_update(block, self.version + 1)
        self.global_state, self.version = new_state, self.version + 1
        self.replies_at_version = self.counts["replies"]
        self.event("version", updates=len(self.buffer), blocks=sorted(by_block))
        self.buffer = []
        self.publish()
        self.checkpoint()
        if self.version % self.cfg.eval_every == 0:
            self.evaluate()
        if self.progress:
            self.progress(self)

    def pull(self) -> int:
        """Hand the Grid's new replies to the clock, with each round's length on the run's clock."""
        waiting = [i for i, d in self.in_flight.items() if not d.arrived]
        if not waiting:
            return 0
        replies = list(self.grid.pull_messages(waiting))
        for reply in replies:
            msg_id = reply.metadata.reply_to_message_id
            d = self.in_flight.get(msg_id)
            if d is None or d.arrived:
                continue
            d.arrived = True
            duration = self.cfg.deadline_s  # an error reply is noticed at the deadline
            if not reply.has_error():
                try:
                    duration = float(reply.content["report"]["duration_s"])
                except (KeyError, TypeError, ValueError):
                    duration = 0.0  # malformed: handled (and rejected) as soon as it is due
            if self.clock.virtual and duration > self.cfg.deadline_s:
                d.expired, duration = True, self.cfg.deadline_s
            self.clock.arrived(msg_id, reply, duration)
        return len(replies)

    def next_reply(self) -> Message | None:
        """The next reply due on the run's clock, pulling from the Grid when none is."""
        due = self.clock.next_due()
        if due is None and self.pull():
            due = self.clock.next_due()
        return due[1] if due else None

    # ------------------------------------------------------------------ the loop

    def should_stop(self) -> bool:
        if self.cfg.max_time_s and self.now() > self.cfg.max_time_s:
            self.event("stopped", reason=f"max_time_s {self.cfg.max_time_s} reached on the {self.cfg.clock} clock")
            return True
        if self.cfg.target_error and self.evals and self.evals[-1]["error"] <= self.cfg.target_error:
            self.event("stopped", reason=f"target error {self.cfg.target_error} reached")
            return True
        if self.counts["replies"] - self.replies_at_version >= self.cfg.stall_replies:
            self.event("stopped", reason=f"{self.cfg.stall_replies} replies without an accepted update")
            return True
        return False

    def run(self) -> dict:
        self.wait_for_nodes()
        self.refresh_nodes()
        self.resume()
        if self.step_s <= 0:
            self.step_s = self.measure_step_s()
            self.event("calibrated", step_s=round(self.step_s, 4))
        self.publish()
        initial = self.evaluate() if not self.evals else self.evals[0]["error"]
        round_open = False
        last_refresh = time.monotonic()
        loop_cpu, loop_eval_cpu = time.process_time(), self.eval_cpu_s
        while self.version < self.cfg.versions and not self.should_stop():
            if time.monotonic() - last_refresh > 1.0:
                self.refresh_nodes()
                last_refresh = time.monotonic()
            if self.cfg.sync:
                if not round_open:
                    for node, rank in self.ranks.items():
                        self.dispatch(node, rank)
                    round_open = True
            else:
                busy = {d.node for d in self.in_flight.values()}
                for node, rank in self.ranks.items():
                    if node not in busy:
                        self.dispatch(node, rank)
            reply = self.next_reply()
            if reply is None:
                time.sleep(0.02)
                continue
            self.handle(reply)
            if self.cfg.sync and round_open and not self.in_flight:
                self.aggregate()
                round_open = False
            elif not self.cfg.sync and len(self.buffer) >= self.cfg.buffer_size:
                self.aggregate()
        loop_time = self.now()  # the simulated span; draining waits out lost messages' deadlines
        self.drain()
        if self.cfg.mode == "parablock" and self.pending_nodes:
            self.refresh_nodes()
            for node in sorted(self.pending_nodes & set(self.ranks)):
                self.dispatch(node, self.ranks[node], action="flush")
            self.drain()
        self.aggregate()  # whatever arrived after the last aggregation
        # the coordinator's own cost: the process's CPU over the loop (its thread, the patch store's and
        # the checkpointer's), held-out evaluations excluded; with in-process clients, theirs too
        self.loop = {"cpu_s": time.process_time() - loop_cpu - (self.eval_cpu_s - loop_eval_cpu), "time_s": loop_time}
        final = self.evaluate()
        self.checkpointer.flush()
        return self.finish(initial, final)

    def drain(self) -> None:
        """Handle every reply still due (each message has its ttl as deadline)."""
        deadline = time.monotonic() + (self.cfg.deadline_s if not self.clock.virtual else VIRTUAL_MODE_TTL_S) + 30
        while self.in_flight and time.monotonic() < deadline:
            reply = self.next_reply()
            if reply is None:
                time.sleep(0.02)
            else:
                self.handle(reply)

    def finish(self, initial: float, final: float) -> dict:
        self.part.set_all(self.lm.model, self.global_state)
        adapter_dir = self.out_dir / "adapter"
        self.lm.model.save_pretrained(adapter_dir)
        bytes_up = sum(c["bytes_up"] for c in self.clients.values())
        bytes_down = sum(c["bytes_down"] for c in self.clients.values())
        summary = {
            "config": self.cfg.__dict__, "initial_eval": initial, "final_eval": final, "metric": "greedy_error",
            "rounds": sum(c["messages"] for c in self.clients.values()), "versions": self.version,
            "bytes_up": bytes_up, "bytes_down": bytes_down, "clock": self.cfg.clock, "time_s": round(self.now(), 2),
            "step_s": self.step_s, "loop": self.loop,
            "counts": self.counts, "evals": self.evals, "clients": {str(k): v for k, v in self.clients.items()},
            "events": self.events, "adapter_dir": str(adapter_dir),
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def close(self) -> None:
        self.admin.close()
        if self.store_server:
            self.store_server.stop()


def run_coordinator(grid, cfg: RunConfig, progress=None) -> dict:
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    coordinator = Coordinator(grid, cfg, progress)
    try:
        return coordinator.run()
    finally:
        coordinator.close()
