"""`fedrl bench methods --pool`: invocations of one setting read as one, unlike runs refused."""

import json

import pytest

import fedrl
from fedrl.cli.main import main
from fedrl.sim.bench.methods import against_dg, method_summary, read_at, report
from fedrl.sim.bench.methods_pool import PoolError, pool

SETTING = {
    "quick": False,
    "clients": 8,
    "budget": "600 virtual s",
    "budget_s": 600.0,
    "frictions": {"noisy": {"share": 0.5, "reward_noise_prob": 0.3}},
    "model": "tiny-gpt",
    "lr": 3e-4,
    "overrides": {"lora_rank": 64},
    "step_s": 0.05,
}


def run(method, seed, curve, target):
    """A result row as `run_case` makes it from a run that stopped at its first eval at or under
    `target` (the curve given ends there) or at its budget."""
    reached = next(((t, s) for t, s, e in curve if e <= target), None)
    return {
        "method": method,
        "seed": seed,
        "samples_to_target": reached and reached[1],
        "time_to_target_s": reached and reached[0],
        "time_to_stay_s": None,
        "samples": curve[-1][1],
        "virtual_s": curve[-1][0],
        "best_eval": min(e for *_, e in curve),
        "final_eval": curve[-1][2],
        "curve": [list(point) for point in curve],
    }


def invocation(tmp_path, name, runs, target=0.15, **setting):
    path = tmp_path / f"{name}.json"
    report(runs, target, {**SETTING, **setting}, path, wall_s=1.0)
    return path


def two_invocations(tmp_path):
    first = [
        run("dg", 0, [(0, 0, 0.99), (10, 100, 0.5), (20, 200, 0.1)], 0.15),
        run("ppo", 0, [(0, 0, 0.99), (10, 150, 0.6), (30, 400, 0.12)], 0.15),
    ]
    second = [
        run("dg", 1, [(0, 0, 0.99), (15, 300, 0.14)], 0.15),
        run("ppo", 1, [(0, 0, 0.99), (60, 900, 0.3)], 0.15),  # never got there: its budget's samples
        run("dg", 2, [(0, 0, 0.99), (12, 100, 0.01)], 0.15),
        run("ppo", 2, [(0, 0, 0.99), (20, 250, 0.15)], 0.15),
    ]
    return invocation(tmp_path, "a", first), invocation(tmp_path, "b", second), first + second


def test_pooled_files_give_what_one_invocation_of_all_their_seeds_gives(tmp_path, capsys):
    a, b, runs = two_invocations(tmp_path)
    out = tmp_path / "pooled.json"
    assert main(["bench", "methods", "--pool", str(a), str(b), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert [(r["method"], r["seed"]) for r in pooled["runs"]] == [(r["method"], r["seed"]) for r in runs]
    summary = {m: method_summary([r for r in runs if r["method"] == m]) for m in ("dg", "ppo")}
    assert pooled["summary"] == summary and pooled["against_dg"] == json.loads(
        json.dumps(against_dg(summary, runs))
    )
    means = pooled["against_dg"]["ppo"]["on_means"]
    assert means["ratio"] == pytest.approx((400 + 900 + 250) / (200 + 300 + 100)) and means["lower_bound"]
    assert pooled["target"] == 0.15 and list(pooled["pooled_from"]) == [str(a), str(b)]
    assert pooled["pooled_from"][str(a)] == pooled["code"] and pooled["code"]["version"] == fedrl.__version__
    assert {k: pooled[k] for k in SETTING} == SETTING and out.with_suffix(".png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "6 runs pooled from 2 files, read at 0.15" in printed and "mean over 3 seed(s)" in printed
    assert "other code" not in printed
    # a file of other code is pooled (a record may span versions knowingly), and named
    older = json.loads(b.read_text()) | {"code": {"version": "0.2.0", "commit": None}}
    b.write_text(json.dumps(older))
    assert main(["bench", "methods", "--pool", str(a), str(b), "--out", str(out)]) == 0
    assert f"run on other code: {a}: {pooled['code']}; {b}: {older['code']}" in capsys.readouterr().out


def test_runs_are_read_again_at_another_target_where_their_curves_reach(tmp_path):
    # ran to 0.05: a run read at 0.15 takes its first eval at or under 0.15
    low = [run("dg", 3, [(0, 0, 0.99), (10, 100, 0.12), (20, 180, 0.04)], 0.05)]
    low += [run("ppo", 3, [(0, 0, 0.99), (40, 500, 0.14), (50, 640, 0.2), (60, 700, 0.3)], 0.05)]
    a, b, _ = two_invocations(tmp_path)
    c = invocation(tmp_path, "c", low, target=0.05)
    with pytest.raises(PoolError, match=r"different targets \(0.05, 0.15\): give --target"):
        pool([a, c], None)
    pooled = pool([a, c], 0.15)
    by_key = {(r["method"], r["seed"]): r for r in pooled.runs}
    assert (
        pooled.target == 0.15
        and by_key["dg", 3]["samples_to_target"] == 100
        and by_key["dg", 3]["time_to_target_s"] == 10
    )
    assert by_key["ppo", 3]["samples_to_target"] == 500 and by_key["ppo", 3]["time_to_stay_s"] is None
    # below the target a run ran to, a run that stopped there has no curve left to read
    with pytest.raises(PoolError, match=r"a.json: dg seed 0 stopped at its target 0.15 before reaching 0.05"):
        pool([a, c], 0.05)
    # a run that never reached its target ran its whole budget: it reads as a lower bound anywhere
    d = [
        run("dg", 7, [(0, 0, 0.99), (8, 80, 0.01)], 0.15),
        run("ppo", 7, [(0, 0, 0.99), (60, 900, 0.3)], 0.15),
    ]
    runs = pool([c, invocation(tmp_path, "d", d)], 0.05).runs
    never = next(r for r in runs if (r["method"], r["seed"]) == ("ppo", 7))
    assert never["samples_to_target"] is None and never["samples"] == 900
    # a pool read at another target keeps where each run stopped: pooled again, it reads as the
    # files it came from would (ppo seed 3 ran its budget, though its curve passed 0.15)
    out = tmp_path / "at-0.15.json"
    assert main(["bench", "methods", "--pool", str(c), str(tmp_path / "d.json"), "--out", str(out)]) == 2
    assert (
        main(
            [
                "bench",
                "methods",
                "--pool",
                str(c),
                str(tmp_path / "d.json"),
                "--target",
                "0.15",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    again = {(r["method"], r["seed"]): r["samples_to_target"] for r in pool([out], 0.1).runs}
    assert again == {("dg", 3): 180, ("ppo", 3): None, ("dg", 7): 80, ("ppo", 7): None}
    # one file alone is read again at another target, and refused below where a run stopped
    with pytest.raises(PoolError, match="a.json: ppo seed 0 stopped at its target 0.15 before reaching 0.1"):
        pool([a], 0.1)


def test_unlike_runs_are_refused_and_the_files_stay_as_they_were(tmp_path, capsys):
    a, b, _ = two_invocations(tmp_path)
    other_lr = invocation(tmp_path, "lr", [run("dg", 5, [(0, 0, 0.99), (9, 90, 0.1)], 0.15)], lr=1e-4)
    with pytest.raises(PoolError, match=r"other settings \(lr: 0.0003 in .*a.json, 0.0001 in .*lr.json\)"):
        pool([a, other_lr], None)
    with pytest.raises(PoolError, match=r"dg seed 0 is in both .*a.json and .*again.json"):
        pool([a, invocation(tmp_path, "again", [run("dg", 0, [(0, 0, 0.9), (5, 50, 0.1)], 0.15)])], None)
    with pytest.raises(PoolError, match="a.json is given twice"):
        pool([a, a], None)
    (tmp_path / "async.json").write_text(json.dumps({"benchmark": "async", "runs": []}))
    (tmp_path / "cut.json").write_text(a.read_text()[:100])
    for bad, said in (
        ("async.json", "not a `fedrl bench methods` JSON"),
        ("cut.json", "not readable as JSON"),
    ):
        with pytest.raises(PoolError, match=said):
            pool([a, tmp_path / bad], None)
    before = a.read_text()
    assert main(["bench", "methods", "--pool", str(a), str(b), "--out", str(a)]) == 2
    assert "--out" in capsys.readouterr().err and a.read_text() == before
    assert main(["bench", "methods", "--pool", str(a), str(other_lr), "--out", str(tmp_path / "x.json")]) == 2
    assert "pool runs of one setting only" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_runs_to_the_budget_are_also_read_where_they_stayed_under_the_target(tmp_path, capsys):
    """A curve that swings reaches a target first and holds it last: DG's here crosses 0.15 at
    100 samples and stays under it from 300, PPO's crosses at 200 and stays from 200."""

    def to_budget(method, curve):
        return {
            "method": method,
            "seed": 0,
            **read_at(curve, 0.15),
            "samples": curve[-1][1],
            "virtual_s": curve[-1][0],
            "best_eval": min(e for *_, e in curve),
            "final_eval": curve[-1][2],
            "curve": [list(point) for point in curve],
        }

    dg = to_budget(
        "dg", [(0, 0, 0.99), (10, 100, 0.1), (20, 200, 0.8), (30, 300, 0.12), (40, 400, 0.1), (50, 500, 0.05)]
    )
    ppo = to_budget(
        "ppo",
        [(0, 0, 0.99), (10, 100, 0.5), (20, 200, 0.14), (30, 300, 0.13), (40, 400, 0.12), (50, 500, 0.1)],
    )
    assert (dg["samples_to_target"], dg["samples_to_stay"], dg["time_to_stay_s"]) == (100, 300, 30)
    assert dg["late_error"] == pytest.approx((0.1 + 0.05) / 2)  # the evals of the last fifth: t >= 40
    assert (ppo["samples_to_target"], ppo["samples_to_stay"]) == (200, 200)
    assert read_at([(0, 0, 0.9), (10, 100, 0.1), (20, 200, 0.5)], 0.15)["samples_to_stay"] is None

    path = invocation(tmp_path, "budget", [dg, ppo], run_to_budget=True)
    data = json.loads(path.read_text())
    assert data["against_dg"]["ppo"]["on_means"]["ratio"] == pytest.approx(2.0)
    assert data["against_dg_to_stay"]["ppo"]["on_means"]["ratio"] == pytest.approx(200 / 300)
    assert data["summary"]["dg"]["stayed"] == 1 and data["summary"]["dg"]["stay_range"] == [300, 300]
    assert data["summary"]["ppo"]["late_error"] == pytest.approx(0.11)
    printed = capsys.readouterr().out
    assert (
        "ppo / dg samples to target: 2.00x" in printed
        and "ppo / dg samples to stay under it: 0.67x" in printed
    )
    # a run to the budget did not stop at its file's target: it is read below it too
    below = {r["method"]: r for r in pool([path], 0.06).runs}
    assert below["dg"]["samples_to_target"] == 500 and below["ppo"]["samples_to_target"] is None
    # such files pool with each other (their ratios to staying differ, as each file's own figures)
    late_ppo = to_budget("ppo", [(0, 0, 0.99), (20, 200, 0.5), (40, 400, 0.1), (50, 500, 0.1)])
    other_seed = [r | {"seed": 1} for r in (dg, late_ppo)]
    out = tmp_path / "both.json"
    later = invocation(tmp_path, "budget-seed1", other_seed, run_to_budget=True)
    assert main(["bench", "methods", "--pool", str(path), str(later), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert pooled["summary"]["dg"]["stayed"] == 2 and "against_dg_to_stay" in pooled
    # and it is not pooled with runs that stopped at the target
    a, _, _ = two_invocations(tmp_path)
    with pytest.raises(PoolError, match="run_to_budget: None in .*a.json, True in .*budget.json"):
        pool([a, path], None)
    # a stop-at-target invocation says nothing of staying (its runs ended at the first crossing)
    assert "against_dg_to_stay" not in json.loads(a.read_text())
