import json
import math

import numpy as np
import pytest

from fedrl.sim.profiles import ClientProfile, ProfileError, load_profile_file, mix, resolve_profiles


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_mixed_volunteers_has_the_promised_spread(n):
    profiles = mix("mixed-volunteers", n)
    assert len(profiles) == n
    speeds = [p.speed for p in profiles]
    ups = [p.up_bytes_s for p in profiles]
    assert max(speeds) / min(speeds) >= 10
    assert max(ups) / min(ups) >= 100
    assert 0.08 <= np.mean([p.dropout for p in profiles]) <= 0.12
    assert mix("mixed-volunteers", n) == profiles  # deterministic for a seed
    assert mix("mixed-volunteers", n, seed=1) != profiles or n < 3


def test_named_mixes_differ_in_the_expected_direction():
    dc, home, mobile = (mix(name, 20) for name in ("datacenter", "home-broadband", "mobile"))
    assert min(p.speed for p in dc) > max(p.speed for p in mobile)
    assert min(p.up_bytes_s for p in dc) > max(p.up_bytes_s for p in home) > min(p.up_bytes_s for p in mobile)
    assert all(p.dropout == 0 for p in dc) and all(p.dropout > 0 for p in mobile)


def test_profile_file_groups_and_mixes(tmp_path):
    path = tmp_path / "clients.toml"
    path.write_text(
        '[[client]]\ncount = 3\nname = "lab"\nspeed = 2.0\nup_bytes_s = 1e7\n\n'
        '[[client]]\ncount = 4\nmix = "mobile"\n'
    )
    profiles = load_profile_file(path)
    assert len(profiles) == 7
    assert profiles[:3] == [ClientProfile(name="lab", speed=2.0, up_bytes_s=1e7)] * 3
    assert all(p.name == "mobile" for p in profiles[3:])
    assert resolve_profiles(str(path), 10)[7] == profiles[0]  # a file is repeated cyclically


@pytest.mark.parametrize(
    "text,message",
    [
        ("[[client]]\ncount = 2\nsped = 1.0\n", "sped: Extra inputs are not permitted"),
        ("[[client]]\ncount = 0\n", "count must be a positive integer"),
        ("[[client]]\nspeed = -1.0\n", "must be > 0"),
        ('[[client]]\nspeed = "fast"\n', "speed: Input should be a valid number"),
        ("[[client]]\ndropout = 1.5\n", r"dropout must be in \[0, 1\)"),
        ("[[client]]\nactor_staleness = -2\n", "actor_staleness must be >= 0, got -2"),
        ("[[client]]\nactor_staleness = 2.5\n", "actor_staleness: Input should be a valid integer"),
        ('[[client]]\nmix = "moon"\n', "unknown profile mix"),
        ('[[client]]\nmix = "mobile"\nspeed = 1.0\n', "only count and mix"),
        ("speed = 1.0\n", "expected one or more"),
        ("[[client]\n", "Expected"),
    ],
)
def test_bad_profile_files_say_what_and_where(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as err:
        load_profile_file(path)
    assert "bad.toml" in str(err.value)


def test_resolve_profiles_forms():
    assert resolve_profiles("", 3) == [ClientProfile()] * 3
    listed = resolve_profiles(json.dumps([{"speed": 0.5}, {"speed": 2}]), 3)
    assert [p.speed for p in listed] == [0.5, 2.0, 0.5]
    assert len(resolve_profiles("mobile", 5)) == 5
    with pytest.raises(ProfileError, match="neither a mix"):
        resolve_profiles("no-such-thing", 2)
    with pytest.raises(ProfileError):
        resolve_profiles("[1, 2]", 2)
    assert (
        ClientProfile.from_mapping(json.loads(ClientProfile().to_json())) == ClientProfile()
    )  # inf survives JSON


def test_availability_windows_and_dropouts():
    rng = np.random.default_rng(0)
    always = ClientProfile()
    assert always.offline_reason(0, 1e6, 1e3, rng) == ""
    cyclic = ClientProfile(online_s=100.0, offline_s=50.0)  # client 0 has phase 0
    assert cyclic.offline_reason(0, 10.0, 20.0, rng) == ""
    assert "offline" in cyclic.offline_reason(0, 120.0, 1.0, rng)  # inside the offline window
    assert "offline" in cyclic.offline_reason(0, 90.0, 20.0, rng)  # goes offline mid-round
    assert cyclic.offline_reason(0, 160.0, 20.0, rng) == ""  # the next cycle
    flaky = ClientProfile(dropout=0.1)
    lost = sum(bool(flaky.offline_reason(0, 0.0, 1.0, rng)) for _ in range(20_000))
    assert abs(lost / 20_000 - 0.1) < 0.01
    assert math.isinf(ClientProfile().link.up_bytes_s)
