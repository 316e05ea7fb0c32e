"""The control-plane messages: what the coordinator asks of a client and what it reports.

Both travel as flat Flower ConfigRecords; `from_record` validates every field so a
malformed message is refused with a clear error instead of crashing a thread later.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

from fedrl.sim.profiles import ClientProfile

MESSAGE_TYPE = "train.block"
MODES = ("parablock", "block-sequential", "fedavg-lora")
ACTIONS = ("train", "flush")


class ProtocolError(ValueError):
    pass


def record_to_dataclass(cls, record: Mapping[str, Any]):
    """Build `cls` from a flat mapping, checking each field's type (int, float, str, bool)."""
    values = {}
    for f in fields(cls):
        if f.name not in record:
            if f.default is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {f.name!r}")
            continue
        value, kind = record[f.name], f.type
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "str": isinstance(value, str), "bool": isinstance(value, bool)}[kind]
        if not ok:
            raise ProtocolError(f"{cls.__name__}: field {f.name!r} must be {kind}, got {type(value).__name__}")
        values[f.name] = float(value) if kind == "float" else value
    return cls(**values)


@dataclass(frozen=True)
class TrainInstruction:
    action: str
    mode: str
    block: int  # -1: every block (fedavg-lora)
    steps: int
    version: int  # the global version to sync to
    store_url: str
    principal: str
    token: str
    public_key: str  # PEM of the coordinator's Ed25519 key; global patches must verify with it
    model: str
    task: str
    task_params: str  # JSON
    num_blocks: int
    lora_rank: int
    lora_alpha: float
    lr: float
    prompts: int
    samples: int
    method: str
    seed: int
    client_id: int
    num_clients: int
    round: int = 0  # this node's message counter (seeds its randomness)
    profile: str = "{}"  # JSON of the simulated client profile (fedrl.sim.profiles.ClientProfile)
    clock: str = "real"  # real | virtual (see fedrl.sim.clock)
    step_s: float = 0.0  # virtual seconds of one local step at speed 1
    now_s: float = 0.0  # the run's clock when the message was sent

    def __post_init__(self):
        if self.action not in ACTIONS or self.mode not in MODES:
            raise ProtocolError(f"unknown action {self.action!r} or mode {self.mode!r}")
        if self.steps < 0 or self.version < 0 or self.num_blocks < 1 or self.prompts < 1 or self.samples < 1:
            raise ProtocolError("steps and version must be >= 0; num_blocks, prompts, samples >= 1")
        if not -1 <= self.block < self.num_blocks or (self.block == -1) != (self.mode == "fedavg-lora"):
            raise ProtocolError(f"block {self.block} does not fit mode {self.mode} with {self.num_blocks} blocks")
        if self.clock not in ("real", "virtual") or (self.clock == "virtual" and self.step_s <= 0):
            raise ProtocolError(f"clock must be real or virtual (virtual needs step_s > 0), got {self.clock!r}")
        try:
            json.loads(self.task_params)
        except ValueError:
            raise ProtocolError("task_params must be JSON") from None
        self.client_profile  # validates

    @property
    def client_profile(self) -> ClientProfile:
        try:
            return ClientProfile.from_mapping(json.loads(self.profile))
        except (ValueError, TypeError) as err:
            raise ProtocolError(f"profile: {err}") from None

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "TrainInstruction":
        return record_to_dataclass(cls, record)


@dataclass(frozen=True)
class TrainReport:
    upload_key: str  # "" when nothing was uploaded
    upload_block: int
    upload_base_version: int
    upload_samples: int
    synced_version: int  # the global version the client holds now
    reward: float
    loss: float
    gate_mean: float
    steps: int
    compute_s: float
    comm_s: float
    overlap_s: float
    duration_s: float  # the round's length on the run's clock (virtual seconds in virtual mode)
    bytes_up: int
    bytes_down: int
    staleness: int  # versions between the local copy compute started from and the instruction's

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "TrainReport":
        report = record_to_dataclass(cls, record)
        if report.upload_key and (len(report.upload_key) != 64 or set(report.upload_key) - set("0123456789abcdef")):
            raise ProtocolError("upload_key must be a SHA-256 hex digest")
        return report
