"""The real thing: Flower's run_simulation (Ray) with fedrl's ServerApp and ClientApp."""

import json

from fedrl.sim.runner import simulate
from fedrl.strategies.run_config import RunConfig


def test_run_simulation_end_to_end(tmp_path):
    profiles = [{"speed": 1.0, "up_bytes_s": 2e6, "down_bytes_s": 4e6, "latency_s": 0.01},
                {"speed": 0.5, "up_bytes_s": 5e5, "down_bytes_s": 1e6, "latency_s": 0.05}]
    cfg = RunConfig(mode="parablock", sync=False, versions=3, buffer_size=1, base_steps=2, max_steps=4, prompts=4,
                    samples=4, min_nodes=2, eval_every=100, out_dir=str(tmp_path / "run"), deadline_s=120.0,
                    task_params=json.dumps({"length": 8, "num_eval": 32}), profiles=json.dumps(profiles))
    summary = simulate(cfg, num_clients=2, quiet=True)
    assert summary["versions"] >= 3
    assert summary["counts"]["errors"] == 0 and summary["counts"]["accepted"] >= 3
    assert set(summary["clients"]) and all(c["messages"] >= 2 for c in summary["clients"].values())
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
    assert (tmp_path / "run" / "summary.json").exists()
