"""`fedrl sim --scenario NAME|FILE`: a real Flower simulation (Ray) of the coordinator and
ClientApps, with a live status line, then summary.json, PNG plots and report.html."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from fedrl.arguments import parse_overrides
from fedrl.ports import check_port_free, free_port
from fedrl.sim.simulated_server import SimConfig, split_config
from fedrl.strategies.run_config import RunConfig


def simulate(
    cfg: RunConfig, sim: SimConfig, num_clients: int, quiet: bool = False, engine: str = "ray"
) -> dict:
    """Run the coordinator and `num_clients` simulated ClientApps: engine "ray" under Flower's
    run_simulation, "local" in this process (see fedrl.sim.local_grid)."""
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from fedrl.sim.apps import client_app

    bar, progress = status_bar(cfg, sim, quiet)
    if engine == "local":
        from fedrl.sim.local_grid import LocalGrid
        from fedrl.sim.simulated_server import run_simulated

        try:
            return run_simulated(LocalGrid(num_clients, client_app), cfg, sim, progress)
        finally:
            bar.close()
    if engine != "ray":
        raise ValueError(f"engine must be ray or local, got {engine!r}")
    from flwr.simulation import run_simulation

    from fedrl.sim.apps import make_server_app

    # Virtual-clock clients never sleep, so one Ray worker per core serves every node in turn;
    # on the real clock slow clients sleep, and a fractional CPU lets every client hold a worker.
    num_cpus = 1.0 if sim.clock == "virtual" else 2 / num_clients
    results: list[dict] = []
    with handlers_kept(signal.SIGTERM, signal.SIGINT), warnings.catch_warnings():
        # Ray's tip that it will stop hiding GPUs from workers that ask for none: nothing to act on
        warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
        try:
            run_simulation(
                server_app=make_server_app(cfg, sim, progress, results),
                client_app=client_app,
                num_supernodes=num_clients,
                backend_config=ray_backend(num_cpus),
            )
        finally:
            bar.close()
    if not results:
        raise RuntimeError("the simulation ended without a summary (see the log above)")
    return results[0]


@contextlib.contextmanager
def handlers_kept(*signums: int) -> Iterator[None]:
    """Puts back the caller's handlers of `signums` afterwards: `ray.init` installs a SIGTERM
    handler of its own (it exits) in the process that starts Ray and leaves it there after the
    simulation, so a program that ran one in-process lost its own."""
    kept = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            for signum, handler in kept.items():
                if handler is not None:  # None: set outside Python, nothing to put back
                    signal.signal(signum, handler)


def status_bar(cfg: RunConfig, sim: SimConfig, quiet: bool = False, file=None) -> tuple[tqdm, Callable]:
    """The run's live status line and the callback that redraws it from the coordinator, once
    per call: in a log file each state reads once."""
    budgets = f"{cfg.versions} versions" + (f" or {cfg.max_time_s:g} {sim.clock} s" if cfg.max_time_s else "")
    budgets += f" or {cfg.max_wall_s:g} wall s" if cfg.max_wall_s else ""
    bar = tqdm(
        total=100,
        desc=f"fedrl sim {cfg.mode}{' sync' if cfg.sync else ' async'} ({budgets})",
        unit="%",
        disable=quiet,
        file=file,
        bar_format="{l_bar}{bar}| {elapsed} {postfix}",
    )

    def progress(coord) -> None:
        last = coord.evals[-1]["error"] if coord.evals else float("nan")
        done = coord.version / cfg.versions
        if cfg.max_time_s:
            done = max(done, coord.run_time() / cfg.max_time_s)
        if cfg.max_wall_s:
            done = max(done, (time.monotonic() - coord.wall_start) / cfg.max_wall_s)
        bar.n = min(100, int(100 * done))
        bar.set_postfix(
            version=coord.version,
            t=f"{coord.run_time():.1f}s",
            replies=coord.counts["replies"],
            rejected=coord.counts["rejected"],
            eval_error=f"{last:.3f}",
            refresh=False,  # the one refresh below draws it: two would print each state twice
        )
        bar.refresh()

    return bar, progress


def ray_backend(cpus_per_client: float) -> dict:
    return {
        "client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": 2,
            "include_dashboard": False,
            "logging_level": "error",
            "log_to_driver": False,
        },
    }


def main(args) -> int:
    from fedrl.sim.report import write_report
    from fedrl.sim.scenario import load_scenario
    from fedrl.strategies.best_adapter import best_adapter_note

    if args.list:
        from fedrl.sim.scenario import shipped

        for name in shipped():
            print(f"{name:18} {load_scenario(name).description}")
        return 0
    scenario = load_scenario(args.scenario)
    clients = args.clients or scenario.clients
    overrides = parse_overrides(args.set)
    base, sim = split_config({**scenario.config.model_dump(), **scenario.sim.model_dump(), **overrides})
    seeds = [base.seed] if "seed" in overrides else list(scenario.seeds)  # else `--set seed` was lost
    out = Path(args.out or f"runs/sim-{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"scenario {scenario.name}: {scenario.description} ({clients} clients, seeds {seeds})")
    if args.dashboard is not None:
        if args.dashboard:  # taken: refused here, not once Ray is up (18 s in) after the link is printed
            check_port_free(base.monitor_host, args.dashboard)
        base = base.replace(monitor_port=args.dashboard or free_port(base.monitor_host))
        host = "127.0.0.1" if base.monitor_host == "0.0.0.0" else base.monitor_host
        url = f"http://{host}:{base.monitor_port}"
        print(f"live dashboard: {url}/dashboard  metrics: {url}/metrics", flush=True)
    out.mkdir(parents=True, exist_ok=True)  # a path that cannot be a folder fails here, not once Ray is up
    for seed in seeds:
        run_out = out / f"seed-{seed}" if len(seeds) > 1 else out
        cfg = base.replace(out_dir=str(run_out), min_nodes=clients, seed=seed)
        start = time.perf_counter()
        summary = simulate(cfg, sim, clients, engine=args.engine)
        summary["scenario"] = {"name": scenario.name, "description": scenario.description, "clients": clients}
        files = write_report(summary, run_out)
        print(
            json.dumps(
                {
                    k: summary[k]
                    for k in (
                        "initial_eval",
                        "final_eval",
                        "versions",
                        "rounds",
                        "bytes_up",
                        "bytes_down",
                        "clock",
                        "time_s",
                    )
                }
                # why it stopped before its versions (a stalled run: every reply an error or refused)
                | ({"stop_reason": summary["stop_reason"]} if summary["stop_reason"] else {})
            )
        )
        print(
            f"wrote {run_out / 'report.html'} ({', '.join(p.name for p in files)}) in "
            f"{time.perf_counter() - start:.0f} s; the adapter: fedrl eval --adapter {summary['adapter_dir']}"
        )
        if note := best_adapter_note(summary):
            print(note)
        if args.dashboard is not None:
            print(f"the dashboard closed with the run; `fedrl dashboard {run_out}` serves it again")
    return 0
