import pytest

from fedrl.sim.bench.overlap import Federation, measure


@pytest.fixture(scope="module")
def cases():
    fed = Federation()
    try:
        yield measure(fed, [1.0], steps=3, repeats=1)
    finally:
        fed.close()


def test_virtual_case_runs_the_client_on_the_virtual_clock(cases):
    (v,) = [c for c in cases if c["mode"] == "virtual"]
    assert v["round_s_overlapped"] == pytest.approx(max(v["compute_s"], v["comm_s"]))  # exact composition
    assert v["round_s_sequential"] > v["round_s_overlapped"]
    assert v["comm_s"] == pytest.approx(v["compute_s"], rel=0.15)  # ratio 1: the link was sized for it


def test_real_case_measures_shaped_rounds(cases):
    """Only what load cannot break: the shaped link cannot move bytes faster than its rate,
    and an overlapped round cannot end before its own slower part."""
    (r,) = [c for c in cases if c["mode"] == "real"]
    assert r["comm_s"] >= r["min_comm_s"]  # bytes / configured rate + latencies: a floor, whatever the load
    assert r["round_s_overlapped"] >= 0.95 * r["ideal_s"]
