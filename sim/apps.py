"""The Flower apps of a simulation: the real ClientApp behind the simulation's mod, and a
ServerApp that runs the real coordinator inside the simulation (fedrl.sim.simulated_server).
`flwr run .` uses these (pyproject's [tool.flwr.app.components]); `fedrl sim` builds them
with its scenario's settings.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedrl.clients.client_app import make_client_app
from fedrl.sim.report import write_report
from fedrl.sim.simulated_client import simulated_client
from fedrl.sim.simulated_server import SimConfig, run_simulated, split_config
from fedrl.strategies.progress_log import ProgressLog, finished_line, log, start_log
from fedrl.strategies.run_config import RunConfig

client_app = make_client_app(mods=[simulated_client])


def make_server_app(
    cfg: RunConfig | None = None, sim: SimConfig | None = None, progress=None, results: list | None = None
) -> ServerApp:
    """Bound to `cfg` and `sim` (`fedrl sim`), or reading Flower's run config (`flwr run`),
    in which case it also logs its progress and writes the report."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if cfg is None:
            start_log()
        run_cfg, sim_cfg = (cfg, sim) if cfg is not None else split_config(context.run_config)
        run_cfg = run_cfg.in_run(context.run_id)
        hook = progress if cfg is not None else ProgressLog()
        summary = run_simulated(grid, run_cfg, sim_cfg or SimConfig(), hook)
        if results is not None:
            results.append(summary)
        else:
            out = Path(run_cfg.out_dir)
            write_report(summary, out)
            # absolute: a relative out-dir is the SuperLink's working directory's, which `flwr run`
            # keeps from the first run it started the SuperLink for
            files = (
                f"report {out.resolve() / 'report.html'}, adapter {Path(summary['adapter_dir']).resolve()}"
            )
            log.info(finished_line(summary, files))

    return app


server_app = make_server_app()
