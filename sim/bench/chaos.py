"""`fedrl bench chaos`: faults and attackers against the real coordinator, one row per fault.

So far it covers the Byzantine family: 20% of clients upload, instead of their update, the
update x100 (`scale`), x-100 (`flip`), reversed at its own size (`ascent`: a valid patch of a
harmful update), noise 100x its norm (`random`) or NaN (`nan`). Each attack runs under each
aggregation rule against a clean run with the same seed and rule; a row reports how much of
the clean run's improvement survived. Block-sequential synchronous rounds, so every update of a
round lands in one block's aggregate (where robust rules can see the attackers among them);
virtual clock, clients in this process (the real ClientApp and coordinator).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from fedrl.bench.common import write_json
from fedrl.sim.attacks import ATTACKS
from fedrl.sim.runner import simulate
from fedrl.sim.simulated_server import SimConfig
from fedrl.strategies.run_config import RunConfig

RULES = {  # name: run config; "clip" is the default rule of a run
    "mean": dict(robust="mean", clip_multiple=0.0),
    "clip": dict(robust="mean", clip_multiple=3.0),
    "trimmed-mean": dict(robust="trimmed-mean", clip_multiple=3.0),
    "median": dict(robust="median", clip_multiple=3.0),
}
HONEST = {"name": "honest", "up_bytes_s": 1e6, "down_bytes_s": 4e6, "latency_s": 0.02}


def add_arguments(parser) -> None:
    parser.add_argument(
        "--clients", type=int, help="clients, a fifth of them attackers (default 10; quick 5)"
    )
    parser.add_argument("--versions", type=int, help="global versions per run (default 16; quick 6)")
    parser.add_argument("--rules", nargs="+", choices=list(RULES), help="default: all; quick: mean clip")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS[1:], default=list(ATTACKS[1:]))
    parser.add_argument("--seed", type=int, default=0)


def attackers(clients: int, attack: str) -> int:
    """A fifth of the clients (at least one) when there is an attack; they are the last ids."""
    return max(1, clients // 5) if attack else 0


def profiles(clients: int, attack: str) -> str:
    n = attackers(clients, attack)
    honest = [dict(HONEST)] * (clients - n)
    return json.dumps(honest + [dict(HONEST, name=f"attacker-{attack}", attack=attack)] * n)


def run(base: RunConfig, clients: int, rule: str, attack: str, out: Path) -> dict:
    cfg = base.replace(**RULES[rule], out_dir=str(out / f"{rule}-{attack or 'clean'}"), resume=False)
    sim = SimConfig(profiles=profiles(clients, attack), clock="virtual")
    s = simulate(cfg, sim, clients, quiet=True, engine="local")
    first = clients - attackers(clients, attack)
    attacker_nodes = {int(node) for node, c in s["clients"].items() if c["client_id"] >= first}
    from_attackers = [e for e in s["events"] if e.get("node") in attacker_nodes]
    return {
        "final": s["final_eval"],
        "initial": s["initial_eval"],
        "versions": s["versions"],
        "stop_reason": s["stop_reason"],
        "tried": sum(e["kind"] in ("accepted", "rejected") for e in from_attackers),
        "accepted": sum(e["kind"] == "accepted" for e in from_attackers),
        "rejected": sum(e["kind"] == "rejected" for e in from_attackers),
        "clipped": sum(e.get("clipped", 0) for e in s["events"] if e["kind"] == "version"),
        "curve": [(e["version"], e["error"]) for e in s["evals"]],
    }


def main(args) -> int:
    clients = args.clients or (5 if args.quick else 10)
    versions = args.versions or (6 if args.quick else 16)
    rules = args.rules or (["mean", "clip"] if args.quick else list(RULES))
    base = RunConfig(
        mode="block-sequential",
        sync=True,
        model="tiny-base",
        task="reversal",
        task_params=json.dumps({"length": 8, "num_eval": 64 if args.quick else 128}),
        prompts=4,
        samples=4 if args.quick else 8,
        base_steps=2,
        min_steps=1,
        max_steps=4,
        versions=versions,
        eval_every=1,
        min_nodes=clients,
        seed=args.seed,
    )
    out = Path(args.out)
    runs = out.parent / f"{out.stem}-runs-{time.strftime('%Y%m%d-%H%M%S')}"
    start, faults, clean = time.perf_counter(), [], {}
    for rule in rules:
        for attack in ["", *args.attacks]:
            print(f"[{rule}] {attack or 'clean'}: {clients} clients, {versions} versions", flush=True)
            r = run(base, clients, rule, attack, runs)
            if not attack:
                clean[rule] = r
                continue
            ref = clean[rule]
            gain = ref["initial"] - ref["final"]
            faults.append(
                {
                    "name": f"byzantine-{attack}",
                    "rule": rule,
                    "tried": r["tried"],
                    "survived": r["versions"] >= versions,
                    # an attacker's update in the global model: NaN must never be; the others are
                    # bounded by the rule (clipped/trimmed), which `improvement_kept` measures
                    "silently_accepted": r["accepted"] if attack == "nan" else 0,
                    "accepted": r["accepted"],
                    "rejected": r["rejected"],
                    "clipped": r["clipped"],
                    "versions_lost": max(0, versions - r["versions"]),
                    "final_metric": r["final"],
                    "clean_metric": ref["final"],
                    "initial_metric": r["initial"],
                    "improvement_kept": (r["initial"] - r["final"]) / gain if gain > 0 else None,
                    "curve": r["curve"],
                    "clean_curve": ref["curve"],
                }
            )
    path = write_json(
        {
            "benchmark": "chaos",
            "quick": args.quick,
            "clients": clients,
            "attackers": attackers(clients, "any"),
            "versions": versions,
            "rules": rules,
            "clean": {rule: {k: v for k, v in r.items() if k != "curve"} for rule, r in clean.items()},
            "faults": faults,
            "wall_s": time.perf_counter() - start,
        },
        args.out,
    )
    plot(faults, path.with_suffix(".png"))
    heads = f"{'tried':>5} {'accepted':>8} {'clipped':>7} {'final':>6} {'clean':>6} {'kept':>6}"
    print(f"{'fault':18} {'rule':13} {heads}")
    for f in faults:
        kept = f"{f['improvement_kept']:.0%}" if f["improvement_kept"] is not None else "-"
        print(
            f"{f['name']:18} {f['rule']:13} {f['tried']:5d} {f['accepted']:8d} {f['clipped']:7d} "
            f"{f['final_metric']:6.3f} {f['clean_metric']:6.3f} {kept:>6}"
        )
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def plot(faults: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = sorted({f["rule"] for f in faults}, key=list(RULES).index)
    fig, axes = plt.subplots(1, len(rules), figsize=(5 * len(rules), 4), squeeze=False, sharey=True)
    for ax, rule in zip(axes[0], rules):
        rows = [f for f in faults if f["rule"] == rule]
        if rows:
            ax.plot(*zip(*rows[0]["clean_curve"]), "k-", lw=2, label="clean")
        for f in rows:
            ax.plot(*zip(*f["curve"]), label=f["name"].removeprefix("byzantine-"))
        ax.set(title=f"rule: {rule}", xlabel="version", ylabel="held-out greedy error")
        ax.legend(fontsize=8)
    fig.suptitle("20% Byzantine clients vs aggregation rules")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
