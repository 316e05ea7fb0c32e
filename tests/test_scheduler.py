import collections

import pytest

from fedrl.strategies.scheduler import BlockScheduler


def test_cyclic_staggers_clients_and_is_fair():
    s = BlockScheduler(num_blocks=3, policy="cyclic")
    first = [s.assign_block(node, rank) for rank, node in enumerate([10, 11, 12])]
    assert sorted(first) == [0, 1, 2]  # three clients train three different blocks at once
    counts = collections.Counter(s.assign_block(n, r) for _ in range(30) for r, n in enumerate([10, 11, 12]))
    assert set(counts.values()) == {30}


@pytest.mark.parametrize("policy", ["random", "lru"])
def test_every_block_gets_trained(policy):
    s = BlockScheduler(num_blocks=4, policy=policy, seed=1)
    seen = collections.Counter()
    for version in range(200):
        b = s.assign_block(version % 5, version % 5)
        seen[b] += 1
        s.release(b)
        s.record_update(b, version)
    assert set(seen) == {0, 1, 2, 3} and min(seen.values()) >= 30


def test_lru_picks_the_least_recently_updated_block():
    s = BlockScheduler(num_blocks=3, policy="lru")
    s.record_update(0, 5)
    s.record_update(2, 7)
    assert s.assign_block(1, 0) == 1
    assert s.assign_block(2, 1) == 0  # block 1 is now in flight


def test_steps_sized_so_clients_finish_together():
    s = BlockScheduler(num_blocks=2, base_steps=8, min_steps=1, max_steps=32)
    assert s.steps_for(1) == 8  # unknown speed: the base
    s.observe_speed(1, 0.1)
    s.observe_speed(2, 0.2)
    s.observe_speed(3, 0.4)
    k = {n: s.steps_for(n) for n in (1, 2, 3)}
    assert k == {1: 16, 2: 8, 3: 4}
    times = {n: k[n] * s.speed[n] for n in k}
    assert max(times.values()) == pytest.approx(min(times.values()))
    restored = BlockScheduler(num_blocks=2)
    restored.load_state_dict(s.state_dict())
    assert restored.speed == s.speed


def test_bad_settings():
    with pytest.raises(ValueError):
        BlockScheduler(num_blocks=2, policy="alphabetical")
    with pytest.raises(ValueError):
        BlockScheduler(num_blocks=2, base_steps=0)


def test_impossible_step_times_cannot_overflow_the_step_count():
    s = BlockScheduler(num_blocks=2, base_steps=4, min_steps=1, max_steps=16)
    s.observe_speed(1, 1.0)
    for liar in (5e-324, 0.0, float("inf"), float("nan"), -1.0):
        s.observe_speed(2, liar)
    s.observe_speed(2, 5e-324)  # twice: the EMA of two tiny values underflowed to 0 before the floor
    assert s.steps_for(2) == 16 and s.steps_for(1) >= 1
