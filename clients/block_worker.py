"""One client's work for one `train.block` message, without Flower.

Two threads run at once in `parablock` mode:
  compute (the caller's thread): local DG steps on the assigned block of the local copy,
      which may be one round stale;
  communication (a helper thread): upload last round's delta, then fetch and verify the
      patches that bring the held global adapter to the instructed version.
When the new global state lands, block-level correction: blocks other than b take the
new global values, block b is rebased: local[b] = global[b] + (local[b] - base[b]).
`block-sequential` and `fedavg-lora` do the same pieces one after another.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from fedrl.blocks import BlockPartition
from fedrl.frictions import corrupt_rewards, inject_bugs
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.lora import LoraSettings, add_lora
from fedrl.models import LoadedModel, load_model
from fedrl.patch import encode_patch
from fedrl.patch_chain import PatchRef, synchronize
from fedrl.protocol import TrainInstruction, TrainReport
from fedrl.rollout import rollout, score
from fedrl.signing import load_public_key, verify_signed_patch
from fedrl.sim.clock import round_seconds
from fedrl.sim.link import Link
from fedrl.store_client import PatchStoreClient
from fedrl.tasks import get_task

Tensors = dict[str, torch.Tensor]


@dataclass
class Pending:
    """The delta computed last round, kept until the next message uploads it."""

    block: int
    base_version: int
    base: Tensors  # the global values of the block it was rebased on
    new: Tensors  # the local values of the block
    samples: int


@dataclass
class ClientState:
    local: Tensors | None = None  # the local adapter (compute works on it)
    held: Tensors | None = None  # the last global adapter synced exactly (patches apply to it)
    held_version: int | None = None
    pending: Pending | None = None


@dataclass
class CommResult:
    held: Tensors | None = None
    upload_key: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    intervals: list[tuple[float, float]] = field(default_factory=list)  # when the link was busy
    virtual_s: float = 0.0  # the link's seconds in virtual mode
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@lru_cache(maxsize=2)
def _cached_peft_model(model: str, rank: int, alpha: float, num_blocks: int, seed: int):
    lm = load_model(model)
    lm.model = add_lora(lm.model, LoraSettings(rank=rank, alpha=alpha), seed=seed)
    part = BlockPartition(lm.model, num_blocks)
    return lm, part, part.get_all(lm.model)


def peft_model(model: str, rank: int, alpha: float, num_blocks: int, seed: int) -> tuple[LoadedModel, BlockPartition]:
    """The base model with a LoRA adapter, loaded once per process and shared by every user in
    it (each message, or the coordinator, sets the weights it needs before using it)."""
    lm, part, _ = _cached_peft_model(model, rank, alpha, num_blocks, seed)
    return lm, part


def initial_adapter(model: str, rank: int, alpha: float, num_blocks: int, seed: int) -> Tensors:
    """The adapter's freshly initialized values, whatever the shared model was trained to since."""
    return {n: t.clone() for n, t in _cached_peft_model(model, rank, alpha, num_blocks, seed)[2].items()}


def block_correction(local: Tensors, base: Tensors, new_global: Tensors, block_names: list[str]) -> tuple[Tensors, Tensors]:
    """Other blocks take the new global values; the trained block keeps its progress on top of
    the new global block. Returns the corrected local copy and the new base of the block."""
    corrected = {n: t.clone() for n, t in new_global.items()}
    for n in block_names:
        corrected[n] = new_global[n] + (local[n] - base[n])
    return corrected, {n: new_global[n].clone() for n in block_names}


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def communicate(instr: TrainInstruction, state: ClientState, upload: bytes | None, sync: str, result: CommResult) -> None:
    """The communication thread: upload (if any), then bring the held global adapter to
    instr.version: sync="patch" by the cheapest verified patches, "full" by an anchor only
    (fedavg-lora exchanges the whole adapter), "none" to skip."""
    start = time.perf_counter()
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    link = Link(instr.client_profile.link, virtual=instr.clock == "virtual")
    client = PatchStoreClient(instr.store_url, instr.principal, instr.token, link)
    try:
        run(client.__aenter__())
        try:
            if upload is not None:
                result.upload_key = run(client.put(upload))
            if sync != "none":
                public_key = load_public_key(instr.public_key.encode())
                refs = [PatchRef(**r) for r in run(client.catalog())["refs"]]
                held = state.held if sync == "patch" else None
                if sync == "full":
                    refs = [r for r in refs if r.base_version is None]
                fetch = lambda ref: verify_signed_patch(run(client.get(ref.key)), public_key)
                result.held, _ = synchronize(held, state.held_version if held else None, instr.version, refs, fetch)
        finally:
            run(client.__aexit__(None, None, None))
    except Exception as err:  # handed to the compute thread, which raises it
        result.error = err
    finally:
        loop.close()
        result.bytes_up, result.bytes_down, result.virtual_s = link.bytes_up, link.bytes_down, link.virtual_s
        result.intervals.append((start, time.perf_counter()))
        result.done.set()


def _run_comm(instr: TrainInstruction, state: ClientState, upload: bytes | None, sync: str) -> CommResult:
    result = CommResult()
    communicate(instr, state, upload, sync, result)
    if result.error:
        raise result.error
    return result


def _encode_upload(pending: Pending | None, full: bool = False) -> bytes | None:
    """The delta as an exact patch of the block against the global values it is based on;
    fedavg-lora sends the whole adapter dense."""
    if pending is None:
        return None
    if full:
        return encode_patch(None, pending.new, None, pending.base_version)
    return encode_patch(pending.base, pending.new, pending.base_version, pending.base_version)


class ClientUnavailable(RuntimeError):
    """A simulated client went offline or dropped out: the message gets no report."""


@dataclass(frozen=True)
class Timing:
    compute_s: float
    comm_s: float
    overlap_s: float
    duration_s: float


def measured(compute: tuple[float, float], comm: CommResult, start: float) -> Timing:
    """Wall-clock timing of a round (real clock)."""
    return Timing(compute[1] - compute[0], sum(end - begin for begin, end in comm.intervals),
                  sum(overlap_seconds(compute, iv) for iv in comm.intervals), time.perf_counter() - start)


def virtual(overlapped: bool, compute_s: float, before_s: float, after_s: float) -> Timing:
    duration, overlap = round_seconds(overlapped, compute_s, before_s, after_s)
    return Timing(compute_s, before_s + after_s, overlap, duration)


def handle(instr: TrainInstruction, state: ClientState) -> tuple[TrainReport, ClientState]:
    """Do what `instr` asks; returns the report and the state to keep for the next message."""
    start = time.perf_counter()
    profile, on_virtual_clock = instr.client_profile, instr.clock == "virtual"
    if instr.action == "flush":  # parablock's last round: push the pending delta
        comm = _run_comm(instr, state, _encode_upload(state.pending), "none")
        timing = virtual(False, 0.0, comm.virtual_s, 0.0) if on_virtual_clock else measured((start, start), comm, start)
        report = _report(instr, state.pending, comm, timing, [], 0, state.held_version or 0)
        return report, ClientState(state.local, state.held, state.held_version)

    rng = np.random.default_rng([instr.seed, instr.client_id, instr.round])
    step_v = instr.step_s / profile.speed  # virtual seconds per step
    gone = profile.offline_reason(instr.client_id, instr.now_s, instr.steps * step_v,
                                  np.random.default_rng([instr.seed, instr.client_id, instr.round, 1]))
    if gone:
        raise ClientUnavailable(f"client {instr.client_id} ({profile.name}): {gone}")
    lm, part = peft_model(instr.model, instr.lora_rank, instr.lora_alpha, instr.num_blocks, 0)
    names = part.names(instr.block)  # block -1: the whole adapter
    overlapped = instr.mode == "parablock" and state.local is not None
    upload = _encode_upload(state.pending) if instr.mode == "parablock" else None
    comm = CommResult()
    sync = "full" if instr.mode == "fedavg-lora" else "patch"
    comm_thread = threading.Thread(target=communicate, args=(instr, state, upload, sync, comm), name="comm", daemon=True)
    comm_thread.start()
    if not overlapped:  # sequential modes, and a parablock client's first round: sync first
        comm_thread.join()
        if comm.error:
            raise comm.error
    local = state.local if overlapped else comm.held
    staleness = instr.version - (state.held_version or 0) if overlapped else 0
    part.set_all(lm.model, local)
    base = {n: local[n].clone() for n in names}
    learner = Learner(part.make_trainable(lm.model, instr.block), LearnerConfig(instr.method, lr=instr.lr))
    task = get_task(instr.task, **json.loads(instr.task_params)).client_split(instr.num_clients, instr.client_id)
    landmine = "0" * task.max_answer_tokens
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    corrected = not overlapped
    metrics: list[dict] = []
    compute_start = time.perf_counter()
    for _ in range(instr.steps):
        step_start = time.perf_counter()
        batch = rollout(lm, task, task.sample(instr.prompts, rng), instr.samples, generator=gen)
        inject_bugs(batch, lm, landmine, profile.bug_prob, rng)  # this client's frictions
        score(task, batch)
        corrupt_rewards(batch.rewards, profile.reward_noise_prob, rng)
        metrics.append(lm_update(learner, lm.model, batch))
        if profile.speed != 1.0 and not on_virtual_clock:  # a slower (or faster) machine than this one
            time.sleep(max(0.0, (1.0 / profile.speed - 1.0) * (time.perf_counter() - step_start)))
        # the patch lands when the comm thread is done: in wall time, or (virtual clock) once
        # the steps computed so far take longer than the link's virtual seconds
        landed = comm.done.is_set() and (not on_virtual_clock or len(metrics) * step_v >= comm.virtual_s)
        if not corrected and landed and comm.error is None:
            base, corrected = _correct(lm, part, comm.held, base, names), True
    compute_end = time.perf_counter()
    comm_thread.join()
    if comm.error:
        raise comm.error
    if not corrected:
        base = _correct(lm, part, comm.held, base, names)
    new_local = part.get_all(lm.model)
    samples = instr.steps * instr.prompts * instr.samples
    pending = Pending(instr.block, instr.version, base, {n: new_local[n].clone() for n in names}, samples)
    before_s, after_s = comm.virtual_s, 0.0
    if instr.mode == "parablock":
        uploaded, keep = (state.pending if upload is not None else None), pending
    else:  # sequential modes upload this round's delta after compute, through the same link
        after = _run_comm(instr, state, _encode_upload(pending, full=instr.mode == "fedavg-lora"), "none")
        comm.upload_key, comm.bytes_up = after.upload_key, comm.bytes_up + after.bytes_up
        comm.intervals += after.intervals
        after_s = after.virtual_s
        uploaded, keep = pending, None
    if on_virtual_clock:
        timing = virtual(overlapped, len(metrics) * step_v, before_s, after_s)
    else:
        timing = measured((compute_start, compute_end), comm, start)
    report = _report(instr, uploaded, comm, timing, metrics, staleness, instr.version)
    return report, ClientState(new_local, comm.held, instr.version, keep)


def _correct(lm, part: BlockPartition, new_global: Tensors, base: Tensors, names: list[str]) -> Tensors:
    corrected, new_base = block_correction(part.get_all(lm.model), base, new_global, names)
    part.set_all(lm.model, corrected)
    return new_base


def _report(instr, uploaded: Pending | None, comm: CommResult, timing: Timing, metrics: list[dict],
            staleness: int, synced: int) -> TrainReport:
    def mean(key: str) -> float:
        values = [m[key] for m in metrics if key in m]
        return float(np.mean(values)) if values else 0.0

    return TrainReport(
        upload_key=comm.upload_key if uploaded else "",
        upload_block=uploaded.block if uploaded else -2,
        upload_base_version=uploaded.base_version if uploaded else -1,
        upload_samples=uploaded.samples if uploaded else 0,
        synced_version=synced,
        reward=mean("reward"), loss=mean("loss"), gate_mean=mean("gate_mean"), steps=len(metrics),
        compute_s=timing.compute_s, comm_s=timing.comm_s, overlap_s=timing.overlap_s, duration_s=timing.duration_s,
        bytes_up=comm.bytes_up, bytes_down=comm.bytes_down, staleness=staleness,
    )
