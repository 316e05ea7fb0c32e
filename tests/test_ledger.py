"""Each node's contribution counted from the run's events (fedrl.ledger): by hand, and as a
property over any sequence of events. On a real run: tests/test_coordinator.py (a node whose
updates are refused for their direction)."""

from hypothesis import given
from hypothesis import strategies as st

from fedrl.ledger import accepted, entry, ledger


def test_each_kind_of_event_counts_where_the_ledger_says():
    events = [
        {"kind": "eval", "version": 0, "value": 0.7},  # no node: not a node's
        {"kind": "joined", "node": 7, "client": 0},
        {"kind": "joined", "node": 9, "client": 1},
        {"kind": "reply", "node": 7, "client": 0, "steps": 3},
        {"kind": "accepted", "node": 7, "client": 0, "samples": 96},
        {"kind": "reply", "node": 7, "client": 0, "steps": 3},
        {"kind": "rejected", "node": 7, "client": 0, "cause": "norm"},
        {"kind": "error", "node": 7, "reason": "dropped out"},
        {"kind": "lost", "node": 7, "reason": "no reply within the watchdog"},
        {"kind": "rejected", "node": 7, "client": 0, "cause": "norm"},
        {"kind": "rejected", "node": 7, "client": 0, "cause": "direction"},
        {"kind": "accepted", "node": 7, "client": 0, "samples": 64, "weight": 0.31},
        # merged at weight 0 (it leaned away from the probe's answers): accepted, credited nothing
        {"kind": "accepted", "node": 7, "client": 0, "samples": 128, "weight": 0.0},
        {"kind": "version", "version": 1, "updates": 3},
    ]
    assert ledger(events) == {
        "7": {
            "client": 0,
            "replies": 2,
            "accepted": 3,
            "refused": {"norm": 2, "direction": 1},
            "errors": 1,
            "lost": 1,
            "samples": 160,
            "weightless": 1,
        },
        # a node that joined and did nothing yet is in the ledger, at zero
        "9": dict(client=1, replies=0, accepted=0, refused={}, errors=0, lost=0, samples=0, weightless=0),
    }


KINDS = ("reply", "accepted", "rejected", "error", "lost", "joined", "left", "version", "eval")
event = st.builds(
    lambda kind, node, cause, samples, weight: dict(
        kind=kind, node=node, cause=cause, samples=samples, weight=weight
    ),
    st.sampled_from(KINDS),
    st.integers(0, 5),
    st.sampled_from(("norm", "direction", "staleness", "patch")),
    st.integers(0, 1000),
    st.sampled_from((0.0, 0.25, 1.0)),
)


@given(st.lists(event, max_size=60))
def test_the_ledger_adds_up_to_the_runs_totals(events):
    rows = ledger(events)
    count = lambda kind: sum(e["kind"] == kind for e in events)  # noqa: E731
    assert sum(r["accepted"] for r in rows.values()) == count("accepted")
    assert sum(sum(r["refused"].values()) for r in rows.values()) == count("rejected")
    assert sum(r["replies"] for r in rows.values()) == count("reply")
    assert sum(r["errors"] + r["lost"] for r in rows.values()) == count("error") + count("lost")
    merged = [e for e in events if e["kind"] == "accepted"]
    assert sum(r["samples"] for r in rows.values()) == sum(e["samples"] for e in merged if e["weight"] > 0)
    assert sum(r["weightless"] for r in rows.values()) == sum(e["weight"] == 0 for e in merged)
    # every node that answered, was refused or joined has a row; no other does
    counted = {"reply", "accepted", "rejected", "error", "lost", "joined"}
    assert set(rows) == {str(e["node"]) for e in events if e["kind"] in counted}


def test_accepted_uploads_read_with_those_at_weight_0():
    assert accepted(entry() | {"accepted": 3}) == "3"
    assert accepted(entry() | {"accepted": 3, "weightless": 1}) == "3 (1 at weight 0)"
    published_before = {k: v for k, v in entry().items() if k != "weightless"} | {"accepted": 2}
    assert accepted(published_before) == "2"  # a row from a coordinator that did not count them
