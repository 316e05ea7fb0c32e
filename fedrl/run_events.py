"""The run's one record of what happened: the report, the dashboard and the metrics all read it.

Each event is a flat JSON object: `t` (the run's clock, virtual in a simulation), `wall`
(Unix time), `run`, `kind`, `version`, then the kind's own fields. An event that advances a
run counter names it in `counted` (a reply rejected as malformed advances both `replies` and
`rejected`), so every total can be rebuilt from the events alone, also from the file.

The coordinator emits events; each is kept in memory (the summary's timeline), appended as
one line to OUT_DIR/events.jsonl (a structured log that `fedrl dashboard` follows) and handed
to listeners (Prometheus metrics). Events may come from the checkpoint writer's thread too.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

COUNTS = ("replies", "errors", "accepted", "rejected", "lost", "unknown")
# expected under churn and faults: logged at INFO; the rest (replies, versions...) at DEBUG
NOTABLE = {
    "rejected",
    "error",
    "lost",
    "unknown",
    "left",
    "leaving",
    "joined",
    "resumed",
    "stopped",
    "late",
    "resting",
    "checkpoint-skipped",
}
log = logging.getLogger("fedrl.events")


class EventLog:
    def __init__(self, run_id: str, path: Path | None = None, append: bool = False):
        self.run_id = run_id
        self.events: list[dict] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.listeners: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        # a resumed run goes on in its file; a new one starts it afresh
        self._file = open(path, "a" if append else "w", encoding="utf-8") if path else None  # noqa: SIM115

    def emit(self, kind: str, t: float, version: int, counted: tuple[str, ...] = (), **fields) -> dict:
        event = {"t": round(t, 3), "wall": round(time.time(), 3), "run": self.run_id, "kind": kind}
        event.update(version=version, **fields)
        if counted:
            event["counted"] = list(counted)
        self._check(event)
        line = json.dumps(event, default=str)
        with self._lock:  # one lock: the file and the memory keep events in the same order
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()  # a follower sees whole lines as they happen
            self._keep(event)
        log.log(logging.INFO if kind in NOTABLE else logging.DEBUG, line)
        return event

    def add(self, event: dict) -> None:
        """Keep an event read back from a file and hand it to the listeners."""
        self._check(event)
        with self._lock:
            self._keep(event)

    def _check(self, event: dict) -> None:
        unknown = set(event.get("counted", ())) - set(self.counts)
        if unknown:
            raise ValueError(f"event counts unknown totals {sorted(unknown)}")

    def _keep(self, event: dict) -> None:
        """Under the lock: remember, count, tell the listeners."""
        self.events.append(event)
        for name in event.get("counted", ()):
            self.counts[name] += 1
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a view of the run must never stop the run
                log.exception("event listener failed on %s", event.get("kind"))

    def since(self, index: int) -> list[dict]:
        """The events from `index` on (a follower's cursor)."""
        with self._lock:
            return self.events[index:]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The whole lines of an events file from byte `offset`, and the offset after them. A line
    still being written is left for the next read; a line that is not an event is skipped."""
    events = []
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for raw in data[:end].splitlines():
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("kind"), str):
            events.append(event)
    return events, offset + end


def follow(path: Path, into: EventLog, stop: threading.Event, every_s: float = 0.5) -> None:
    """Feed `into` with the events appended to `path` (which may not exist yet) until `stop`."""
    offset = 0
    while True:
        if path.exists():
            events, offset = read_events(path, offset)
            for event in events:
                try:
                    into.add(event)
                except ValueError as err:
                    log.warning("skipped an event in %s: %s", path, err)
        if stop.wait(every_s):
            return
