"""The Flower ServerApp of a real deployment: reads the run config and runs the coordinator
on the wall clock (the simulation has its own: fedrl.sim.apps)."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedrl.strategies.coordinator import run_coordinator
from fedrl.strategies.progress_log import ProgressLog, finished_line, log, start_log
from fedrl.strategies.run_config import RunConfig


def make_server_app(cfg: RunConfig | None = None, progress=None, results: list | None = None) -> ServerApp:
    """A ServerApp bound to `cfg` (for `run_simulation`), or reading `context.run_config` (`flwr run`)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = (cfg or RunConfig.from_mapping(context.run_config)).in_run(context.run_id)
        if cfg is None:  # a deployment: its progress and notable events go to the ServerApp's log
            start_log()
        summary = run_coordinator(grid, config, progress=progress if cfg is not None else ProgressLog())
        if results is not None:
            results.append(summary)
        if cfg is None:
            log.info(finished_line(summary, f"summary in {Path(config.out_dir).resolve() / 'summary.json'}"))

    return app


app = make_server_app()
