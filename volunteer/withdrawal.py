"""`fedrl volunteer leave` and the SDK's `leave`: withdraw the volunteer that runs for a
federation, from any shell or program (another process than the one running `join`).

It asks the running `fedrl volunteer join` to leave as a first Ctrl-C would (SIGTERM: finish or
abandon the round as its `--on-exit` says, hand in the delta, wait for the coordinator's
goodbye), then waits for it to exit and says how it left. A volunteer already leaving is not
signalled again (a second signal stops it at once); `--now` is that second signal, sent once
the first was taken.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
from rich.console import Console

from fedrl.invite import Invite
from fedrl.live_line import LiveLine
from fedrl.node_files import LEAVE
from fedrl.volunteer.home import VolunteerHome, resolve_invite
from fedrl.volunteer.node_status import EXIT_FAILED, EXIT_OK, how_it_left, read_status

POLL_S = 0.2
TAKEN_S = 10.0  # the longest `--now` waits for the first signal to be taken before the second
LEAVE_TIMEOUT_S = 600.0  # longer than a withdrawal waits for its round (Session.exit_timeout_s)


def leave(
    invite: Invite | str | None = None,
    home: str | Path | None = None,
    now: bool = False,
    timeout_s: float = LEAVE_TIMEOUT_S,
    console: Console | None = None,
) -> int:
    """Withdraw the volunteer that `join` runs for `invite` (an Invite, a path or the
    fedrl-invite:... string; None: the one federation this machine joined) on `home` (as `join`
    was given it); the exit status, 0 when it left or none ran. InviteError when there is no
    such invite."""
    if not isinstance(invite, Invite):
        invite = resolve_invite(invite, home)
    return withdraw(VolunteerHome.for_run(invite.run, home), now, timeout_s, console)


def withdraw(
    home: VolunteerHome, now: bool = False, timeout_s: float = LEAVE_TIMEOUT_S, console: Console | None = None
) -> int:
    """Withdraw the volunteer running on `home`; the exit status (0: it left, or none ran)."""
    console = console or Console(highlight=False, soft_wrap=True)  # a path split across lines is no path
    pid = home.running_pid()
    if pid is None:
        console.print(f"no volunteer runs on {home.data}: nothing to leave", markup=False)
        return EXIT_OK
    try:
        proc = psutil.Process(pid)
        if leaving(home):
            console.print(f"the volunteer (pid {pid}) is already leaving", markup=False)
        else:
            proc.send_signal(signal.SIGTERM)
        if now:
            taken = time.monotonic() + TAKEN_S
            while not leaving(home) and alive(proc) and time.monotonic() < taken:
                time.sleep(POLL_S)
            proc.send_signal(signal.SIGTERM)  # the second signal: everything stops at once
    except psutil.NoSuchProcess:  # it exited meanwhile: its files say how
        return outcome(home, pid, now, console)
    except psutil.AccessDenied as err:
        console.print(f"cannot signal the volunteer (pid {pid}): {err}", markup=False)
        return EXIT_FAILED
    line, deadline = LiveLine(console), time.monotonic() + timeout_s
    while alive(proc):
        if time.monotonic() > deadline:
            line.done()
            console.print(
                f"the volunteer (pid {pid}) is still leaving after {timeout_s:g} s; it goes on: "
                "`fedrl volunteer leave --now` stops it at once",
                markup=False,
            )
            return EXIT_FAILED
        line.show(f"waiting for the volunteer (pid {pid}) to leave: {read_status(home).get('phase', '?')}")
        time.sleep(POLL_S)
    line.done()
    return outcome(home, pid, now, console)


def outcome(home: VolunteerHome, pid: int, now: bool, console: Console) -> int:
    if home.last_session().get("clean"):
        left = how_it_left(read_status(home))
        console.print(f"the volunteer (pid {pid}) left the federation cleanly ({left})", markup=False)
        return EXIT_OK
    if now:
        console.print(
            f"the volunteer (pid {pid}) stopped at once; its cached work stays in {home.data}", markup=False
        )
        return EXIT_OK
    console.print(
        f"the volunteer (pid {pid}) exited without leaving cleanly: see {home.logs} and where it ran",
        markup=False,
    )
    return EXIT_FAILED


def alive(proc: psutil.Process) -> bool:
    """Still running: not gone, and not a zombie its parent has yet to reap."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def leaving(home: VolunteerHome) -> bool:
    """The session took a request to leave (it writes LEAVE on the first signal)."""
    return (home.state_dir / LEAVE).exists()
