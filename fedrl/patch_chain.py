"""Versions, anchors and the cheapest way for a receiver to reach the newest state.

The publisher keeps the states it needs (anchors every N versions and a few recent ones)
and emits for each new version a patch from every recent one (the previous version's, and
skips v_old -> v_new directly) and an anchor every N versions. A receiver ranks the ways to
reach a target from what it holds (its own version, or nothing) and falls back to the next on
any failure.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fedrl.patch import (
    PatchError,
    PatchHeader,
    TargetMismatch,
    apply_patch,
    encode_patch,
    read_header,
    state_hash,
)


@dataclass(frozen=True)
class PatchRef:
    base_version: int | None  # None: an anchor (full state)
    target_version: int
    size: int
    key: str  # where to fetch it (a content hash in the patch store)


def cheapest_path(refs: list[PatchRef], start: int | None, target: int) -> list[PatchRef] | None:
    """Fewest bytes from `start` (None = holding nothing) to `target` over the refs (Dijkstra)."""
    edges = collections.defaultdict(list)
    for r in refs:
        edges[r.base_version].append(r)
    best = {start: 0}
    queue = [(0, 0, start, [])]
    tie = 0
    while queue:
        cost, _, node, path = heapq.heappop(queue)
        if node == target and path:
            return path
        if cost > best.get(node, float("inf")):
            continue
        for r in edges[node]:
            nxt = cost + r.size
            if nxt < best.get(r.target_version, float("inf")):
                best[r.target_version] = nxt
                tie += 1
                heapq.heappush(queue, (nxt, tie, r.target_version, path + [r]))
    return None


def sync_plans(refs: list[PatchRef], held_version: int | None, target: int) -> list[list[PatchRef]]:
    """Distinct ways to reach `target`, cheapest first: from the held version, from an anchor,
    and the anchor of the target itself (a full sync)."""
    candidates = []
    if held_version is not None:
        candidates.append(cheapest_path(refs, held_version, target))
    candidates.append(cheapest_path(refs, None, target))
    candidates += [[r] for r in refs if r.base_version is None and r.target_version == target]
    plans, seen = [], set()
    for plan in sorted((p for p in candidates if p), key=lambda p: sum(r.size for r in p)):
        ident = tuple(r.key for r in plan)
        if ident not in seen:
            seen.add(ident)
            plans.append(plan)
    return plans


class SyncFailed(RuntimeError):
    pass


def _label(base: int | None, target: int) -> str:
    return f"anchor v{target}" if base is None else f"v{base}->v{target}"


def check_labels(header: PatchHeader, ref: PatchRef) -> None:
    """A genuine, signed patch can still be the wrong one: a catalog that lists the v0 anchor
    as v9 would roll a client back. The versions in the (signed) header must be the ref's."""
    if (header.base_version, header.target_version) != (ref.base_version, ref.target_version):
        raise TargetMismatch(
            f"rollback refused: the catalog lists {_label(ref.base_version, ref.target_version)}, "
            f"the patch's own header says {_label(header.base_version, header.target_version)}"
        )


def synchronize(
    held: Mapping[str, torch.Tensor] | None,
    held_version: int | None,
    target: int,
    refs: list[PatchRef],
    fetch: Callable[[PatchRef], bytes],
) -> tuple[dict[str, torch.Tensor], list[PatchRef]]:
    """Reach `target` by the cheapest plan that verifies; returns the state and the plan used.

    A plan whose fetch fails (OSError) or whose patch does not verify (PatchError) is abandoned
    and the next is tried; the held state is never modified."""
    if held_version == target and held is not None:
        return dict(held), []
    errors = []
    held_hash = state_hash(held) if held else None
    for plan in sync_plans(refs, held_version if held else None, target):
        state, known_hash = (held, held_hash) if plan[0].base_version is not None else (None, None)
        try:
            for ref in plan:
                data = fetch(ref)
                check_labels(read_header(data), ref)
                state = apply_patch(state, data, base_hash=known_hash)
                known_hash = None
            return state, plan
        except (PatchError, OSError) as err:
            errors.append(f"v{plan[0].base_version}->v{target} via {len(plan)} patch(es): {err}")
    raise SyncFailed(f"no way to reach v{target}: " + ("; ".join(errors) or "no patches lead there"))


def in_catalog(base: int | None, target: int, latest: int, publisher: PatchPublisher) -> bool:
    """Whether a published patch stays listed once `latest` is out: the anchors the publisher
    keeps, the chain from every version it retains, and skips to the latest two versions (a node
    told to sync to the version before the latest still finds its one download; older skips are
    dropped to bound the store, and a node syncing to an older version takes the chain)."""
    if base is None:
        return target in publisher.anchors
    retained = base >= latest - publisher.keep_recent
    return retained and (target == base + 1 or target >= latest - 1)


class PatchPublisher:
    """Produces the patches for each new global version and keeps what later patches need."""

    def __init__(self, anchor_every: int = 10, keep_recent: int = 8, level: int = 1, keep_anchors: int = 2):
        if anchor_every < 1 or keep_recent < 1:
            raise ValueError("anchor_every and keep_recent must be >= 1")
        self.anchor_every, self.level = anchor_every, level
        self.recent: collections.OrderedDict[int, tuple[dict, str]] = collections.OrderedDict()
        self.anchors: dict[int, tuple[dict, str]] = {}
        self.keep_recent, self.keep_anchors = keep_recent, keep_anchors

    @property
    def latest_version(self) -> int | None:
        return next(reversed(self.recent), None)

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> list[tuple[int | None, int, bytes]]:
        """(base_version, target_version, patch bytes) to store for `version`: a patch from every
        retained recent version (the previous one's is the chain's next link; the older ones are
        skips, so a receiver that fell behind downloads one patch, not a chain), and an anchor
        every `anchor_every` versions."""
        bases = list(self.recent.items())  # before _remember drops the oldest
        state, digest = self._remember(state, version)
        out = [
            (
                base_version,
                version,
                encode_patch(base, state, base_version, version, self.level, base_hash, digest),
            )
            for base_version, (base, base_hash) in reversed(bases)
        ]
        if not self.anchors or version % self.anchor_every == 0:
            self.anchors[version] = (state, digest)
            for old in sorted(self.anchors)[: -self.keep_anchors]:
                del self.anchors[old]
            out.append(
                (None, version, encode_patch(None, state, None, version, self.level, target_hash=digest))
            )
        return out

    def retain(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Keep an earlier state without publishing it (a resumed coordinator's older checkpoints):
        deltas based on it can still be judged, and the next publish patches from it."""
        self._remember(state, version)

    def _remember(self, state: Mapping[str, torch.Tensor], version: int) -> tuple[dict, str]:
        if self.latest_version is not None and version <= self.latest_version:
            raise ValueError(f"version {version} is not newer than {self.latest_version}")
        kept = {k: v.detach().clone() for k, v in state.items()}
        entry = self.recent[version] = (kept, state_hash(kept))
        while len(self.recent) > self.keep_recent:
            self.recent.popitem(last=False)
        return entry

    def state(self, version: int) -> dict | None:
        """A retained global state (recent or anchor), or None when it is gone."""
        kept = self.recent.get(version) or self.anchors.get(version)
        return kept[0] if kept else None

    def retained(self) -> dict[int, dict]:
        """Every retained global state (recent and anchors), by version."""
        return {v: kept[0] for v, kept in (self.anchors | self.recent).items()}

    def full(self) -> bytes:
        """An anchor of the latest version (a full sync)."""
        new, new_hash = self.recent[self.latest_version]
        return encode_patch(None, new, None, self.latest_version, self.level, target_hash=new_hash)
