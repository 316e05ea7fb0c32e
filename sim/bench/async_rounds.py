"""`fedrl bench async`: time to a target held-out error, and bytes per client, for
synchronous FedAvg-LoRA (whole adapter both ways), synchronous block rounds, synchronous
parablock, asynchronous (FedBuff-style) parablock, and the same with top-k uploads and error
feedback (`--upload-density`: the uplink is sparse, and so the global changes and the
downlink are too), and FedBuff with top-k uploads (one block: every client trains the whole
adapter; on the tiny model it reaches a target sooner than three blocks), under the
`mixed-volunteers` profiles on the virtual clock. Every strategy gets the same clients, the
same virtual budget and the same unit of work (one calibration of step_s shared by all)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from fedrl.arguments import ERROR, POSITIVE, SECONDS, integer, number, parse_overrides
from fedrl.bench.common import add_workers_argument, run_cases, write_json
from fedrl.protocol import WIRE_DTYPES
from fedrl.sim.report import write_report
from fedrl.sim.runner import simulate
from fedrl.sim.simulated_server import SimConfig
from fedrl.strategies.run_config import RunConfig

STRATEGIES = {
    "fedavg-lora": dict(mode="fedavg-lora", sync=True),
    "block-sequential": dict(mode="block-sequential", sync=True),
    "parablock-sync": dict(mode="parablock", sync=True),
    "parablock-async": dict(mode="parablock", sync=False),
    "parablock-async-topk": dict(mode="parablock", sync=False),  # + upload_density from the command
    # buffered async rounds on one block, the whole adapter (FedBuff), + upload_density likewise
    "fedbuff-topk": dict(mode="parablock", sync=False, num_blocks=1),
}


def strategy_config(base: RunConfig, name: str, upload_density: float, blocks: int | None) -> RunConfig:
    """`base` run as strategy `name`: its settings, top-k uploads at `upload_density`, and
    `blocks` for the block strategies (fedbuff-topk keeps its one; fedavg-lora the base's)."""
    settings = STRATEGIES[name] | ({"upload_density": upload_density} if name.endswith("topk") else {})
    if blocks and STRATEGIES[name]["mode"] != "fedavg-lora":
        settings = {"num_blocks": blocks} | settings
    return base.replace(**settings)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--target", type=ERROR, default=0.3, help="held-out greedy error to reach (start: 0.69)"
    )
    parser.add_argument("--profile", default="mixed-volunteers", help="profile mix or file")
    parser.add_argument("--clients", type=integer(1), help="clients (default 12; quick 6)")
    parser.add_argument(
        "--budget-s", type=POSITIVE, help="virtual seconds per strategy (default 300; quick 12)"
    )
    parser.add_argument(
        "--deadline-s",
        type=POSITIVE,
        default=20.0,
        help="round deadline (virtual s) for stragglers and dropouts",
    )
    parser.add_argument(
        "--upload-density",
        type=number(float, 0.0, 1.0, above=True),
        default=0.05,
        help="parablock-async-topk: fraction of a block's entries each upload sends",
    )
    parser.add_argument(
        "--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES), help="which to run"
    )
    parser.add_argument(
        "--blocks",
        type=integer(1),
        help="blocks of the block strategies (not fedbuff-topk's one); fedavg-lora keeps the run "
        "config's, which its defenses split its updates into: `--set num_blocks=B` changes the "
        "reference too",
    )
    parser.add_argument(
        "--wire-dtype",
        choices=WIRE_DTYPES,
        default=RunConfig.model_fields["wire_dtype"].default,
        help="the dtype versions travel in, for every strategy (fedavg-lora's whole adapters too)",
    )
    add_step_s_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--engine", choices=["local", "ray"], default="local")
    add_workers_argument(parser)
    parser.add_argument(
        "--run-to-budget",
        action="store_true",
        help="run every strategy for the whole budget instead of stopping it at the target, so "
        "final errors compare at equal virtual time (time and bytes to the target are read where "
        "its curve first reaches it; 'stays from' is where it reached it for good)",
    )


def time_to_target(evals: list[dict], target: float) -> float | None:
    return next((e["t"] for e in evals if e["error"] <= target), None)


def seconds_text(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}s"


def time_to_stay(evals: list[dict], target: float) -> float | None:
    """When the held-out error reached `target` for good: the first eval from which every later
    one is at or below it; None if the last is above. `time_to_target` is the first crossing, which
    a noisy eval can make and then leave; with `--run-to-budget` this one says whether it held."""
    settled = None
    for e in evals:
        if e["error"] > target:
            settled = None
        elif settled is None:
            settled = e["t"]
    return settled


def bytes_to_target(evals: list[dict], target: float) -> int | None:
    """Bytes up and down (patches and Flower messages, all clients) when the held-out error first
    reached `target`, as the eval recorded them; None if it never did."""
    hit = next((e for e in evals if e["error"] <= target), None)
    return None if hit is None else hit["bytes_up"] + hit["bytes_down"]


def ratio_to_reference(ref: float | None, ref_bound: float, value: float | None) -> dict:
    """`ref / value`, or a lower bound (`ref_bound / value`, the reference's figure at the end of
    its budget) when the reference never got there; None when `value` never did."""
    if not value:
        return {"ratio": None, "lower_bound": False}
    return {"ratio": (ref or ref_bound) / value, "lower_bound": ref is None}


def add_step_s_argument(parser) -> None:
    parser.add_argument(
        "--step-s",
        type=SECONDS,
        default=0.0,
        help="seconds of one learner step at speed 1 (0: measured once, in the first run); fix it "
        "to compare invocations: the measurement follows the machine's load",
    )


def add_set_argument(parser) -> None:
    parser.add_argument(
        "--set",
        nargs="+",
        action="extend",
        metavar="KEY=VALUE",
        help="run config overrides for every run (e.g. the aggregation rule)",
    )


def bench_run_config(clients: int, budget: float, target: float, quick: bool, **settings) -> RunConfig:
    """What the federated benchmarks share: reversal H=8 from a base, every client needed, no
    version or stall limit; a run stops at the target error or after `budget` virtual seconds."""
    return RunConfig.parse(
        dict(
            task="reversal",
            task_params=json.dumps({"length": 8, "num_eval": 64 if quick else 256}),
            prompts=4 if quick else 8,
            samples=4 if quick else 8,
            versions=10_000,
            max_time_s=budget,
            buffer_size=max(2, clients // 2),
            max_staleness=8,
            min_nodes=clients,
            stall_replies=10_000,
            target_error=target,
            **settings,
        )
    )


def runs_dir(out: str | Path) -> Path:
    """Where each run's folder (summary, report, checkpoints) goes: a new one per invocation,
    beside the JSON, created here so that two invocations within one second never share it;
    nothing is deleted."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = f"{out.stem}-runs-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in itertools.count(1):
        path = out.parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def run_with_one_unit(run, case_for, keys: list, step_s: float | None, workers: int, desc: str):
    """`run(case_for(key, step_s))` for each key, in order: without a unit of work, the first run
    alone measures it and every later run takes it; then `workers` processes side by side, as
    virtual-clock runs with one unit give the same curves either way. `run` returns a dict with
    the "step_s" it used. Returns the results and the unit."""
    results = []
    if not step_s:
        results.append(run({**case_for(keys[0], None), "quiet": False}))
        step_s, keys = results[0]["step_s"], keys[1:]
    cases = [{**case_for(key, step_s), "quiet": workers > 1} for key in keys]
    return results + run_cases(run, cases, workers, desc), step_s


def side_by_side(workers: int, clock: str, engine: str) -> int:
    """Runs on the real clock share the cores, and Ray is one per machine: those go one at a time."""
    return workers if clock == "virtual" and engine == "local" else 1


def run_case(case: dict) -> dict:
    """One strategy: the federation simulated, its report written, its result row."""
    cfg, clients, target = case["cfg"], case["clients"], case["target"]
    if not case["quiet"]:
        print(f"[{case['name']}] {clients} clients, {cfg.max_time_s:g} virtual s", flush=True)
    s = simulate(cfg, case["sim"], clients, quiet=case["quiet"], engine=case["engine"])
    write_report(s, Path(cfg.out_dir))
    return {
        "name": case["name"],
        "time_to_target_s": time_to_target(s["evals"], target),
        "time_to_stay_s": time_to_stay(s["evals"], target),
        "bytes_to_target": per_client(bytes_to_target(s["evals"], target), clients),
        "final_eval": s["final_eval"],
        "initial_eval": s["initial_eval"],
        # per client: patches to and from the store plus Flower's messages (instructions
        # down, replies up), which carry a few hundred bytes each way every round
        "bytes_up": (s["bytes_up"] + s["control_bytes_up"]) / clients,
        "bytes_down": (s["bytes_down"] + s["control_bytes_down"]) / clients,
        "control_up": s["control_bytes_up"] / clients,
        "control_down": s["control_bytes_down"] / clients,
        "versions": s["versions"],
        "virtual_s": s["time_s"],
        "counts": s["counts"],
        "curve": [(e["t"], e["error"]) for e in s["evals"]],
        "step_s": s["simulation"]["step_s"],
    }


def main(args) -> int:
    clients = args.clients or (6 if args.quick else 12)
    budget = args.budget_s or (12.0 if args.quick else 300.0)
    sim = SimConfig(profiles=args.profile, clock="virtual")
    overrides = parse_overrides(args.set)
    base = bench_run_config(
        clients,
        budget,
        0.0 if args.run_to_budget else args.target,
        args.quick,
        model="tiny-base",
        lr=5e-4,
        deadline_s=args.deadline_s,
        eval_every=2 if args.quick else 1,
        seed=args.seed,
        wire_dtype=args.wire_dtype,
    ).replace(**overrides)
    start = time.perf_counter()
    runs = runs_dir(args.out)
    names = ["fedavg-lora"] + [n for n in args.strategies if n != "fedavg-lora"]  # the reference runs first

    def case_for(name: str, step_s: float | None) -> dict:
        cfg = strategy_config(base, name, args.upload_density, args.blocks)
        cfg = cfg.replace(out_dir=str(runs / name), resume=False)
        return {
            "name": name,
            "cfg": cfg,
            "sim": sim.replace(step_s=step_s or sim.step_s),
            "clients": clients,
            "engine": args.engine,
            "target": args.target,
        }

    workers = side_by_side(args.workers, sim.clock, args.engine)
    results, step_s = run_with_one_unit(run_case, case_for, names, args.step_s, workers, "bench async")
    by_name = {r["name"]: r for r in results}
    ref = by_name["fedavg-lora"]
    ref_total = ref["bytes_up"] + ref["bytes_down"]
    for r in results:
        # ratios to fedavg-lora, > 1 where this strategy is better
        sooner = ratio_to_reference(ref["time_to_target_s"], ref["virtual_s"], r["time_to_target_s"])
        r["speedup_vs_fedavg"], r["speedup_is_lower_bound"] = sooner["ratio"], sooner["lower_bound"]
        fewer = ratio_to_reference(ref["bytes_to_target"], ref_total, r["bytes_to_target"])
        r["bytes_to_target_ratio_vs_fedavg"] = fewer["ratio"]
        r["bytes_to_target_ratio_is_lower_bound"] = fewer["lower_bound"]
        r["bytes_ratio_vs_fedavg"] = ref_total / max(1, r["bytes_up"] + r["bytes_down"])
    out = write_json(
        {
            "benchmark": "async",
            "quick": args.quick,
            "target": args.target,
            "run_to_budget": args.run_to_budget,
            "profile": args.profile,
            "clients": clients,
            "budget_s": budget,
            "deadline_s": args.deadline_s,
            "step_s": step_s,
            "engine": args.engine,
            "upload_density": args.upload_density,
            "blocks": args.blocks,
            "wire_dtype": args.wire_dtype,
            "overrides": overrides,
            "wall_s": time.perf_counter() - start,
            "strategies": results,
        },
        args.out,
    )
    plot(results, args.target, out.with_suffix(".png"))
    print(
        f"{'strategy':20} {'to target':>10} {'stays from':>10} {'kB to target':>13} {'final':>6} {'at':>7} "
        f"{'kB up/client':>13} {'kB down/client':>15} {'of which Flower msgs':>21} "
        f"{'sooner':>8} {'fewer B':>8} {'bytes x':>8}"
    )
    for r in results:
        t, stays = (seconds_text(r[key]) for key in ("time_to_target_s", "time_to_stay_s"))
        b = f"{r['bytes_to_target'] / 1e3:.0f}" if r["bytes_to_target"] is not None else "-"
        sooner = ratio_text(r["speedup_vs_fedavg"], r["speedup_is_lower_bound"])
        fewer = ratio_text(r["bytes_to_target_ratio_vs_fedavg"], r["bytes_to_target_ratio_is_lower_bound"])
        print(
            f"{r['name']:20} {t:>10} {stays:>10} {b:>13} {r['final_eval']:6.3f} {r['virtual_s']:6.1f}s "
            f"{r['bytes_up'] / 1e3:13.0f} {r['bytes_down'] / 1e3:15.0f} "
            f"{r['control_up'] / 1e3:9.0f} up {r['control_down'] / 1e3:6.0f} down "
            f"{sooner:>8} {fewer:>8} {r['bytes_ratio_vs_fedavg']:7.1f}x"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def per_client(total: int | None, clients: int) -> float | None:
    return None if total is None else total / clients


def ratio_text(ratio: float | None, lower_bound: bool) -> str:
    return "-" if ratio is None else f"{'>' if lower_bound else ''}{ratio:.2f}x"


def plot(results: list[dict], target: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        ax.plot([t for t, _ in r["curve"]], [e for _, e in r["curve"]], ".-", label=r["name"])
    ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("held-out greedy error")
    ax.set_title("time to target under heterogeneous volunteers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
