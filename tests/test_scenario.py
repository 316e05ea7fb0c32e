import json
import signal

import pytest

from fedrl.sim.profiles import resolve_profiles
from fedrl.sim.scenario import ScenarioError, load_scenario, shipped


def test_shipped_scenarios_load_and_the_default_exists():
    names = shipped()
    assert {"default", "mixed-volunteers", "datacenter", "real-links", "buggy-clients"} <= set(names)
    for name in names:
        s = load_scenario(name)
        assert s.clients >= 1 and s.config.min_nodes == s.clients
        assert len(resolve_profiles(s.sim.profiles, s.clients)) == s.clients
    assert load_scenario("default").sim.clock == "virtual"
    assert load_scenario("real-links").sim.clock == "real"


@pytest.mark.parametrize(
    "text,message",
    [
        ("clients = 2\nbogus = 1\n", "unknown keys"),
        ("clients = 2\n[run]\nnum_rounds = 3\n", "num_rounds: Extra inputs are not permitted"),
        ('clients = 2\n[run]\nversions = "many"\n', "versions: Input should be a valid integer"),
        ("clients = 0\n", "clients must be a positive integer"),
        ("clients = 2\nseeds = []\n", "seeds must be"),
        ('clients = 2\n[run]\nclock = "sundial"\n', "clock must be real or virtual, got 'sundial'"),
        ("clients = 2\n[run]\nstep_s = -0.1\n", "step_s must be a finite number >= 0"),
        ("clients = 2\n[run]\nlr = 0.0\n", "lr must be a finite number > 0"),
        ('clients = 2\n[run]\nprofiles = "nowhere"\n', "neither a mix"),
        ('clients = 2\n[run]\nprofiles = "mobile"\n[[client]]\nspeed = 1.0\n', "not both"),
        ("[[client]]\nspeed = 0.0\n", "must be > 0"),
        ("clients = 2\n[run\n", "Expected"),
    ],
)
def test_bad_scenarios_say_what_and_where(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=message) as err:
        load_scenario(str(path))
    assert "bad.toml" in str(err.value)


def test_unknown_scenario_names_list_the_shipped_ones():
    with pytest.raises(ScenarioError, match="shipped: .*default"):
        load_scenario("no-such-scenario")


def test_profile_file_beside_the_scenario(tmp_path):
    (tmp_path / "clients.toml").write_text("[[client]]\ncount = 2\nspeed = 0.5\n")
    (tmp_path / "s.toml").write_text('clients = 4\n[run]\nprofiles = "clients.toml"\n')
    s = load_scenario(str(tmp_path / "s.toml"))
    assert [p.speed for p in resolve_profiles(s.sim.profiles, 4)] == [0.5] * 4


@pytest.mark.slow
def test_a_small_scenario_runs_end_to_end_under_flower_simulation(tmp_path, capsys):
    """`fedrl sim --scenario FILE` with Ray: a virtual-clock run with a mix, a dropout-prone client,
    a report with every plot and the HTML page."""
    from fedrl.cli.main import main

    path = tmp_path / "small.toml"
    path.write_text(f"""
name = "small"
description = "two clients, virtual clock"
clients = 2
seeds = [0, 1]
[run]
mode = "parablock"
clock = "virtual"
versions = 3
buffer_size = 1
base_steps = 2
max_steps = 3
prompts = 4
samples = 4
eval_every = 2
task_params = '{json.dumps({"length": 8, "num_eval": 32})}'
[[client]]
name = "fast"
speed = 2.0
up_bytes_s = 1e6
down_bytes_s = 4e6
[[client]]
name = "slow"
speed = 0.25
up_bytes_s = 1e5
down_bytes_s = 4e5
latency_s = 0.05
""")
    out = tmp_path / "out"

    def own(signum, frame):  # a program's own handler, which Ray's must not replace
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        # `--set seed` runs that seed alone, in place of the scenario's (before, the scenario's seeds ran)
        assert main(["sim", "--scenario", str(path), "--out", str(out), "--set", "seed=3"]) == 0
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not list(out.glob("seed-*"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["seed"] == 3
    assert summary["scenario"]["name"] == "small" and summary["clock"] == "virtual"
    assert summary["versions"] >= 3 and summary["counts"]["accepted"] >= 3
    profiles = sorted(c["profile"] for c in summary["clients"].values())
    assert profiles == ["fast", "slow"]
    fast, slow = (next(c for c in summary["clients"].values() if c["profile"] == p) for p in ("fast", "slow"))
    assert (
        fast["messages"] > slow["messages"]
    )  # virtual time, not Ray's scheduling, decides who gets more rounds
    for name in ("metric_vs_time.png", "bytes_vs_time.png", "staleness_histogram.png", "client_timeline.png"):
        assert (out / name).stat().st_size > 5000
    page = (out / "report.html").read_text()
    assert "staleness_histogram.png" in page and "small" in page
    assert "<th>uploads accepted</th>" in page and "fedrl/ledger.py" in page  # each client's ledger
    best = summary["best_adapter"]
    assert f"{best['error']:.3f} at v{best['version']}" in page  # the best-evaluated version's adapter
    # the exported adapter, evaluated with nothing but its folder: the run's final held-out error
    capsys.readouterr()
    assert main(["eval", "--adapter", summary["adapter_dir"]]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["problems"] == 32 and evaluated["greedy_error"] == summary["final_eval"], evaluated
