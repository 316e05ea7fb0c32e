"""What a volunteer's node files say, for its owner: the live status line, how it left, and
`fedrl volunteer status`; and the exit statuses of `fedrl volunteer`. Light to import (no torch):
`status` and `leave` start in a fraction of a second."""

from __future__ import annotations

import sys
import time

from fedrl.ledger import accepted, refusals
from fedrl.node_files import PROBE, STATUS, read_json
from fedrl.volunteer.home import VolunteerHome

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130


def read_status(home: VolunteerHome) -> dict:
    """The node's last status ({} before its first, or while the file is being replaced)."""
    try:
        return read_json(home.state_dir / STATUS) or {}
    except ValueError:
        return {}


def how_it_left(status: dict) -> str:
    """A node's last phase and what told it that nothing more was owed, from its status file."""
    said = (
        "the coordinator said goodbye"
        if status.get("acknowledged")
        else "the run was over"
        if status.get("run_over")
        else "the coordinator had pulled its replies"
        if status.get("phase") == "resting"
        else "no goodbye came"
    )
    phase = status.get("phase", "idle")
    return "before its node started" if phase == "connecting" else f"{phase}, {said}"


def ledger_text(row: dict) -> str:
    """The node's ledger row as the coordinator last published it (fedrl.ledger)."""
    refused = sum(row["refused"].values())
    causes = f" ({refusals(row)})" if refused else ""
    samples = f"{row['samples']:,} samples credited"
    return f"uploads accepted {accepted(row)}, refused {refused}{causes}, {samples}"


def status_text(node_id, s: dict) -> str:
    """A node's status in one line: its phase, versions, reward and traffic."""
    if node_id is None:
        return "connecting ..."
    if not s:
        return f"node {node_id} | connected | waiting for work"
    kb = lambda n: f"{n / 1000:,.0f} kB"  # noqa: E731
    g = s.get
    phase = g("phase", "?") + (" (run over)" if g("run_over") else "")
    if g("phase") == "resting":  # asked nothing until then: its last updates were refused
        until = time.strftime("%H:%M:%S", time.localtime(g("rest_until", 0)))
        phase += f" until {until} (updates refused for their direction)"
    memory = f" | out of memory {g('memory_retries')}x: {g('prompts')} prompts a step"
    return (
        f"node {node_id} | {phase} | v{g('version', '?')} held v{g('synced_version', '?')}"
        f" staleness {g('staleness', 0)} | reward {g('reward', 0):.3f} | rounds {g('rounds', 0)}"
        f" | up {kb(g('bytes_up', 0))} down {kb(g('bytes_down', 0))}"
        f" | {g('link_bytes_per_s', 0) / 1000:,.1f} kB/s"
        + (f" | {ledger_text(g('ledger'))}" if g("ledger") else "")
        + (memory if g("memory_retries") else "")
        + (f" | last message refused or failed: {g('error')}" if g("error") else "")
    )


def print_status(home: VolunteerHome, out=sys.stdout) -> int:
    """`fedrl volunteer status`: whether the volunteer runs, what its node did last, its probe."""
    pid = home.running_pid()
    status = read_status(home)
    probe = read_json(home.state_dir / PROBE)
    out.write(f"volunteer: {'not running' if pid is None else f'running (pid {pid})'}\n")
    for key in (
        "phase",
        "version",
        "synced_version",
        "staleness",
        "reward",
        "rounds",
        "bytes_up",
        "bytes_down",
        "prompts",
        "memory_retries",
        "run_over",
        "error",
    ):
        if status.get(key, "") != "":  # an empty error: the last message went through
            out.write(f"  {key}: {status[key]}\n")
    if status.get("ledger"):
        out.write(f"  ledger: {ledger_text(status['ledger'])}\n")
    if "updated_at" in status:
        out.write(f"  last message: {time.time() - status['updated_at']:.0f} s ago\n")
    if probe:
        out.write(
            "  probe: "
            + ", ".join(f"{k}={probe[k]}" for k in ("step_s", "steps_per_round", "prompts"))
            + "\n"
        )
    return EXIT_OK
