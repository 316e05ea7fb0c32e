import pytest

from fedrl.bench.overlap import Federation, measure


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
    (r,) = [c for c in cases if c["mode"] == "real"]
    assert r["comm_s"] > 0.3 * r["compute_s"]  # the link really was shaped
    # the overlapped round cannot beat its own slower part, and it beats doing both in turn
    assert r["round_s_overlapped"] >= 0.95 * r["ideal_s"]
    assert r["round_s_overlapped"] < r["compute_s"] + r["comm_s"]
