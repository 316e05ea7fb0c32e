"""`fedrl bench scale`: how the coordinator copes with many virtual clients on this machine.

Each case runs parablock-async rounds for N `mixed-volunteers` clients on the virtual clock,
in a fresh process (so its peak RSS is its own), with the ClientApps in-process
(fedrl.sim.local_grid). The coordinator's CPU is the process's CPU over the coordinator loop
minus the CPU spent while ClientApps ran and on held-out evaluations; overhead = that CPU /
virtual seconds simulated. The clock charges each local step the time of the default
scenario's step (8 prompts x 8 samples on tiny-base, measured here), while the clients run
2 x 4 rollouts to keep the real cost of 1,000 clients down.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import tempfile
import time

from fedrl.arguments import POSITIVE, SECONDS, integer
from fedrl.bench.common import write_json


def add_arguments(parser) -> None:
    parser.add_argument(
        "--clients", type=integer(1), nargs="+", help="cases (default 10 100 1000; quick 10 100)"
    )
    parser.add_argument(
        "--messages-per-client", type=POSITIVE, default=2.0, help="work per case, in messages per client"
    )
    parser.add_argument(
        "--step-s",
        type=SECONDS,
        default=0.0,
        help="virtual seconds per local step (0: the default scenario's step, measured here)",
    )


def run_case(case: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from fedrl.sim.apps import client_app
    from fedrl.sim.local_grid import LocalGrid
    from fedrl.sim.simulated_server import SimConfig, run_simulated
    from fedrl.strategies.run_config import RunConfig

    n = case["clients"]
    buffer = max(2, n // 5)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(
            mode="parablock",
            sync=False,
            model="tiny-base",
            task="reversal",
            task_params=json.dumps({"length": 8, "num_eval": 16}),
            prompts=2,
            samples=4,
            base_steps=2,
            min_steps=1,
            max_steps=4,
            buffer_size=buffer,
            versions=max(2, int(case["messages_per_client"] * n / buffer)),
            max_staleness=50,
            deadline_s=60.0,
            eval_every=10**9,
            anchor_every=10,
            min_nodes=n,
            out_dir=tmp,
            stall_replies=10**9,
        )
        grid = LocalGrid(n, client_app)
        wall0 = time.perf_counter()
        summary = run_simulated(grid, cfg, SimConfig(profiles="mixed-volunteers", step_s=case["step_s"]))
        wall = time.perf_counter() - wall0
    cpu = summary["loop"]["cpu_s"] - grid.client_cpu_s  # ClientApps run inside the coordinator's thread here
    virtual_s = summary["loop"]["time_s"]
    messages = summary["counts"]["replies"]
    return {
        "clients": n,
        "messages": messages,
        "versions": summary["versions"],
        "counts": summary["counts"],
        "coordinator_cpu_ms_per_msg": 1e3 * cpu / max(1, messages),
        "coordinator_overhead": cpu / max(virtual_s, 1e-9),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "virtual_s": virtual_s,
        "wall_s": wall,
        "step_s": summary["simulation"]["step_s"],
        # the whole run on both clocks (the drain waits out lost messages' deadlines in virtual time)
        "wall_s_per_virtual_hour": wall / max(summary["time_s"], 1e-9) * 3600,
        "client_cpu_s": grid.client_cpu_s,
    }


def default_step_s() -> float:
    from fedrl.sim.simulated_server import calibrate_step_s
    from fedrl.strategies.run_config import RunConfig

    return calibrate_step_s(RunConfig())


def main(args) -> int:
    import torch

    torch.set_num_threads(1)
    sizes = args.clients or ([10, 100] if args.quick else [10, 100, 1000])
    messages = 1.0 if args.quick else args.messages_per_client
    start = time.perf_counter()
    step_s = args.step_s or default_step_s()
    print(f"[scale] the virtual clock charges {step_s:.3f} s per local step at speed 1")
    cases = []
    for n in sizes:
        print(f"[scale] {n} clients ...", flush=True)
        with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a fresh process: its own peak RSS
            case = pool.apply(run_case, ({"clients": n, "step_s": step_s, "messages_per_client": messages},))
        cases.append(case)
        print(
            f"  {case['messages']} messages, coordinator "
            f"{case['coordinator_cpu_ms_per_msg']:.1f} ms CPU/message "
            f"({100 * case['coordinator_overhead']:.2f}% of {case['virtual_s']:.0f} virtual s), "
            f"peak RSS {case['peak_rss_mb']:.0f} MB, "
            f"{case['wall_s_per_virtual_hour']:.0f} wall s per virtual hour"
        )
    out = write_json(
        {"benchmark": "scale", "quick": args.quick, "wall_s": time.perf_counter() - start, "cases": cases},
        args.out,
    )
    plot(cases, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(cases: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [c["clients"] for c in cases]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in zip(
        axes,
        ("coordinator_cpu_ms_per_msg", "peak_rss_mb", "coordinator_overhead"),
        ("coordinator CPU ms / message", "peak RSS (MB)", "coordinator CPU / virtual time"),
    ):
        ax.plot(n, [c[key] for c in cases], "o-")
        ax.set_xscale("log")
        ax.set_xlabel("virtual clients")
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
