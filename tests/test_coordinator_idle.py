"""The coordinator's wait for replies: the loop asks the Grid less often the longer nothing comes
(`idle_wait_s`), since a deployment's SuperLink answers each pull as an RPC, and still notices a
reply within about a tenth of its wait."""

import time

from fake_grid import FakeGrid, small_config
from hypothesis import given
from hypothesis import strategies as st

from fedrl.clients.client_app import app as client_app
from fedrl.strategies.coordinator import idle_wait_s, run_coordinator


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_the_idle_wait_grows_with_the_quiet_within_its_bounds(a, b):
    shorter, longer = sorted((a, b))
    assert 0.02 <= idle_wait_s(shorter) <= idle_wait_s(longer) <= 0.5
    assert idle_wait_s(longer) <= max(0.02, longer / 10)  # a reply waits at most a tenth more


class HeldGrid(FakeGrid):
    """Each reply comes `hold_s` of wall time after its message went, as a node's round would;
    pulls are counted."""

    def __init__(self, num_nodes: int, hold_s: float):
        super().__init__(num_nodes, client_app)
        self.hold_s, self.ready_at, self.pulls = hold_s, {}, 0

    def push_messages(self, msgs):
        ids = super().push_messages(msgs)
        self.ready_at.update({i: time.monotonic() + self.hold_s for i in ids if i})
        return ids

    def pull_messages(self, ids):
        self.pulls += 1
        return super().pull_messages([i for i in ids if time.monotonic() >= self.ready_at[i]])


def test_a_run_waiting_on_slow_rounds_asks_the_grid_a_few_times_a_round(tmp_path):
    grid = HeldGrid(1, hold_s=1.5)
    cfg = small_config(tmp_path, min_nodes=1, versions=2, buffer_size=1, sync=False, mode="parablock")
    summary = run_coordinator(grid, cfg)
    replies = summary["counts"]["replies"]
    assert summary["versions"] >= 2 and summary["counts"]["accepted"] >= 2
    # a steady 20 ms asked about 75 times a 1.5 s round; a tenth of the quiet so far, about 31
    assert grid.pulls <= 45 * replies, (grid.pulls, replies)
