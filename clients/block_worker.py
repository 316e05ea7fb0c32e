"""One client's work for one `train.block` message, without Flower.

Two threads run at once in `parablock` mode:
  compute (the caller's thread): local DG steps on the assigned block of the local copy,
      which may be one round stale;
  communication (a helper thread): upload last round's delta, then fetch and verify the
      patches that bring the held global adapter to the instructed version.
When the new global state lands, block-level correction: blocks other than b take the
new global values, block b is rebased: local[b] = global[b] + (local[b] - base[b]).
`block-sequential` and `fedavg-lora` do the same pieces one after another.
Links, pacing, timing and the actor's faults come from the runtime (fedrl.clients.runtime).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import resource
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fedrl.clients.model_cache import ModelCache
from fedrl.clients.runtime import CommResult, Runtime, Timing, current_runtime
from fedrl.frictions import lagged_rollout, logit_noise_hook, perturb_and_score
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.lora import AdapterModel
from fedrl.patch import encode_patch, state_hash
from fedrl.patch_chain import SyncFailed, published, synchronize
from fedrl.patch_routes import PatchRef
from fedrl.protocol import NO_UPLOAD, TrainInstruction, TrainReport
from fedrl.signing import load_public_key, verify_signed_patch
from fedrl.sparsify import top_k_with_feedback
from fedrl.store_client import PatchStoreClient, StoreError
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
    steps: int = 0  # the local steps behind it (0: not known, from a state saved before it was kept)


@dataclass
class ClientState:
    local: Tensors | None = None  # the local adapter (compute works on it)
    held: Tensors | None = None  # the last global adapter synced exactly (patches apply to it)
    held_version: int | None = None
    pending: Pending | None = None
    residual: Tensors = field(default_factory=dict)  # what top-k uploads have not sent yet, per tensor
    moments: Tensors = field(default_factory=dict)  # Adam's state per tensor (keep_optimizer_state)


def block_correction(
    local: Tensors, base: Tensors, new_global: Tensors, block_names: list[str]
) -> tuple[Tensors, Tensors]:
    """Other blocks take the new global values; the trained block keeps its progress on top of
    the new global block. Returns the corrected local copy and the new base of the block."""
    corrected = {n: t.clone() for n, t in new_global.items()}
    for n in block_names:
        corrected[n] = new_global[n] + (local[n] - base[n])
    return corrected, {n: new_global[n].clone() for n in block_names}


def communicate(
    instr: TrainInstruction,
    state: ClientState,
    upload: bytes | None,
    sync: str,
    result: CommResult,
    runtime: Runtime,
    ca_file: str | None = None,
) -> None:
    """The communication thread: upload (if any), then bring the held global adapter to
    instr.version: sync="patch" by the cheapest verified patches, "full" by an anchor unless that
    version is held already (fedavg-lora exchanges the whole adapter), "none" to skip. `ca_file`
    verifies an https store."""
    start = time.perf_counter()
    link = runtime.open_link()
    result.links.append(link)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    client = PatchStoreClient(instr.store_url, instr.principal, instr.token, link, ca_file=ca_file)
    try:
        run(client.__aenter__())
        try:
            if upload is not None:
                result.upload_key = run(client.put(upload))
            if sync != "none":
                public_key = load_public_key(instr.public_key.encode())
                held = state.held if sync == "patch" or state.held_version == instr.version else None
                held_version = state.held_version if held else None
                fetch = lambda ref: verify_signed_patch(run(client.get(ref.key)), public_key)  # noqa: E731
                # the cheapest route alone first (it verifies in most rounds), every route if it fails
                tries = (1, None) if sync == "patch" else (None,)
                for plans in tries:
                    answer = run(client.catalog(instr.version, held_version, plans))
                    result.full_sync_bytes = answer["full_sync_bytes"]
                    refs = [PatchRef(**r) for r in answer["refs"]]
                    if sync == "full":
                        refs = [r for r in refs if r.base_version is None]
                    try:
                        result.held, plan = synchronize(held, held_version, instr.version, refs, fetch)
                        break
                    except SyncFailed:
                        if plans is None:
                            raise
                result.sync_patches = len(plan)
                if runtime.shows_ledger():
                    try:
                        runtime.show_ledger(run(client.ledger()))
                    except StoreError:  # a store of before the ledger, or briefly away: the last row stays
                        pass
        finally:
            run(client.__aexit__(None, None, None))
    except Exception as err:  # handed to the compute thread, which raises it
        result.error = err
    finally:
        loop.close()
        result.intervals.append((start, time.perf_counter()))
        result.done.set()


def holding_origin(state: ClientState, initial: Tensors, instr: TrainInstruction) -> ClientState:
    """A node that holds no version yet builds v0 itself: v0 is the seeded adapter, published in
    the wire dtype. When its hash is the coordinator's (`origin_hash`), the node holds v0 and syncs
    from it by patches instead of downloading an anchor; otherwise it holds nothing, as before."""
    if state.held is not None or not instr.origin_hash:
        return state
    v0 = published(initial, instr.wire_dtype)
    if state_hash(v0) != instr.origin_hash:
        return state
    return dataclasses.replace(state, held=v0, held_version=0)


def _encode_upload(pending: Pending | None, full: bool = False) -> bytes | None:
    """The delta as an exact patch of the block against the global values it is based on;
    fedavg-lora sends the whole adapter dense."""
    if pending is None:
        return None
    if full:
        return encode_patch(None, pending.new, None, pending.base_version)
    return encode_patch(pending.base, pending.new, pending.base_version, pending.base_version)


def _comm_thread(instr, state, upload, sync, runtime, ca_file) -> tuple[threading.Thread, CommResult]:
    result = CommResult()
    thread = threading.Thread(
        target=communicate,
        args=(instr, state, upload, sync, result, runtime, ca_file),
        name="comm",
        daemon=True,
    )
    thread.start()
    return thread, result


def _finish(thread: threading.Thread, result: CommResult) -> CommResult:
    thread.join()
    if result.error:
        raise result.error
    return result


def handle(
    instr: TrainInstruction, state: ClientState, models: ModelCache, ca_file: str | None = None
) -> tuple[TrainReport, ClientState]:
    """Do what `instr` asks; returns the report and the state to keep for the next message.
    `ca_file`: the CA of an https patch store (the node's own setting). A node whose owner asked
    it to leave (runtime.leaving()) trains no more: "flush" hands in its pending delta (a round
    in progress is finished first), "drop" abandons the round and uploads nothing more."""
    start = time.perf_counter()
    runtime = current_runtime()
    leaving = runtime.leaving()
    if instr.action == "flush" or leaving:  # parablock's last round, or a node on its way out
        upload = _encode_upload(state.pending) if leaving != "drop" else None
        comm = _finish(*_comm_thread(instr, state, upload, "none", runtime, ca_file))
        timing = runtime.timing(False, (start, start), 0, comm, None, start)
        uploaded = state.pending if upload is not None else None
        report = _report(uploaded, comm, timing, [], 0, state.held_version or 0, "now" if leaving else "")
        return report, dataclasses.replace(state, pending=None)

    adapter = models.get(instr.model, instr.lora_rank, instr.lora_alpha, instr.num_blocks)
    state = holding_origin(state, adapter.initial, instr)
    names = adapter.part.names(instr.block)  # block -1: the whole adapter
    overlapped = instr.mode == "parablock" and state.local is not None
    upload = _encode_upload(state.pending) if instr.mode == "parablock" else None
    sync = "full" if instr.mode == "fedavg-lora" else "patch"
    thread, comm = _comm_thread(instr, state, upload, sync, runtime, ca_file)
    try:  # the comm thread is joined on every path, also when compute fails
        if not overlapped:  # sequential modes, and a parablock client's first round: sync first
            _finish(thread, comm)
        local = state.local if overlapped else comm.held
        base, corrected, metrics, compute, moments = train_steps(
            instr, adapter, names, local, comm, runtime, not overlapped, state.moments
        )
    finally:
        thread.join()
    if comm.error:
        raise comm.error
    if not corrected:  # the patch landed after the last step: correct now
        base = _correct(adapter, comm.held, base, names)
    new_local = adapter.part.get_all(adapter.lm.model)
    staleness = instr.version - (state.held_version or 0) if overlapped else 0
    leaving = runtime.leaving()  # asked during the round: "drop" abandoned it, "flush" finished it
    pending, residual = None, state.residual
    if leaving != "drop":
        trained = {n: new_local[n].clone() for n in names}
        sent, residual = top_k_with_feedback(base, trained, residual, instr.upload_density)
        pending = Pending(
            instr.block,
            instr.version,
            base,
            runtime.poison_update(
                base, sent, instr.seed + instr.round, {n: adapter.initial[n] for n in names}
            ),
            sum(m["samples"] for m in metrics),
            len(metrics),
        )
    after = None
    if instr.mode == "parablock":
        uploaded, keep = (state.pending if upload is not None else None), pending
    elif pending is not None:  # sequential modes upload this round's delta after compute
        after = _finish(
            *_comm_thread(
                instr,
                state,
                _encode_upload(pending, full=instr.mode == "fedavg-lora"),
                "none",
                runtime,
                ca_file,
            )
        )
        comm.upload_key = after.upload_key
        uploaded, keep = pending, None
    else:
        uploaded, keep = None, None
    timing = runtime.timing(overlapped, compute, len(metrics), comm, after, start)
    if after is not None:
        comm.links += after.links
    farewell = ("after-flush" if keep is not None else "now") if leaving else ""
    report = _report(uploaded, comm, timing, metrics, staleness, instr.version, farewell)
    moments = {**state.moments, **moments} if instr.keep_optimizer_state else {}
    return report, ClientState(new_local, comm.held, instr.version, keep, residual, moments)


def train_steps(
    instr: TrainInstruction,
    adapter: AdapterModel,
    names: list[str],
    local: Tensors,
    comm: CommResult,
    runtime: Runtime,
    corrected: bool,
    moments: Tensors,
) -> tuple[Tensors, bool, list[dict], tuple[float, float], Tensors]:
    """The compute thread's local DG steps on the block; applies block correction between
    steps once the comm thread's patch has landed. Adam goes on from `moments` when the run keeps
    optimizer state. Returns the block's base, whether it was corrected, per-step metrics, the
    compute interval (wall clock) and Adam's state of the block's tensors after the steps."""
    lm, part = adapter.lm, adapter.part
    part.set_all(lm.model, local)
    base = {n: local[n].clone() for n in names}
    learner = Learner(part.make_trainable(lm.model, instr.block), LearnerConfig.of(instr))
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    if instr.keep_optimizer_state:
        learner.restore_moments(trainable, moments)
    task = get_task(instr.task, **json.loads(instr.task_params)).client_split(instr.data_shards, instr.shard)
    rng = np.random.default_rng([instr.seed, instr.client_id, instr.round])
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    faults = runtime.frictions()  # a simulated volunteer's actor; nothing on a real node
    history = runtime.actor_history()
    noise = logit_noise_hook(faults.logit_noise, gen)

    def step(prompts: int) -> dict:
        problems = task.sample(prompts, rng)
        batch = lagged_rollout(
            lm,
            part,
            history,
            rng,
            task,
            problems,
            instr.samples,
            generator=gen,
            temperature=instr.temperature,
            logit_hook=noise,
        )
        perturb_and_score(batch, lm, task, faults, rng)
        return {**lm_update(learner, lm.model, batch), "prompts": prompts, "samples": prompts * instr.samples}

    metrics: list[dict] = []
    prompts, retried = instr.prompts, False
    compute_start = time.perf_counter()
    for _ in range(instr.steps):
        step_start = time.perf_counter()
        try:
            done = step(prompts)
        except Exception as err:
            if retried or prompts == 1 or not is_out_of_memory(err):
                raise
            done = None
        if done is None:  # out of memory, once a round: the step again with half the prompts, out
            # of the handler (its traceback holds the failed step's tensors until it is left)
            prompts, retried = prompts // 2, True
            gc.collect()
            done = step(prompts)
        metrics.append(done)
        runtime.pace(time.perf_counter() - step_start)
        if runtime.leaving() == "drop":  # the owner abandons the round: no more steps
            break
        if not corrected and runtime.landed(comm, len(metrics)) and comm.error is None:
            base, corrected = _correct(adapter, comm.held, base, names), True
    kept = learner.moments(trainable) if instr.keep_optimizer_state else {}
    return base, corrected, metrics, (compute_start, time.perf_counter()), kept


OUT_OF_MEMORY = ("can't allocate memory", "out of memory")  # torch's CPU allocator; CUDA, MPS


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, torch's OutOfMemoryError (CUDA) or its
    CPU allocator's RuntimeError, which is what a node past its memory cap (RLIMIT_DATA) gets."""
    return isinstance(err, MemoryError) or (
        isinstance(err, RuntimeError) and any(words in str(err).lower() for words in OUT_OF_MEMORY)
    )


def _correct(adapter: AdapterModel, new_global: Tensors, base: Tensors, names: list[str]) -> Tensors:
    corrected, new_base = block_correction(adapter.part.get_all(adapter.lm.model), base, new_global, names)
    adapter.part.set_all(adapter.lm.model, corrected)
    return new_base


def _report(
    uploaded: Pending | None,
    comm: CommResult,
    timing: Timing,
    metrics: list[dict],
    staleness: int,
    synced: int,
    leaving: str = "",
) -> TrainReport:
    def mean(key: str) -> float:
        values = [m[key] for m in metrics if key in m]
        return float(np.mean(values)) if values else 0.0

    return TrainReport(
        upload_key=comm.upload_key if uploaded else "",
        upload_block=uploaded.block if uploaded else NO_UPLOAD,
        upload_base_version=uploaded.base_version if uploaded else -1,
        upload_samples=uploaded.samples if uploaded else 0,
        upload_steps=uploaded.steps if uploaded else 0,
        synced_version=synced,
        reward=mean("reward"),
        loss=mean("loss"),
        gate_mean=mean("gate_mean"),
        steps=len(metrics),
        compute_s=timing.compute_s,
        comm_s=timing.comm_s,
        overlap_s=timing.overlap_s,
        duration_s=timing.duration_s,
        bytes_up=comm.bytes_up,
        bytes_down=comm.bytes_down,
        full_sync_bytes=comm.full_sync_bytes,
        sync_patches=comm.sync_patches,
        staleness=staleness,
        link_bytes_per_s=(comm.bytes_up + comm.bytes_down) / timing.comm_s if timing.comm_s > 0 else 0.0,
        memory_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
        prompts=metrics[-1]["prompts"] if metrics else 0,
        leaving=leaving,
    )
