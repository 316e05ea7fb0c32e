"""The hardware probe a volunteer runs before taking work: what the machine has, how fast it
takes one learner step of the run's own model, and how fast its (capped) link to the patch
store is. From these it picks the most steps per round and prompts per step it will take on;
the ClientApp keeps to them and reports them, and the coordinator's scheduler sizes its work
with them (fedrl.protocol.HardwareProbe).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from fedrl.clients.block_worker import train_steps
from fedrl.clients.runtime import CommResult, Runtime
from fedrl.invite import Invite
from fedrl.link import RateLimitedLink
from fedrl.lora import build_adapter_model
from fedrl.protocol import HardwareProbe, LearnerSettings, TrainInstruction
from fedrl.store_client import PatchStoreClient

MAX_STEPS_PER_ROUND = 64


@dataclass(frozen=True)
class Limits:
    """What a volunteer allows fedrl to use (0: no limit of its own)."""

    max_cpu: int = 0  # threads
    max_memory_mb: float = 0.0
    upload_kbps: float = 0.0
    download_kbps: float = 0.0
    round_s: float = 60.0  # the longest local compute of one round it wants to give

    def __post_init__(self):
        limits = (self.max_cpu, self.max_memory_mb, self.upload_kbps, self.download_kbps)
        if not all(0 <= x < float("inf") for x in limits):  # NaN fails too
            raise ValueError("limits must be finite numbers >= 0 (0: no limit)")
        if not 0 < self.round_s < float("inf"):
            raise ValueError(f"round_s must be a finite number > 0, got {self.round_s}")

    def threads(self) -> int:
        cores = os.cpu_count() or 1
        return min(self.max_cpu, cores) if self.max_cpu else cores

    def cap_bytes_s(self, kbps: float) -> float:
        return kbps * 1000 / 8 if kbps else float("inf")

    def declared_cap(self, kbps: float) -> float:
        """The cap as a probe records it: bytes/s, 0 for none."""
        return kbps * 1000 / 8 if kbps else 0.0


def accelerator() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def probe_instruction(invite: Invite, prompts: int) -> TrainInstruction:
    """A local instruction of the run's learner (nothing is sent; block 0, one shard)."""
    return TrainInstruction(
        **(LearnerSettings.of(invite) | {"prompts": prompts}),
        action="train",
        mode="parablock",
        block=0,
        steps=3,
        version=0,
        store_url=invite.store_url,
        principal=invite.principal,
        token=invite.token,
        public_key="",
        seed=0,
        client_id=0,
        data_shards=1,
    )


def measure_step(invite: Invite, threads: int) -> tuple[float, float, float]:
    """(seconds per learner step, resident MB before, peak resident MB) at the run's batch."""
    torch.set_num_threads(threads)
    adapter = build_adapter_model(invite.model, invite.lora_rank, invite.lora_alpha, invite.num_blocks)
    names = adapter.part.names(0)
    before_mb = psutil.Process().memory_info().rss / 2**20
    instr = probe_instruction(invite, invite.prompts)
    warm = instr.replace(steps=1)
    train_steps(warm, adapter, names, dict(adapter.initial), CommResult(), Runtime(), True, {})
    _, _, metrics, (begin, end), _ = train_steps(
        instr, adapter, names, dict(adapter.initial), CommResult(), Runtime(), True, {}
    )
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return (end - begin) / max(1, len(metrics)), before_mb, peak_mb


async def measure_link(invite: Invite, ca_file: str, limits: Limits) -> tuple[float, float]:
    """(upload, download) bytes/s to the patch store through the volunteer's capped link. The
    sizes take about two seconds at the cap (at most 4 MiB without one)."""
    up_cap, down_cap = limits.cap_bytes_s(limits.upload_kbps), limits.cap_bytes_s(limits.download_kbps)
    size = lambda cap: int(min(4 << 20, max(64 << 10, 2 * cap)))  # noqa: E731
    link = RateLimitedLink(up_cap, down_cap)
    async with PatchStoreClient(invite.store_url, invite.principal, invite.token, link, ca_file=ca_file) as c:
        await c.probe_up(16 << 10)  # the TLS handshake and the first request, outside the timing
        start = time.perf_counter()
        sent = await c.probe_up(size(up_cap))
        up_s = time.perf_counter() - start
        start = time.perf_counter()
        received = await c.probe_down(size(down_cap))
        down_s = time.perf_counter() - start
    return sent / up_s, received / down_s


def choose_prompts(prompts: int, before_mb: float, peak_mb: float, max_memory_mb: float) -> int:
    """The most prompts per step whose estimated peak stays under the memory limit (halving)."""
    if not max_memory_mb:
        return prompts
    per_prompt = max(peak_mb - before_mb, 1.0) / prompts
    while prompts > 1 and before_mb + per_prompt * prompts > max_memory_mb:
        prompts //= 2
    return prompts


def run_probe(invite: Invite, ca_file: str, limits: Limits) -> HardwareProbe:
    threads = limits.threads()
    step_s, before_mb, peak_mb = measure_step(invite, threads)
    up, down = asyncio.run(measure_link(invite, ca_file, limits))
    prompts = choose_prompts(invite.prompts, before_mb, peak_mb, limits.max_memory_mb)
    steps = int(np.clip(limits.round_s / (step_s * prompts / invite.prompts), 1, MAX_STEPS_PER_ROUND))
    return HardwareProbe(
        cores=os.cpu_count() or 1,
        threads=threads,
        memory_mb=round(psutil.virtual_memory().total / 2**20, 1),
        memory_limit_mb=float(limits.max_memory_mb),
        accelerator=accelerator(),
        model=invite.model,
        step_s=round(step_s, 4),
        up_bytes_s=round(up, 1),
        down_bytes_s=round(down, 1),
        upload_cap_bytes_s=limits.declared_cap(limits.upload_kbps),
        download_cap_bytes_s=limits.declared_cap(limits.download_kbps),
        steps_per_round=steps,
        prompts=prompts,
    )


def probe_matches(p: HardwareProbe, invite: Invite, limits: Limits) -> bool:
    """Whether a kept probe was made for this run's model and these limits."""
    return (
        p.model == invite.model
        and p.threads == limits.threads()
        and p.memory_limit_mb == limits.max_memory_mb
        and p.upload_cap_bytes_s == limits.declared_cap(limits.upload_kbps)
        and p.download_cap_bytes_s == limits.declared_cap(limits.download_kbps)
        and p.prompts <= invite.prompts
    )


def probe_table(p: HardwareProbe) -> str:
    rate = lambda b: f"{b * 8 / 1000:,.0f} kbit/s"  # noqa: E731
    cap = lambda b: f" (cap {rate(b)})" if b else ""  # noqa: E731
    rows = [
        ("cores", f"{p.cores} (learner threads: {p.threads})"),
        (
            "memory",
            f"{p.memory_mb:,.0f} MB" + (f" (limit {p.memory_limit_mb:,.0f} MB)" if p.memory_limit_mb else ""),
        ),
        ("accelerator", p.accelerator),
        ("model", p.model),
        ("learner step", f"{p.step_s:.3f} s"),
        ("upload to store", rate(p.up_bytes_s) + cap(p.upload_cap_bytes_s)),
        ("download from store", rate(p.down_bytes_s) + cap(p.download_cap_bytes_s)),
        ("steps per round", str(p.steps_per_round)),
        ("prompts per step", str(p.prompts)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def probe_json(p: HardwareProbe) -> str:
    return json.dumps(p.model_dump(), indent=1)
