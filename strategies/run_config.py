"""Every knob of a coordinator run in one dataclass (Flower run config keys may use dashes)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from fedrl.protocol import MODES, ProtocolError, record_to_dataclass
from fedrl.sim.profiles import ClientProfile, ProfileError, resolve_profiles


@dataclass(frozen=True)
class RunConfig:
    mode: str = "parablock"  # parablock | block-sequential | fedavg-lora
    sync: bool = False  # True: round barrier with deadline; False: FedBuff-style async
    model: str = "tiny-base"
    task: str = "reversal"
    task_params: str = '{"length": 8}'
    num_blocks: int = 3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lr: float = 5e-4
    prompts: int = 8
    samples: int = 8
    method: str = "dg"
    schedule: str = "cyclic"  # cyclic | random | lru
    base_steps: int = 6  # local steps for a client of median speed
    min_steps: int = 1
    max_steps: int = 24
    versions: int = 30  # stop after this many global versions
    buffer_size: int = 3  # async: aggregate after this many accepted updates
    max_staleness: int = 6
    alpha: float = 0.5
    robust: str = "mean"  # mean | trimmed-mean | median
    clip_norm: float = 0.0  # 0: off
    deadline_s: float = 300.0  # per-message ttl: the straggler deadline
    anchor_every: int = 5
    eval_every: int = 4
    min_nodes: int = 2
    node_wait_s: float = 120.0
    max_time_s: float = 0.0  # stop after this many seconds on the run's clock; 0: no limit
    target_error: float = 0.0  # stop once a held-out eval reaches this error; 0: never
    clock: str = "real"  # real: wall time; virtual: simulated time (fedrl.sim.clock)
    step_s: float = 0.0  # virtual seconds per local step at speed 1; 0: measured on this machine at start
    stall_replies: int = 200  # stop when this many replies in a row bring no new version
    seed: int = 0
    out_dir: str = "runs/latest"
    checkpoint_dir: str = ""  # default: OUT_DIR/checkpoints
    store_url: str = ""  # empty: run the patch store inside the ServerApp
    store_secret_file: str = ""  # deployments: the secret shared with the standalone store
    profiles: str = ""  # a mix name, a profile file, or a JSON list of profiles (fedrl.sim.profiles)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ProtocolError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.versions < 1 or self.buffer_size < 1 or self.min_nodes < 1 or self.eval_every < 1:
            raise ProtocolError("versions, buffer_size, min_nodes and eval_every must be >= 1")
        if self.clock not in ("real", "virtual") or self.step_s < 0 or self.max_time_s < 0:
            raise ProtocolError(f"clock must be real or virtual (got {self.clock!r}); step_s, max_time_s >= 0")
        try:
            json.loads(self.task_params)
        except ValueError:
            raise ProtocolError("task_params must be JSON") from None
        try:
            self.client_profiles(1)
        except ProfileError as err:
            raise ProtocolError(str(err)) from None

    def client_profiles(self, n: int) -> list[ClientProfile]:
        return resolve_profiles(self.profiles, n, self.seed)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "RunConfig":
        normalized = {k.replace("-", "_"): v for k, v in values.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(normalized) - known)
        if unknown:
            raise ProtocolError(f"unknown run config keys: {unknown}")
        return record_to_dataclass(cls, normalized)

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)
