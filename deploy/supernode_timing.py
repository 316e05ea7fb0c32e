"""`flower-supernode` with two of its timings set: how long an idle SuperNode waits before it
asks the SuperLink again, and the heartbeat interval it registers with.

Flower 1.41 fixes both. An idle SuperNode sleeps 3 s between asks (and 0.5 s between looks for
its ClientApp's reply), so a message waits 0-3 s before it is even fetched: a round of the tiny
model took about 1 s of work and 4 s of waiting in a local deployment. And a node heartbeats
on a 30 s interval, so the SuperLink keeps a killed node's session for up to a minute (two
missed heartbeats), during which its restart cannot connect. Neither is a flag. This entry sets
them in the SuperNode's own process before Flower starts: every wait of the message loop is
capped at `poll_s` (the SuperExec that launches its ClientApps gets the same interval through
Flower's FLWR_SUPEREXEC_TASK_POLL_INTERVAL), and `heartbeat_s` is the interval the node
registers and heartbeats at (10-1800 s, what the SuperLink accepts). Each name is checked
first: a Flower without one of them runs with its own timing and says so.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from fedrl.arguments import number
from fedrl.deploy.parent_watch import interrupt_when_orphaned

POLL_S = 1.0  # Flower's SuperExec asks this often by default; its SuperNode, every 3 s
HEARTBEAT_S = 30.0  # Flower's: a killed node is let go after 2 x this
POLL_RANGE, HEARTBEAT_RANGE = (0.05, 60.0), (10.0, 1800.0)  # the second: what the SuperLink accepts
HEARTBEAT_PATIENCE = 2  # Flower's: a node is online until it misses this many heartbeats
HOLD_MARGIN_S = 30.0  # for a busy SuperLink and the clocks of two machines
# (module, name) this entry replaces: the message loop's `time`, and the interval both places use
PATCHED = (
    ("flwr.supernode.start_client_internal", "time"),
    ("flwr.supernode.fleet_http_connection", "HEARTBEAT_DEFAULT_INTERVAL"),
    ("flwr.supercore.heartbeat", "HEARTBEAT_DEFAULT_INTERVAL"),
)
SUPEREXEC_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"


class CappedSleep:
    """The `time` module, but no sleep longer than `cap` seconds."""

    def __init__(self, cap: float):
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str):
        return getattr(time, name)


def apply(poll_s: float, heartbeat_s: float) -> str:
    """Set the timings in this process (before Flower's SuperNode starts); "" when set, else why not."""
    modules = {}
    for module, name in PATCHED:
        try:
            modules[module] = importlib.import_module(module)
        except ImportError:
            return f"this Flower has no {module}"
        if not hasattr(modules[module], name):
            return f"this Flower's {module} has no {name}"
    modules["flwr.supernode.start_client_internal"].time = CappedSleep(poll_s)
    for module, name in PATCHED[1:]:
        setattr(modules[module], name, heartbeat_s)
    os.environ.setdefault(SUPEREXEC_POLL_ENV, f"{poll_s:g}")  # the SuperExec is a child: it inherits
    return ""


def session_hold_s(heartbeat_s: float) -> float:
    """How long the SuperLink may keep a node online after the node stopped without telling it:
    a crash, or a goodbye that did not go out (Flower 1.41's SuperNode sends it once as it
    unwinds, ignores a failure, and exits by force 5 s after the signal, goodbye sent or not).
    Until then the node's key cannot be activated again."""
    return HEARTBEAT_PATIENCE * heartbeat_s + HOLD_MARGIN_S


def supernode_argv(
    flower_args: list[str],
    poll_s: float = POLL_S,
    heartbeat_s: float = HEARTBEAT_S,
    parent_pid: int | None = None,
) -> list[str]:
    """The command that runs `flower-supernode FLOWER_ARGS` with these timings (and, given
    `parent_pid`, only as long as that process runs)."""
    timing = ["--poll-s", f"{poll_s:g}", "--heartbeat-s", f"{heartbeat_s:g}"]
    timing += ["--parent-pid", str(parent_pid)] if parent_pid else []
    return [sys.executable, "-m", "fedrl.deploy.supernode_timing", *timing, "--", *flower_args]


def timing_parser(**kwargs) -> argparse.ArgumentParser:
    """The two options, for any command that starts a SuperNode."""
    parser = argparse.ArgumentParser(allow_abbrev=False, **kwargs)
    parser.add_argument(
        "--poll-s",
        type=number(float, *POLL_RANGE),
        default=POLL_S,
        help="an idle SuperNode asks the SuperLink for work this often (Flower's own: every 3 s)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=number(float, *HEARTBEAT_RANGE),
        default=HEARTBEAT_S,
        help="the node's heartbeat interval, 10-1800 s: the SuperLink lets a killed node go after "
        "twice this, and its restart cannot connect before",
    )
    parser.add_argument(
        "--parent-pid",
        type=number(int, 1),
        default=None,
        help="the pid of the process that starts this SuperNode: once that process is gone the "
        "SuperNode stops as on Ctrl-C (a volunteer's session passes its own; fedrl.deploy.parent_watch)",
    )
    return parser


def split_args(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """fedrl's two options (out of range: exit 2, as argparse does) and the rest: flower-supernode's."""
    timing, rest = timing_parser(prog="fedrl supernode", add_help=False).parse_known_args(args)
    return timing, rest[1:] if rest[:1] == ["--"] else rest


def main() -> None:
    timing, flower_args = split_args(sys.argv[1:])
    refused = apply(timing.poll_s, timing.heartbeat_s)
    if refused:
        print(f"fedrl supernode: {refused}; running with Flower's own timing", file=sys.stderr, flush=True)
    if timing.parent_pid:
        interrupt_when_orphaned(timing.parent_pid)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()


if __name__ == "__main__":
    main()
