"""The control-plane messages: what the coordinator asks of a client and what it reports.

Both travel as flat Flower ConfigRecords (what is sent every round packed, by position) and are
validated by their schema on arrival, so a malformed message is refused with one clear line
instead of crashing a thread later. They
carry what a real deployment has: assignments, versions, store references, measured
timings. Nothing about simulated clients travels here (fedrl.sim wraps the apps instead).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from pydantic import model_validator

from fedrl.bounds import at_least
from fedrl.schema import Schema

MESSAGE_TYPE = "train.block"
MODES = ("parablock", "block-sequential", "fedavg-lora")
# train: a round on a block; flush: hand in the pending delta only; goodbye: the node that withdrew is
# off the schedule (its owner may stop it: its last reply was pulled); run-over: the run ended and
# every reply was pulled (an owner who withdraws now has nothing left to wait for); rest: the
# node's last updates were refused for their direction, and it is asked nothing for rest_s
# seconds (its replies were pulled: its owner may leave at once)
NOTICES = ("goodbye", "run-over", "rest")  # they ask for no work; nobody reads their answers
ACTIONS = ("train", "flush", *NOTICES)
NO_UPLOAD = -2  # upload_block when a reply carries no upload
LEAVING = ("", "after-flush", "now")
WIRE_DTYPES = ("float32", "bfloat16", "float16")  # what published versions may be cast to
LOSS_NAMES = ("dg", "reinforce", "iw_pg", "ppo", "decoupled_ppo")  # fedrl.losses.LOSSES, by name


def check_json(text: str, what: str) -> None:
    try:
        json.loads(text)
    except ValueError:
        raise ValueError(f"{what} must be JSON, got {text[:60]!r}") from None


def check_upload_density(density: float, mode: str) -> None:
    if not 0 < density <= 1 or (density < 1 and mode == "fedavg-lora"):
        raise ValueError(
            f"upload_density must be in (0, 1] (1 for fedavg-lora, which sends whole adapters); got {density}"
        )


def check_wire_dtype(dtype: str) -> None:
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {dtype!r}")


def check_learner(settings) -> None:
    """What a learner can train with, checked where the settings are written (a run config, an
    invite) and where they arrive (every instruction): a negative lr or an unknown loss would
    otherwise fail on every client, every round, while the coordinator waits for updates."""
    from fedrl.tasks import get_task  # light: no torch

    s = settings
    check_json(s.task_params, "task_params")
    params = json.loads(s.task_params)
    if not isinstance(params, dict):
        raise ValueError(f"task_params must be a JSON object, got {s.task_params[:60]!r}")
    get_task(s.task, **params)  # unknown tasks, parameters and values; tasks make their problems lazily
    if s.method not in LOSS_NAMES:
        raise ValueError(f"method must be one of {LOSS_NAMES}, got {s.method!r}")
    at_least(s, 1, "num_blocks", "lora_rank", "prompts", "samples")
    for name in ("lr", "lora_alpha", "temperature"):
        if not 0 < getattr(s, name) < float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {getattr(s, name)}")
    at_least(s, 0, "micro_batch")
    if not 0 <= s.dg_eta < float("inf"):
        raise ValueError(f"dg_eta must be a finite number >= 0 (0: the hard gate), got {s.dg_eta}")
    if not 0 < s.ppo_clip < 1:
        raise ValueError(f"ppo_clip must be in (0, 1), got {s.ppo_clip}")


class LearnerSettings(Schema):
    """What a run trains: its model, adapter and learner. Every instruction carries them, and so
    does an invite (a volunteer's probe measures the real learner step)."""

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
    temperature: float = 1.0  # actors sample from softmax(logits / temperature); the learner scores the same
    micro_batch: int = 0  # rows per backward pass, whole prompt groups (gradient accumulation); 0: all
    # a node's Adam goes on from its last round on each tensor (DiLoCo's inner state) instead
    # of starting fresh every round
    keep_optimizer_state: bool = False
    # DG's gate temperature: sigmoid(U * surprisal / dg_eta); the papers' 1, 0 the hard gate
    dg_eta: float = 1.0
    ppo_clip: float = 0.2  # PPO's clip range around the behaviour policy (ppo, decoupled_ppo)

    @model_validator(mode="after")
    def _learnable(self):
        check_learner(self)
        return self

    @classmethod
    def of(cls, source) -> dict:
        """These settings as fields, read from anything that has them (a RunConfig, an Invite)."""
        return {name: getattr(source, name) for name in cls.model_fields}


class TrainInstruction(LearnerSettings):
    action: str
    mode: str
    block: int  # -1: every block (fedavg-lora)
    steps: int
    version: int  # the global version to sync to
    store_url: str
    principal: str
    token: str
    public_key: str  # PEM of the coordinator's Ed25519 key; global patches must verify with it
    seed: int
    client_id: int  # the node's stable id in this run (never renumbered)
    data_shards: int  # the task's data is split in this many shards; the client takes client_id % data_shards
    round: int = 0  # this node's message counter (seeds its randomness)
    upload_density: float = 1.0  # block uploads send this fraction of entries (top-k, error feedback)
    wire_dtype: str = "float32"  # the dtype published versions travel in
    # the state hash of v0 as published: a node whose own seeded adapter, cast to wire_dtype,
    # hashes the same holds v0 without downloading it ("": no such claim)
    origin_hash: str = ""
    rest_s: float = 0.0  # a rest notice: seconds on the run's clock the node is asked nothing

    @model_validator(mode="after")
    def _consistent(self):
        if self.action not in ACTIONS or self.mode not in MODES:
            raise ValueError(f"unknown action {self.action!r} or mode {self.mode!r}")
        if not (0 < self.rest_s < float("inf") if self.action == "rest" else self.rest_s == 0):
            raise ValueError(
                f"rest_s must be > 0 and finite in a rest notice and 0 otherwise, got {self.rest_s}"
            )
        at_least(self, 0, "steps", "version", "client_id")
        check_upload_density(self.upload_density, self.mode)
        check_wire_dtype(self.wire_dtype)
        at_least(self, 1, "data_shards")
        if not -1 <= self.block < self.num_blocks or (self.block == -1) != (self.mode == "fedavg-lora"):
            raise ValueError(
                f"block {self.block} does not fit mode {self.mode} with {self.num_blocks} blocks"
            )
        return self

    @property
    def shard(self) -> int:
        return self.client_id % self.data_shards


class InstructionHead(Schema):
    """What an instruction changes every round, sent packed. The rest of it (the run's settings:
    learner, store, credential, the coordinator's key, ~700 bytes) travels in a "settings" record
    only until a reply shows the node holds them; `settings_id` names the settings the head goes with."""

    action: str
    block: int
    steps: int
    version: int
    round: int
    seed: int
    client_id: int
    settings_id: str
    rest_s: float = 0.0

    @classmethod
    def layout_source(cls) -> str:
        # the settings a head goes with travel by name: a node that would not know one of their
        # fields refuses the head itself, by its layout, as another fedrl version
        settings = ",".join(f"{n}:{f.annotation.__name__}" for n, f in TrainInstruction.model_fields.items())
        return f"{super().layout_source()}+{settings}"


ROUND_FIELDS = tuple(n for n in InstructionHead.model_fields if n != "settings_id")
SETTINGS_UNKNOWN = "settings unknown"  # a node's error reason: send the settings again


def settings_id(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def split_instruction(instr: TrainInstruction) -> tuple[InstructionHead, dict]:
    """The instruction as it travels: its head (round fields + settings id) and its settings."""
    record = instr.to_record()
    settings = {k: v for k, v in record.items() if k not in ROUND_FIELDS}
    head = InstructionHead(**{k: record[k] for k in ROUND_FIELDS}, settings_id=settings_id(settings))
    return head, settings


def join_instruction(head: InstructionHead, settings: Mapping) -> TrainInstruction:
    """The whole instruction from its head and the settings the node holds (or was just sent)."""
    fields = head.to_record()
    fields.pop("settings_id")
    return TrainInstruction.parse({**settings, **fields}, "instruction")


class TrainReport(Schema):
    """A node's answer to an instruction, sent packed (every round: its size is the uplink's floor)."""

    upload_key: str  # "" when nothing was uploaded
    upload_block: int  # NO_UPLOAD when nothing was uploaded
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
    duration_s: float  # the round's length on the run's clock
    bytes_up: int
    bytes_down: int
    staleness: int  # versions between the local copy compute started from and the instruction's
    # the client's own measurements (a real client measures itself; nothing is declared for it)
    link_bytes_per_s: float  # bytes moved to and from the store over the seconds its link was busy
    memory_mb: float  # peak resident memory of the process that served the message
    full_sync_bytes: int = 0  # what a node holding nothing would have downloaded for the same version
    sync_patches: int = 0  # patches downloaded to reach synced_version (1 from any recent version)
    # the local steps behind the upload, however many prompts each took (0: not known: the
    # coordinator then counts them from the samples at the run's prompts per step)
    upload_steps: int = 0
    # prompts per step at the round's end: fewer than asked after a retry on out of memory
    # (the node then takes no more until its ClientApp state is lost); 0: nothing trained
    prompts: int = 0
    hardware: str = ""  # a volunteer's probe (HardwareProbe as JSON): what it measured and will take on
    leaving: str = ""  # a withdrawing node: "after-flush" (collect its last delta first) or "now"

    @property
    def probe(self) -> HardwareProbe | None:
        return HardwareProbe.parse(json.loads(self.hardware), "hardware probe") if self.hardware else None

    @model_validator(mode="after")
    def _consistent(self):
        if self.upload_key and (len(self.upload_key) != 64 or set(self.upload_key) - set("0123456789abcdef")):
            raise ValueError("upload_key must be a SHA-256 hex digest")
        counts = ["steps", "bytes_up", "bytes_down", "upload_samples", "sync_patches"]
        at_least(self, 0, *counts, "prompts", "upload_steps")
        for name in ("compute_s", "comm_s", "overlap_s", "duration_s", "link_bytes_per_s", "memory_mb"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.leaving not in LEAVING:
            raise ValueError(f"leaving must be one of {LEAVING}, got {self.leaving!r}")
        if self.hardware:
            try:
                self.probe  # noqa: B018 (validates)
            except ValueError as err:
                raise ValueError(f"hardware: {err}") from None
        return self


class HardwareProbe(Schema):
    """What a volunteer node measured before taking work, and the work it will take on."""

    cores: int  # logical CPUs of the machine
    threads: int  # CPU threads the learner may use (the volunteer's --max-cpu)
    memory_mb: float  # the machine's memory
    memory_limit_mb: float  # the volunteer's --max-memory (0: none)
    accelerator: str  # cpu | cuda:NAME | mps
    model: str
    step_s: float  # measured seconds per learner step on the run's model at `prompts`
    up_bytes_s: float  # measured upload to the patch store (after the volunteer's cap)
    down_bytes_s: float
    upload_cap_bytes_s: float  # 0: none
    download_cap_bytes_s: float
    steps_per_round: int  # the most local steps the node takes in one message
    prompts: int  # the most prompts per step (smaller where memory is short)

    @model_validator(mode="after")
    def _consistent(self):
        at_least(self, 1, "cores", "threads", "steps_per_round", "prompts")
        for name in ("memory_mb", "memory_limit_mb", "step_s", "up_bytes_s", "down_bytes_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0")
        return self
