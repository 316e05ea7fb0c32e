"""The files a volunteer node keeps in its state directory, shared by the ClientApp (which
writes what it did) and the `fedrl volunteer` process (which shows it and asks it to leave).

  status.json   the ClientApp's last word: phase (working / idle / left), versions, reward,
                rounds, bytes, rates, and "run_over" once the coordinator said the run ended
                (every reply pulled); `fedrl volunteer status` reads it from another shell
  probe.json    the hardware probe (fedrl.protocol.HardwareProbe): caps the ClientApp keeps to
  leave.json    written on the first Ctrl-C: {"on_exit": "flush" | "drop"}; the ClientApp
                finishes or abandons its round, answers "leaving" and marks status "left";
                the coordinator's goodbye then marks it "acknowledged"
  client-state/ the held global adapter, the local copy and the pending delta (resume)

Every write is atomic (a temporary file renamed over the old one), so a process killed in the
middle of one leaves the previous file whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATUS, PROBE, LEAVE, CLIENT_STATE = "status.json", "probe.json", "leave.json", "client-state"
APPROVED = "approved"  # the fingerprint of the node key the operator approved
ON_EXIT = ("flush", "drop")


def write_atomic(path: Path, data: bytes) -> None:
    """Replace the file whole: a kill before the rename leaves the previous one as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1).encode())


def read_json(path: Path) -> dict | None:
    """The file's table, or None when it is missing; a ValueError names an unreadable one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON table")
    return data


def leave_request(state_dir: str | Path) -> str:
    """ "" while the node stays; "flush" or "drop" once its volunteer asked it to leave."""
    if not state_dir:
        return ""
    try:
        request = read_json(Path(state_dir) / LEAVE)
    except ValueError:
        return "drop"  # a garbled request to leave is still a request to leave
    if request is None:
        return ""
    return request.get("on_exit") if request.get("on_exit") in ON_EXIT else "drop"


def update_status(state_dir: str | Path, add: dict | None = None, **fields) -> dict:
    """Merge `fields` into status.json and add `add`'s numbers to the running totals (written by
    the ClientApp; the volunteer only resets the phase when it starts)."""
    path = Path(state_dir) / STATUS
    try:
        status = read_json(path) or {}
    except ValueError:
        status = {}
    for key, amount in (add or {}).items():
        status[key] = status.get(key, 0) + amount
    status.update(fields)
    write_json(path, status)
    return status
