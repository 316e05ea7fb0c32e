"""Every knob of a coordinator run in one schema (Flower run config keys may use dashes)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from fedrl.bounds import at_least, require
from fedrl.models import check_model_spec, model_layers
from fedrl.protocol import MODES, check_learner, check_upload_density, check_wire_dtype
from fedrl.schema import Schema
from fedrl.strategies.aggregation import AggregationConfig
from fedrl.strategies.scheduler import BlockScheduler

DIRECTION_TESTS = ("z", "sequential")  # the direction check's refusal (strategies/direction.py)
WEIGHTINGS = ("cosine", "none")  # the direction check's weight of an accepted update: max(cos - bar, 0), or 1


def check_direction(test: str, false_refusal: float, weighting: str) -> None:
    """The direction check's settings (strategies/direction.py), named as the run config names them."""
    if test not in DIRECTION_TESTS:
        raise ValueError(f"direction_test must be one of {DIRECTION_TESTS}, got {test!r}")
    if not 0 < false_refusal < 1:
        raise ValueError(f"direction_false_refusal is a chance in (0, 1), got {false_refusal}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"direction_weighting must be one of {WEIGHTINGS}, got {weighting!r}")


class RunConfig(Schema):
    what: ClassVar[str] = "run config"
    mode: str = "parablock"  # parablock | block-sequential | fedavg-lora
    sync: bool = False  # True: round barrier with deadline; False: FedBuff-style async
    model: str = "tiny-base"
    task: str = "reversal"
    task_params: str = '{"length": 8}'
    num_blocks: int = 3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lr: float = 2e-4  # a fresh Adam per round moves every entry ~lr per step: 5e-4 made async curves swing
    prompts: int = 8
    samples: int = 8
    method: str = "dg"
    temperature: float = 1.0  # sampling temperature of the actors (the learner's policy is the same)
    micro_batch: int = 0  # learner rows per backward pass (whole prompt groups); 0: the whole batch
    keep_optimizer_state: bool = False  # each node's Adam state per tensor lives on across its rounds
    dg_eta: float = 1.0  # DG's gate temperature (the papers': 1; 0: the hard gate); other methods ignore it
    ppo_clip: float = 0.2  # PPO's clip range (ppo, decoupled_ppo); other methods ignore it
    schedule: str = "cyclic"  # cyclic | random | lru
    base_steps: int = 6  # local steps for a client of median speed
    min_steps: int = 1
    max_steps: int = 24
    versions: int = 30  # ask for no more work after this many; what is in flight then makes one more
    buffer_size: int = 3  # async: aggregate after this many accepted updates
    max_staleness: int = 6
    alpha: float = 0.5
    # block uploads send this fraction of the block's entries, largest first, and keep the rest
    # for the block's next round (top-k with error feedback); 1: the whole delta
    upload_density: float = 1.0
    robust: str = "mean"  # mean | trimmed-mean | median
    clip_norm: float = 0.0  # a fixed per-update norm clip; 0: off
    # adaptive clip: this many times the median norm per √step of recent updates, times √ the
    # update's steps; 0: off. At 1 (the norm FLTrust scales every update to) an update reversed
    # at the bound pulls no harder than one reversed at its own size, which the direction
    # weighting below answers; per √step, so a fast client's longer round is not cut to a slow one's
    # (top-k uploads: per step of the client's latest rounds on the block, which error feedback carries)
    clip_multiple: float = 1.0
    # refuse (not clip) an update over this many times that median (per √step); 0: off
    refuse_multiple: float = 10.0
    # verification gate: score each update on this many probe problems before merging it; 0: off
    gate_probe: int = 0
    gate_tolerance: float = 0.05  # refuse an update that lowers the probe's mean reward by more than this
    # direction check: the gradient of the reference answers' log-prob on this many probe problems
    # (off, with a note in the log, for a task whose targets are not text answers); 0: off ...
    direction_probe: int = 64
    # ... refuses the updates of a client while its evidence says its updates point away: "z",
    # while its z (mean cosine * sqrt(n) / spread) is below -direction_threshold; "sequential",
    # while the likelihood ratio of its cosines leaning away against sitting at the bar is at least
    # 1 / direction_false_refusal: an honest client at the bar is then ever refused with at most
    # that chance, however many updates it hands in (slower to refuse; README, Chaos)
    direction_test: str = "z"
    direction_threshold: float = 1.5
    direction_false_refusal: float = 0.05
    # ... and weighs each accepted update by max(its cosine, 0) (cosine) or not at all (none), in
    # the weighted mean (robust = "mean"; the median and the trimmed mean weigh nothing)
    direction_weighting: str = "cosine"
    # ... and a client it refuses sits out 1, 2, 4, ... of its own rounds, up to this many, until
    # an update of its is accepted (its samples would be refused too); 0: refused clients keep working
    direction_rest_cap: int = 32
    reputation: bool = False  # weight each client's updates by its record of accepted and refused ones
    deadline_s: float = 300.0  # a round's deadline on the run's clock (stragglers past it are cut)
    watchdog_s: float = (
        600.0  # wall seconds after which a message with no reply is given up, whatever the clock
    )
    data_shards: int = 0  # the task's data is split in this many shards (client id % shards); 0: min_nodes
    anchor_every: int = 5
    # the dtype global versions travel in (the coordinator keeps and merges in float32):
    # bfloat16 | float16 | float32. In bfloat16 most of a LoRA step is below a bf16 ulp's
    # distance, so a version's patch is ~1/3 of a float32 one (same final error, 3 seeds)
    wire_dtype: str = "bfloat16"
    eval_every: int = 4
    # at the end, also evaluate on this many held-out problems (drawn with the eval's seed: a larger
    # set that may share a few problems with the usual one); 0: off
    final_eval_size: int = 0
    min_nodes: int = 2
    node_wait_s: float = 120.0
    max_time_s: float = 0.0  # stop after this many seconds on the run's clock; 0: no limit
    max_wall_s: float = 0.0  # stop after this many wall-clock seconds, whatever the clock; 0: no limit
    target_error: float = 0.0  # stop once a held-out eval reaches this error; 0: never
    stall_replies: int = 200  # stop when this many replies in a row bring no new version
    seed: int = 0
    out_dir: str = "runs/latest"
    checkpoint_dir: str = ""  # default: OUT_DIR/checkpoints
    state_dir: str = ""  # coordinator keys (signing key, own store secret), made once; default OUT_DIR/state
    resume: bool = True  # continue from the newest good checkpoint in checkpoint_dir
    store_url: str = ""  # empty: run the patch store inside the ServerApp
    store_secret_file: str = ""  # deployments: the secret shared with the standalone store
    store_ca_file: str = ""  # deployments: the CA that signed the store's TLS certificate (https store_url)
    run_name: str = ""  # in every event and log line; default: the name of out_dir
    monitor_port: int = -1  # serve /metrics and /dashboard on this port (0: any free one); -1: off
    monitor_host: str = "127.0.0.1"  # 0.0.0.0 to let Prometheus or a browser on another host in

    @field_validator("task_params", mode="before")
    @classmethod
    def _task_params_as_text(cls, value):
        # `--set task_params='{"length": 6}'` and a TOML inline table arrive parsed; instructions carry text
        return json.dumps(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _consistent(self):
        # every check runs, so that a config with several mistakes is told all of them at once
        problems = []
        for check in self._checks():
            try:
                check()
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _checks(self) -> list[Callable[[], object]]:
        nonnegative = ["max_time_s", "max_wall_s", "data_shards", "clip_norm", "gate_probe"]
        nonnegative += ["direction_probe", "direction_threshold", "direction_rest_cap", "final_eval_size"]
        return [
            lambda: require(self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}"),
            lambda: check_learner(self),
            self._check_model,
            self.aggregation,  # its own checks: alpha, max_staleness, the clip and refuse multiples, robust
            self.block_scheduler,  # and its: schedule, 1 <= min_steps <= base_steps <= max_steps, seed
            lambda: at_least(
                self, 1, "versions", "buffer_size", "min_nodes", "eval_every", "anchor_every", "stall_replies"
            ),
            lambda: at_least(self, 0, *nonnegative),
            lambda: check_upload_density(self.upload_density, self.mode),
            lambda: require(
                0 <= self.target_error <= 1,
                f"target_error is a held-out error, in [0, 1] (0: off); got {self.target_error}",
            ),
            lambda: require(
                0 <= self.gate_tolerance <= 1,
                f"gate_tolerance is a drop in mean reward, in [0, 1]; got {self.gate_tolerance}",
            ),
            lambda: require(
                -1 <= self.monitor_port <= 65535,
                f"monitor_port must be -1 (off), 0 (any free port) or a port, got {self.monitor_port}",
            ),
            lambda: require(
                min(self.deadline_s, self.watchdog_s, self.node_wait_s) > 0,
                "deadline_s, watchdog_s and node_wait_s must be > 0",
            ),
            lambda: require(
                not self.store_url or bool(self.store_secret_file),
                "store_url needs store_secret_file (the secret the standalone store was given)",
            ),
            lambda: require(
                not self.store_url or self.store_url.startswith(("http://", "https://")),
                f"store_url must start with http:// or https://, got {self.store_url!r}",
            ),
            lambda: check_wire_dtype(self.wire_dtype),
            lambda: check_direction(
                self.direction_test, self.direction_false_refusal, self.direction_weighting
            ),
        ]

    def _check_model(self) -> None:
        check_model_spec(self.model)  # a typo used to fail once the coordinator loaded it, 17 s in
        layers = model_layers(self.model)  # more blocks than layers failed once the coordinator built them
        if layers is not None and self.num_blocks > layers:
            raise ValueError(
                f"num_blocks={self.num_blocks}, but {self.model} has {layers} layers (one or more a block)"
            )

    def aggregation(self) -> AggregationConfig:
        return AggregationConfig(
            self.alpha,
            self.max_staleness,
            self.clip_norm or None,
            self.clip_multiple,
            self.refuse_multiple,
            self.robust,
        )

    def block_scheduler(self) -> BlockScheduler:
        return BlockScheduler(
            self.num_blocks, self.schedule, self.base_steps, self.min_steps, self.max_steps, self.seed
        )

    @property
    def shards(self) -> int:
        return self.data_shards or self.min_nodes

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        return cls.parse({k.replace("-", "_"): v for k, v in values.items()})

    def in_run(self, run_id: int) -> RunConfig:
        """With "{run_id}" in its directories replaced by Flower's run id: `flwr run .`'s default
        out-dir holds it, so that running it again makes a new run, where a fixed out-dir resumes
        the run in it (and refuses to rerun one that finished)."""
        dirs = ("out_dir", "checkpoint_dir", "state_dir")
        return self.replace(**{k: getattr(self, k).replace("{run_id}", str(run_id)) for k in dirs})
