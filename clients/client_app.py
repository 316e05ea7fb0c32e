"""The Flower ClientApp: `train.block` messages run fedrl's two-thread block worker.

Per-node state (local adapter, held global adapter, pending delta) lives in
`context.state`, which Flower keeps across the messages of a run. The app owns the
process's model cache. The node's own settings (`--node-config`: the store's CA, a state
directory) and the coordinator key it pinned are checked before any work
(fedrl.clients.node). `app` is the real client; the simulation builds the same app with its
own mod in front (fedrl.sim.apps).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedrl.clients.block_worker import ClientState, Pending, handle
from fedrl.clients.model_cache import ModelCache
from fedrl.clients.node import NodeSettings, check_pin, load_pins, save_pins
from fedrl.protocol import NO_UPLOAD, TrainInstruction


def _tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in record.to_torch_state_dict().items()}


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
        )
    return ClientState(
        _tensors(arrays["local"]), _tensors(arrays["held"]), int(meta["held_version"]), pending
    )


def save_state(state: RecordDict, s: ClientState) -> None:
    if s.local is None or s.held is None:
        return
    p = s.pending
    state["local"] = ArrayRecord(s.local)
    state["held"] = ArrayRecord(s.held)
    if p is not None:
        state["pending_base"], state["pending_new"] = ArrayRecord(p.base), ArrayRecord(p.new)
    state["meta"] = ConfigRecord(
        {
            "held_version": int(s.held_version),
            "pending_block": p.block if p else NO_UPLOAD,
            "pending_base_version": p.base_version if p else -1,
            "pending_samples": p.samples if p else 0,
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


def make_client_app(mods: list | None = None, models: ModelCache | None = None) -> ClientApp:
    app = ClientApp(mods=mods or [])
    cache = models or ModelCache()

    @app.train("block")
    def train_block(msg: Message, context: Context) -> Message:
        instr = TrainInstruction.parse(msg.content["instruction"])  # malformed: an error reply
        try:
            node = NodeSettings.from_node_config(context.node_config)
            trust_coordinator(context.state, node.state_dir, instr)
        except ValueError as err:  # a refusal, with its reason, for the coordinator's log
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=msg)
        report, new_state = handle(instr, load_state(context.state), cache, node.ca_file or None)
        save_state(context.state, new_state)
        return Message(RecordDict({"report": ConfigRecord(report.to_record())}), reply_to=msg)

    return app


app = make_client_app()
