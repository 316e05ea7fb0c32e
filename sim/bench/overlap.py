"""`fedrl bench overlap`: round time of block-sequential vs parablock rounds vs the ideal
max(comm, compute), across comm/compute ratios.

Both modes run the ClientApp's own block worker against a real patch store on loopback,
with a link whose bandwidth is set so that the round's bytes take `ratio` x the measured
compute time. Real mode shapes the transfers with a token bucket and times the round on the
wall clock; virtual mode runs the same round on the virtual clock (each step charged the
measured step time, link seconds = latency + bytes / bandwidth) and reads its duration.
"""

from __future__ import annotations

import json
import time

import torch

from fedrl.arguments import integer
from fedrl.bench.common import write_json
from fedrl.clients.block_worker import ClientState, Pending, handle
from fedrl.clients.model_cache import ModelCache
from fedrl.clients.runtime import use_runtime
from fedrl.credentials import ADMIN, new_secret, node_principal, token_for, token_source
from fedrl.link import CHUNK
from fedrl.patch_chain import PatchPublisher
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.protocol import TrainInstruction
from fedrl.signing import generate_signing_key, public_key_pem
from fedrl.sim.link import LinkProfile
from fedrl.sim.profiles import ClientProfile
from fedrl.sim.simulated_client import SimulatedRuntime
from fedrl.store_client import BlockingStoreClient, put_signed_patches

NUM_BLOCKS, BLOCK = 3, 1


class Federation:
    """A store holding global versions 0 and 1 of a tiny LoRA adapter, and a client's state at v0.
    The store runs in this process, or is a running one at `store_url` (given its `secret`)."""

    def __init__(self, store_url: str = "", secret: bytes = b""):
        self.secret, key = secret or new_secret(), generate_signing_key()
        self.public_key = public_key_pem(key).decode()
        self.server = None if store_url else PatchStoreServer(StoreState(self.secret)).start()
        self.store_url = store_url or self.server.url
        self.models = ModelCache()
        adapter = self.models.get("tiny-base", 8, 16.0, NUM_BLOCKS)
        lm, part = adapter.lm, adapter.part
        g = torch.Generator().manual_seed(0)
        v0 = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in part.get_all(lm.model).items()}
        v1 = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in v0.items()}
        admin = BlockingStoreClient(self.store_url, ADMIN, token_source(self.secret))
        publisher, refs = PatchPublisher(anchor_every=100), []
        for version, state in ((0, v0), (1, v1)):
            refs += put_signed_patches(admin, publisher.publish(state, version), key)
        admin.publish({"latest": 1, "refs": refs, "public_key": self.public_key})
        admin.close()
        names = part.names(BLOCK)
        new_block = {n: v0[n] + 1e-3 * torch.randn(v0[n].shape, generator=g) for n in names}
        self.state = ClientState(v0, v0, 0, Pending(BLOCK, 0, {n: v0[n] for n in names}, new_block, 64))

    def instruction(self, mode: str, steps: int) -> TrainInstruction:
        return TrainInstruction(
            action="train",
            mode=mode,
            block=BLOCK,
            steps=steps,
            version=1,
            store_url=self.store_url,
            principal=node_principal(1),
            token=token_for(self.secret, node_principal(1)),
            public_key=self.public_key,
            model="tiny-base",
            task="reversal",
            task_params=json.dumps({"length": 8}),
            num_blocks=NUM_BLOCKS,
            lora_rank=8,
            lora_alpha=16.0,
            lr=5e-4,
            prompts=8,
            samples=8,
            method="dg",
            seed=0,
            client_id=0,
            data_shards=1,
        )

    def round(self, mode: str, steps: int, link: LinkProfile | None, step_s: float = 0.0):
        """One round from the same starting state; parablock starts with a pending delta to push.
        step_s > 0: on the virtual clock, each step charged step_s."""
        state = self.state if mode == "parablock" else ClientState(self.state.local, self.state.held, 0, None)
        link = link or LinkProfile()
        profile = ClientProfile(
            up_bytes_s=link.up_bytes_s, down_bytes_s=link.down_bytes_s, latency_s=link.latency_s
        )
        # the simulated client's runtime: shaped links on the wall clock, or virtual time at step_s per step
        with use_runtime(SimulatedRuntime(profile, virtual=step_s > 0, step_s=step_s or 1.0)):
            report, _ = handle(self.instruction(mode, steps), state, self.models)
        return report

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def measure(fed: Federation, ratios: list[float], steps: int, repeats: int) -> list[dict]:
    # Unshaped rounds give the compute time and the bytes each mode moves.
    fed.round("parablock", steps, None)  # warm-up: model load, caches
    seq0 = fed.round("block-sequential", steps, None)
    par0 = fed.round("parablock", steps, None)
    compute = min(seq0.compute_s, par0.compute_s)
    up, down = par0.bytes_up, par0.bytes_down  # the same patches travel in both modes
    latency = 0.01
    cases = []
    for ratio in ratios:
        # comm = 2 latencies + (up + down) / rate = ratio * compute  (symmetric link)
        rate = (up + down) / max(ratio * compute - 2 * latency, 1e-3)
        link = LinkProfile(rate, rate, latency)
        vseq = fed.round("block-sequential", steps, link, compute / steps)
        vpar = fed.round("parablock", steps, link, compute / steps)
        cases.append(_case("virtual", ratio, vseq.duration_s, vpar.duration_s, vpar.compute_s, vpar.comm_s))
        seq = [fed.round("block-sequential", steps, link) for _ in range(repeats)]
        par = [fed.round("parablock", steps, link) for _ in range(repeats)]
        best_par = min(par, key=lambda r: r.duration_s)
        # the ideal for the overlapped round is max of its own compute and its own transfers
        # (the sequential round moves a different pending delta and opens a second session)
        real = _case(
            "real",
            ratio,
            min(r.duration_s for r in seq),
            best_par.duration_s,
            best_par.compute_s,
            best_par.comm_s,
        )
        # what the token buckets allow at best (each may bank one chunk while idle): load only adds to it
        real["min_comm_s"] = sum(max(0, n - CHUNK) / rate for n in (best_par.bytes_up, best_par.bytes_down))
        cases.append(real)
    return cases


def _case(mode: str, ratio: float, sequential: float, overlapped: float, compute: float, comm: float) -> dict:
    ideal = max(compute, comm)
    return {
        "mode": mode,
        "comm_compute_ratio": ratio,
        "round_s_sequential": sequential,
        "round_s_overlapped": overlapped,
        "ideal_s": ideal,
        "compute_s": compute,
        "comm_s": comm,
        "speedup": sequential / overlapped,
        "efficiency": ideal / overlapped,
    }


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=integer(1), help="local DG steps per round (default 12; quick 6)")
    parser.add_argument(
        "--repeats", type=integer(1), help="rounds per case, the fastest counts (default 2; quick 1)"
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="instead: store and clients as processes in network namespaces, links shaped by tc (root)",
    )


def main(args) -> int:
    torch.set_num_threads(1)
    ratios = [0.5, 1.0, 2.0] if args.quick else [0.25, 0.5, 1.0, 2.0, 4.0]
    steps = args.steps or (6 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 2)
    fed = Federation()
    start = time.perf_counter()
    skipped = None
    try:
        if args.netns:
            from fedrl.sim.bench import netns

            fed.round("parablock", steps, None)  # warm-up
            unshaped = fed.round("parablock", steps, None)  # the compute and bytes the rates are planned on
            skipped = netns.unavailable()
            cases = [] if skipped else netns.measure(steps, repeats, unshaped)
        else:
            cases = measure(fed, ratios, steps, repeats)
    finally:
        fed.close()
    if skipped:
        print(f"netns: skipped: {skipped}")
    out = write_json(
        {
            "benchmark": "overlap",
            "quick": args.quick,
            "steps": steps,
            "wall_s": time.perf_counter() - start,
            "cases": cases,
            **({"netns_skipped": skipped} if skipped else {}),
        },
        args.out,
    )
    plot(cases, out.with_suffix(".png"))
    print(
        f"{'mode':8} {'ratio':>6} {'sequential':>11} {'overlapped':>11} {'ideal':>7} {'speedup':>8} "
        f"{'efficiency':>10}"
    )
    for c in cases:
        print(
            f"{c['mode']:8} {c['comm_compute_ratio']:6.2f} {c['round_s_sequential']:10.2f}s "
            f"{c['round_s_overlapped']:10.2f}s "
            f"{c['ideal_s']:6.2f}s {c['speedup']:7.2f}x {c['efficiency']:10.2f}"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(cases: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("virtual", "real", "netns") if any(c["mode"] == m for c in cases)] or ["real"]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, mode in zip(axes, modes):
        cs = [c for c in cases if c["mode"] == mode]
        x = [c["comm_compute_ratio"] for c in cs]
        ax.plot(x, [c["round_s_sequential"] for c in cs], "o-", label="block-sequential")
        ax.plot(x, [c["round_s_overlapped"] for c in cs], "o-", label="parablock (overlapped)")
        ax.plot(x, [c["ideal_s"] for c in cs], "k--", label="ideal max(comm, compute)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("comm / compute")
        ax.set_title({"netns": "namespaces, tc-shaped links"}.get(mode, f"{mode} links"))
    axes[0].set_ylabel("round time (s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
