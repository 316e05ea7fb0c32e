"""What end-to-end tests of something else may find refused in an honest run.

The direction check (strategies/direction.py) by default is a z-test of each client's cosines
with the probe's reference direction, refused below -1.5 and re-tested at every update: a
client whose first few honest updates happen to lean away is refused now and then. In the short
runs of the process tests (3 nodes, 9-13 updates, honest cosines about +0.02 with spread 0.08,
as measured in the deployment test) a simulation of that rule on such cosines refused at least
one update in 10-13% of runs (`direction_test = "sequential"` bounds it; 0.3% there). Every
other cause (staleness, rollback, patch, store, norm, samples, ...) says something went wrong."""

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
