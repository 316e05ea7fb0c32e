"""`fedrl bench methods --pool A.json B.json ...`: the runs of several invocations as one.

Seeds of one setting are often run in several invocations (three at a time, on two machines,
one stop after another); their figures then belong together: the means, the per-seed ratios and
the interval over all the seeds. Pooling re-reads every run from its own curve, at the files'
target or at another one (`--target`; one file alone too), and refuses what would mix unlike
runs: other settings, a seed of a method twice, a run that stopped before the target it is read
at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fedrl.sim.bench.methods import FIRST, HELD, read_at, samples_to_target

# what differs between invocations of one setting without making their runs unlike
PER_INVOCATION = {"target", "wall_s", "summary", "runs", "pooled_from", "code", FIRST.against, HELD.against}


class PoolError(ValueError):
    """The files cannot be pooled; the message says which and why."""


def load(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PoolError(f"{path}: not readable as JSON ({e})") from None
    if (
        not isinstance(data, dict)
        or data.get("benchmark") != "methods"
        or not isinstance(data.get("runs"), list)
    ):
        raise PoolError(f"{path}: not a `fedrl bench methods` JSON")
    return data


def shared_setting(files: dict[str, dict]) -> dict:
    """What every file was run with (model, frictions, budget, clients, step_s, overrides, ...)."""
    (first, setting), *rest = (
        (p, {k: v for k, v in d.items() if k not in PER_INVOCATION}) for p, d in files.items()
    )
    for path, other in rest:
        if other != setting:
            keys = sorted(k for k in setting.keys() | other.keys() if setting.get(k) != other.get(k))
            differ = "; ".join(
                f"{k}: {setting.get(k)!r} in {first}, {other.get(k)!r} in {path}" for k in keys
            )
            raise PoolError(
                f"the files were run with other settings ({differ}): pool runs of one setting only"
            )
    return setting


def reread(run: dict, target: float, ran_to: float | None, path: str) -> dict:
    """The run's figures at `target`, from its curve. A run stopped at the first eval at or under
    the target it ran to (`ran_to`: its file's, or the one a pool kept with it; None: a
    scenario's runs and those run to the budget, which go on), so below that target its curve
    ends early unless it had already got there."""
    ran_to = run.get("ran_to", ran_to)
    curve = run["curve"]
    read = read_at(curve, target)
    stopped = ran_to is not None and samples_to_target(curve, ran_to) is not None  # else: its whole budget
    if read["samples_to_target"] is None and stopped and target < ran_to:
        raise PoolError(
            f"{path}: {run['method']} seed {run['seed']} stopped at its target {ran_to} before reaching "
            f"{target}, so it cannot be read there: pool at a target of {ran_to} or above"
        )
    return {**run, "ran_to": ran_to, **read}


@dataclass
class Pooled:
    setting: dict  # what every file was run with
    target: float  # where every run was read
    runs: list[dict]  # each re-read there, by seed
    # each file's fedrl version and commit (None: written before they were kept)
    codes: dict[str, dict | None]


def pool(paths: list[str], target: float | None) -> Pooled:
    """The runs of the files at `paths` as one. Files of other code are pooled, since a record can
    span versions knowingly; `codes` says which."""
    files: dict[str, dict] = {}
    for p in map(str, paths):
        if p in files:
            raise PoolError(f"{p} is given twice")
        files[p] = load(p)
    setting = shared_setting(files)
    targets = sorted({d["target"] for d in files.values()})
    if target is None:
        if len(targets) > 1:
            raise PoolError(
                f"the files ran to different targets ({', '.join(map(str, targets))}): give --target"
            )
        target = targets[0]
    seen: dict[tuple[str, int], str] = {}
    runs = []
    for path, data in files.items():
        ran_to = None if "scenario" in data or data.get("run_to_budget") else data["target"]
        for run in data["runs"]:
            key = (run["method"], run["seed"])
            if key in seen:
                raise PoolError(f"{run['method']} seed {run['seed']} is in both {seen[key]} and {path}")
            seen[key] = path
            runs.append(reread(run, target, ran_to, path))
    runs.sort(key=lambda r: r["seed"])  # stable: each seed's methods stay in their order
    return Pooled(setting, target, runs, {path: data.get("code") for path, data in files.items()})
