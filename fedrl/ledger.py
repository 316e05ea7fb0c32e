"""Each node's contribution to a run, counted from the run's events alone (fedrl.run_events), so
that `summary.json`, the report and a replayed `events.jsonl` give the same figures.

Per node (keyed by node id, as the summary's `clients`), every count from one kind of event:
  client     the client id the coordinator gave it (kept when it leaves and comes back)
  replies    messages it answered with a report ("reply"): rounds done, whatever became of them
  accepted   uploads merged into the global adapter ("accepted")
  refused    uploads refused, by cause ("rejected": norm, direction, staleness, patch, ...)
  errors     messages that came back as an error ("error": it dropped out, ran out of memory or
             crashed, or the SuperLink could not deliver the message)
  lost       messages with no answer before their deadline ("lost")
  samples    rollouts behind its accepted uploads, as its reports gave them (each checked against
             the round's maximum, max-steps x prompts x samples, before it is accepted), but for
             those merged at weight 0 (the direction check's weight of an update that leans
             away from the probe's answers): they added nothing to the global adapter
  weightless accepted uploads merged at weight 0 (counted in `accepted` too)
An upload travels in the reply after the round that made it (a node's comm thread pushes its
last delta while the next round computes), and a refusal is decided when its reply is handled,
so `accepted` + `sum(refused)` counts uploads, not replies. Bytes and seconds per node are in
the summary's `clients` rows.
"""

from __future__ import annotations

from collections.abc import Iterable

COUNTED = {"reply": "replies", "accepted": "accepted", "error": "errors", "lost": "lost"}
KINDS = (*COUNTED, "rejected", "joined")


def entry() -> dict:
    return {
        "client": None,
        "replies": 0,
        "accepted": 0,
        "refused": {},
        "errors": 0,
        "lost": 0,
        "samples": 0,
        "weightless": 0,
    }


class Ledger:
    """The rows kept up to date one event at a time (a listener of the run's EventLog), and
    which nodes' rows changed since `take_changed` was last asked (what the coordinator
    publishes to the patch store, where each node reads its own row)."""

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.changed: set[str] = set()

    def observe(self, e: dict) -> None:
        kind = e["kind"]
        if "node" not in e or kind not in KINDS:
            return
        node = str(e["node"])
        row = self.rows.setdefault(node, entry())
        self.changed.add(node)
        if "client" in e:
            row["client"] = e["client"]
        if kind in COUNTED:
            row[COUNTED[kind]] += 1
        if kind == "rejected":
            row["refused"][e["cause"]] = row["refused"].get(e["cause"], 0) + 1
        elif kind == "accepted" and e.get("weight", 1) == 0:
            row["weightless"] += 1
        elif kind == "accepted":
            row["samples"] += e.get("samples", 0)

    def take_changed(self) -> dict[str, dict]:
        changed, self.changed = {node: self.rows[node] for node in sorted(self.changed)}, set()
        return changed


def accepted(row: dict) -> str:
    """A row's accepted uploads as people read them: "3", or "3 (1 at weight 0)"."""
    weightless = row.get("weightless", 0)  # rows published before it was counted lack it
    return f"{row['accepted']} ({weightless} at weight 0)" if weightless else str(row["accepted"])


def refusals(row: dict) -> str:
    """A row's refusals by cause, as people read them: "1 direction, 2 norm" ("" for none)."""
    return ", ".join(f"{n} {cause}" for cause, n in sorted(row["refused"].items()))


def ledger(events: Iterable[dict]) -> dict[str, dict]:
    book = Ledger()
    for e in events:
        book.observe(e)
    return book.rows
