"""A run's progress as log lines (one per held-out evaluation, then the result and where it is),
for the ServerApps whose output is a log: `flwr run . --stream` (the simulation) and `flwr run
fedrl/deploy/app ... --stream` or `flwr log` (a deployment). `fedrl sim` and `fedrl deploy local`
draw a live status line instead; under Flower's CLI the ServerApp's output is all its user sees,
and before stop 73 it said nothing at all."""

from __future__ import annotations

import logging

from fedrl.runtime_env import runtime_env_warning
from fedrl.strategies.best_adapter import best_adapter_note

log = logging.getLogger("fedrl.progress")


def start_log() -> None:
    """fedrl's INFO lines (this module's, and the notable events: refusals, errors, nodes that
    come and go) to the ServerApp's stderr, which Flower streams and keeps for `flwr log`; first
    a warning if the run imports packages Flower installed for it (fedrl.runtime_env)."""
    logger = logging.getLogger("fedrl")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    if warning := runtime_env_warning():
        log.warning(f"fedrl: {warning}")


def eval_line(evaluation: dict, versions: int, clock: str, replies: int, refused: int) -> str:
    return (
        f"fedrl: version {evaluation['version']} of {versions}: held-out error {evaluation['error']:.3f} "
        f"at {evaluation['t']:.1f} s on the {clock} clock ({replies} replies, {refused} refused)"
    )


class ProgressLog:
    """The coordinator's `progress` hook (called after each version, and once more after the final
    evaluation): a line for each held-out evaluation made since the last call."""

    def __init__(self):
        self.logged = 0

    def __call__(self, coord) -> None:
        clock, counts = "virtual" if coord.clock.virtual else "real", coord.counts
        for evaluation in coord.evals[self.logged :]:
            log.info(eval_line(evaluation, coord.cfg.versions, clock, counts["replies"], counts["rejected"]))
        self.logged = len(coord.evals)


def finished_line(summary: dict, results: str) -> str:
    stopped = f" (stopped early: {summary['stop_reason']})" if summary.get("stop_reason") else ""
    best = f"; {note}" if (note := best_adapter_note(summary)) else ""
    return (
        f"fedrl: finished: held-out error {summary['initial_eval']:.3f} -> {summary['final_eval']:.3f} "
        f"in {summary['versions']} versions, {summary['time_s']:.1f} s on the {summary['clock']} clock"
        f"{stopped}; {results}{best}"
    )
