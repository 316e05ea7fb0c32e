import hashlib
from unittest import mock

import pytest
import torch

import fedrl.patch
import fedrl.patch_chain
from fedrl.patch import read_header, state_hash
from fedrl.patch_chain import PatchPublisher, SyncFailed, in_catalog, synchronize
from fedrl.patch_routes import PatchRef, cheapest_path, routes_in, sync_plans
from fedrl.sim.patch_fuzz import bits_equal


def states(n):
    g = torch.Generator().manual_seed(0)
    s = {"w": torch.randn(2000, generator=g).bfloat16(), "b": torch.randn(300, generator=g).bfloat16()}
    out = [s]
    for _ in range(n):
        s = {k: v.clone() for k, v in s.items()}
        s["w"].view(torch.int16)[torch.randint(0, 2000, (20,), generator=g)] += 1
        out.append(s)
    return out


class Store:
    """An in-memory content-addressed store standing in for the patch store's GET."""

    def __init__(self):
        self.objects, self.refs = {}, []

    def put(self, base, target, data):
        key = hashlib.sha256(data).hexdigest()
        self.objects[key] = data
        self.refs.append(PatchRef(base, target, len(data), key))

    def fetch(self, ref):
        if ref.key not in self.objects:
            raise OSError(f"{ref.key[:8]} not found")
        return self.objects[ref.key]


def publish_all(n, anchor_every=4):
    pub, store, hist = PatchPublisher(anchor_every=anchor_every, keep_recent=3), Store(), states(n)
    for v, s in enumerate(hist):
        for base, target, data in pub.publish(s, v):
            store.put(base, target, data)
    return pub, store, hist


def test_publisher_emits_deltas_skips_and_anchors_every_n():
    pub, store, hist = publish_all(9, anchor_every=4)
    anchors = sorted(r.target_version for r in store.refs if r.base_version is None)
    deltas = sorted((r.base_version, r.target_version) for r in store.refs if r.base_version is not None)
    assert anchors == [0, 4, 8]
    # from every version the publisher held (keep_recent 3) to the new one: the chain and skips
    assert deltas == sorted((b, v) for v in range(1, 10) for b in range(max(0, v - 3), v))
    with pytest.raises(ValueError):
        pub.publish(hist[-1], 3)


def test_receiver_takes_one_skip_the_chain_or_the_anchor_bit_identically():
    pub, store, hist = publish_all(9)
    state, plan = synchronize(hist[6], 6, 9, store.refs, store.fetch)  # one download, not a chain
    assert state_hash(state) == state_hash(hist[9])
    assert [(r.base_version, r.target_version) for r in plan] == [(6, 9)]
    links = [r for r in store.refs if r.base_version is not None and r.target_version == r.base_version + 1]
    assert plan[0].size < sum(r.size for r in links if r.base_version >= 6)
    chain = [r for r in store.refs if r.base_version is None or r.target_version == r.base_version + 1]
    state, plan = synchronize(hist[6], 6, 9, chain, store.fetch)  # without skips: the chain
    assert state_hash(state) == state_hash(hist[9]) and [r.target_version for r in plan] == [7, 8, 9]
    fresh, plan = synchronize(None, None, 9, store.refs, store.fetch)
    assert (
        state_hash(fresh) == state_hash(hist[9])
        and plan[0].base_version is None
        and plan[0].target_version == 8
    )
    assert read_header(pub.full()).is_anchor


def test_the_catalog_lists_kept_anchors_the_retained_chain_and_skips_to_the_latest_two():
    pub, store, _ = publish_all(9, anchor_every=4)  # keep_recent 3: v7, v8, v9 retained
    listed = {
        (r.base_version, r.target_version)
        for r in store.refs
        if in_catalog(r.base_version, r.target_version, 9, pub)
    }
    assert {t for b, t in listed if b is None} == {4, 8}  # the publisher keeps two anchors
    assert {(b, t) for b, t in listed if b is not None and t == b + 1} == {(6, 7), (7, 8), (8, 9)}
    assert {(b, t) for b, t in listed if b is not None and t > b + 1} == {(6, 8), (6, 9), (7, 9)}


def test_a_version_a_node_still_holds_stays_a_base_after_it_leaves_the_recent_window():
    """keep_recent 3: v1 leaves the window at v5, but a node holds it, so v1 -> latest keeps being
    published and listed, and that node reaches v9 in one patch instead of an anchor and a chain.
    Once no node holds it, it is dropped; at most keep_held such states are kept (the newest)."""
    pub, store, hist = PatchPublisher(anchor_every=4, keep_recent=3, keep_held=2), Store(), states(12)
    for v, s in enumerate(hist[:10]):
        for base, target, data in pub.publish(s, v, held_versions={1}):
            store.put(base, target, data)
    assert set(pub.held) == {1} and {(r.base_version, r.target_version) for r in store.refs} >= {(1, 9)}
    listed = [r for r in store.refs if in_catalog(r.base_version, r.target_version, 9, pub)]
    state, plan = synchronize(hist[1], 1, 9, listed, store.fetch)
    assert state_hash(state) == state_hash(hist[9]) and [
        (r.base_version, r.target_version) for r in plan
    ] == [(1, 9)]
    pub.publish(hist[10], 10, held_versions={1, 5, 7})  # 5 left the window unheld: it is gone
    assert set(pub.held) == {1, 7}
    pub.publish(hist[11], 11, held_versions={1, 7, 8})
    assert set(pub.held) == {7, 8}  # keep_held 2: the newest
    pub.publish(hist[12], 12, held_versions=set())
    assert pub.held == {} and not in_catalog(7, 12, 12, pub)


def test_retained_states_are_bases_for_the_next_publish_without_being_published():
    hist = states(7)
    pub = PatchPublisher(anchor_every=4, keep_recent=2)
    for v in (4, 5, 6):
        pub.retain(hist[v], v)
    assert pub.state(4) is None and state_hash(pub.state(5)) == state_hash(hist[5])  # keep_recent holds
    out = pub.publish(hist[7], 7)
    assert [(base, target) for base, target, _ in out] == [(6, 7), (5, 7), (None, 7)]
    with pytest.raises(ValueError):
        pub.retain(hist[6], 6)  # not newer than what it holds


def test_corrupted_or_missing_patch_falls_back_to_the_next_plan():
    pub, store, hist = publish_all(9)
    for bad in (r for r in store.refs if r.base_version == 6):  # every way out of v6
        store.objects[bad.key] = store.objects[bad.key][:-3]  # truncated in storage
    state, plan = synchronize(hist[6], 6, 9, store.refs, store.fetch)
    assert state_hash(state) == state_hash(hist[9]) and plan[0].base_version is None
    gone = next(r for r in store.refs if r.base_version is None and r.target_version == 8)
    del store.objects[gone.key]
    with pytest.raises(SyncFailed, match="no way to reach v9"):
        synchronize(hist[6], 6, 9, store.refs, store.fetch)


def test_a_chain_hashes_the_held_state_once_and_applies_its_later_links_in_place():
    pub, store, hist = publish_all(9)
    chain = [r for r in store.refs if r.base_version is None or r.target_version == r.base_version + 1]
    held = {k: v.clone() for k, v in hist[5].items()}
    with (
        mock.patch.object(fedrl.patch_chain, "state_hash", wraps=state_hash) as held_hashes,
        mock.patch.object(fedrl.patch, "state_hash", wraps=state_hash) as base_hashes,
        mock.patch.object(fedrl.patch, "tensor_digest", wraps=fedrl.patch.tensor_digest) as digests,
        mock.patch.object(fedrl.patch_chain, "apply_patch", wraps=fedrl.patch.apply_patch) as applies,
    ):
        state, plan = synchronize(held, 5, 9, chain, store.fetch)
    assert [r.target_version for r in plan] == [6, 7, 8, 9]
    assert state_hash(state) == state_hash(hist[9]) and bits_equal(held, hist[5])
    # the held state hashed once (a digest per tensor); each link checks only what it changes,
    # from the state and hash the last one left
    assert held_hashes.call_count == 1 and base_hashes.call_count == 0 and digests.call_count == len(held)
    assert [c.kwargs["in_place"] for c in applies.call_args_list] == [False, True, True, True]
    assert {c.kwargs["verify"] for c in applies.call_args_list} == {"changes"}


def test_a_link_misnamed_by_its_signer_is_refused_by_the_next_and_the_sync_falls_back():
    """A link checks its changes, not the whole state it makes: a target hash the publisher got
    wrong names the result and is caught as the next link's base."""
    pub, store, hist = publish_all(9)
    chain = [r for r in store.refs if r.base_version is None or r.target_version == r.base_version + 1]
    link = next(r for r in chain if r.base_version == 6)
    store.objects[link.key] = fedrl.patch.encode_patch(hist[6], hist[7], 6, 7, target_hash="0" * 64)
    state, plan = synchronize(hist[5], 5, 9, chain, store.fetch)
    assert state_hash(state) == state_hash(hist[9])
    assert [(r.base_version, r.target_version) for r in plan] == [(None, 8), (8, 9)]


def test_wrong_held_state_is_detected_not_applied():
    pub, store, hist = publish_all(5)
    claimed = {k: v.clone() for k, v in hist[3].items()}
    claimed["b"].view(torch.int16)[0] += 1  # holds something else than v3
    state, plan = synchronize(claimed, 3, 5, store.refs, store.fetch)
    assert state_hash(state) == state_hash(hist[5]) and plan[0].base_version is None


def test_cheapest_path_prefers_fewer_bytes():
    refs = [
        PatchRef(0, 1, 10, "a"),
        PatchRef(1, 2, 10, "b"),
        PatchRef(0, 2, 15, "c"),
        PatchRef(None, 2, 100, "d"),
    ]
    assert [r.key for r in cheapest_path(refs, 0, 2)] == ["c"]
    assert [[r.key for r in p] for p in sync_plans(refs, 0, 2)] == [["c"], ["d"]]
    assert cheapest_path(refs, 5, 2) is None


def test_a_node_is_answered_with_the_refs_of_its_routes_only():
    """What the store sends a node syncing to T: the refs `synchronize` could try, none else."""
    pub, store, hist = publish_all(9, anchor_every=4)
    catalog = [vars(r) for r in store.refs if in_catalog(r.base_version, r.target_version, 9, pub)]
    full = sum(r.size for r in cheapest_path([PatchRef(**r) for r in catalog], None, 9))
    for held in (None, 0, 5, 7, 8, 9):
        answer = routes_in(catalog, held, 9)
        routes = answer["refs"]
        assert routes == [r for r in catalog if r in routes]  # catalog order, no copies
        assert answer["full_sync_bytes"] == full
        kept = [PatchRef(**r) for r in routes]
        plans = sync_plans([PatchRef(**r) for r in catalog], held, 9)
        assert sync_plans(kept, held, 9) == plans
        assert len(routes) <= 3 < len(catalog), (held, len(routes), len(catalog))  # a skip; an anchor + 1
        first = [PatchRef(**r) for r in routes_in(catalog, held, 9, plans=1)["refs"]]
        assert first == plans[0]  # the cheapest route alone
        for refs in (kept, first):
            state, _ = synchronize(hist[held] if held is not None else None, held, 9, refs, store.fetch)
            assert state_hash(state) == state_hash(hist[9])
    assert routes_in(catalog, 3, 42) == {"refs": [], "full_sync_bytes": 0}  # never published


def test_a_catalog_that_relabels_an_old_anchor_is_a_rollback_and_refused():
    """The store (or whoever serves the catalog) lists the valid v0 anchor as v9: the patch is
    genuine, so only its own header's versions can tell that it is not what was asked for."""
    pub, store, hist = publish_all(9)
    v0 = next(r for r in store.refs if r.base_version is None and r.target_version == 0)
    liar = [PatchRef(None, 9, v0.size, v0.key)]
    with pytest.raises(SyncFailed, match="rollback"):
        synchronize(None, None, 9, liar, store.fetch)
    delta = next(r for r in store.refs if (r.base_version, r.target_version) == (5, 6))
    relabelled = [PatchRef(5, 9, delta.size, delta.key)]  # a real delta 5->6 offered as 5->9
    with pytest.raises(SyncFailed, match="rollback"):
        synchronize(hist[5], 5, 9, relabelled, store.fetch)
