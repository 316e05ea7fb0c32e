"""The real thing: Flower's run_simulation (Ray) with fedrl's simulated apps, and nodes that
leave and come back while the coordinator runs."""

import json

import pytest

from fedrl.protocol import InstructionHead

pytestmark = pytest.mark.slow


class ChurnView:
    """The real simulation Grid, seen through membership that changes during the run: after
    the 2nd reply the second node is gone (its in-flight reply still arrives, late), after
    the 5th it is back. Records which client id each node is told it is."""

    def __init__(self, grid):
        self.grid, self.replies, self.client_ids = grid, 0, {}

    def get_node_ids(self):
        ids = sorted(self.grid.get_node_ids())
        return [n for n in ids if n != ids[1]] if 2 <= self.replies < 5 else ids

    def push_messages(self, msgs):
        for m in msgs:
            self.client_ids.setdefault(m.metadata.dst_node_id, set()).add(
                InstructionHead.unpack(m.content["instruction"])["client_id"]
            )
        return self.grid.push_messages(msgs)

    def pull_messages(self, ids):
        replies = list(self.grid.pull_messages(ids))
        self.replies += len(replies)
        return replies


def test_run_simulation_survives_churn_and_dropouts(tmp_path, monkeypatch):
    from fake_grid import small_config

    from fedrl.strategies.coordinator import Coordinator

    # membership is read every turn, so the departure between the 2nd and 5th reply is seen
    # however fast this machine runs the rounds (by default it is read at most once a second)
    monkeypatch.setattr(Coordinator, "refresh_every_s", 0.0)
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedrl.sim.apps import client_app
    from fedrl.sim.runner import ray_backend
    from fedrl.sim.simulated_server import SimConfig, run_simulated

    profiles = [
        {"name": "steady", "speed": 1.0, "up_bytes_s": 2e6, "down_bytes_s": 4e6, "latency_s": 0.01},
        {"name": "churner", "speed": 0.5, "up_bytes_s": 5e5, "down_bytes_s": 1e6, "latency_s": 0.05},
        {"name": "flaky", "speed": 1.0, "dropout": 0.5},
    ]
    cfg = small_config(tmp_path, mode="parablock", sync=False, versions=6, buffer_size=1, min_nodes=3)
    sim = SimConfig(clock="virtual", step_s=0.05, profiles=json.dumps(profiles))
    results, views = [], []
    app = ServerApp()

    @app.main()
    def main(grid, context):
        views.append(ChurnView(grid))
        results.append(run_simulated(views[0], cfg, sim))

    run_simulation(server_app=app, client_app=client_app, num_supernodes=3, backend_config=ray_backend(1.0))
    (summary,) = results
    assert summary["versions"] >= 6 and summary["counts"]["accepted"] >= 6
    kinds = [e["kind"] for e in summary["events"]]
    assert "left" in kinds and kinds.count("joined") >= 4  # three at the start, one coming back
    assert all(len(ids) == 1 for ids in views[0].client_ids.values())  # nobody was renumbered
    reasons = [e["reason"] for e in summary["events"] if e["kind"] == "error"]
    assert any("dropped out" in r for r in reasons)  # the mod's error reply, not a ClientApp exception
    assert not any("raised" in r or "Traceback" in r for r in reasons)
