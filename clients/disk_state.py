"""A node's ClientState on disk, so a restarted node resumes where it was.

Flower keeps `context.state` in the SuperNode's memory: a node that crashes, reboots or is
withdrawn loses it. A node with a state directory also keeps the state in one safetensors
file (held global adapter, local copy, pending delta, the residual of top-k uploads, Adam's
kept state, their versions), written atomically after every message: it rejoins holding version v and syncs
by patches from v. The file is bound to the patch store it came from; another federation's
state is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load, save

from fedrl.clients.block_worker import ClientState, Pending
from fedrl.node_files import CLIENT_STATE, write_atomic

FILE = "state.safetensors"
PARTS = ("local", "held", "pending_base", "pending_new", "residual", "moments")


def state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / CLIENT_STATE / FILE


def save_to_disk(state_dir: str | Path, store_url: str, s: ClientState) -> None:
    if s.local is None or s.held is None:
        return
    p = s.pending
    parts = {"local": s.local, "held": s.held, "residual": s.residual, "moments": s.moments}
    if p is not None:
        parts |= {"pending_base": p.base, "pending_new": p.new}
    tensors = {f"{part}/{name}": t.contiguous() for part, ts in parts.items() for name, t in ts.items()}
    meta = {
        "store_url": store_url,
        "held_version": s.held_version,
        "pending": None if p is None else [p.block, p.base_version, p.samples, p.steps],
    }
    write_atomic(state_path(state_dir), save(tensors, metadata={"fedrl": json.dumps(meta)}))


def load_from_disk(state_dir: str | Path, store_url: str) -> ClientState | None:
    """The saved state for this store, or None (none saved, another store's, or unreadable)."""
    path = state_path(state_dir)
    try:
        data = path.read_bytes()
        tensors = load(data)
        meta = json.loads(_metadata(data)["fedrl"])
    except (FileNotFoundError, SafetensorError, ValueError, KeyError):
        return None
    if meta.get("store_url") != store_url:
        return None
    parts: dict[str, dict] = {part: {} for part in PARTS}
    for key, t in tensors.items():
        part, name = key.split("/", 1)
        parts[part][name] = t
    pending = None
    if meta["pending"] is not None:
        block, base_version, samples, *steps = meta["pending"]  # no steps: saved before they were kept
        pending = Pending(block, base_version, parts["pending_base"], parts["pending_new"], samples, *steps)
    return ClientState(
        parts["local"], parts["held"], meta["held_version"], pending, parts["residual"], parts["moments"]
    )


def _metadata(data: bytes) -> dict:
    """The safetensors header's metadata (8-byte little-endian length, then JSON)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__", {})
