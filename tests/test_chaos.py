import json

import pytest
import torch

from fedrl.sim.attacks import SCALE, poison
from fedrl.sim.profiles import ClientProfile, ProfileError


def test_each_attack_turns_the_update_into_what_it_says():
    base = {"w": torch.zeros(50), "b": torch.ones(3)}
    new = {"w": torch.linspace(-1, 1, 50), "b": torch.ones(3) + 0.5}
    delta = lambda out: torch.cat([out[k] - base[k] for k in base])  # noqa: E731
    honest = delta(new)
    assert poison("", base, new, 0) is new
    assert torch.allclose(delta(poison("scale", base, new, 0)), SCALE * honest)
    assert torch.allclose(delta(poison("flip", base, new, 0)), -SCALE * honest)
    assert torch.allclose(delta(poison("ascent", base, new, 0)), -honest)
    noise = delta(poison("random", base, new, 1))
    assert abs(float(noise.norm()) - SCALE * float(honest.norm())) < 1e-2 * SCALE * float(honest.norm())
    assert torch.isnan(delta(poison("nan", base, new, 0))).all()
    with pytest.raises(ValueError, match="unknown attack"):
        poison("bribe", base, new, 0)
    with pytest.raises((ValueError, ProfileError), match="attack must be one of"):
        ClientProfile.from_mapping({"attack": "bribe"})


@pytest.mark.slow
def test_bench_chaos_at_tiny_size_loses_nothing_and_lets_no_nan_in(tmp_path):
    from fedrl.cli.main import main

    out = tmp_path / "chaos.json"
    argv = ["bench", "chaos", "--clients", "5", "--versions", "2", "--rules", "clip"]
    assert main(argv + ["--attacks", "nan", "scale", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {f["name"]: f for f in result["faults"]}
    assert set(rows) == {"byzantine-nan", "byzantine-scale"} and result["attackers"] == 1
    assert all(f["survived"] and f["versions_lost"] == 0 for f in rows.values())
    nan = rows["byzantine-nan"]
    assert nan["tried"] >= 2 and nan["rejected"] == nan["tried"] and nan["silently_accepted"] == 0
    scale = rows["byzantine-scale"]
    # the x100 update is clipped (an attacker whose own update was zero that round sends zero x100)
    assert scale["accepted"] >= 2 and scale["clipped"] >= 1
    assert out.with_suffix(".png").stat().st_size > 10_000
