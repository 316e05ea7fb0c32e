"""`fedrl bench pulse`: the patch codec on real RL updates.

Trajectories of bf16 weights from real DG training (fp32 master weights, bf16 cast after
every step, as PULSE measures): the tiny model's full weights, one layer block of
SmolLM2-135M-Instruct on 2-digit addition, and LoRA adapters. For each learning rate and
k in {1..32}, a patch from step t to step t+k, against full sync, zstd of the full tensors
and raw COO; encode/decode throughput beside a warm memcpy of the same tensors.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import zstandard
from tqdm import tqdm

from fedrl.arguments import integer
from fedrl.bench.common import write_json
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.lora import LoraSettings, add_lora
from fedrl.models import load_model
from fedrl.patch import apply_patch, encode_patch, read_header, state_hash, to_bits
from fedrl.patch_chain import synchronize
from fedrl.patch_routes import PatchRef
from fedrl.rollout import rollout, score
from fedrl.tasks import AdditionTask, ReversalTask


def bf16_trajectory(
    lm,
    task,
    params: dict[str, torch.nn.Parameter],
    lr: float,
    steps: int,
    prompts: int,
    samples: int,
    seed: int,
    desc: str,
) -> list[dict]:
    """bf16 casts of `params` before training and after each DG step."""
    torch.manual_seed(seed)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    learner = Learner(list(params.values()), LearnerConfig("dg", lr=lr))
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    snap = lambda: {n: p.detach().to(torch.bfloat16).clone() for n, p in params.items()}
    out = [snap()]
    for _ in tqdm(range(steps), desc=desc, leave=False):
        batch = score(task, rollout(lm, task, task.sample(prompts, rng), samples, generator=gen))
        lm_update(learner, lm.model, batch)
        out.append(snap())
    return out


TIMED_PAIRS = 4  # per case: the throughput is the median over the first pairs that changed


def measure(name: str, lr: float, k: int, traj: list[dict], level: int, timed: bool) -> dict:
    """Averages over the (t, t+k) pairs of one trajectory, all of them, in which some value
    changed (early Adam steps at tiny learning rates may change nothing in bf16): a patch late
    in training codes differently from an early one. The first TIMED_PAIRS of them are timed,
    and the case's throughput is the median over those."""
    pairs = [(t, t + k) for t in range(0, len(traj) - k, k)]
    dense = sum(t.numel() * t.element_size() for t in traj[0].values())
    numel = sum(t.numel() for t in traj[0].values())
    changes = {
        (a, b): sum(int(np.count_nonzero(to_bits(traj[a][n]) != to_bits(traj[b][n]))) for n in traj[a])
        for a, b in pairs
    }
    unchanged = [p for p in pairs if changes[p] == 0]
    pairs = [p for p in pairs if changes[p] > 0]
    sparsity, patch_bytes, zstd_bytes, coo_bytes, identical, speeds, tiered = [], [], [], [], True, [], []
    for a, b in pairs:
        base, new, changed = traj[a], traj[b], changes[(a, b)]
        patch = encode_patch(base, new, a, b, level=level)
        tiered.append(sum(e["mode"] == "tiered" for e in read_header(patch).tensors))
        identical &= state_hash(apply_patch(base, patch)) == state_hash(new)
        sparsity.append(1 - changed / numel)
        patch_bytes.append(len(patch))
        zstd_bytes.append(
            sum(
                len(zstandard.ZstdCompressor(level=level).compress(to_bits(t).tobytes()))
                for t in new.values()
            )
        )
        coo_bytes.append(max(changed * (4 + 4 + 2), 1))  # int32 row, int32 col, bf16 value (PULSE's baseline)
        speeds.append(
            throughput(base, new, level, dense) if timed and len(pairs_timed(speeds)) < TIMED_PAIRS else {}
        )
    if not pairs:
        return {"name": name, "lr": lr, "k": k, "pairs": 0, "unchanged_pairs": len(unchanged)}
    case = {
        "name": name,
        "dtype": "bfloat16",
        "lr": lr,
        "k": k,
        "pairs": len(pairs),
        "unchanged_pairs": len(unchanged),
        "dense_bytes": dense,
        "patch_bytes": float(np.mean(patch_bytes)),
        "sparsity": float(np.mean(sparsity)),
        "ratio": dense / float(np.mean(patch_bytes)),
        "ratio_zstd_dense": dense / float(np.mean(zstd_bytes)),
        "ratio_raw_coo": dense / float(np.mean(coo_bytes)),
        "bit_identical": bool(identical),
        "per_pair": [
            {
                "from": a,
                "to": b,
                "sparsity": sp,
                "ratio": dense / size,
                "bits_per_change": 8 * size / changes[(a, b)],
                "tiered_tensors": n_tiered,
                **speed,
            }
            for (a, b), sp, size, n_tiered, speed in zip(pairs, sparsity, patch_bytes, tiered, speeds)
        ],
    }
    case.update({key: float(np.median([s[key] for s in pairs_timed(speeds)])) for key in speeds[0]})
    return case


def pairs_timed(speeds: list[dict]) -> list[dict]:
    return [s for s in speeds if s]


def throughput(base: dict, new: dict, level: int, dense: int, repeats: int = 3) -> dict:
    """MB/s of dense model bytes on one thread; hashes of held states are known, as in use.
    Encoding hashes the new state unless its hash is known too (`encode_known_mb_s`: a
    publisher's patches from its retained versions to a version it has hashed once). Decoding
    into new tensors and hashing the whole result (`decode_mb_s`), and as a sync's link does
    (`link_decode_mb_s`: in place, checking the changes). Beside a warm memcpy, a copy into
    fresh memory (what any apply that returns new tensors pays at least) and the state hash
    alone (what any apply that verifies its whole result pays)."""
    base_hash, target_hash = state_hash(base), state_hash(new)
    targets = {n: torch.empty_like(t) for n, t in new.items()}
    for t in targets.values():
        t.fill_(1)  # warm the destination pages
    work = {n: t.clone() for n, t in base.items()}

    def best(fn, setup=lambda: None) -> float:
        times = []
        for _ in range(repeats):
            setup()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return dense / min(times) / 1e6

    patch = encode_patch(base, new, 0, 1, level=level, base_hash=base_hash)
    return {
        "encode_mb_s": best(lambda: encode_patch(base, new, 0, 1, level=level, base_hash=base_hash)),
        "encode_known_mb_s": best(
            lambda: encode_patch(base, new, 0, 1, level=level, base_hash=base_hash, target_hash=target_hash)
        ),
        "decode_mb_s": best(lambda: apply_patch(base, patch, base_hash=base_hash)),
        "link_decode_mb_s": best(
            lambda: apply_patch(work, patch, base_hash=base_hash, in_place=True, verify="changes"),
            setup=lambda: [work[n].copy_(t) for n, t in base.items()],
        ),
        "memcpy_mb_s": best(lambda: [targets[n].copy_(t) for n, t in new.items()]),
        "fresh_copy_mb_s": best(lambda: [t.clone() for t in new.values()]),
        "hash_mb_s": best(lambda: state_hash(new)),
    }


def chain_speed(name: str, lr: float, traj: list[dict], level: int, repeats: int = 5) -> dict:
    """Milliseconds to sync from the first state to the last through every one-step patch, as
    a node that fell behind does (`synchronize`: links after the first in place, each from the
    hash the last one verified), beside applying each link into new tensors from a re-hashed
    base (what synchronize did before); medians over `repeats`, one thread."""
    refs, objects = [], {}
    for v in range(1, len(traj)):
        data = encode_patch(traj[v - 1], traj[v], v - 1, v, level=level)
        objects[str(v)] = data
        refs.append(PatchRef(v - 1, v, len(data), str(v)))
    last = len(traj) - 1

    def copying():
        state = traj[0]
        for ref in refs:
            state = apply_patch(state, objects[ref.key])
        return state

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state = fn()
            times.append(time.perf_counter() - start)
        if state_hash(state) != state_hash(traj[last]):
            raise RuntimeError(f"{name}: the chain did not rebuild the last state")
        return 1e3 * float(np.median(times))

    sync_ms = median_ms(lambda: synchronize(traj[0], 0, last, refs, lambda ref: objects[ref.key])[0])
    return {"name": name, "lr": lr, "links": len(refs), "sync_ms": sync_ms, "copying_ms": median_ms(copying)}


def tiny_cases(lrs, ks, steps, level) -> list[dict]:
    task = ReversalTask(length=8)
    cases = []
    for lr in lrs:
        lm = load_model("tiny-base")
        traj = bf16_trajectory(
            lm, task, dict(lm.model.named_parameters()), lr, steps, 10, 10, 0, f"tiny lr={lr:g}"
        )
        cases += [measure("tiny-full", lr, k, traj, level, timed=True) for k in ks if k < len(traj)]
    return cases


def lora_cases(lrs, ks, steps, level) -> list[dict]:
    task = ReversalTask(length=8)
    cases = []
    for lr in lrs:
        lm = load_model("tiny-base")
        lm.model = add_lora(lm.model, LoraSettings(rank=8))
        params = {n: p for n, p in lm.model.named_parameters() if "lora_" in n}
        traj = bf16_trajectory(lm, task, params, lr, steps, 10, 10, 0, f"lora lr={lr:g}")
        cases += [measure("tiny-lora", lr, k, traj, level, timed=True) for k in ks if k < len(traj)]
    return cases


def smollm2_cases(lrs, ks, steps, level, chains: list, layers=range(0, 6)) -> list[dict]:
    """Full-weight updates of one block of layers of SmolLM2-135M at RL learning rates; each
    trajectory's chain sync speed goes onto `chains`."""
    task = AdditionTask()
    cases = []
    for lr in lrs:
        lm = load_model("smollm2-135m")
        prefixes = tuple(f"model.layers.{i}." for i in layers)
        params = {n: p for n, p in lm.model.named_parameters() if n.startswith(prefixes)}
        traj = bf16_trajectory(lm, task, params, lr, steps, 4, 4, 0, f"smollm2 block lr={lr:g}")
        cases += [measure("smollm2-135m-block", lr, k, traj, level, timed=True) for k in ks if k < len(traj)]
        chains.append(chain_speed("smollm2-135m-block", lr, traj, level))
    return cases


def add_arguments(parser) -> None:
    parser.add_argument("--level", type=integer(1, 22), default=1, help="zstd level (1-22)")
    parser.add_argument(
        "--cases", nargs="+", choices=["tiny", "lora", "smollm2"], help="which trajectories (default: all)"
    )
    parser.add_argument(
        "--smollm2-steps", type=integer(1), default=24, help="DG steps per lr on SmolLM2 (full mode)"
    )


def table(cases: list[dict]) -> str:
    head = (
        f"{'case':20} {'lr':>7} {'k':>3} {'sparsity':>9} {'ratio':>8} {'zstd':>6} {'coo':>7} "
        f"{'enc MB/s':>9} {'dec MB/s':>9} {'memcpy':>8} {'enc/cpy':>7} {'enc*/cpy':>8} {'dec/cpy':>7} "
        f"{'link/cpy':>8} {'hash/cpy':>8} {'exact':>6}"
    )
    rows = [head]
    for c in (c for c in cases if c["pairs"]):
        copy = c.get("memcpy_mb_s", 1)
        rows.append(
            f"{c['name']:20} {c['lr']:7.0e} {c['k']:3d} {100 * c['sparsity']:8.2f}% {c['ratio']:8.1f} "
            f"{c['ratio_zstd_dense']:6.2f} {c['ratio_raw_coo']:7.1f} {c.get('encode_mb_s', 0):9.0f} "
            f"{c.get('decode_mb_s', 0):9.0f} {c.get('memcpy_mb_s', 0):8.0f} "
            f"{c.get('encode_mb_s', 0) / copy:7.2f} {c.get('encode_known_mb_s', 0) / copy:8.2f} "
            f"{c.get('decode_mb_s', 0) / copy:7.2f} {c.get('link_decode_mb_s', 0) / copy:8.2f} "
            f"{c.get('hash_mb_s', 0) / copy:8.2f} "
            f"{str(c['bit_identical']):>6}"
        )
    return "\n".join(rows)


def sparse_summary(cases: list[dict], at_least: float = 0.99) -> str:
    """The patches at least `at_least` sparse, per model: how many, and the smallest ratio."""
    rows = []
    for name in dict.fromkeys(c["name"] for c in cases):
        pairs = [
            p for c in cases if c["name"] == name for p in c.get("per_pair", []) if p["sparsity"] >= at_least
        ]
        if pairs:
            worst = min(pairs, key=lambda p: p["ratio"])
            rows.append(
                f"{name}: {len(pairs)} patches >= {100 * at_least:g}% sparse, smallest ratio "
                f"{worst['ratio']:.0f}x (at {100 * worst['sparsity']:.2f}%)"
            )
    return "\n".join(rows)


def plot(cases: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in cases if c["pairs"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, lr) in enumerate(sorted({(c["name"], c["lr"]) for c in cases})):
        cs = sorted((c for c in cases if (c["name"], c["lr"]) == (name, lr)), key=lambda c: c["k"])
        ks = [c["k"] for c in cs]
        axes[0].plot(
            ks, [100 * c["sparsity"] for c in cs], "o-", color=f"C{i % 10}", label=f"{name} lr={lr:g}"
        )
        axes[1].plot(ks, [c["ratio"] for c in cs], "o-", color=f"C{i % 10}")
    for ax, label in zip(axes, ("sparsity (% unchanged bf16 values)", "compression ratio (dense / patch)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (steps between versions)")
        ax.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    torch.set_num_threads(1)
    chosen = set(args.cases or (["tiny", "lora"] if args.quick else ["tiny", "lora", "smollm2"]))
    chains: list[dict] = []
    if args.quick:
        ks = [1, 4, 8]
        cases = tiny_cases([1e-6, 1e-4], ks, 8, args.level) if "tiny" in chosen else []
        cases += lora_cases([1e-4], ks, 8, args.level) if "lora" in chosen else []
        cases += smollm2_cases([3e-6], [1, 2], 4, args.level, chains) if "smollm2" in chosen else []
    else:
        ks = [1, 2, 4, 8, 16, 32]
        cases = tiny_cases([1e-6, 3e-6, 1e-5, 1e-4], ks, 64, args.level) if "tiny" in chosen else []
        cases += lora_cases([1e-5, 1e-4, 1e-3], ks, 64, args.level) if "lora" in chosen else []
        ks_smol = [k for k in ks if k < args.smollm2_steps]
        if "smollm2" in chosen:
            cases += smollm2_cases([1e-6, 3e-6], ks_smol, args.smollm2_steps, args.level, chains)
    out = write_json(
        {"benchmark": "pulse", "quick": args.quick, "level": args.level, "cases": cases, "chains": chains},
        args.out,
    )
    plot(cases, out.with_suffix(".png"))
    print(table(cases))
    print(sparse_summary(cases))
    for c in chains:
        print(
            f"{c['name']} lr={c['lr']:g}: sync through {c['links']} one-step patches {c['sync_ms']:.0f} ms "
            f"(each link into new tensors from a re-hashed base: {c['copying_ms']:.0f} ms)"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
