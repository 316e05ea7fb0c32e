"""`fedrl bench dg`: DG against REINFORCE, IW-PG, PPO and decoupled PPO under frictions.

Token reversal (H=10, M=2) with the tiny GPT trained from scratch (learned positions, as the
papers' model; `--model tiny` runs the rotary-position Llama instead, which learns reversal
about 3x slower), 10 prompts x 10 samples per step, Adam 3e-4; and digits as a contextual
bandit (MLP width 100, batch 100) with the actor's weights D steps stale. Friction strengths
follow DESIGN.md §4.2.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict

import numpy as np
import torch

from fedrl.arguments import integer
from fedrl.bench.common import add_workers_argument, run_cases, write_json
from fedrl.frictions import Actor, Frictions, StalenessBuffer
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.losses import LOSSES, PGBatch
from fedrl.models import TINY_MODELS
from fedrl.rollout import greedy_error
from fedrl.tasks import DigitsBandit, ReversalTask

METHODS = list(LOSSES)
SCENARIOS = {
    "clean": Frictions(),
    "staleness": Frictions(staleness=8),
    "bugs": Frictions(bug_prob=0.1),
    "corruption": Frictions(reward_noise_prob=0.1),
    "discovery": Frictions(discovery_prob=0.01),
    "all": Frictions(staleness=8, bug_prob=0.1, reward_noise_prob=0.1, discovery_prob=0.01),
}
PROMPTS, SAMPLES = 10, 10


def run_reversal(case: dict) -> dict:
    """One learner from scratch; greedy sequence error on all 1,024 prompts along the way."""
    seed, steps, make_model = case["seed"], case["steps"], TINY_MODELS[case["model"]]
    task = ReversalTask(length=10, num_symbols=2, reward_kind="first_error")
    learner_lm = make_model(seed, alphabet="01")
    actor_lm = make_model(seed, alphabet="01")
    learner = Learner(list(learner_lm.model.parameters()), LearnerConfig(case["method"], lr=3e-4))
    actor = Actor(actor_lm, task, SCENARIOS[case["scenario"]], seed=seed + 1)
    rng = np.random.default_rng(seed)
    actor.sync(dict(learner_lm.model.named_parameters()), 0)
    curve, start, train_s = [], time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        tick = time.perf_counter()
        batch = actor.collect(task.sample(PROMPTS, rng), SAMPLES)
        lm_update(learner, learner_lm.model, batch)
        actor.sync(dict(learner_lm.model.named_parameters()), step)
        train_s += time.perf_counter() - tick
        if step % case["eval_every"] == 0 or step == steps:
            curve.append([step * PROMPTS * SAMPLES, greedy_error(learner_lm, task)])
    return {
        **_meta(case, "reversal"),
        "model": case["model"],
        "episodes": steps * PROMPTS * SAMPLES,
        "final_error": curve[-1][1],
        "curve": curve,
        "step_s": train_s / steps,  # one learner step: sample 10x10, score, frictions, update, sync
        "wall_s": time.perf_counter() - start,
    }


def _digits_policy(task: DigitsBandit) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(task.feature_dim, 100), torch.nn.ReLU(), torch.nn.Linear(100, task.num_actions)
    )


def run_digits(case: dict) -> dict:
    """Digits bandit: an MLP policy picks a class; the actor's weights are `staleness` steps old."""
    seed, steps, stale = case["seed"], case["steps"], case["staleness"]
    task = DigitsBandit()
    torch.manual_seed(seed)
    policy, actor = _digits_policy(task), _digits_policy(task)
    learner = Learner(list(policy.parameters()), LearnerConfig(case["method"], lr=1e-3))
    buffer = StalenessBuffer(stale, uniform=False)
    buffer.push({k: v.clone() for k, v in policy.state_dict().items()})
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    x_eval, y_eval = (torch.as_tensor(a) for a in task.eval_arrays())
    curve, start, batch_size = [], time.perf_counter(), 100
    for step in range(1, steps + 1):
        actor.load_state_dict(buffer.get(buffer.sample_age(rng)))
        x, y = (torch.as_tensor(a) for a in task.sample_arrays(batch_size, rng))
        with torch.no_grad():
            behaviour_all = torch.log_softmax(actor(x), -1)
        action = torch.multinomial(behaviour_all.exp(), 1, generator=gen)
        reward = (action.squeeze(1) == y).float()
        logp = torch.log_softmax(policy(x), -1).gather(1, action)
        batch = PGBatch(
            logp,
            reward,
            torch.zeros(batch_size, dtype=torch.long),
            torch.ones_like(logp),
            behaviour_all.gather(1, action),
        )
        learner.update(batch)
        buffer.push({k: v.clone() for k, v in policy.state_dict().items()})
        if step % case["eval_every"] == 0 or step == steps:
            with torch.no_grad():
                curve.append([step * batch_size, (policy(x_eval).argmax(-1) != y_eval).float().mean().item()])
    return {
        **_meta(case, f"staleness-{stale}"),
        "task": "digits",
        "episodes": steps * batch_size,
        "final_error": curve[-1][1],
        "curve": curve,
        "wall_s": time.perf_counter() - start,
    }


def _meta(case: dict, scenario: str) -> dict:
    return {
        "task": "reversal",
        "scenario": case.get("scenario", scenario),
        "method": case["method"],
        "seed": case["seed"],
    }


def run_case(case: dict) -> dict:
    return run_reversal(case) if case["task"] == "reversal" else run_digits(case)


def plan(
    quick: bool, steps: int | None, seeds: int | None, digits_steps: int | None, model: str = "tiny-gpt"
) -> list[dict]:
    scenarios = ["all"] if quick else list(SCENARIOS)
    steps = steps or (60 if quick else 1000)
    seeds = seeds or (1 if quick else 3)
    digits_steps = digits_steps or (200 if quick else 3000)
    staleness = [0, 100] if quick else [0, 10, 100, 1000]
    cases = [
        {
            "task": "reversal",
            "model": model,
            "scenario": s,
            "method": m,
            "seed": seed,
            "steps": steps,
            "eval_every": max(steps // 10, 1),
        }
        for s, m, seed in itertools.product(scenarios, METHODS, range(seeds))
    ]
    cases += [
        {
            "task": "digits",
            "staleness": d,
            "method": m,
            "seed": seed,
            "steps": digits_steps,
            "eval_every": max(digits_steps // 10, 1),
        }
        for d, m, seed in itertools.product(staleness, METHODS, range(seeds))
    ]
    return cases


def runs_of(results: list[dict], task: str, scenario: str, method: str) -> list[dict]:
    return [r for r in results if (r["task"], r["scenario"], r["method"]) == (task, scenario, method)]


def table(results: list[dict]) -> str:
    """Final error per (task, scenario) row and method column: mean over seeds [min-max]."""
    rows = sorted({(r["task"], r["scenario"]) for r in results})
    lines = [f"{'task':9} {'scenario':15} " + " ".join(f"{m:>20}" for m in METHODS)]
    for task, scenario in rows:
        cells = []
        for m in METHODS:
            errs = [100 * r["final_error"] for r in runs_of(results, task, scenario, m)]
            cell = f"{np.mean(errs):.1f}% [{min(errs):.1f}-{max(errs):.1f}]" if errs else "-"
            cells.append(f"{cell:>20}")
        lines.append(f"{task:9} {scenario:15} " + " ".join(cells))
    return "\n".join(lines)


def speed(results: list[dict]) -> dict:
    """Seconds per reversal learner step (eval excluded), over every reversal run."""
    steps = [r["step_s"] for r in results if r["task"] == "reversal"]
    if not steps:
        return {}
    return {
        "reversal_step_s_median": float(np.median(steps)),
        "reversal_step_s_min": float(min(steps)),
        "reversal_steps_per_s": 1 / float(np.median(steps)),
        "threads_per_run": 1,
    }


def plot(results: list[dict], path) -> None:
    """Greedy error vs episodes, one panel per (task, scenario): mean over seeds, range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    panels = sorted({(r["task"], r["scenario"]) for r in results})
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, (task, scenario) in zip(axes.flat, panels):
        for i, m in enumerate(METHODS):
            runs = runs_of(results, task, scenario, m)
            if not runs:
                continue
            xs = [x for x, _ in runs[0]["curve"]]
            ys = np.array([[y for _, y in r["curve"]] for r in runs])
            ax.plot(xs, ys.mean(0), color=f"C{i}", label=f"{m} ({len(runs)} seeds)")
            if len(runs) > 1:
                ax.fill_between(xs, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.15, lw=0)
        ax.set_title(f"{task}: {scenario}")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 50k, not 50000 run into its neighbours
        ax.set_xlabel("episodes")
        ax.set_ylabel("greedy error")
        ax.set_ylim(-0.02, 1.02)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--steps", type=integer(1), help="reversal learner steps per run (default 1000; quick 60)"
    )
    parser.add_argument("--seeds", type=integer(1), help="seeds per (scenario, method) (default 3; quick 1)")
    parser.add_argument(
        "--digits-steps", type=integer(1), help="digits bandit steps per run (default 3000; quick 200)"
    )
    parser.add_argument(
        "--model",
        choices=sorted(TINY_MODELS),
        default="tiny-gpt",
        help="reversal model from scratch (default tiny-gpt: learned positions, as the papers' model)",
    )
    add_workers_argument(parser)


def main(args) -> int:
    cases = plan(args.quick, args.steps, args.seeds, args.digits_steps, args.model)
    start = time.perf_counter()
    results = run_cases(run_case, cases, args.workers, "bench dg")
    learner_speed = speed(results)
    out = write_json(
        {
            "benchmark": "dg",
            "quick": args.quick,
            "wall_s": time.perf_counter() - start,
            "scenarios": {k: asdict(v) for k, v in SCENARIOS.items()},
            "setup": {
                "reversal": (
                    f"H=10 M=2, {args.model} 3 layers d=64 from scratch, 10x10 per step, Adam 3e-4, "
                    "reward to first error"
                ),
                "digits": "MLP 64-100-10, batch 100, Adam 1e-3, actor weights D steps stale",
            },
            "speed": learner_speed,
            "results": results,
        },
        args.out,
    )
    plot(results, out.with_suffix(".png"))
    print(table(results))
    if learner_speed:
        median = learner_speed["reversal_step_s_median"]
        print(f"learner: {median:.4f} s per reversal step (median, one thread per run)")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
