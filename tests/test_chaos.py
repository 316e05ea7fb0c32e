import json

import pytest
import torch

from fedrl.sim.attacks import IN_BOUND, SCALE, poison
from fedrl.sim.profiles import ClientProfile, ProfileError


def test_each_attack_turns_the_update_into_what_it_says():
    base = {"w": torch.zeros(50), "b": torch.ones(3)}
    new = {"w": torch.linspace(-1, 1, 50), "b": torch.ones(3) + 0.5}
    delta = lambda out: torch.cat([out[k] - base[k] for k in base])  # noqa: E731
    honest = delta(new)
    assert poison("", base, new, 0) is new
    assert torch.allclose(delta(poison("scale", base, new, 0)), SCALE * honest)
    assert torch.allclose(delta(poison("flip", base, new, 0)), -SCALE * honest)
    assert torch.allclose(delta(poison("flip-x3", base, new, 0)), -IN_BOUND * honest)
    assert torch.allclose(delta(poison("ascent", base, new, 0)), -honest)
    noise = delta(poison("random", base, new, 1))
    assert abs(float(noise.norm()) - SCALE * float(honest.norm())) < 1e-2 * SCALE * float(honest.norm())
    assert torch.isnan(delta(poison("nan", base, new, 0))).all()
    # a liar about its base: its update on the version-0 values, which from the real base is a
    # rollback of all merged since plus the update
    first = {"w": torch.full((50,), 3.0), "b": torch.zeros(3)}
    rolled_back = torch.cat([first[k] - base[k] for k in base]) + honest
    assert torch.allclose(delta(poison("stale-base", base, new, 0, first)), rolled_back)
    with pytest.raises(ValueError, match="version 0"):
        poison("stale-base", base, new, 0)
    with pytest.raises(ValueError, match="unknown attack"):
        poison("bribe", base, new, 0)
    with pytest.raises((ValueError, ProfileError), match="attack must be one of"):
        ClientProfile.from_mapping({"attack": "bribe"})


@pytest.mark.slow
def test_bench_chaos_at_tiny_size_loses_nothing_and_lets_no_nan_in(tmp_path):
    from fedrl.cli.main import main

    out = tmp_path / "chaos.json"
    argv = ["bench", "chaos", "--families", "byzantine", "--clients", "5", "--versions", "2"]
    argv += ["--rules", "clip", "gate", "--seeds", "2", "--workers", "1"]  # the suite holds the cores
    assert main(argv + ["--attacks", "nan", "scale", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["byzantine_seeds"] == [0, 1] and result["overrides"] == {}
    assert len({f["step_s"] for f in result["faults"]}) == 1  # every run used one unit of work
    # every seed has its own row per rule and attack, and the summary spans them
    seeds = {(f["name"], f["rule"]): set() for f in result["faults"]}
    for f in result["faults"]:
        seeds[f["name"], f["rule"]].add(f["seed"])
    assert set(map(frozenset, seeds.values())) == {frozenset({0, 1})}
    for k in result["byzantine_kept"]:
        runs = [f for f in result["faults"] if (f["name"], f["rule"]) == (k["name"], k["rule"])]
        kept = [f["improvement_kept"] for f in runs if f["improvement_kept"] is not None]
        assert k["seeds"] == [f["seed"] for f in runs if f["improvement_kept"] is not None]
        assert k["kept_min"] == min(kept) and k["kept_max"] == max(kept), k
        assert abs(k["kept_mean"] - sum(kept) / len(kept)) < 1e-12
    result["faults"] = [f for f in result["faults"] if f["seed"] == 0]
    gated = {f["name"]: f for f in result["faults"] if f["rule"] == "gate"}
    rows = {f["name"]: f for f in result["faults"] if f["rule"] == "clip"}
    assert set(rows) == {"byzantine-nan", "byzantine-scale"} and result["attackers"] == 1
    assert all(f["survived"] and f["versions_lost"] == 0 for f in rows.values())
    nan = rows["byzantine-nan"]
    assert nan["tried"] >= 2 and nan["rejected"] == nan["tried"] and nan["silently_accepted"] == 0
    scale = rows["byzantine-scale"]
    # the x100 update is refused for its norm once there are peers to compare it with (an
    # attacker whose own update was zero that round sends zero x100, which passes)
    assert scale["refused_by_cause"].get("norm", 0) >= 1 and not scale["honest_refused"], scale
    # under the gate rule too, and the refusals weigh: the attacker's weight falls below what its
    # accepted updates alone would earn
    caught = gated["byzantine-scale"]
    assert caught["rejected"] >= 1 and caught["gate_refused_honest"] == 0
    assert caught["attacker_weight"] < (caught["accepted"] + 1) / (caught["accepted"] + 2)
    assert caught["gate_cpu_s_per_update"] > 0 and gated["byzantine-nan"]["silently_accepted"] == 0
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
def test_bench_chaos_faults_at_tiny_size_lose_at_most_a_version_and_accept_nothing_silently(tmp_path):
    """Churn, coordinator SIGKILLs (one per phase: a random moment, mid-aggregation,
    mid-checkpoint-write, mid-publish), the store under attack and the patch fuzzer, each at its
    smallest: the invariants hold (the figures are the benchmark's, not this test's)."""
    from fedrl.cli.main import main

    out = tmp_path / "chaos.json"
    argv = ["bench", "chaos", "--quick", "--families", "churn", "kill", "store", "fuzz", "--clients", "3"]
    assert main(argv + ["--versions", "8", "--kills", "4", "--mutations", "500", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {f["name"]: f for f in result["faults"]}
    assert all(f["survived"] and f["silently_accepted"] == 0 for f in rows.values()), rows
    for mode in ("churn-parablock-async", "churn-block-sequential-sync"):
        churned = rows[mode]  # how far the schedule gets in 8 versions depends on the machine's pace
        assert churned["churn"][0]["what"] == "left" and churned["replies_failed_in_flight"] == 1, churned
        assert churned["identities_stable"] and churned["left_events"] >= 1 and churned["versions_lost"] == 0
    killed = rows["coordinator-kill-9"]
    assert killed["kills_done"] == 4 and all(k["killed"] for k in killed["kills"]), killed
    assert set(killed["kills_by_phase"].values()) == {1} and killed["versions_lost_max"] <= 1, killed
    assert killed["leftover_tmp_files"] == 0 and killed["corrupt_checkpoints"] == 0
    assert rows["store-replayed"]["tried"] >= 10 and rows["store-replayed"]["original_status"] == 200
    assert result["store"]["honest_under_attack"]["lost"] == 0
    fuzzed = rows["patch-mutations"]
    assert fuzzed["tried"] == 500 and fuzzed["crashed"] == 0 and fuzzed["refused"] + fuzzed["exact"] == 500
    synced = rows["patch-mutations-sync"]  # a sync's link: only its changes hashed, its target hash a name
    assert synced["tried"] == 500 and synced["refused"] + synced["exact"] + synced["misnamed"] == 500
    assert rows["decompression-bombs"]["peak_rss_growth_max"] < 64 << 20
    assert out.with_suffix(".png").stat().st_size > 10_000
