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
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.lora import LoraSettings, add_lora
from fedrl.models import LoadedModel, load_model
from fedrl.patch import encode_patch
from fedrl.patch_chain import PatchRef, synchronize
from fedrl.protocol import TrainInstruction, TrainReport
from fedrl.rollout import rollout, score
from fedrl.signing import load_public_key, verify_signed_patch
from fedrl.sim.link import Link, LinkProfile
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
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@lru_cache(maxsize=2)
def peft_model(model: str, rank: int, alpha: float, num_blocks: int, seed: int) -> tuple[LoadedModel, BlockPartition]:
    """The base model with a LoRA adapter, loaded once per process; every message sets its weights."""
    lm = load_model(model)
    lm.model = add_lora(lm.model, LoraSettings(rank=rank, alpha=alpha), seed=seed)
    return lm, BlockPartition(lm.model, num_blocks)


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
    link = Link(LinkProfile(instr.up_bytes_s or float("inf"), instr.down_bytes_s or float("inf"), instr.latency_s))
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
        result.bytes_up, result.bytes_down = link.bytes_up, link.bytes_down
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


def handle(instr: TrainInstruction, state: ClientState) -> tuple[TrainReport, ClientState]:
    """Do what `instr` asks; returns the report and the state to keep for the next message."""
    start = time.perf_counter()
    if instr.action == "flush":  # parablock's last round: push the pending delta
        comm = _run_comm(instr, state, _encode_upload(state.pending), "none")
        report = _report(instr, state.pending, comm, (start, start), [], 0, state.held_version or 0, start)
        return report, ClientState(state.local, state.held, state.held_version)

    lm, part = peft_model(instr.model, instr.lora_rank, instr.lora_alpha, instr.num_blocks, 0)
    names = part.names(instr.block) if instr.block >= 0 else [n for b in range(instr.num_blocks) for n in part.names(b)]
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
    params = dict(lm.model.named_parameters())
    for name, p in params.items():
        p.requires_grad_(name in base)
    learner = Learner([params[n] for n in names], LearnerConfig(instr.method, lr=instr.lr))
    task = get_task(instr.task, **json.loads(instr.task_params)).client_split(instr.num_clients, instr.client_id)
    rng = np.random.default_rng([instr.seed, instr.client_id, instr.version])
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    corrected = not overlapped
    metrics: list[dict] = []
    compute_start = time.perf_counter()
    for _ in range(instr.steps):
        step_start = time.perf_counter()
        batch = score(task, rollout(lm, task, task.sample(instr.prompts, rng), instr.samples, generator=gen))
        metrics.append(lm_update(learner, lm.model, batch))
        if instr.speed != 1.0:  # a slower (or faster) machine than this one
            time.sleep(max(0.0, (1.0 / instr.speed - 1.0) * (time.perf_counter() - step_start)))
        if not corrected and comm.done.is_set() and comm.error is None:
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
    if instr.mode == "parablock":
        uploaded, keep = (state.pending if upload is not None else None), pending
    else:  # sequential modes upload this round's delta after compute, through the same link
        after = _run_comm(instr, state, _encode_upload(pending, full=instr.mode == "fedavg-lora"), "none")
        comm.upload_key, comm.bytes_up = after.upload_key, comm.bytes_up + after.bytes_up
        comm.intervals += after.intervals
        uploaded, keep = pending, None
    report = _report(instr, uploaded, comm, (compute_start, compute_end), metrics, staleness, instr.version, start)
    return report, ClientState(new_local, comm.held, instr.version, keep)


def _correct(lm, part: BlockPartition, new_global: Tensors, base: Tensors, names: list[str]) -> Tensors:
    corrected, new_base = block_correction(part.get_all(lm.model), base, new_global, names)
    part.set_all(lm.model, corrected)
    return new_base


def _report(instr, uploaded: Pending | None, comm: CommResult, compute: tuple[float, float],
            metrics: list[dict], staleness: int, synced: int, start: float) -> TrainReport:
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
        compute_s=compute[1] - compute[0], comm_s=sum(end - begin for begin, end in comm.intervals),
        overlap_s=sum(overlap_seconds(compute, iv) for iv in comm.intervals), wall_s=time.perf_counter() - start,
        bytes_up=comm.bytes_up, bytes_down=comm.bytes_down, staleness=staleness,
    )
