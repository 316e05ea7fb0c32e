"""Versions, anchors and the cheapest way for a receiver to reach the newest state.

The publisher keeps the states it needs (anchors every N versions and a few recent ones)
and emits for each new version a patch from every recent one (the previous version's, and
skips v_old -> v_new directly) and an anchor every N versions. A receiver tries the routes
from what it holds (its own version, or nothing) to a target, cheapest first
(fedrl.patch_routes), and falls back to the next on any failure.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping

import torch

from fedrl.patch import PatchHeader, apply_patch, encode_patch, read_header, state_hash
from fedrl.patch_errors import PatchError, TargetMismatch
from fedrl.patch_routes import PatchRef, sync_plans


def published(state: Mapping[str, torch.Tensor], wire_dtype: str) -> dict[str, torch.Tensor]:
    """A global state as it is published: cast to the run's wire dtype (float32: as it is)."""
    dtype = getattr(torch, wire_dtype)
    return {n: t.to(dtype) for n, t in state.items()}


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
    and the next is tried; the held state is never modified. The held state is hashed once, and
    each link then checks only what it changes (`verify="changes"`): it starts from the state the
    last link made, named by that link's signed target hash, so a wrong name is refused by the
    next link's base check, and the next sync hashes what it holds again. Past a plan's first
    link the state is the plan's own, and later links apply in place."""
    if held_version == target and held is not None:
        return dict(held), []
    errors = []
    held_hash = state_hash(held) if held else None
    for plan in sync_plans(refs, held_version if held else None, target):
        state, known_hash = (held, held_hash) if plan[0].base_version is not None else (None, None)
        try:
            for i, ref in enumerate(plan):
                data = fetch(ref)
                header = read_header(data)
                check_labels(header, ref)
                state = apply_patch(state, data, base_hash=known_hash, in_place=i > 0, verify="changes")
                known_hash = header.target_hash
            return state, plan
        except (PatchError, OSError) as err:
            errors.append(f"v{plan[0].base_version}->v{target} via {len(plan)} patch(es): {err}")
    raise SyncFailed(f"no way to reach v{target}: " + ("; ".join(errors) or "no patches lead there"))


def in_catalog(base: int | None, target: int, latest: int, publisher: PatchPublisher) -> bool:
    """Whether a published patch stays listed once `latest` is out: the anchors the publisher
    keeps, the chain from every version it retains (recent, or held by a node), and skips to the
    latest two versions (a node told to sync to the version before the latest still finds its one
    download; older skips are dropped to bound the store, and a node syncing to an older version
    takes the chain)."""
    if base is None:
        return target in publisher.anchors
    retained = base >= latest - publisher.keep_recent or base in publisher.held
    return retained and (target == base + 1 or target >= latest - 1)


class PatchPublisher:
    """Produces the patches for each new global version and keeps what later patches need."""

    def __init__(
        self,
        anchor_every: int = 10,
        keep_recent: int = 8,
        level: int | None = None,  # zstd level (None: by body size)
        keep_anchors: int = 2,
        keep_held: int = 8,
    ):
        if anchor_every < 1 or keep_recent < 1 or keep_held < 0:
            raise ValueError("anchor_every and keep_recent must be >= 1, keep_held >= 0")
        self.anchor_every, self.level = anchor_every, level
        self.recent: collections.OrderedDict[int, tuple[dict, str]] = collections.OrderedDict()
        self.anchors: dict[int, tuple[dict, str]] = {}
        # states that left `recent` while a node still held them (at most keep_held, the newest):
        # patches from them let a node that fell far behind skip to the latest in one download
        self.held: dict[int, tuple[dict, str]] = {}
        self.holding: set[int] = set()
        self.keep_recent, self.keep_anchors, self.keep_held = keep_recent, keep_anchors, keep_held

    @property
    def latest_version(self) -> int | None:
        return next(reversed(self.recent), None)

    def publish(
        self, state: Mapping[str, torch.Tensor], version: int, held_versions: Iterable[int] = ()
    ) -> list[tuple[int | None, int, bytes]]:
        """(base_version, target_version, patch bytes) to store for `version`: a patch from every
        retained recent version (the previous one's is the chain's next link; the older ones are
        skips, so a receiver that fell behind downloads one patch, not a chain) and from every
        older version a node still holds (`held_versions`, as far as they were kept), and an
        anchor every `anchor_every` versions."""
        self.holding = set(held_versions)
        self._prune_held()
        bases = list(self.held.items()) + list(self.recent.items())  # before _remember drops the oldest
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
            old, kept_old = self.recent.popitem(last=False)
            if old in self.holding:
                self.held[old] = kept_old
        self._prune_held()
        return entry

    def _prune_held(self) -> None:
        still = sorted(v for v in self.held if v in self.holding)
        self.held = {v: self.held[v] for v in still[max(0, len(still) - self.keep_held) :]}

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
