"""The routes from a held version to a target through a catalog of published patches: which
patches to download, fewest bytes first. Pure Python over the catalog's refs (no tensors), so
the patch store can answer a node with only the refs its routes use (`routes_in`), not the
whole catalog every round."""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass


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


def routes_in(refs: list[dict], held_version: int | None, target: int, plans: int | None = None) -> dict:
    """What a node holding `held_version` (None: nothing) needs to reach `target`: the catalog refs
    (as published, dicts, in catalog order) on the first `plans` routes `sync_plans` would try
    (None: all), and the bytes of a sync from nothing (what the node's cache saves, for reports).
    Most rounds the first route verifies; a node asks for the rest only when it does not."""
    parsed = [PatchRef(**r) for r in refs]
    routes = sync_plans(parsed, held_version, target)[:plans]
    used = {r.key for plan in routes for r in plan}
    full = cheapest_path(parsed, None, target) or []
    return {"refs": [r for r in refs if r["key"] in used], "full_sync_bytes": sum(r.size for r in full)}
