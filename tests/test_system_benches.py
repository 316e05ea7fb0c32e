"""The async and scale benchmarks' measuring pieces (the benchmarks themselves are commands)."""

from fedrl.sim.bench.async_rounds import time_to_target
from fedrl.sim.bench.scale import run_case


def test_time_to_target_is_the_first_eval_at_or_below_it():
    evals = [
        {"t": 0.0, "error": 0.7},
        {"t": 5.0, "error": 0.35},
        {"t": 9.0, "error": 0.3},
        {"t": 12.0, "error": 0.2},
    ]
    assert time_to_target(evals, 0.3) == 9.0
    assert time_to_target(evals, 0.1) is None


def test_scale_case_separates_coordinator_cost_from_clients():
    case = run_case({"clients": 6, "step_s": 0.05, "messages_per_client": 1.0})
    assert case["messages"] >= 6 and case["versions"] >= 2
    assert 0 < case["coordinator_cpu_ms_per_msg"] < 1000
    assert case["client_cpu_s"] > 0 and case["virtual_s"] > 0 and case["peak_rss_mb"] > 50
    assert case["wall_s_per_virtual_hour"] > 0


def test_bench_async_out_never_deletes_a_folder(tmp_path, monkeypatch):
    """Before: `fedrl bench async --out results` deleted a folder named results/."""
    import argparse

    from fedrl.sim.bench import async_rounds

    keep = tmp_path / "results"
    keep.mkdir()
    (keep / "precious.txt").write_text("mine")
    runs = []

    def fake_simulate(cfg, sim, clients, engine):  # the folder handling is under test, not the training
        runs.append(cfg.out_dir)
        evals = [{"t": 0.0, "error": 0.7}, {"t": 1.0, "error": 0.2}]
        return {
            "evals": evals,
            "final_eval": 0.2,
            "initial_eval": 0.7,
            "bytes_up": 1,
            "bytes_down": 1,
            "versions": 1,
            "time_s": 1.0,
            "counts": {},
            "simulation": {"step_s": 0.1},
        }

    monkeypatch.setattr(async_rounds, "simulate", fake_simulate)
    monkeypatch.setattr(async_rounds, "write_report", lambda summary, out: [])
    args = argparse.Namespace(
        quick=True,
        out=str(keep / "bench-async.json"),
        clients=2,
        budget_s=1.0,
        profile="datacenter",
        deadline_s=20.0,
        seed=0,
        engine="local",
        target=0.3,
        upload_density=0.05,
        strategies=list(async_rounds.STRATEGIES),
    )
    assert async_rounds.main(args) == 0
    assert (keep / "precious.txt").read_text() == "mine"
    assert (keep / "bench-async.json").exists() and len(set(runs)) == len(async_rounds.STRATEGIES)
    assert all(run.startswith(str(keep / "bench-async-runs-")) for run in runs)  # a new folder of its own
