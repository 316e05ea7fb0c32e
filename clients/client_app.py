"""The Flower ClientApp: `train.block` messages run fedrl's two-thread block worker.

Per-node state (local adapter, held global adapter, pending delta) lives in
`context.state`, which Flower keeps across the messages of a run. The app owns the
process's model cache. The node's own settings (`--node-config`: the store's CA, a state
directory, its owner's limits) and the coordinator key it pinned are checked before any
work (fedrl.clients.node). A node with a state directory (a volunteer's) also keeps its
state on disk to resume from, keeps to the caps of its hardware probe, reports the probe,
answers its owner's request to leave and writes its status (fedrl.node_files). `app` is the
real client; the simulation builds the same app with its own mod in front (fedrl.sim.apps).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedrl.clients.block_worker import ClientState, Pending, handle
from fedrl.clients.disk_state import load_from_disk, save_to_disk
from fedrl.clients.model_cache import ModelCache
from fedrl.clients.node import NodeSettings, check_pin, load_pins, save_pins
from fedrl.clients.runtime import NodeRuntime, use_runtime
from fedrl.node_files import PROBE, read_json, update_status
from fedrl.protocol import (
    NO_UPLOAD,
    NOTICES,
    SETTINGS_UNKNOWN,
    HardwareProbe,
    InstructionHead,
    TrainInstruction,
    TrainReport,
    join_instruction,
)

# Flower's arrays are numpy's, which has no bfloat16: such a tensor is kept as its raw bits
# (int16) under its name with this suffix, and comes back bit for bit.
_BF16_BITS = "::bfloat16-bits"


def _record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    arrays = {}
    for k, t in tensors.items():
        if t.dtype == torch.bfloat16:
            k, t = k + _BF16_BITS, t.view(torch.int16)
        arrays[k] = t
    return ArrayRecord(arrays)


def _tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in record.to_torch_state_dict().items():
        if k.endswith(_BF16_BITS):
            k, v = k.removesuffix(_BF16_BITS), v.view(torch.bfloat16)
        out[k] = v.clone()
    return out


def load_state(state: RecordDict) -> ClientState:
    if "meta" not in state.config_records:
        return ClientState()
    meta = state.config_records["meta"]
    arrays = state.array_records
    pending = None
    if meta["pending_block"] != NO_UPLOAD:
        pending = Pending(
            int(meta["pending_block"]),
            int(meta["pending_base_version"]),
            _tensors(arrays["pending_base"]),
            _tensors(arrays["pending_new"]),
            int(meta["pending_samples"]),
            int(meta["pending_steps"]),
        )
    residual, moments = (_tensors(arrays[k]) if k in arrays else {} for k in ("residual", "moments"))
    return ClientState(
        _tensors(arrays["local"]),
        _tensors(arrays["held"]),
        int(meta["held_version"]),
        pending,
        residual,
        moments,
    )


def save_state(state: RecordDict, s: ClientState) -> None:
    if s.local is None or s.held is None:
        return
    p = s.pending
    state["local"] = _record(s.local)
    state["held"] = _record(s.held)
    if p is not None:
        state["pending_base"], state["pending_new"] = _record(p.base), _record(p.new)
    for key, tensors in (("residual", s.residual), ("moments", s.moments)):
        if tensors:
            state[key] = _record(tensors)
        elif key in state:  # an emptied part must not come back from an older message
            del state[key]
    state["meta"] = ConfigRecord(
        {
            "held_version": int(s.held_version),
            "pending_block": p.block if p else NO_UPLOAD,
            "pending_base_version": p.base_version if p else -1,
            "pending_samples": p.samples if p else 0,
            "pending_steps": p.steps if p else 0,
        }
    )


def trust_coordinator(state: RecordDict, state_dir: str, instr: TrainInstruction) -> None:
    """Pin the coordinator's key on first sight (on disk when the node has a state dir, else for
    the run); raise KeyChanged when a message brings another."""
    pins = load_pins(state_dir) if state_dir else dict(state.config_records.get("pins") or {})
    updated = check_pin(pins, instr.store_url, instr.public_key)
    if updated != pins:
        save_pins(state_dir, updated)
        state["pins"] = ConfigRecord(updated)


def read_probe(state_dir: str) -> HardwareProbe | None:
    data = read_json(Path(state_dir) / PROBE) if state_dir else None
    return HardwareProbe.parse(data, f"{Path(state_dir) / PROBE}") if data is not None else None


MEMORY = "memory"  # the prompts per step a node went down to when it ran out of memory


def within_caps(instr: TrainInstruction, probe: HardwareProbe | None, state: RecordDict) -> TrainInstruction:
    """The node never takes on more than its probe chose, nor more prompts than it could hold
    when it last ran out of memory, whatever it is asked."""
    steps, prompts = instr.steps, instr.prompts
    if probe is not None:
        steps, prompts = min(steps, probe.steps_per_round), min(prompts, probe.prompts)
    if MEMORY in state.config_records:
        prompts = min(prompts, int(state[MEMORY]["prompts"]))
    return instr.replace(steps=steps, prompts=prompts)


def node_runtime(node: NodeSettings):
    """The runtime of a node with an owner (a state dir or link caps); None leaves the default
    (the real world, or the simulation's runtime installed by its mod)."""
    if not (node.state_dir or node.upload_kbps or node.download_kbps):
        return None
    return NodeRuntime(
        node.cap_bytes_s(node.upload_kbps), node.cap_bytes_s(node.download_kbps), node.state_dir
    )


def read_instruction(content: RecordDict, state: RecordDict) -> TrainInstruction:
    """The whole instruction: its head, with the settings it carries (kept for the messages that
    will not) or the ones kept. ValueError (SETTINGS_UNKNOWN) when neither is the head's."""
    head = InstructionHead.from_packed(content["instruction"], "instruction")  # malformed: an error reply
    if "settings" in content.config_records:
        instr = join_instruction(head, content["settings"])
        state["settings"] = ConfigRecord({**content["settings"], "settings_id": head.settings_id})
        return instr
    kept = dict(state.config_records.get("settings", {}))
    if kept.pop("settings_id", None) != head.settings_id:
        raise ValueError(f"{SETTINGS_UNKNOWN}: this node does not hold settings {head.settings_id}")
    return join_instruction(head, kept)


def ran_out_of_memory(instr: TrainInstruction, report: TrainReport) -> bool:
    """The round went on with fewer prompts than the node took on (block_worker's retry)."""
    return 0 < report.prompts < instr.prompts


def record_status(state_dir: str, instr: TrainInstruction, report: TrainReport, holds_delta: bool) -> None:
    # a round that trained nothing (a sync, a flush) keeps the last measured step time and reward
    measured = (
        {"step_s": report.compute_s / report.steps, "reward": report.reward, "prompts": report.prompts}
        if report.steps
        else {}
    )
    update_status(
        state_dir,
        add={
            "rounds": 1 if report.steps else 0,
            "memory_retries": int(ran_out_of_memory(instr, report)),
            "bytes_up": report.bytes_up,
            "bytes_down": report.bytes_down,
        },
        phase="left" if report.leaving == "now" else "idle",
        error="",  # a round went through: an earlier refusal or failure is over
        version=instr.version,
        synced_version=report.synced_version,
        staleness=report.staleness,
        steps=report.steps,
        last_bytes_down=report.bytes_down,
        last_full_sync_bytes=report.full_sync_bytes,  # what the cache saved: this minus the above
        link_bytes_per_s=report.link_bytes_per_s,
        leaving=report.leaving,
        holds_delta=holds_delta,  # an unsent delta: a flush withdrawal waits for the next message
        updated_at=time.time(),
        **measured,
    )


# what a notice says in the node's status file (its owner's status line reads it)
NOTICE_STATUS = {
    "goodbye": lambda instr: {"phase": "left", "acknowledged": True},
    "run-over": lambda instr: {"phase": "idle", "run_over": True},
    "rest": lambda instr: {"phase": "resting", "rest_until": time.time() + instr.rest_s},
}


def make_client_app(mods: list | None = None, models: ModelCache | None = None) -> ClientApp:
    app = ClientApp(mods=mods or [])
    cache = models or ModelCache()

    @app.train("block")
    def train_block(msg: Message, context: Context) -> Message:
        node = None
        try:
            node = NodeSettings.from_node_config(context.node_config)
            instr = read_instruction(msg.content, context.state)
            trust_coordinator(context.state, node.state_dir, instr)
            probe = read_probe(node.state_dir)
        except ValueError as err:  # a refusal, with its reason, for the coordinator's log and the owner's
            if node is not None and node.state_dir:  # e.g. an instruction of another fedrl version
                update_status(node.state_dir, error=str(err)[:300], updated_at=time.time())
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=msg)
        if instr.action in NOTICES:  # its owner may stop it (nobody reads the reply)
            if node.state_dir:
                update_status(node.state_dir, **NOTICE_STATUS[instr.action](instr), updated_at=time.time())
            return Message(RecordDict(), reply_to=msg)
        instr = within_caps(instr, probe, context.state)
        if node.max_threads:
            torch.set_num_threads(node.max_threads)
        state = load_state(context.state)
        if node.state_dir and state.held is None:  # a restarted node: resume from disk
            state = load_from_disk(node.state_dir, instr.store_url) or state
        runtime = node_runtime(node)
        if node.state_dir:
            update_status(
                node.state_dir, phase="working", version=instr.version, since=time.time(), run_over=False
            )
        try:
            with use_runtime(runtime) if runtime else nullcontext():
                report, new_state = handle(instr, state, cache, node.ca_file or None)
        except Exception as err:
            if node.state_dir:
                update_status(node.state_dir, phase="idle", error=str(err)[:300])
            raise
        save_state(context.state, new_state)
        if ran_out_of_memory(instr, report):  # no more prompts than it could hold from now on
            context.state[MEMORY] = ConfigRecord({"prompts": report.prompts})
        if node.state_dir:
            save_to_disk(node.state_dir, instr.store_url, new_state)
            record_status(node.state_dir, instr, report, holds_delta=new_state.pending is not None)
        if probe is not None:
            report = report.replace(hardware=probe.model_dump_json())
        return Message(RecordDict({"report": ConfigRecord(report.to_packed())}), reply_to=msg)

    return app


app = make_client_app()
