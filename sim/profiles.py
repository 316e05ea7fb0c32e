"""Client profiles: how fast a client computes, how its link behaves, when it is reachable,
and which frictions its actor suffers. Profiles come from named mixes or from a TOML file.

A profile file lists groups of identical clients, or draws a group from a named mix:

    [[client]]
    count = 4
    name = "lab-gpu"
    speed = 2.0               # compute speed factor (1 = this machine)
    up_bytes_s = 12.5e6       # uplink, bytes/s (inf: unshaped)
    down_bytes_s = 50e6
    latency_s = 0.01          # per request
    loss = 0.0                # packet loss rate (goodput = bandwidth * (1 - loss))
    dropout = 0.0             # probability a round is lost mid-way (the client vanishes)
    online_s = inf            # availability: online this long, then offline offline_s, repeating
    offline_s = 0.0
    bug_prob = 0.0            # frictions of the client's actor (see fedrl.frictions)
    reward_noise_prob = 0.0
    actor_staleness = 0       # the actor samples with weights up to this many local steps old
    actor_lags_across_rounds = false  # ...counting earlier rounds' steps (else this round's only)
    logit_noise = 0.0         # std of Gaussian noise on the actor's logits (inference mismatch)

    [[client]]
    count = 6
    mix = "mobile"
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import model_validator

from fedrl.bounds import at_least
from fedrl.schema import Schema, SchemaError
from fedrl.sim.attacks import ATTACKS
from fedrl.sim.link import LinkProfile


class ProfileError(ValueError):
    pass


class ClientProfile(Schema):
    name: str = "default"
    speed: float = 1.0
    up_bytes_s: float = math.inf
    down_bytes_s: float = math.inf
    latency_s: float = 0.0
    loss: float = 0.0
    dropout: float = 0.0
    online_s: float = math.inf
    offline_s: float = 0.0
    bug_prob: float = 0.0
    reward_noise_prob: float = 0.0
    actor_staleness: int = 0
    actor_lags_across_rounds: bool = False
    logit_noise: float = 0.0
    attack: str = ""  # a Byzantine client: what it uploads instead of its update (fedrl.sim.attacks)

    @model_validator(mode="after")
    def _in_range(self):
        for name, value in self.model_dump().items():
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{name} is NaN")
        if self.speed <= 0 or self.up_bytes_s <= 0 or self.down_bytes_s <= 0 or self.online_s <= 0:
            raise ValueError("speed, bandwidths and online_s must be > 0")
        at_least(self, 0, "latency_s", "offline_s", "actor_staleness", "logit_noise")
        if self.attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {self.attack!r}")
        for name in ("loss", "dropout", "bug_prob", "reward_noise_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ClientProfile:
        try:
            return cls.parse(values, "profile")
        except SchemaError as err:
            raise ProfileError(str(err)) from None

    def to_json(self) -> str:
        return json.dumps(self.model_dump())  # inf travels as Infinity, which json reads back

    @property
    def link(self) -> LinkProfile:
        return LinkProfile(self.up_bytes_s, self.down_bytes_s, self.latency_s, self.loss)

    def offline_reason(
        self, client_id: int, start_s: float, duration_s: float, rng: np.random.Generator
    ) -> str:
        """Why a round over [start_s, start_s + duration_s] on the run's clock is lost, or ""."""
        if self.offline_s > 0 and math.isfinite(self.online_s):
            period = self.online_s + self.offline_s
            phase = (client_id * 0.6180339887 % 1.0) * period  # spreads clients' schedules evenly
            begin = (start_s + phase) % period
            if begin >= self.online_s or begin + duration_s > self.online_s:
                return f"offline (online {self.online_s:g} s, offline {self.offline_s:g} s per cycle)"
        if self.dropout and rng.random() < self.dropout:
            return f"dropped out mid-round (dropout rate {self.dropout:g})"
        return ""


# Named mixes: archetypes with ranges; a mix of n clients spreads each archetype's clients
# evenly (log-spaced) over its ranges, so even small mixes show the whole spread.
ARCHETYPES = {
    "datacenter": dict(
        speed=(1.0, 2.0),
        up_bytes_s=(50e6, 125e6),
        down_bytes_s=(50e6, 125e6),
        latency_s=(0.001, 0.005),
        loss=0.0,
        dropout=0.0,
    ),
    "home-broadband": dict(
        speed=(0.3, 1.0),
        up_bytes_s=(1e6, 5e6),
        down_bytes_s=(6e6, 50e6),
        latency_s=(0.02, 0.06),
        loss=0.001,
        dropout=0.05,
    ),
    "mobile": dict(
        speed=(0.05, 0.2),
        up_bytes_s=(1e5, 1e6),
        down_bytes_s=(5e5, 5e6),
        latency_s=(0.05, 0.15),
        loss=0.01,
        dropout=0.2,
        online_s=1800.0,
        offline_s=600.0,
    ),
}
MIXES = {
    "datacenter": {"datacenter": 1.0},
    "home-broadband": {"home-broadband": 1.0},
    "mobile": {"mobile": 1.0},
    # >= 10x compute spread, >= 100x bandwidth spread, ~10% dropouts per round
    "mixed-volunteers": {"datacenter": 0.1, "home-broadband": 0.5, "mobile": 0.4},
}


def _spread(lo: float, hi: float, j: int, m: int) -> float:
    return lo if m == 1 else float(lo * (hi / lo) ** (j / (m - 1)))


def mix(name: str, n: int, seed: int = 0) -> list[ClientProfile]:
    """`n` profiles of the named mix, in a seeded order."""
    if name not in MIXES:
        raise ProfileError(f"unknown profile mix {name!r}; known: {sorted(MIXES)}")
    if n < 1:
        raise ProfileError("a mix needs at least one client")
    shares = MIXES[name]
    counts = {a: int(math.floor(share * n)) for a, share in shares.items()}
    by_remainder = sorted(shares, key=lambda a: shares[a] * n - counts[a], reverse=True)
    for a in by_remainder[: n - sum(counts.values())]:
        counts[a] += 1
    profiles = []
    for archetype, m in counts.items():
        spec = ARCHETYPES[archetype]
        order = np.random.default_rng([seed, len(profiles)]).permutation(m)  # decorrelate speed and bandwidth
        for j in range(m):
            values = {}
            for key, value in spec.items():
                if isinstance(value, tuple):
                    k = j if key == "speed" else int(order[j])
                    values[key] = _spread(*value, k, m)
                else:
                    values[key] = value
            profiles.append(ClientProfile.from_mapping({"name": archetype, **values}))
    np.random.default_rng(seed).shuffle(profiles)
    return profiles


def load_profile_file(path: str | Path, seed: int = 0) -> list[ClientProfile]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ProfileError(f"{path}: {err}") from None
    return parse_client_groups(data.get("client"), str(path), seed)


def parse_client_groups(groups: Any, where: str, seed: int = 0) -> list[ClientProfile]:
    """[[client]] tables: each has `count` and either `mix` or profile fields."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise ProfileError(f"{where}: expected one or more [[client]] tables")
    profiles = []
    for i, group in enumerate(groups):
        group = dict(group)
        count = group.pop("count", 1)
        try:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ProfileError(f"count must be a positive integer, got {count!r}")
            if "mix" in group:
                name = group.pop("mix")
                if group:
                    raise ProfileError(f"a mix group takes only count and mix, not {sorted(group)}")
                profiles += mix(name, count, seed + i)
            else:
                profiles += [ClientProfile.from_mapping(group)] * count
        except ProfileError as err:
            raise ProfileError(f"{where}: [[client]] #{i + 1}: {err}") from None
    return profiles


def resolve_profiles(spec: str, n: int, seed: int = 0) -> list[ClientProfile]:
    """A run's `profiles` setting for n clients: a mix name, a profile file, or a JSON list of
    profiles (repeated cyclically); empty: every client is this machine on an unshaped link."""
    spec = spec.strip()
    if not spec or spec == "[]":
        return [ClientProfile()] * n
    if spec in MIXES:
        return mix(spec, n, seed)
    if spec.startswith("["):
        try:
            items = json.loads(spec)
        except ValueError as err:
            raise ProfileError(f"profiles JSON: {err}") from None
        if not isinstance(items, list) or not all(isinstance(p, dict) for p in items):
            raise ProfileError("profiles must be a JSON list of objects")
        listed = [ClientProfile.from_mapping(p) for p in items]
        return [listed[i % len(listed)] for i in range(n)]
    path = Path(spec)
    if not path.exists():
        raise ProfileError(f"profiles {spec!r} is neither a mix ({', '.join(MIXES)}), a JSON list nor a file")
    listed = load_profile_file(path, seed)
    return [listed[i % len(listed)] for i in range(n)]
