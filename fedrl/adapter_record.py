"""What an exported adapter was trained on: the model spec, task and task parameters a run
wrote beside its PEFT files, so `fedrl eval --adapter DIR` evaluates it as the run did."""

from __future__ import annotations

import json
from pathlib import Path

RECORD = "fedrl.json"
FIELDS = ("model", "task", "task_params")
FINAL_DIR, BEST_DIR = "adapter", "adapter-best"  # a run's output folder holds both (see best_adapter)


def check_adapter_dir(path: str | Path) -> None:
    """A clear error, before any model loads, for a folder that holds no PEFT adapter; a run's
    output folder (the folder users tend to give) is answered with the adapters in it."""
    path, config = Path(path), "adapter_config.json"
    if (path / config).is_file():
        return
    inside = [str(path / name) for name in (FINAL_DIR, BEST_DIR) if (path / name / config).is_file()]
    hint = f"; it is a run's output folder: give {' or '.join(inside)}" if inside else ""
    raise ValueError(f"no PEFT adapter in {path} (no adapter_config.json there){hint}")


def write_record(adapter_dir: str | Path, **record) -> None:
    missing = set(FIELDS) - record.keys()
    if missing:
        raise ValueError(f"an adapter record needs {sorted(missing)}")
    (Path(adapter_dir) / RECORD).write_text(json.dumps(record, indent=1))


def read_record(adapter_dir: str | Path) -> dict:
    """The record, or {} for an adapter exported without one (by PEFT itself, or an older fedrl)."""
    path = Path(adapter_dir) / RECORD
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in FIELDS):
        raise ValueError(f"{path} must name the adapter's {', '.join(FIELDS)} as strings")
    return record
