"""The run's adapter at its lowest held-out error, kept beside the final one.

An async federation's held-out curve can swing: from scratch at the papers' step size a run
that stood at 0.094 read 0.797 once the replies still in flight were merged into its last
version (docs/federated-methods.md). The final adapter is what the run ended with; this one is
the version a user would rather deploy. Its error was measured on the same held-out set that
chose it, so it flatters the adapter: `final_set_eval` (a larger set) is for the final one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedrl.adapter_record import RECORD, read_record, write_record


class BestAdapter:
    """PEFT files and a fedrl record (its `version` and `best_eval`) in `directory`, rewritten
    whenever an evaluation beats the best so far. The record goes first and comes back last, so
    a record always describes the weights beside it, even after a kill mid-write."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.error: float | None = None
        self.version: int | None = None

    def resume(self) -> None:
        """Take the bar from what an earlier life of this run kept (none: the next eval sets it)."""
        try:
            record = read_record(self.directory)
        except ValueError:  # a garbled record describes nothing: the next eval rewrites it
            return
        error, version = record.get("best_eval"), record.get("version")
        if isinstance(error, float | int) and isinstance(version, int):
            self.error, self.version = float(error), version

    def offer(self, error: float, version: int, save: Callable[[Path], None], record: dict) -> bool:
        """Keep the adapter that `save` writes into a folder if `error` is the lowest yet (ties
        keep the earlier version); whether it was kept."""
        if self.error is not None and error >= self.error:
            return False
        (self.directory / RECORD).unlink(missing_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        save(self.directory)
        write_record(self.directory, **record, version=version, best_eval=error)
        self.error, self.version = error, version
        return True

    def summary(self) -> dict | None:
        if self.error is None:
            return None
        return {"version": self.version, "error": self.error, "adapter_dir": str(self.directory)}


def best_adapter_note(summary: dict) -> str | None:
    """The line that tells a run's user where its best adapter is, when the final version did not
    evaluate best (else the final adapter is the one to take, and there is nothing to say)."""
    best = summary.get("best_adapter")
    if not best or best["version"] == summary["versions"]:
        return None
    lowest = f"{best['error']:.3f} at v{best['version']}"
    return f"the held-out error was lowest, {lowest}, in the adapter {best['adapter_dir']}"
