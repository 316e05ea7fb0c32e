"""The coordinator's monitor: /metrics while a run goes on, and the same figures rebuilt from
events.jsonl afterwards (`fedrl dashboard`), checked against the run's summary."""

import json
import threading
import urllib.request

import pytest
from fake_grid import FakeGrid, small_config
from flwr.app import ConfigRecord, Error, Message, RecordDict
from prometheus_client.parser import text_string_to_metric_families

from fedrl.background_app import BackgroundApp
from fedrl.clients.client_app import app as client_app
from fedrl.credentials import ADMIN, new_secret, node_principal, token_for
from fedrl.monitor import make_monitor_app
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.run_events import EventLog, follow
from fedrl.run_metrics import RunMetrics
from fedrl.store_client import BlockingStoreClient, StoreError
from fedrl.strategies.coordinator import run_coordinator


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def samples(text: str) -> dict[str, list]:
    """Prometheus text, parsed by prometheus_client: sample name -> [(labels, value)]."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def total(found: dict, name: str, **labels) -> float:
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def faulty(node, msg, reply):
    """Node 3 is unreachable; node 2 answers version 1 with junk: errors and a malformed reply."""
    if node == 3:
        return Message(Error(code=5, reason="node unavailable"), reply_to=msg)
    if node == 2 and msg.content["instruction"]["version"] == 1:
        return Message(RecordDict({"junk": ConfigRecord({"x": 1})}), reply_to=msg)
    return reply


def test_metrics_served_during_a_run_and_rebuilt_from_its_file_match_the_summary(tmp_path):
    scrapes = []

    def scrape(coord):  # runs in the coordinator's thread: the monitor answers from its own
        urls = json.loads((coord.out_dir / "monitor.json").read_text())
        scrapes.append((coord.version, dict(coord.counts), samples(fetch(urls["metrics"]))))

    cfg = small_config(tmp_path, mode="block-sequential", sync=True, monitor_port=0, eval_every=1)
    summary = run_coordinator(FakeGrid(3, client_app, faulty), cfg, progress=scrape)

    assert len(scrapes) >= 3
    for version, counts, live in scrapes:
        assert total(live, "fedrl_version") == version
        for name in ("replies", "errors", "accepted", "lost", "unknown"):
            assert total(live, f"fedrl_{name}_total") == counts[name], name
        assert total(live, "fedrl_rejected_total") == counts["rejected"]
        assert total(live, "fedrl_heldout_metric", metric="greedy_error") >= 0
    assert [v for v, _, _ in scrapes] == sorted(v for v, _, _ in scrapes)

    # `fedrl dashboard RUN_DIR`: the same figures from events.jsonl alone
    log, metrics = EventLog("replay"), RunMetrics()
    log.listeners.append(metrics.observe)
    stop = threading.Event()
    stop.set()  # one pass over the finished file
    follow(tmp_path / "run" / "events.jsonl", log, stop)
    with BackgroundApp(lambda: make_monitor_app(log, metrics), "monitor") as server:
        replayed = samples(fetch(f"{server.url}/metrics"))
        page = fetch(f"{server.url}/dashboard")
        api = json.loads(fetch(f"{server.url}/api/events?since=0"))
    assert "<canvas" in page and "EventSource" in page and "cdn" not in page.lower()
    assert len(api["events"]) == len(summary["events"])
    counts = summary["counts"]
    assert counts["errors"] >= 3 and counts["rejected"] >= 1 and counts["accepted"] >= 3
    for name in ("replies", "errors", "accepted", "lost", "unknown"):
        assert total(replayed, f"fedrl_{name}_total") == counts[name], name
    assert total(replayed, "fedrl_rejected_total") == counts["rejected"]
    assert total(replayed, "fedrl_rejected_total", cause="malformed") >= 1
    assert total(replayed, "fedrl_version") == summary["versions"]
    assert total(replayed, "fedrl_bytes_total", direction="up") == summary["bytes_up"]
    assert total(replayed, "fedrl_bytes_total", direction="down") == summary["bytes_down"]
    assert total(replayed, "fedrl_update_staleness_count") == counts["accepted"]
    heldout = total(replayed, "fedrl_heldout_metric", metric="greedy_error")
    assert heldout == pytest.approx(summary["final_eval"])
    compute = sum(c["compute_s"] for c in summary["clients"].values())
    assert total(replayed, "fedrl_client_seconds_total", kind="compute") == pytest.approx(compute)
    assert total(replayed, "fedrl_checkpoint_version") == summary["versions"]
    assert 0 <= total(replayed, "fedrl_checkpoint_age_seconds") < 600
    assert total(replayed, "fedrl_store_objects") > 0 and total(replayed, "fedrl_store_bytes") > 0
    # each client's ledger: its uploads accepted, and refused by cause, as the summary's ledger has them
    uploads = "fedrl_client_uploads_total"
    for row in summary["ledger"].values():
        client = str(row["client"])
        assert total(replayed, uploads, client=client, outcome="accepted") == row["accepted"]
        for cause, n in row["refused"].items():
            assert total(replayed, uploads, client=client, outcome=cause) == n
    assert total(replayed, uploads) == counts["accepted"] + counts["rejected"]
    seen = {lab["client"] for lab, _ in replayed["fedrl_client_last_seen_timestamp_seconds"]}
    # node 3 never answered: it is a client of the summary (messages were sent to it) but never seen
    assert seen == {str(c["client_id"]) for c in summary["clients"].values() if c["messages"]}
    assert len(seen) == len(summary["clients"]) - 1


def test_a_bad_events_query_is_a_clear_400(tmp_path):
    log, metrics = EventLog("r"), RunMetrics()
    with BackgroundApp(lambda: make_monitor_app(log, metrics), "monitor") as server:
        with pytest.raises(urllib.error.HTTPError) as err:
            fetch(f"{server.url}/api/events?since=abc")
    assert err.value.code == 400 and b"since must be an integer" in err.value.read()


def test_dishonest_report_values_do_not_break_the_metrics():
    metrics = RunMetrics()
    base = {"kind": "reply", "version": 1, "client": 0, "wall": 1.0, "staleness": 0}
    values = {"bytes_up": -5, "bytes_down": float("nan"), "compute_s": "x", "comm_s": 1.5, "overlap_s": 0.0}
    metrics.observe(base | values)
    found = samples(metrics.text().decode())
    assert total(found, "fedrl_bytes_total") == 0
    assert total(found, "fedrl_client_seconds_total", kind="compute") == 0
    assert total(found, "fedrl_client_seconds_total", kind="comm") == 1.5


def test_the_patch_store_serves_its_own_metrics():
    secret = new_secret()
    with PatchStoreServer(StoreState(secret)) as server:
        node = BlockingStoreClient(server.url, node_principal(1), token_for(secret, node_principal(1)))
        admin = BlockingStoreClient(server.url, ADMIN, token_for(secret, ADMIN))
        try:
            digest = node.put(b"x" * 1000)
            assert node.get(digest) == b"x" * 1000
            with pytest.raises(StoreError):
                node.delete(digest)  # admin only: 403
            admin.get(digest)
            found = samples(fetch(f"{server.url}/metrics"))
        finally:
            node.close()
            admin.close()
    objects = "/objects/{digest}"
    assert total(found, "fedrl_store_requests_total", method="PUT", route=objects, status="201") == 1
    assert total(found, "fedrl_store_requests_total", method="GET", route=objects, status="200") == 2
    assert total(found, "fedrl_store_requests_total", method="DELETE", status="403") == 1
    assert total(found, "fedrl_store_transferred_bytes_total", direction="in") >= 1000
    assert total(found, "fedrl_store_transferred_bytes_total", direction="out") >= 2000
    assert total(found, "fedrl_store_request_seconds_count", method="GET", route=objects) == 2
    assert total(found, "fedrl_store_objects") == 1 and total(found, "fedrl_store_bytes") == 1000


def test_a_busy_monitor_port_a_bad_one_and_a_missing_run_dir_are_clear_errors(tmp_path, capsys):
    from fedrl.cli.main import main
    from fedrl.strategies.run_config import RunConfig

    with pytest.raises(ValueError, match="monitor_port must be -1"):
        RunConfig(monitor_port=70000)
    log, metrics = EventLog("r"), RunMetrics()
    with BackgroundApp(lambda: make_monitor_app(log, metrics), "monitor") as busy:
        cfg = small_config(tmp_path, monitor_port=busy.port)
        with pytest.raises(OSError, match=f"monitor could not listen on 127.0.0.1:{busy.port}"):
            run_coordinator(FakeGrid(3, client_app), cfg)
    assert main(["dashboard", str(tmp_path / "no-such-run")]) == 2
    assert "is not a folder" in capsys.readouterr().err
