"""The simulation around the real coordinator: its settings, its clock, and the Grid
wrapper that stamps each outgoing message with what the simulated client needs.

`SimConfig` is what a simulation adds to a run (profiles, clock mode, unit of work); the
coordinator never sees it. `run_simulated` measures the unit of work if asked, injects a
virtual clock (or the real one) and runs the real coordinator over a `SimulatedGrid`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord
from pydantic import model_validator

from fedrl.blocks import ALL_BLOCKS
from fedrl.clock import RealClock
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.lora import build_adapter_model
from fedrl.protocol import InstructionHead
from fedrl.rollout import rollout, score
from fedrl.schema import Schema, SchemaError
from fedrl.sim.clock import VirtualClock
from fedrl.sim.profiles import ClientProfile, ProfileError, resolve_profiles
from fedrl.sim.simulated_client import STAMP, Stamp
from fedrl.strategies.coordinator import run_coordinator
from fedrl.strategies.run_config import RunConfig
from fedrl.tasks import get_task


class SimConfig(Schema):
    clock: str = "virtual"  # virtual: simulated time; real: wall time, slow clients really sleep
    step_s: float = 0.0  # seconds of one local step at speed 1; 0: measured on this machine at start
    profiles: str = ""  # a mix name, a profile file, or a JSON list of profiles (fedrl.sim.profiles)

    @model_validator(mode="after")
    def _consistent(self):
        if self.clock not in ("real", "virtual"):
            raise ValueError(f"clock must be real or virtual, got {self.clock!r}")
        if not 0 <= self.step_s < float("inf"):
            raise ValueError(f"step_s must be a finite number >= 0 (0: measured here), got {self.step_s}")
        try:
            resolve_profiles(self.profiles, 1)
        except ProfileError as err:
            raise ValueError(str(err)) from None
        return self


def split_config(values: Mapping[str, Any]) -> tuple[RunConfig, SimConfig]:
    """One mapping of settings (a scenario's [run], `--set`, Flower's run config) into the
    coordinator's part and the simulation's part."""
    values = {k.replace("-", "_"): v for k, v in values.items()}
    sim = {k: v for k, v in values.items() if k in SimConfig.model_fields}
    run = {k: v for k, v in values.items() if k not in SimConfig.model_fields}
    return RunConfig.from_mapping(run), SimConfig.parse(sim, "simulation config")


class SimulatedGrid:
    """A Flower Grid whose outgoing messages carry the simulation stamp of their client."""

    def __init__(self, grid, sim: SimConfig, step_s: float, clock, profiles: list[ClientProfile]):
        self.grid, self.sim, self.step_s, self.clock, self.profiles = grid, sim, step_s, clock, profiles
        self.run = uuid.uuid4().hex

    def profile(self, client_id: int) -> ClientProfile:
        return self.profiles[client_id % len(self.profiles)]

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def pull_messages(self, ids):
        return self.grid.pull_messages(ids)

    def push_messages(self, msgs):
        for m in msgs:
            profile = self.profile(InstructionHead.unpack(m.content["instruction"])["client_id"])
            stamp = Stamp(
                profile=profile.to_json(),
                clock=self.sim.clock,
                step_s=self.step_s,
                now_s=self.clock.now(),
                run=self.run,
            )
            m.content[STAMP] = ConfigRecord(stamp.to_record())
        return self.grid.push_messages(msgs)


def calibrate_step_s(cfg: RunConfig, repeats: int = 3) -> float:
    """Seconds of one local DG step on this machine: the virtual clock's unit of work."""
    adapter = build_adapter_model(cfg.model, cfg.lora_rank, cfg.lora_alpha, cfg.num_blocks)
    task = get_task(cfg.task, **json.loads(cfg.task_params))
    block = ALL_BLOCKS if cfg.mode == "fedavg-lora" else 0
    learner = Learner(
        adapter.part.make_trainable(adapter.lm.model, block),
        LearnerConfig.of(cfg),
    )
    rng, gen = np.random.default_rng(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        problems = task.sample(cfg.prompts, rng)
        batch = score(
            task, rollout(adapter.lm, task, problems, cfg.samples, generator=gen, temperature=cfg.temperature)
        )
        lm_update(learner, adapter.lm.model, batch)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def run_simulated(grid, cfg: RunConfig, sim: SimConfig, progress=None) -> dict:
    """The real coordinator over `grid`, with the simulation's clock and stamps."""
    step_s = sim.step_s or calibrate_step_s(cfg)
    try:
        profiles = resolve_profiles(sim.profiles, cfg.min_nodes, cfg.seed)
    except ProfileError as err:
        raise SchemaError(f"simulation config: {err}") from None

    def lookahead(
        instr,
    ) -> float:  # no reply can come before the round's compute is done, nor after the deadline
        speed = profiles[instr.client_id % len(profiles)].speed
        return min(instr.steps * step_s / speed, cfg.deadline_s)

    clock = (  # replies due at one virtual time: by client id, the same order every run
        VirtualClock(lookahead, tie=lambda instr: instr.client_id) if sim.clock == "virtual" else RealClock()
    )
    sim_grid = SimulatedGrid(grid, sim, step_s, clock, profiles)
    summary = run_coordinator(sim_grid, cfg, clock, progress)
    for c in summary["clients"].values():
        c["profile"] = sim_grid.profile(c["client_id"]).name
    summary["simulation"] = {**sim.model_dump(), "step_s": step_s}
    return summary
