import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedrl.run_events import COUNTS, EventLog, follow, read_events

kinds = st.sampled_from(["reply", "accepted", "rejected", "error", "lost", "version", "joined"])
event_args = st.lists(
    st.tuples(kinds, st.lists(st.sampled_from(COUNTS), max_size=2, unique=True), st.integers(0, 50)),
    max_size=30,
)


@given(event_args)
def test_totals_rebuilt_from_the_file_equal_the_live_ones(tmp_path_factory, args):
    path = tmp_path_factory.mktemp("events") / "events.jsonl"
    live = EventLog("run-a", path)
    for t, (kind, counted, version) in enumerate(args):
        live.emit(kind, float(t), version, tuple(counted), node=7)
    live.close()
    events, offset = read_events(path)
    assert offset == path.stat().st_size
    replayed = EventLog("run-a")
    for e in events:
        replayed.add(e)
    assert replayed.counts == live.counts
    assert replayed.events == live.events  # every field, the wall time and run id included
    assert all(e["run"] == "run-a" and e["node"] == 7 for e in events)


def test_a_half_written_line_waits_and_junk_lines_are_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = json.dumps({"t": 1, "kind": "version", "version": 1})
    path.write_text(f"{whole}\nnot json\n[1, 2]\n" + '{"t": 2, "kind": "ver')
    events, offset = read_events(path)
    assert [e["version"] for e in events] == [1]
    with open(path, "a") as f:
        f.write('sion", "version": 2}\n')
    more, _ = read_events(path, offset)
    assert [e["version"] for e in more] == [2]


def test_an_unknown_total_is_refused_and_a_failing_listener_does_not_stop_the_run(tmp_path):
    log = EventLog("r")
    with pytest.raises(ValueError, match="unknown totals"):
        log.add({"kind": "x", "counted": ["bogus"]})
    log.listeners.append(lambda e: 1 / 0)
    log.emit("reply", 0.0, 0, ("replies",))
    assert log.counts["replies"] == 1 and len(log.events) == 1


def test_follow_feeds_a_log_from_a_file_that_appears_later(tmp_path):
    path = tmp_path / "events.jsonl"
    into, stop = EventLog("r"), threading.Event()
    thread = threading.Thread(target=follow, args=(path, into, stop, 0.02))
    thread.start()
    try:
        writer = EventLog("r", path)
        for v in range(5):
            writer.emit("version", float(v), v, ("accepted",))
        writer.close()
        for _ in range(500):
            if len(into.events) == 5:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        thread.join()
    assert into.counts["accepted"] == 5 and [e["version"] for e in into.events] == list(range(5))


def test_a_resumed_run_appends_and_a_new_one_starts_afresh(tmp_path):
    path = tmp_path / "events.jsonl"
    for append in (False, True):
        log = EventLog("r", path, append=append)
        log.emit("version", 0.0, 1)
        log.close()
    assert len(read_events(path)[0]) == 2
    EventLog("r", path).close()
    assert read_events(path)[0] == []
