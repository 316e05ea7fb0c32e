import json

from cli_process import run_fedrl

from fedrl.bench.dg import METHODS, table


def test_bench_dg_writes_curves_a_seed_range_table_a_speed_row_and_a_plot(tmp_path):
    out = tmp_path / "dg.json"
    args = ["--quick", "--steps", "4", "--seeds", "2", "--digits-steps", "4", "--workers", "1"]
    done = run_fedrl("bench", "dg", *args, "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    reversal = [r for r in data["results"] if r["task"] == "reversal"]
    assert {r["model"] for r in reversal} == {"tiny-gpt"}  # the papers' architecture by default
    assert {(r["method"], r["seed"]) for r in reversal} == {(m, s) for m in METHODS for s in (0, 1)}
    assert all(len(r["curve"]) == 4 and 0 <= r["final_error"] <= 1 for r in data["results"])
    assert 0 < data["speed"]["reversal_step_s_median"] < 60
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "learner:" in done.stdout and "s per reversal step" in done.stdout


def test_table_shows_mean_and_range_over_seeds():
    results = [
        {"task": "reversal", "scenario": "all", "method": "dg", "final_error": e} for e in (0.01, 0.03, 0.02)
    ]
    row = table(results).splitlines()[1]
    assert "2.0% [1.0-3.0]" in row
