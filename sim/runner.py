"""`fedrl sim`: a real Flower simulation (Ray) of the coordinator and ClientApps, with a live
status line, then summary.json and PNG plots in the output folder."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm import tqdm

from fedrl.strategies.run_config import RunConfig

# The embedded default: 8 volunteers, compute speed spread 3x, upload 50-400 kB/s.
DEFAULT_PROFILES = [
    {"speed": 1.0, "up_bytes_s": 400e3, "down_bytes_s": 1600e3, "latency_s": 0.02},
    {"speed": 1.0, "up_bytes_s": 200e3, "down_bytes_s": 800e3, "latency_s": 0.05},
    {"speed": 0.7, "up_bytes_s": 100e3, "down_bytes_s": 400e3, "latency_s": 0.05},
    {"speed": 0.7, "up_bytes_s": 400e3, "down_bytes_s": 1600e3, "latency_s": 0.02},
    {"speed": 0.5, "up_bytes_s": 50e3, "down_bytes_s": 200e3, "latency_s": 0.1},
    {"speed": 0.5, "up_bytes_s": 200e3, "down_bytes_s": 800e3, "latency_s": 0.05},
    {"speed": 0.35, "up_bytes_s": 100e3, "down_bytes_s": 400e3, "latency_s": 0.1},
    {"speed": 0.35, "up_bytes_s": 50e3, "down_bytes_s": 200e3, "latency_s": 0.2},
]
DEFAULT_CONFIG = RunConfig(min_nodes=8, profiles=json.dumps(DEFAULT_PROFILES))


def simulate(cfg: RunConfig, num_clients: int, quiet: bool = False) -> dict:
    """Run the ServerApp and `num_clients` ClientApps under flwr.simulation.run_simulation."""
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from flwr.simulation import run_simulation

    from fedrl.clients.client_app import app as client_app
    from fedrl.strategies.server_app import make_server_app

    bar = tqdm(total=cfg.versions, desc=f"fedrl sim {cfg.mode}{' sync' if cfg.sync else ' async'}",
               unit="version", disable=quiet)

    def progress(coord) -> None:
        last = coord.evals[-1]["error"] if coord.evals else float("nan")
        bar.n = min(coord.version, cfg.versions)
        bar.set_postfix(replies=coord.counts["replies"], rejected=coord.counts["rejected"], eval_error=f"{last:.3f}")
        bar.refresh()

    results: list[dict] = []
    run_simulation(
        server_app=make_server_app(cfg, progress, results),
        client_app=client_app,
        num_supernodes=num_clients,
        # A fractional CPU per client lets every client hold a Ray worker at once; simulated slow
        # clients sleep rather than spin, and each worker uses one torch thread.
        backend_config={"client_resources": {"num_cpus": 2 / num_clients, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "include_dashboard": False, "logging_level": "error",
                                      "log_to_driver": False}},
    )
    bar.close()
    if not results:
        raise RuntimeError("the simulation ended without a summary (see the log above)")
    return results[0]


def main(args) -> int:
    from fedrl.sim.report import write_report

    cfg = DEFAULT_CONFIG
    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            overrides[key.replace("-", "_")] = json.loads(value)
        except ValueError:  # a bare string such as mode=fedavg-lora
            overrides[key.replace("-", "_")] = value
    if overrides:
        cfg = RunConfig.from_mapping({**cfg.__dict__, **overrides})
    out = Path(args.out or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = cfg.replace(out_dir=str(out), min_nodes=args.clients)
    start = time.perf_counter()
    summary = simulate(cfg, args.clients)
    plots = write_report(summary, out)
    print(json.dumps({k: summary[k] for k in ("initial_eval", "final_eval", "versions", "rounds", "bytes_up",
                                              "bytes_down", "wall_s")}))
    print(f"wrote {out / 'summary.json'} and {', '.join(p.name for p in plots)} in {time.perf_counter() - start:.0f} s")
    return 0
