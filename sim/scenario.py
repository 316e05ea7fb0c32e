"""Scenario files: one TOML file names everything a simulated run needs.

    name = "mixed-volunteers"
    description = "..."
    clients = 20              # number of simulated SuperNodes
    seeds = [0, 1]            # one run per seed

    [run]                     # any RunConfig or SimConfig key: model, task, mode, lr, clock, budget ...
    mode = "parablock"
    clock = "virtual"
    versions = 40             # budget in versions ...
    max_time_s = 3600         # ... and/or in seconds on the run's clock
    profiles = "mixed-volunteers"   # a mix name or a profile file (relative to this file) ...

    [[client]]                # ... or the clients' profiles inline (see fedrl.sim.profiles)
    count = 4
    speed = 0.5

Shipped scenarios live in fedrl/sim/scenarios/ and are found by name.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fedrl.schema import SchemaError
from fedrl.sim.profiles import ProfileError, parse_client_groups
from fedrl.sim.simulated_server import SimConfig, split_config
from fedrl.strategies.run_config import RunConfig

SHIPPED = Path(__file__).parent / "scenarios"
TOP_LEVEL_KEYS = {"name", "description", "clients", "seeds", "run", "client"}


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    clients: int
    seeds: tuple[int, ...]
    config: RunConfig
    sim: SimConfig


def shipped() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SHIPPED.glob("*.toml"))}


def find(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ScenarioError(f"scenario file {path} does not exist")
        return path
    if name_or_path not in shipped():
        raise ScenarioError(
            f"unknown scenario {name_or_path!r}; shipped: {', '.join(shipped())}, or give a .toml path"
        )
    return shipped()[name_or_path]


def load_scenario(name_or_path: str) -> Scenario:
    path = find(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ScenarioError(f"{path}: {err}") from None
    return parse_scenario(data, path)


def parse_scenario(data: dict, path: Path) -> Scenario:
    unknown = sorted(set(data) - TOP_LEVEL_KEYS)
    if unknown:
        raise ScenarioError(f"{path}: unknown keys {unknown}; known: {sorted(TOP_LEVEL_KEYS)}")
    run = dict(data.get("run", {}))
    if not isinstance(data.get("run", {}), dict):
        raise ScenarioError(f"{path}: [run] must be a table")
    try:
        if "client" in data:
            if "profiles" in run:
                raise ScenarioError(f"{path}: give [[client]] tables or run.profiles, not both")
            profiles = parse_client_groups(data["client"], str(path))
            run["profiles"] = json.dumps([p.model_dump() for p in profiles])
        elif "profiles" in run and (path.parent / str(run["profiles"])).is_file():
            run["profiles"] = str(path.parent / run["profiles"])  # a profile file beside the scenario
        config, sim = split_config(run)
    except (SchemaError, ProfileError) as err:
        raise ScenarioError(f"{path}: {err}") from None
    clients = data.get("clients", len(json.loads(run["profiles"])) if "client" in data else None)
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ScenarioError(f"{path}: clients must be a positive integer, got {clients!r}")
    seeds = data.get("seeds", [config.seed])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        raise ScenarioError(f"{path}: seeds must be a non-empty list of integers")
    name, description = data.get("name", path.stem), data.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise ScenarioError(f"{path}: name and description must be strings")
    return Scenario(name, description, clients, tuple(seeds), config.replace(min_nodes=clients), sim)
