"""The namespace topology of `fedrl bench overlap --netns`: shaped veth links that exist only
while the benchmark runs, and a clean skip (with the reason) where namespaces cannot be made."""

import json
import subprocess
import types

import pytest

from fedrl.sim.bench import netns, overlap


def test_without_root_it_says_why(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    if netns.shutil.which("ip") and netns.shutil.which("tc"):
        assert "needs root" in netns.unavailable()
    else:
        assert "iproute2" in netns.unavailable()


def test_the_benchmark_skips_with_its_reason_and_still_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(netns, "unavailable", lambda: "no rights here")
    args = types.SimpleNamespace(quick=True, steps=1, repeats=1, netns=True, out=str(tmp_path / "o.json"))
    assert overlap.main(args) == 0
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["netns_skipped"] == "no rights here" and result["cases"] == []
    assert "netns: skipped: no rights here" in capsys.readouterr().out


def test_rates_are_planned_for_each_ratio_with_a_slower_upload():
    clients = netns.plan_clients(compute_s=2.0, up_bytes=100_000, down_bytes=200_000)
    assert [c.ratio for c in clients] == [0.5, 1.0, 2.0]
    for c in clients:
        assert c.down_bits_s == 2 * c.up_bits_s
        # the planned transfers take ratio x compute: 2 latencies + up / u + down / d
        comm = 2 * c.latency_s + 8 * 100_000 / c.up_bits_s + 8 * 200_000 / c.down_bits_s
        assert comm == pytest.approx(c.ratio * 2.0, rel=0.01)


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_each_client_link_is_shaped_both_ways_and_everything_is_removed():
    clients = [netns.ShapedClient(1.0, 2_000_000, 4_000_000, 0.01)]
    with netns.Topology(clients) as topo:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert topo.store_ns in names and topo.client_ns[0] in names
        client_if, store_if = topo.links[0]
        up = subprocess.run(
            ["tc", "-n", topo.client_ns[0], "qdisc", "show", "dev", client_if], capture_output=True, text=True
        )
        down = subprocess.run(
            ["tc", "-n", topo.store_ns, "qdisc", "show", "dev", store_if], capture_output=True, text=True
        )
        assert "tbf" in up.stdout and "rate 2Mbit" in up.stdout
        assert "tbf" in down.stdout and "rate 4Mbit" in down.stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert topo.store_ns not in names and topo.client_ns[0] not in names
