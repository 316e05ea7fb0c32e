"""Prometheus metrics of a run, built from its events alone (fedrl.run_events), so a live
coordinator and `fedrl dashboard RUN_DIR` replaying a file answer `/metrics` alike."""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fedrl.run_events import COUNTS

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


def _amount(x) -> float:
    """What a client reported, as a counter increment: a finite number >= 0, else nothing
    (replies are range-checked elsewhere; a counter must never go down or turn NaN)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) and x > 0 else 0.0


class RunMetrics:
    """Listen to an EventLog (`log.listeners.append(metrics.observe)`); render with `text()`."""

    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.version = Gauge("fedrl_version", "Current global version", registry=r)
        self.heldout = Gauge("fedrl_heldout_metric", "Last held-out evaluation", ["metric"], registry=r)
        self.totals = {
            name: Counter(f"fedrl_{name}", f"Run total: {name}", registry=r)
            for name in COUNTS
            if name != "rejected"
        }
        self.rejected = Counter("fedrl_rejected", "Rejected updates by cause", ["cause"], registry=r)
        # each client's ledger (fedrl.ledger): its uploads accepted, and refused by cause
        self.uploads = Counter(
            "fedrl_client_uploads",
            "A client's uploads: accepted, or the cause refused",
            ["client", "outcome"],
            registry=r,
        )
        self.staleness = Histogram(
            "fedrl_update_staleness", "Staleness of accepted updates", buckets=STALENESS_BUCKETS, registry=r
        )
        self.bytes = Counter("fedrl_bytes", "Bytes moved by clients", ["direction", "client"], registry=r)
        self.seconds = Counter("fedrl_client_seconds", "Client time by kind", ["kind", "client"], registry=r)
        self.last_seen = Gauge(
            "fedrl_client_last_seen_timestamp_seconds",
            "Wall time of a client's last reply",
            ["client"],
            registry=r,
        )
        self.clipped = Counter("fedrl_clipped_updates", "Updates scaled down to the norm bound", registry=r)
        self.nodes = Gauge("fedrl_nodes_present", "Nodes taking part now", registry=r)
        self.store_objects = Gauge("fedrl_store_objects", "Objects in the patch store", registry=r)
        self.store_bytes = Gauge("fedrl_store_bytes", "Bytes held by the patch store", registry=r)
        self.checkpoint_version = Gauge(
            "fedrl_checkpoint_version", "Version of the last checkpoint", registry=r
        )
        self.checkpoint_wall: float | None = None
        Gauge(
            "fedrl_checkpoint_age_seconds",
            "Seconds since the last checkpoint was written (-1: none yet)",
            registry=r,
        ).set_function(lambda: -1.0 if self.checkpoint_wall is None else time.time() - self.checkpoint_wall)

    def observe(self, e: dict) -> None:
        self.version.set(e.get("version", 0))
        for name in e.get("counted", ()):
            if name == "rejected":
                self.rejected.labels(e.get("cause", "other")).inc()
            else:
                self.totals[name].inc()
        kind = e["kind"]
        if kind in ("accepted", "rejected"):  # an events file of before stop 73 names no client: "-"
            self.uploads.labels(str(e.get("client", "-")), e.get("cause", "accepted")).inc()
        if kind == "eval":
            self.heldout.labels(e["metric"]).set(e["value"])
        elif kind == "accepted":
            self.staleness.observe(e["staleness"])
        elif kind == "reply":
            client = str(e["client"])
            self.bytes.labels("up", client).inc(_amount(e["bytes_up"]))
            self.bytes.labels("down", client).inc(_amount(e["bytes_down"]))
            for part in ("compute", "comm", "overlap"):
                self.seconds.labels(part, client).inc(_amount(e[f"{part}_s"]))
            self.last_seen.labels(client).set(e["wall"])
        elif kind == "joined":
            self.nodes.inc()
        elif kind == "left":
            self.nodes.dec()
        elif kind == "version":
            self.clipped.inc(_amount(e.get("clipped", 0)))
            if "store_objects" in e:
                self.store_objects.set(e["store_objects"])
                self.store_bytes.set(e["store_bytes"])
        elif kind == "checkpoint":
            self.checkpoint_version.set(e["saved_version"])
            self.checkpoint_wall = e["wall"]

    def text(self) -> bytes:
        return generate_latest(self.registry)
