"""The async and scale benchmarks' measuring pieces (the benchmarks themselves are commands)."""

from fedrl.sim.bench.async_rounds import time_to_target
from fedrl.sim.bench.scale import run_case


def test_time_to_target_is_the_first_eval_at_or_below_it():
    evals = [{"t": 0.0, "error": 0.7}, {"t": 5.0, "error": 0.35}, {"t": 9.0, "error": 0.3}, {"t": 12.0, "error": 0.2}]
    assert time_to_target(evals, 0.3) == 9.0
    assert time_to_target(evals, 0.1) is None


def test_scale_case_separates_coordinator_cost_from_clients():
    case = run_case({"clients": 6, "step_s": 0.05, "messages_per_client": 1.0})
    assert case["messages"] >= 6 and case["versions"] >= 2
    assert 0 < case["coordinator_cpu_ms_per_msg"] < 1000
    assert case["client_cpu_s"] > 0 and case["virtual_s"] > 0 and case["peak_rss_mb"] > 50
    assert case["wall_s_per_virtual_hour"] > 0
