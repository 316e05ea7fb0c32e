"""Where a volunteer's files live, per federation (the invite's run name):

  config  (platformdirs user_config_dir("fedrl")/federations/RUN):
      invite.txt   the invite it joined with (`fedrl volunteer join` with no INVITE reuses it)
      ca.pem       the CA from the invite
      nodes/node.key, nodes/node.pub   the node's EC key pair (made on first join, kept)
  data    (platformdirs user_data_dir("fedrl")/federations/RUN):
      state/       the node's state dir (fedrl.node_files: client state, status, probe, pins)
      logs/        the SuperNode's log
      session.json this volunteer's process: pid, started (or ended), whether it exited
                   cleanly, whether its node connected, the node's heartbeat interval

`--home DIR` (or FEDRL_VOLUNTEER_HOME) puts both under DIR/RUN: several volunteers on one
machine, or a self-contained folder.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import psutil

from fedrl.certs import make_node_key
from fedrl.deploy.supernode_timing import HEARTBEAT_S, session_hold_s
from fedrl.invite import Invite, InviteError, load_invite
from fedrl.node_files import read_json

NODE = "node"


@dataclass(frozen=True)
class VolunteerHome:
    config: Path
    data: Path

    @classmethod
    def for_run(cls, run: str, home: str | Path | None = None) -> VolunteerHome:
        home = home or os.environ.get("FEDRL_VOLUNTEER_HOME")
        if home:
            root = Path(home).expanduser().resolve() / run
            return cls(root, root)
        return cls(
            Path(platformdirs.user_config_dir("fedrl")) / "federations" / run,
            Path(platformdirs.user_data_dir("fedrl")) / "federations" / run,
        )

    @property
    def state_dir(self) -> Path:
        return self.data / "state"

    @property
    def logs(self) -> Path:
        return self.data / "logs"

    @property
    def session(self) -> Path:
        return self.data / "session.json"

    @property
    def ca_file(self) -> Path:
        return self.config / "ca.pem"

    def remember(self, invite: Invite) -> None:
        """Keep the invite and its CA: a later join (or `status`) needs no invite."""
        for d in (self.config, self.state_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        (self.config / "invite.txt").write_text(invite.encode() + "\n")
        self.ca_file.write_text(invite.ca_pem)

    def node_key(self) -> tuple[Path, Path]:
        """The node's key pair, made on first use and kept (the SuperLink knows the node by it)."""
        return make_node_key(self.config, NODE)

    def last_session(self) -> dict:
        try:
            return read_json(self.session) or {}
        except ValueError:
            return {}

    def key_held_until(self) -> float:
        """Until when (wall clock) the SuperLink may still hold the node's session from the last
        `fedrl volunteer join` here: a refused activation before then is that session, after it a
        refused key. A crashed session stopped at an unknown moment (now at the latest); a clean
        one told the SuperLink, but that goodbye is not confirmed (session_hold_s); one that never
        connected holds nothing."""
        session = self.last_session()
        if session.get("connected") is False:
            return 0.0
        heartbeat_s = session.get("heartbeat_s")
        hold = session_hold_s(heartbeat_s if isinstance(heartbeat_s, (int, float)) else HEARTBEAT_S)
        if session.get("clean") is False:
            return time.time() + hold
        ended = session.get("ended")
        return ended + hold if isinstance(ended, (int, float)) else 0.0

    def running_pid(self) -> int | None:
        """The pid of a `fedrl volunteer join` still at work on this home: its session did not
        end, and its process lives and is a volunteer's (not a pid the system gave out again)."""
        session = self.last_session()
        pid = session.get("pid")
        if not isinstance(pid, int) or session.get("clean") is not False or pid == os.getpid():
            return None
        try:
            command = psutil.Process(pid).cmdline()
        except psutil.Error:
            return None
        return pid if "volunteer" in " ".join(command) else None


def known_runs(home: str | Path | None = None) -> list[str]:
    """The federations this machine has joined (their run names)."""
    home = home or os.environ.get("FEDRL_VOLUNTEER_HOME")
    root = Path(home).expanduser() if home else Path(platformdirs.user_config_dir("fedrl")) / "federations"
    return sorted(p.parent.name for p in root.glob("*/invite.txt"))


def resolve_invite(invite: str | None, home: str | Path | None = None) -> Invite:
    """The invite given, or the one remembered when this machine joined exactly one federation."""
    if invite:
        return load_invite(invite)
    runs = known_runs(home)
    if len(runs) != 1:
        raise InviteError(
            "no invite given and "
            + (f"several federations joined ({', '.join(runs)}): name one" if runs else "none joined yet")
        )
    return load_invite(str(VolunteerHome.for_run(runs[0], home).config / "invite.txt"))
