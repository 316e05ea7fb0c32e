"""`fedrl bench chaos`: faults, attackers and load against the real system, one row per fault.

Families (`--families`, default all):
  byzantine  20% of clients upload, instead of their update, the update x100 (`scale`), x-100
             (`flip`), x-3 (`flip-x3`: inside the norm refusal, at the clip), reversed at its
             own size (`ascent`: a valid patch of a harmful update), noise 100x its norm
             (`random`) or NaN (`nan`), under each aggregation rule (`mean`: no clip, no norm
             refusal; `clip`: the norm refusal and a clip at 3x the median; trimmed mean;
             median; `gate`: the clip plus the verification gate and reputation weights, none
             of these with the direction check; `default`: a run's defaults, the norm
             refusal, a clip at the median and the direction check with its weights) vs a
             clean run with the same seed and rule. Block-sequential synchronous rounds, so every
             update of a round is merged in one version (the blocks' aggregates side by
             side); virtual clock, the real ClientApp and coordinator in-process.
  churn      30% of the nodes leave (replies in flight lost), as many new ones join, the
             leavers return, in an async (parablock) and a sync (block-sequential) run, vs the
             same run without churn.
  kill       the coordinator (`fedrl sim` processes) SIGKILLed N times, in turn at a random
             moment and, through failpoints, mid-aggregation, mid-checkpoint-write and
             mid-publish, and resumed by running the same command (fedrl.sim.kill_loop).
  store      a real `fedrl patch-store` under floods, slow headers, oversize bodies, replayed
             and wrong credentials and traversal names (fedrl.sim.store_attack).
  fuzz       mutated real signed patches through a client's receive path, and decompression
             bombs in every stream (fedrl.sim.patch_fuzz).
JSON: {"faults": [{"name", "tried", "survived", "silently_accepted", "versions_lost",
"final_metric", "clean_metric", ...}], "store": {...}}, and a PNG beside it.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

from fedrl.arguments import integer, parse_overrides
from fedrl.bench.common import add_workers_argument, write_json
from fedrl.patch import PatchLimits
from fedrl.sim.attacks import ATTACKS
from fedrl.sim.bench.async_rounds import add_set_argument, add_step_s_argument, run_with_one_unit
from fedrl.sim.runner import simulate
from fedrl.sim.simulated_server import SimConfig
from fedrl.strategies.run_config import RunConfig

FAMILIES = ("byzantine", "churn", "kill", "store", "fuzz")
NO_DIRECTION = dict(direction_probe=0)
CLIP = dict(NO_DIRECTION, robust="mean", clip_multiple=3.0)
RULES = {  # name: run config over a run's defaults; "default" is the default rule of a run
    "mean": dict(NO_DIRECTION, robust="mean", clip_multiple=0.0, refuse_multiple=0.0),
    "clip": CLIP,
    "trimmed-mean": dict(CLIP, robust="trimmed-mean"),
    "median": dict(CLIP, robust="median"),
    "gate": dict(CLIP, gate_probe=64, gate_tolerance=0.05, reputation=True),
    "default": {},
}
HONEST = {"name": "honest", "up_bytes_s": 1e6, "down_bytes_s": 4e6, "latency_s": 0.02}


def add_arguments(parser) -> None:
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument(
        "--clients", type=integer(1), help="clients, a fifth of them attackers (default 10; quick 5)"
    )
    parser.add_argument("--versions", type=integer(1), help="global versions per run (default 16; quick 6)")
    parser.add_argument("--rules", nargs="+", choices=list(RULES), help="default: all; quick: default gate")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS[1:], default=list(ATTACKS[1:]))
    parser.add_argument("--kills", type=integer(1), help="coordinator SIGKILLs (default 20; quick 3)")
    parser.add_argument("--mutations", type=integer(1), help="fuzzed patches (default 20000; quick 2000)")
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument(
        "--seeds",
        type=integer(1),
        help="byzantine runs per rule and attack, with seeds SEED, SEED+1, ... (default 3; quick 1): "
        "one eval problem moves a run's kept improvement by about 1.5%%",
    )
    add_set_argument(parser)
    add_step_s_argument(parser)  # the byzantine runs' unit of work
    add_workers_argument(parser)


def attackers(clients: int, attack: str) -> int:
    """A fifth of the clients (at least one) when there is an attack; they are the last ids."""
    return max(1, clients // 5) if attack else 0


def profiles(clients: int, attack: str) -> str:
    n = attackers(clients, attack)
    honest = [dict(HONEST)] * (clients - n)
    return json.dumps(honest + [dict(HONEST, name=f"attacker-{attack}", attack=attack)] * n)


def curve(summary: dict) -> list[tuple[int, float]]:
    return [(e["version"], e["error"]) for e in summary["evals"]]


def row(name: str, summary: dict, clean: dict, versions: int, **fields) -> dict:
    """One fault's row: its outcome next to the clean run's."""
    gain = clean["initial_eval"] - clean["final_eval"]
    return {
        "name": name,
        "survived": summary["versions"] >= versions,
        "versions_lost": max(0, versions - summary["versions"]),
        "final_metric": summary["final_eval"],
        "clean_metric": clean["final_eval"],
        "initial_metric": summary["initial_eval"],
        "improvement_kept": (summary["initial_eval"] - summary["final_eval"]) / gain if gain > 0 else None,
        "curve": curve(summary),
        "clean_curve": curve(clean),
        **fields,
    }


def byzantine_run(case: dict) -> dict:
    """One byzantine run (a seed, a rule, an attack or none): its summary."""
    seed, rule, attack = case["key"]
    cfg = case["cfg"]
    if not case["quiet"]:
        print(
            f"[byzantine/{rule}/seed {seed}] {attack or 'clean'}: {case['clients']} clients, "
            f"{cfg.versions} versions",
            flush=True,
        )
    s = simulate(cfg, case["sim"], case["clients"], True, "local")
    return {"key": case["key"], "summary": s, "step_s": s["simulation"]["step_s"]}


def byzantine(
    base: RunConfig,
    clients: int,
    rules: list[str],
    attacks: list[str],
    seeds: list[int],
    out: Path,
    step_s: float,
    workers: int,
) -> list[dict]:
    """Every (seed, rule) clean and under each attack, with one unit of work (`step_s`, or the
    first run's measurement), side by side in `workers` processes; a row per attacked run."""

    def case_for(key: tuple[int, str, str], step_s: float | None) -> dict:
        seed, rule, attack = key
        run = out / f"seed-{seed}" / f"{rule}-{attack or 'clean'}"
        cfg = base.replace(**RULES[rule], seed=seed, out_dir=str(run), resume=False)
        sim = SimConfig(profiles=profiles(clients, attack), clock="virtual", step_s=step_s or 0.0)
        return {"key": key, "cfg": cfg, "sim": sim, "clients": clients}

    keys = [(seed, rule, attack) for seed in seeds for rule in rules for attack in ["", *attacks]]
    done, _ = run_with_one_unit(byzantine_run, case_for, keys, step_s, workers, "bench chaos byzantine")
    summaries = {tuple(d["key"]): d["summary"] for d in done}
    rows = []
    for seed, rule, attack in keys:
        if not attack:
            continue
        s, clean = summaries[(seed, rule, attack)], summaries[(seed, rule, "")]
        first = clients - attackers(clients, attack)
        bad = {int(node) for node, c in s["clients"].items() if c["client_id"] >= first}
        judged = [e for e in s["events"] if e["kind"] in ("accepted", "rejected")]
        mine = [e for e in judged if e.get("node") in bad]
        gated = [e for e in judged if e["kind"] == "rejected" and e.get("cause") == "gate"]
        rows.append(
            row(
                f"byzantine-{attack}",
                s,
                clean,
                base.versions,
                rule=rule,
                seed=seed,
                step_s=s["simulation"]["step_s"],  # the unit of work this run used
                tried=len(mine),
                accepted=sum(e["kind"] == "accepted" for e in mine),
                rejected=sum(e["kind"] == "rejected" for e in mine),
                # an attacker's update in the global model: NaN must never be; the others are
                # bounded by the rule (clipped/trimmed/gated), which `improvement_kept` measures
                silently_accepted=sum(e["kind"] == "accepted" for e in mine) if attack == "nan" else 0,
                clipped=sum(e.get("clipped", 0) for e in s["events"] if e["kind"] == "version"),
                refused_by_cause=dict(
                    collections.Counter(e["cause"] for e in mine if e["kind"] == "rejected")
                ),
                honest_refused=dict(
                    collections.Counter(
                        e["cause"] for e in judged if e["kind"] == "rejected" and e.get("node") not in bad
                    )
                ),
                clean_refused=dict(
                    collections.Counter(e["cause"] for e in clean["events"] if e["kind"] == "rejected")
                ),
                direction_cpu_s_per_reference=(s["direction"]["cpu_s"] / max(s["direction"]["references"], 1))
                if s.get("direction")
                else None,
                gate_caught=sum(e.get("node") in bad for e in gated),
                gate_refused_honest=sum(e.get("node") not in bad for e in gated),
                gate_cpu_s_per_update=(s["gate"]["cpu_s"] / max(s["gate"]["updates_scored"], 1))
                if s.get("gate")
                else None,
                attacker_weight=min(
                    (w for c, w in s.get("reputation", {}).items() if int(c) >= first), default=None
                ),
            )
        )
    return rows


def churn(base: RunConfig, clients: int, out: Path) -> list[dict]:
    from fedrl.sim.apps import client_app
    from fedrl.sim.churn import ChurnGrid
    from fedrl.sim.local_grid import LocalGrid
    from fedrl.sim.simulated_server import run_simulated

    rows = []
    sim = SimConfig(profiles=json.dumps([HONEST]), clock="virtual")
    for mode, sync in (("parablock", False), ("block-sequential", True)):
        cfg = base.replace(mode=mode, sync=sync, buffer_size=max(2, clients // 2))
        print(
            f"[churn] {mode} {'sync' if sync else 'async'}: {clients} clients, {cfg.versions} versions",
            flush=True,
        )
        clean = run_simulated(
            LocalGrid(clients, client_app), cfg.replace(out_dir=str(out / f"{mode}-clean")), sim
        )
        # leave, join and return at about 20%, 40% and 60% of the run's replies
        replies = cfg.versions * (clients if sync else cfg.buffer_size)
        grid = ChurnGrid(clients, client_app, fraction=0.3, period=max(1, replies // 5))
        s = run_simulated(grid, cfg.replace(out_dir=str(out / f"{mode}-churn")), sim)
        seen: dict[int, set] = {}  # node -> every client id the coordinator gave it
        for e in s["events"]:
            if e["kind"] in ("joined", "left"):
                seen.setdefault(e["node"], set()).add(e["client"])
        kinds = [e["kind"] for e in s["events"]]
        left_at = {e["node"]: i for i, e in enumerate(s["events"]) if e["kind"] == "left"}
        rows.append(
            row(
                f"churn-{mode}-{'sync' if sync else 'async'}",
                s,
                clean,
                cfg.versions,
                tried=len(grid.log),
                churn=grid.log,
                replies_failed_in_flight=grid.failed_in_flight,
                left_events=kinds.count("left"),
                joined_events=kinds.count("joined"),
                returned_events=sum(
                    e["kind"] == "joined" and i > left_at.get(e["node"], len(kinds))
                    for i, e in enumerate(s["events"])
                ),
                # stable identities: a node keeps one client id through leaving and returning, and
                # no id is given to two nodes
                identities_stable=all(len(c) == 1 for c in seen.values())
                and len({min(c) for c in seen.values()}) == len(seen),
                silently_accepted=0,
            )
        )
    return rows


def kill(base: RunConfig, clients: int, kills: int, seed: int, out: Path) -> list[dict]:
    from fedrl.sim.kill_loop import PHASES, kill_loop, run_to_end, warm_lives

    overrides = {
        k: v
        for k, v in base.model_dump().items()
        if k in ("mode", "sync", "task_params", "prompts", "samples", "base_steps", "min_steps", "max_steps")
    }
    versions = max(base.versions, 3 * kills)  # each life makes a version or two: the run outlives the kills
    overrides.update(
        mode="parablock",
        sync=False,
        versions=versions,
        eval_every=2,
        buffer_size=max(2, clients // 2),
        seed=seed,
    )
    print(f"[kill] {kills} SIGKILLs of a {clients}-client parablock run, then an unkilled one", flush=True)
    with warm_lives():
        result = kill_loop(out / "killed", kills, clients, overrides, seed=seed)
        clean = run_to_end(out / "unkilled", clients, overrides, timeout_s=600)
    killed = json.loads((out / "killed" / "summary.json").read_text())
    return [
        row(
            "coordinator-kill-9",
            killed,
            clean,
            versions,
            tried=result["kills_done"],
            silently_accepted=result["corrupt_checkpoints"],
            # where the kills landed: a failpoint life killed from outside never reached its phase
            kills_by_phase={
                p: sum(
                    k["phase"] == p
                    and k["killed"]
                    and k["killed_by"] == ("loop" if p == "random" else "failpoint")
                    for k in result["kills"]
                )
                for p in PHASES
            },
            **{k: v for k, v in result.items() if k not in ("final_metric", "initial_metric", "versions")},
        )
        | {"versions_lost": result["versions_lost_total"]}  # over all kills, not against the budget
    ]


def store(quick: bool) -> tuple[list[dict], dict]:
    from fedrl.sim.store_attack import attack_store

    print("[store] honest node alone, then under every attack at once", flush=True)
    result = attack_store(seconds=3.0 if quick else 10.0, scale=0.25 if quick else 1.0)
    rows = [
        {"name": f"store-{name}", "survived": result["survived"], "versions_lost": 0, **fields}
        for name, fields in result["attacks"].items()
    ]
    return rows, {k: v for k, v in result.items() if k != "attacks"}


def fuzz(mutations: int, seed: int) -> list[dict]:
    from fedrl.sim.patch_fuzz import fuzz_signed, try_bombs

    print(f"[fuzz] {mutations} mutated signed patches per verification, and decompression bombs", flush=True)
    rows = []
    for verify, name in (("state", "patch-mutations"), ("changes", "patch-mutations-sync")):
        start = time.perf_counter()
        result = fuzz_signed(mutations, seed, verify=verify)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        rows.append(
            {
                "name": name,
                "survived": result["crashed"] == 0,
                "silently_accepted": result["silently_applied"],
                "versions_lost": 0,
                **result,
            }
        )
    limits = PatchLimits(max_patch_bytes=16 << 20, max_body_bytes=16 << 20)  # a receiver's bound
    bombs = try_bombs(limits)
    return [
        *rows,
        {
            "name": "decompression-bombs",
            "tried": len(bombs),
            "survived": all(not b["outcome"].startswith("crashed") for b in bombs),
            "silently_accepted": sum(b["outcome"] == "applied" for b in bombs),
            "versions_lost": 0,
            "peak_rss_growth_max": max(b["peak_rss_growth"] for b in bombs),
            "bombs": bombs,
        },
    ]


def main(args) -> int:
    clients = args.clients or (5 if args.quick else 10)
    versions = args.versions or (6 if args.quick else 16)
    rules = args.rules or (["default", "gate"] if args.quick else list(RULES))
    overrides = parse_overrides(args.set)  # under each rule's own settings
    base = RunConfig(
        mode="block-sequential",
        sync=True,
        model="tiny-base",
        task="reversal",
        task_params=json.dumps({"length": 8, "num_eval": 64 if args.quick else 256}),
        # the clean run must gain enough for "improvement kept" to mean something: at the default
        # lr (2e-4, chosen for async steadiness) 16 sync versions gained 12 of 128 problems
        lr=5e-4,
        prompts=4,
        samples=4 if args.quick else 8,
        base_steps=2,
        min_steps=1,
        max_steps=4,
        versions=versions,
        eval_every=1,
        min_nodes=clients,
        seed=args.seed,
    ).replace(**overrides)
    out = Path(args.out)
    runs = out.parent / f"{out.stem}-runs-{time.strftime('%Y%m%d-%H%M%S')}"
    start, faults, store_latency = time.perf_counter(), [], None
    seeds = list(range(args.seed, args.seed + (args.seeds or (1 if args.quick else 3))))
    if "byzantine" in args.families:
        faults += byzantine(
            base, clients, rules, args.attacks, seeds, runs / "byzantine", args.step_s, args.workers
        )
    if "churn" in args.families:
        faults += churn(base, clients, runs / "churn")
    if "kill" in args.families:
        faults += kill(base, clients, args.kills or (3 if args.quick else 20), args.seed, runs / "kill")
    if "store" in args.families:
        rows, store_latency = store(args.quick)
        faults += rows
    if "fuzz" in args.families:
        faults += fuzz(args.mutations or (2000 if args.quick else 20_000), args.seed)
    path = write_json(
        {
            "benchmark": "chaos",
            "quick": args.quick,
            "clients": clients,
            "attackers": attackers(clients, "any"),
            "versions": versions,
            "families": args.families,
            "rules": rules,
            "byzantine_seeds": seeds,
            "overrides": overrides,
            "faults": faults,
            "byzantine_kept": kept_over_seeds(faults),
            "store": store_latency,
            "wall_s": time.perf_counter() - start,
        },
        args.out,
    )
    plot(faults, store_latency, path.with_suffix(".png"))
    print_table(faults, store_latency)
    print_kept(kept_over_seeds(faults))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(faults: list[dict], store_latency: dict | None) -> None:
    heads = f"{'tried':>6} {'silent':>6} {'lost':>4} {'final':>6} {'clean':>6} {'kept':>6}"
    print(f"{'fault':26} {'rule':13} {heads}")
    for f in faults:
        counts = f"{f.get('tried', 0):6d} {f.get('silently_accepted', 0):6d} {f['versions_lost']:4d}"
        kept = fmt(f.get("improvement_kept"), ".0%")
        metrics = f"{fmt(f.get('final_metric')):>6} {fmt(f.get('clean_metric')):>6} {kept:>6}"
        print(f"{f['name']:26} {f.get('rule', ''):13} {counts} {metrics}")


def kept_over_seeds(faults: list[dict]) -> list[dict]:
    """Per Byzantine attack and rule: the improvement kept, mean and range over the seeds, and
    the clean runs' final metric."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for f in faults:
        if "rule" in f and f.get("improvement_kept") is not None:
            groups.setdefault((f["name"], f["rule"]), []).append(f)
    return [
        {
            "name": name,
            "rule": rule,
            "seeds": [f["seed"] for f in rows],
            "kept_mean": sum(f["improvement_kept"] for f in rows) / len(rows),
            "kept_min": min(f["improvement_kept"] for f in rows),
            "kept_max": max(f["improvement_kept"] for f in rows),
            "clean_metric_mean": sum(f["clean_metric"] for f in rows) / len(rows),
        }
        for (name, rule), rows in groups.items()
    ]


def print_kept(kept: list[dict]) -> None:
    if not kept:
        return
    print(f"\nimprovement kept, mean [min-max] over seeds ({len(kept[0]['seeds'])})")
    rules = list(dict.fromkeys(k["rule"] for k in kept))
    cells = {(k["name"], k["rule"]): k for k in kept}
    print(f"{'attack':22}" + "".join(f"{r:>20}" for r in rules))
    for name in dict.fromkeys(k["name"] for k in kept):
        row = [cells.get((name, r)) for r in rules]
        text = [f"{k['kept_mean']:.0%} [{k['kept_min']:.0%}-{k['kept_max']:.0%}]" if k else "-" for k in row]
        print(f"{name.removeprefix('byzantine-'):22}" + "".join(f"{t:>20}" for t in text))


def plot(faults: list[dict], store_latency: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    first_seed = min((f["seed"] for f in faults if "rule" in f), default=None)
    for f in faults:
        if "curve" in f and ("rule" not in f or f["seed"] == first_seed):  # one seed's curves: readable
            key = f"byzantine, rule {f['rule']}, seed {f['seed']}" if "rule" in f else f["name"]
            groups.setdefault(key, []).append(f)
    panels = len(groups) + (1 if store_latency else 0)
    if not panels:
        return
    cols = min(3, panels)
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax, (title, group) in zip(flat, groups.items()):
        ax.plot(*zip(*group[0]["clean_curve"]), "k-", lw=2, label="clean")
        for f in group:
            ax.plot(*zip(*f["curve"]), label=f["name"].removeprefix("byzantine-"))
        ax.set(title=title, xlabel="version", ylabel="held-out greedy error")
        ax.legend(fontsize=7)
    if store_latency:
        ax = flat[len(groups)]
        phases = ["honest_alone", "honest_under_attack"]
        for i, q in enumerate(("p50_ms", "p99_ms")):
            ax.bar([j + 0.4 * i for j in range(2)], [store_latency[p][q] for p in phases], 0.4, label=q[:3])
        ax.set_xticks([0.2, 1.2], ["alone", "under attack"])
        ax.set(title="patch store: an honest node's request latency", ylabel="ms")
        ax.legend()
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle("fedrl bench chaos: held-out error per fault vs a clean run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
