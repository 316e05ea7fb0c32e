"""The async and scale benchmarks' measuring pieces (the benchmarks themselves are commands)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrl.sim.bench.async_rounds import (
    bytes_to_target,
    ratio_to_reference,
    strategy_config,
    time_to_stay,
    time_to_target,
)
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


def test_time_to_stay_is_where_the_error_reached_the_target_for_good():
    def evals(*errors):
        return [{"t": float(i), "error": e} for i, e in enumerate(errors)]

    bounced = evals(0.7, 0.04, 0.06, 0.05, 0.0)  # crosses at 1, leaves at 2, back for good at 3
    assert time_to_target(bounced, 0.05) == 1.0 and time_to_stay(bounced, 0.05) == 3.0
    assert time_to_stay(evals(0.7, 0.04, 0.06), 0.05) is None  # left it at the last eval
    assert time_to_stay(evals(0.04, 0.03), 0.05) == 0.0
    assert time_to_stay([], 0.05) is None


@given(st.lists(st.floats(0, 1), max_size=20), st.floats(0, 1))
def test_time_to_stay_is_never_before_the_first_crossing_and_holds_after(errors, target):
    evals = [{"t": float(i), "error": e} for i, e in enumerate(errors)]
    first, stays = time_to_target(evals, target), time_to_stay(evals, target)
    if stays is None:
        assert not errors or errors[-1] > target
    else:
        assert first is not None and first <= stays
        assert all(e <= target for e in errors[int(stays) :])
        assert int(stays) == 0 or errors[int(stays) - 1] > target


def test_bytes_to_target_are_those_moved_by_the_first_eval_at_or_below_it():
    evals = [
        {"t": 0.0, "error": 0.7, "bytes_up": 0, "bytes_down": 0},
        {"t": 5.0, "error": 0.3, "bytes_up": 40, "bytes_down": 100},
        {"t": 9.0, "error": 0.1, "bytes_up": 90, "bytes_down": 200},
    ]
    assert bytes_to_target(evals, 0.3) == 140
    assert bytes_to_target(evals, 0.05) is None


def test_a_reference_that_never_reached_the_target_gives_a_lower_bound():
    assert ratio_to_reference(150.0, 260.0, 50.0) == {"ratio": 3.0, "lower_bound": False}
    # the reference ran out its budget (260 s) without getting there: at least 5.2x
    assert ratio_to_reference(None, 260.0, 50.0) == {"ratio": 5.2, "lower_bound": True}
    assert ratio_to_reference(150.0, 260.0, None) == {"ratio": None, "lower_bound": False}


def test_scale_case_separates_coordinator_cost_from_clients():
    case = run_case({"clients": 6, "step_s": 0.05, "messages_per_client": 1.0})
    assert case["messages"] >= 6 and case["versions"] >= 2
    assert 0 < case["coordinator_cpu_ms_per_msg"] < 1000
    assert case["client_cpu_s"] > 0 and case["virtual_s"] > 0 and case["peak_rss_mb"] > 50
    assert case["wall_s_per_virtual_hour"] > 0


def test_bench_async_blocks_reach_the_block_strategies_and_leave_the_reference_as_it_runs():
    from fedrl.strategies.run_config import RunConfig

    base = RunConfig(num_blocks=3)
    runs = {
        name: strategy_config(base, name, 0.01, 2)
        for name in ("fedavg-lora", "parablock-async-topk", "fedbuff-topk")
    }
    assert runs["fedavg-lora"].num_blocks == 3 and runs["fedavg-lora"].mode == "fedavg-lora"
    assert (
        runs["parablock-async-topk"].num_blocks == 2 and runs["parablock-async-topk"].upload_density == 0.01
    )
    assert runs["fedbuff-topk"].num_blocks == 1  # the whole adapter, whatever --blocks says
    assert strategy_config(base, "parablock-async", 0.01, None).num_blocks == 3
    assert strategy_config(base, "parablock-async", 0.01, None).upload_density == base.upload_density


def test_bench_async_out_never_deletes_a_folder(tmp_path, monkeypatch):
    """Before: `fedrl bench async --out results` deleted a folder named results/."""
    import argparse

    from fedrl.sim.bench import async_rounds

    keep = tmp_path / "results"
    keep.mkdir()
    (keep / "precious.txt").write_text("mine")
    runs, step_s, clips, shapes, targets = [], [], [], {}, []

    def fake_simulate(cfg, sim, clients, quiet, engine):  # the folders are under test, not the training
        runs.append(cfg.out_dir)
        step_s.append(sim.step_s)
        clips.append(cfg.clip_multiple)
        shapes[Path(cfg.out_dir).name] = (cfg.num_blocks, cfg.upload_density, cfg.sync)
        targets.append(cfg.target_error)
        evals = [
            {"t": 0.0, "error": 0.7, "bytes_up": 0, "bytes_down": 0},
            {"t": 1.0, "error": 0.2, "bytes_up": 1, "bytes_down": 1},
        ]
        return {
            "evals": evals,
            "final_eval": 0.2,
            "initial_eval": 0.7,
            "bytes_up": 1,
            "bytes_down": 1,
            "control_bytes_up": 1,
            "control_bytes_down": 1,
            "versions": 1,
            "time_s": 1.0,
            "counts": {},
            "simulation": {"step_s": sim.step_s or 0.1},  # what simulate reports: the unit it used
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
        wire_dtype="bfloat16",
        strategies=list(async_rounds.STRATEGIES),
        step_s=0.0,
        set=None,
        run_to_budget=False,
        blocks=None,
        workers=1,  # in this process, where simulate is the fake
    )
    assert async_rounds.main(args) == 0
    assert set(targets) == {0.3}  # each run stops at the target
    assert step_s[0] == 0.0 and set(step_s[1:]) == {0.1}  # the first run's measurement is everyone's
    # top-k strategies take the command's density; FedBuff trains one block, parablock the run's blocks
    assert shapes["fedbuff-topk"] == (1, 0.05, False) and shapes["parablock-async-topk"] == (3, 0.05, False)
    assert shapes["parablock-async"] == (3, 1.0, False)
    assert async_rounds.main(argparse.Namespace(**{**vars(args), "step_s": 0.25})) == 0
    assert set(step_s[len(async_rounds.STRATEGIES) :]) == {0.25}  # a given unit of work: no measurement
    assert (keep / "precious.txt").read_text() == "mine"
    assert (keep / "bench-async.json").exists() and len(set(runs)) == 2 * len(async_rounds.STRATEGIES)
    assert all(run.startswith(str(keep / "bench-async-runs-")) for run in runs)  # a new folder of its own
    assert set(clips) == {1.0}  # the default rule
    assert async_rounds.main(argparse.Namespace(**{**vars(args), "set": ["clip-multiple=3"]})) == 0
    assert set(clips[len(runs) - len(async_rounds.STRATEGIES) :]) == {3.0}  # every strategy's rule
    assert json.loads((keep / "bench-async.json").read_text())["overrides"] == {"clip_multiple": 3}
    targets.clear()
    assert async_rounds.main(argparse.Namespace(**{**vars(args), "run_to_budget": True})) == 0
    assert set(targets) == {0.0}  # no run stops at the target; each is read where its curve reaches it
    written = json.loads((keep / "bench-async.json").read_text())
    assert written["run_to_budget"] and all(r["bytes_to_target"] == 1.0 for r in written["strategies"])
    # --blocks reaches the block strategies only: the reference runs as it does by default
    assert async_rounds.main(argparse.Namespace(**{**vars(args), "blocks": 2})) == 0
    assert shapes["fedavg-lora"][0] == 3 and shapes["parablock-async-topk"] == (2, 0.05, False)
    assert shapes["fedbuff-topk"][0] == 1 and shapes["block-sequential"][0] == 2


def test_two_benchmark_invocations_within_one_second_get_folders_of_their_own(tmp_path, monkeypatch):
    from fedrl.sim.bench import async_rounds

    monkeypatch.setattr(async_rounds.time, "strftime", lambda fmt: "20260101-000000")
    out = tmp_path / "new" / "bench.json"
    first, second = async_rounds.runs_dir(out), async_rounds.runs_dir(out)
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "bench-runs-20260101-000000-2"


def _methods_args(*argv: str):
    """`fedrl bench methods`'s flags as its own parser reads them, defaults included."""
    import argparse

    from fedrl.sim.bench.methods import add_arguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_friction_profiles_make_the_asked_shares_buggy_noisy_stale_and_mismatched():
    import json

    from fedrl.sim.bench.methods import friction_profiles, volunteer_frictions

    # the defaults: 2 buggy + 2 noisy of 8, strength 0.3
    profiles = json.loads(
        friction_profiles(8, volunteer_frictions(_methods_args("--actor-staleness", "6")), seed=0)
    )
    assert sum(p["bug_prob"] == 0.3 for p in profiles) == 2
    assert sum(p["reward_noise_prob"] == 0.3 for p in profiles) == 2
    assert not any(p["bug_prob"] and p["reward_noise_prob"] for p in profiles)
    assert not any(p["actor_staleness"] or p["logit_noise"] for p in profiles)
    assert len({p["speed"] for p in profiles}) > 4  # still the heterogeneous mixed-volunteers mix
    flags = [
        "--actor-staleness",
        "6",
        "--buggy",
        "0",
        "--stale",
        "0.25",
        "--lag-across-rounds",
        "--mismatched",
        "0.5",
    ]
    profiles = json.loads(friction_profiles(8, volunteer_frictions(_methods_args(*flags)), seed=0))
    assert [p["name"].rsplit("-", 1)[-1] for p in profiles] == ["noisy"] * 2 + ["stale"] * 2 + [
        "mismatched"
    ] * 4
    assert [p["actor_staleness"] for p in profiles] == [0] * 2 + [6] * 2 + [0] * 4
    assert [p["actor_lags_across_rounds"] for p in profiles] == [False] * 2 + [True] * 2 + [False] * 4
    assert [p["logit_noise"] for p in profiles] == [0.0] * 4 + [0.5] * 4


def test_bench_methods_on_a_scenario_takes_its_clients_and_budget_with_overrides():
    import argparse
    import json

    from fedrl.sim.bench.methods import scenario_setup

    args = argparse.Namespace(scenario="smollm2-addition", clients=None, set=["max_wall_s=600", "lr=1e-4"])
    base, clients, sim_for, setting, budget = scenario_setup(args)
    assert clients == 4 and base.min_nodes == 4 and base.model == "smollm2-135m" and base.task == "addition"
    assert base.lr == 1e-4 and base.max_wall_s == 600 and base.temperature == 0.7  # overrides, then the file
    assert base.target_error == 0 and budget == "600 wall s"  # runs go to the end of their budget
    assert [p["name"] for p in json.loads(sim_for(0).profiles)] == [
        "desktop",
        "desktop",
        "laptop",
        "old-laptop",
    ]
    assert setting["scenario"] == "smollm2-addition"


def test_bench_methods_friction_setup_takes_rule_overrides_and_refuses_unknown_keys():
    from fedrl.schema import SchemaError
    from fedrl.sim.bench.methods import friction_setup

    base, *_ = friction_setup(_methods_args("--logit-noise", "1.0"))
    assert base.clip_multiple == 1.0 and base.direction_probe == 64  # the default rule
    old_rule = ["clip-multiple=3", "direction_probe=0"]
    base, _, _, setting, _ = friction_setup(_methods_args("--logit-noise", "1.0", "--set", *old_rule))
    assert base.clip_multiple == 3.0 and base.direction_probe == 0 and base.lr == 1e-4
    assert setting["overrides"] == {"clip_multiple": 3, "direction_probe": 0}
    with pytest.raises(SchemaError, match="no_such_key"):
        friction_setup(_methods_args("--set", "no_such_key=1"))
    # a run stops at the target unless it runs to the budget
    assert friction_setup(_methods_args())[0].target_error == 0.15
    assert friction_setup(_methods_args("--run-to-budget"))[0].target_error == 0


def test_samples_to_target_counts_every_step_the_clients_ran_before_the_eval():
    from fedrl.sim.bench.methods import samples_curve, samples_to_target

    summary = {
        "config": {"prompts": 2, "samples": 3},
        "events": [
            {"kind": "reply", "t": 1.0, "steps": 4},
            {"kind": "eval", "t": 1.5},
            {"kind": "reply", "t": 2.0, "steps": 2},
            {"kind": "reply", "t": 3.0, "steps": 5},
        ],
        "evals": [{"t": 0.0, "error": 0.8}, {"t": 2.0, "error": 0.5}, {"t": 3.5, "error": 0.2}],
    }
    curve = samples_curve(summary)
    assert curve == [(0.0, 0, 0.8), (2.0, 36, 0.5), (3.5, 66, 0.2)]
    assert samples_to_target(curve, 0.3) == 66 and samples_to_target(curve, 0.1) is None


def test_bench_methods_puts_each_method_against_dg_on_the_means_and_seed_by_seed():
    from fedrl.sim.bench.methods import against_dg, against_table, method_summary

    def run(method, seed, reached, samples):
        return {
            "method": method,
            "seed": seed,
            "samples_to_target": reached,
            "samples": samples,
            **{"time_to_target_s": 1.0, "virtual_s": 2.0, "best_eval": 0.1, "final_eval": 0.2},
        }

    def against(results):
        methods = dict.fromkeys(r["method"] for r in results)
        summary = {m: method_summary([r for r in results if r["method"] == m]) for m in methods}
        return against_dg(summary, results)

    results = [
        run("dg", 0, 100, 120),
        run("ppo", 0, 150, 160),
        run("dg", 1, 200, 210),
        run("ppo", 1, None, 900),  # never got there: its 900 samples are a lower bound
        run("dg", 2, 100, 100),
        run("ppo", 2, 400, 400),
    ]
    ppo = against(results)["ppo"]
    assert ppo["on_means"]["ratio"] == pytest.approx((150 + 900 + 400) / (100 + 200 + 100))
    assert ppo["on_means"]["lower_bound"] is True
    assert [r["ratio"] for r in ppo["per_seed"]] == [1.5, 4.5, 4.0]
    assert [r["lower_bound"] for r in ppo["per_seed"]] == [False, True, False]
    assert ppo["median_per_seed"] == 4.0
    # a lower bound among the seeds: no interval over them, no geometric mean
    assert ppo["interval_90"] is None and ppo["geomean_per_seed"] is None
    assert against_table({"ppo": ppo}) == (
        "ppo / dg samples to target: >= 3.62x on the means; per seed 1.50x, >= 4.50x, 4.00x (median 4.00x)"
    )
    # every seed got there: the seeds' spread around the means' ratio, which it brackets
    ppo = against([*results[:3], run("ppo", 1, 400, 900), *results[4:]])["ppo"]
    low, high = ppo["interval_90"]
    assert ppo["on_means"]["ratio"] == pytest.approx(950 / 400)
    assert 1.5 <= low < 950 / 400 < high <= 4.0
    assert ppo["geomean_per_seed"] == pytest.approx((1.5 * 2 * 4) ** (1 / 3))
    assert against_table({"ppo": ppo}) == (
        f"ppo / dg samples to target: 2.38x on the means (90% over seeds: {low:.2f}-{high:.2f}x); "
        "per seed 1.50x, 2.00x, 4.00x (median 2.00x, geometric mean 2.29x)"
    )
    # a DG run that never got there leaves that seed, and the means, without a ratio
    results[4] = run("dg", 2, None, 500)
    ppo = against(results)["ppo"]
    assert ppo["on_means"]["ratio"] is None and ppo["per_seed"][2]["ratio"] is None
    assert ppo["median_per_seed"] == 3.0
    assert against([r for r in results if r["method"] == "ppo"]) == {}  # no DG: nothing to set against


def test_bench_methods_runs_the_real_federation_per_method(tmp_path):
    import json

    from cli_process import run_fedrl

    out = tmp_path / "methods.json"
    # the unit of work pinned (`--step-s`): measured, it follows the load, and a busy machine
    # leaves a 3-virtual-second budget without a reply
    args = ["--quick", "--methods", "dg", "ppo", "--clients", "4", "--budget-s", "3", "--target", "0.01"]
    args += ["--step-s", "0.05", "--seed", "1"]  # the first seed (quick: one)
    done = run_fedrl("bench", "methods", *args, "--out", str(out), timeout=600)  # two workers
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    # side by side, virtual-clock runs give what they give one at a time
    alone = tmp_path / "alone" / "methods.json"
    done = run_fedrl("bench", "methods", *args, "--workers", "1", "--out", str(alone), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["curve"] for r in json.loads(alone.read_text())["runs"]] == [r["curve"] for r in data["runs"]]
    assert [(r["method"], r["seed"]) for r in data["runs"]] == [("dg", 1), ("ppo", 1)]
    for run in data["runs"]:
        assert run["samples"] > 0 and run["curve"][0][1] == 0 and 0 <= run["best_eval"] <= 1
        assert run["time_to_stay_s"] is None or run["time_to_target_s"] <= run["time_to_stay_s"]
        summary = json.loads(
            (
                tmp_path
                / next(tmp_path.glob("methods-runs-*")).name
                / f"{run['method']}-seed1"
                / "summary.json"
            ).read_text()
        )
        assert summary["config"]["method"] == run["method"] and summary["config"]["model"] == "tiny-gpt-base"
    assert set(data["summary"]) == {"dg", "ppo"} and out.with_suffix(".png").exists()
    # both invocations ran seed 1: pooled, it would count twice
    from fedrl.sim.bench.methods_pool import PoolError, pool

    with pytest.raises(PoolError, match=f"dg seed 1 is in both {out} and {alone}"):
        pool([out, alone], None)


@pytest.mark.parametrize("bench", ["overlap", "pulse", "scale"])
def test_benchmarks_that_run_one_case_at_a_time_refuse_workers(bench, capsys):
    """`--workers` belongs to the benchmarks that run cases side by side (dg, methods, async, chaos)."""
    from fedrl.cli.main import main

    with pytest.raises(SystemExit) as refused:
        main(["bench", bench, "--workers", "2"])
    assert refused.value.code == 2 and "unrecognized arguments: --workers 2" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.floats(1.0, 1e7), st.floats(1.0, 1e7)), min_size=2, max_size=12),
    scale=st.floats(0.01, 100.0),
)
def test_the_seed_interval_lies_within_the_per_seed_ratios_and_scales_with_them(pairs, scale):
    from fedrl.sim.bench.methods import seed_interval

    reference, other = (list(column) for column in zip(*pairs))
    low, high = seed_interval(reference, other, draws=2000)
    ratios = [o / r for r, o in pairs]
    # a ratio of sums lies between the smallest and the largest of its terms' ratios
    assert min(ratios) * (1 - 1e-9) <= low <= high <= max(ratios) * (1 + 1e-9)
    scaled = seed_interval(reference, [scale * o for o in other], draws=2000)
    assert scaled == pytest.approx([scale * low, scale * high], rel=1e-9)
    assert seed_interval(reference, reference, draws=2000) == pytest.approx([1.0, 1.0])


def test_the_seed_interval_refuses_what_it_cannot_bootstrap():
    from fedrl.sim.bench.methods import seed_interval

    for reference, other in (([1.0], [2.0]), ([1.0, 2.0], [1.0]), ([0.0, 1.0], [1.0, 1.0])):
        with pytest.raises(ValueError, match="two or more paired, positive"):
            seed_interval(reference, other)
