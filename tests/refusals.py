"""What end-to-end tests of something else may find refused in an honest run.

The direction check (strategies/direction.py) refuses a client while the likelihood ratio of
its cosines with the probe's reference direction leaning away, against sitting at the bar, is
20 or more: an honest client at the bar is ever refused with a chance of at most 5%, and one
that leans toward the answers less. In the short runs of the process tests (3 nodes, 9-13
updates, honest cosines about +0.02 with spread 0.08, as measured in the deployment test) that
is rare (simulated, one client's 13 updates at +0.02: 0.3%; the z-test before stop 75: 10%), but
not impossible, so these tests let it pass. Every other cause (staleness, rollback, patch,
store, norm, samples, ...) says something went wrong."""

BY_CHANCE = "direction"


def refused_by_cause(summary: dict) -> dict[str, int]:
    """Every life's refusals of a run, by cause (its ledger, which a resumed run carries on)."""
    causes: dict[str, int] = {}
    for row in summary["ledger"].values():
        for cause, n in row["refused"].items():
            causes[cause] = causes.get(cause, 0) + n
    return causes


def refused_not_by_chance(summary: dict) -> dict[str, int]:
    return {cause: n for cause, n in refused_by_cause(summary).items() if cause != BY_CHANCE}
