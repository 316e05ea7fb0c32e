"""`fedrl volunteer join`: one volunteer's node, from the invite to a clean exit.

1. remember the invite, make (once) the node's key pair and show it;
2. enroll the key with the operator's patch store and wait for approval (the operator's
   approver registers it with the SuperLink; `fedrl approve`);
3. probe the hardware (volunteer.probe) and keep the caps where the ClientApp reads them;
4. run `flower-supernode` (TLS, node auth, the volunteer's limits as node config, its
   threads pinned to `--max-cpu` cores) in its own process group, restart it after a network
   loss or a crash (the ClientApp resumes from the state it keeps on disk); its ClientApps fork
   from one warm launcher (fedrl.deploy.warm_clientapp) that the session keeps across restarts
   (and starts again if it dies);
5. show a live status line from the ClientApp's status file;
6. first Ctrl-C / SIGTERM (`fedrl volunteer leave` from another shell) / the `--until` time:
   ask the node to leave (fedrl.node_files: it finishes or abandons its round, hands in its
   pending delta or not, says "leaving" to the coordinator), then stop the SuperNode (Flower
   deactivates it) and exit 0; before the node started (enrolling, waiting for approval,
   probing) it exits 0 at once. A second Ctrl-C kills everything at once (every cache write is
   atomic: nothing is corrupted).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console

from fedrl.cores import thread_env
from fedrl.deploy.federation import flwr_env, tool
from fedrl.deploy.local import stop_groups
from fedrl.deploy.supernode_timing import HEARTBEAT_RANGE, HEARTBEAT_S, session_hold_s
from fedrl.deploy.warm_clientapp import LauncherKeeper
from fedrl.invite import Invite
from fedrl.live_line import LiveLine
from fedrl.node_files import (
    APPROVED,
    LEAVE,
    ON_EXIT,
    PROBE,
    read_json,
    update_status,
    write_atomic,
    write_json,
)
from fedrl.ports import free_port
from fedrl.protocol import HardwareProbe
from fedrl.signing import key_fingerprint_ssh
from fedrl.store_client import PatchStoreClient, StoreError
from fedrl.volunteer.home import VolunteerHome
from fedrl.volunteer.node_status import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    how_it_left,
    read_status,
    status_text,
)
from fedrl.volunteer.preflight import STORE, SUPERLINK, failed, preflight_table, run_preflight
from fedrl.volunteer.probe import Limits, probe_json, probe_matches, probe_table, run_probe

SESSION_RETRY_S = 2.0  # between tries while it holds it (each starts a SuperNode and its SuperExec)
MEMORY_CHECK_S = 5.0  # how often the session sums the node's memory against --max-memory
IDLE_LEAVE_S = 30.0  # an idle node with a delta to hand in gets its next message within seconds, or goes
# Flower's SuperLink answers NODE_UNAVAILABLE for a message whose node has gone offline, even when
# the reply is already there: the node stays up until the coordinator's goodbye (or its word that
# the run is over) says it pulled its last reply, or this long after that reply when neither
# comes (a coordinator that stopped)
GOODBYE_WAIT_S = 30.0
# the SuperNode's log lines: a message handled, its reply sent, or dropped (the run had ended)
STARTED, SENT, DROPPED = "Start `flwr-clientapp` process", "Sent successfully", "Ignoring reply message"


def confinement(cpus: list[int] | None, max_memory_mb: float):
    """What each of the node's processes (the SuperNode, the warm launcher) runs before it starts
    (every process they start inherits it): stay on `cpus`, and let the kernel refuse memory past
    `max_memory_mb` (RLIMIT_DATA: heap and private mappings, so an allocation beyond it fails
    inside that process, which answers an error and lives on, instead of the machine swapping).
    It caps each process, not their sum: the session watches the sum."""
    cap = int(max_memory_mb * 2**20)

    def confine() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if cap:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    return confine


class VolunteerError(Exception):
    """The volunteer cannot go on; `code` is the exit status, the message says why and what to do."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Session:
    invite: Invite
    home: VolunteerHome
    limits: Limits = field(default_factory=Limits)
    on_exit: str = "flush"
    until: float = 0.0  # wall-clock time to withdraw at (0: none)
    approval_timeout_s: float = 600.0
    heartbeat_s: float = HEARTBEAT_S  # a killed node's restart waits up to twice this to connect
    exit_timeout_s: float = 300.0  # the longest a withdrawal waits for the round to be finished
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))

    def __post_init__(self):
        if self.on_exit not in ON_EXIT:
            raise ValueError(f"on_exit must be one of {ON_EXIT}, got {self.on_exit!r}")
        if not HEARTBEAT_RANGE[0] <= self.heartbeat_s <= HEARTBEAT_RANGE[1]:  # NaN fails too
            raise ValueError(f"heartbeat_s must be within {HEARTBEAT_RANGE} s, got {self.heartbeat_s}")
        self.proc: subprocess.Popen | None = None  # the SuperNode
        # the warm ClientApp launcher, one a session: a SuperNode restarted while the SuperLink
        # holds its old session would otherwise pay the imports of torch and peft again each time
        self.launcher = LauncherKeeper(self.start_confined)
        self.signals = 0
        self.node_id: int | None = None
        self.leave_at: float | None = None
        self.held_until = 0.0  # till then (wall clock) the SuperLink may hold the node's last session
        self.connected_once = False  # the SuperLink took the node once in this session

    def say(self, text: str) -> None:
        self.console.print(text, markup=False)  # it quotes logs and errors: "[/v1/...]" is not markup

    # ------------------------------------------------------------------ joining

    def store(self) -> PatchStoreClient:
        return PatchStoreClient(
            self.invite.store_url, self.invite.principal, self.invite.token, ca_file=str(self.home.ca_file)
        )

    async def _enroll(self, public_key: str) -> dict:
        async with self.store() as store:
            entry = await store.enroll(public_key, os.uname().nodename)
            deadline = time.monotonic() + self.approval_timeout_s
            shown = False
            while entry["status"] == "pending":
                if not shown:
                    self.say(
                        "waiting for the operator to approve this node (`fedrl approve` does it for "
                        f"invited keys); by hand: flwr supernode register {self.home.node_key()[1]}"
                    )
                    shown = True
                if time.monotonic() > deadline or self.leave_at is not None:
                    break
                await asyncio.sleep(1.0)
                entry = await store.enrollment(entry["fingerprint"])
            return entry

    def preflight(self) -> None:
        """The machine and the run's services, checked before anything is enrolled or measured."""
        checks = run_preflight(self.invite, str(self.home.ca_file), self.limits, self.home.data)
        # one row a line, however narrow the console; errors may hold brackets, which are not markup
        self.console.print("preflight:\n" + preflight_table(checks), soft_wrap=True, markup=False)
        bad = failed(checks)
        if bad:
            unreachable = any(c.name in (STORE, SUPERLINK) for c in bad)
            raise VolunteerError(
                EXIT_UNREACHABLE if unreachable else EXIT_FAILED,
                "preflight failed: " + "; ".join(c.detail for c in bad),
            )

    def enroll(self) -> None:
        _, public = self.home.node_key()
        line = public.read_text().strip()
        fingerprint = key_fingerprint_ssh(line)
        self.say(f"node key: {public}\n  {line[:40]}...{line[-24:]}")
        self.say(f"  fingerprint {fingerprint[:32]}")
        approved = self.home.state_dir / APPROVED
        if approved.is_file() and approved.read_text().strip() == fingerprint:
            # the invite only enrolls keys (it may have expired since); the SuperLink still checks this one
            self.say("approved earlier by the operator")
            return
        ended = self.invite.expired()
        if ended:
            raise VolunteerError(
                EXIT_REFUSED, f"this invite expired on {ended}: ask the operator for a new one"
            )
        try:
            entry = asyncio.run(self._enroll(line))
        except StoreError as err:
            if "HTTP 403" in str(err) or "HTTP 401" in str(err):
                raise VolunteerError(
                    EXIT_REFUSED,
                    f"the patch store refused this invite ({err}): ask the operator for a new one",
                ) from None
            raise VolunteerError(
                EXIT_UNREACHABLE, f"cannot reach the patch store at {self.invite.store_url}: {err}"
            ) from None
        if entry["status"] == "pending" and self.leave_at is not None:
            return  # asked to leave while it waited for approval
        if entry["status"] == "refused":
            raise VolunteerError(
                EXIT_REFUSED, f"the operator refused this node: {entry['reason'] or 'no reason'}"
            )
        if entry["status"] != "approved":
            raise VolunteerError(
                EXIT_REFUSED,
                f"not approved within {self.approval_timeout_s:.0f} s; ask the operator to run "
                f"`fedrl approve` or `flwr supernode register {public}`",
            )
        write_atomic(approved, (fingerprint + "\n").encode())
        self.say("approved by the operator")

    def probe(self) -> None:
        """Probe once per machine and limits: a rejoin reuses the probe (`fedrl volunteer probe`
        measures again)."""
        path = self.home.state_dir / PROBE
        try:
            kept = HardwareProbe.parse(read_json(path) or {}, "probe")
        except ValueError:
            kept = None
        if kept is not None and probe_matches(kept, self.invite, self.limits):
            self.say("hardware probe (kept from the last join; `fedrl volunteer probe` measures again):")
            self.say(probe_table(kept))
            return
        self.say("probing this machine and its link to the patch store ...")
        result = run_probe(self.invite, str(self.home.ca_file), self.limits)
        write_atomic(path, probe_json(result).encode())
        self.say(probe_table(result))

    # ------------------------------------------------------------------ the SuperNode

    def node_config(self) -> str:
        items = {
            "ca-file": str(self.home.ca_file),
            "state-dir": str(self.home.state_dir),
            "max-threads": self.limits.threads(),
            "upload-kbps": float(self.limits.upload_kbps),
            "download-kbps": float(self.limits.download_kbps),
        }
        return " ".join(f"{k}={json.dumps(v)}" for k, v in items.items())

    def log_path(self) -> Path:
        return self.home.logs / "supernode.log"

    def start_node(self) -> None:
        key, _ = self.home.node_key()
        argv = [tool("fedrl"), "supernode", "--superlink", self.invite.superlink]
        argv += ["--root-certificates", str(self.home.ca_file), "--auth-supernode-private-key", str(key)]
        argv += ["--port", str(free_port()), "--node-config", self.node_config()]
        argv += ["--max-retries", "5", "--max-wait-time", "60", "--heartbeat-s", f"{self.heartbeat_s:g}"]
        argv += ["--warm-launcher", str(self.launcher.warm.directory)]
        argv += ["--parent-pid", str(os.getpid())]  # a session killed outright takes its SuperNode along
        self.log_offset = self.log_path().stat().st_size if self.log_path().exists() else 0
        self.proc = self.start_confined(argv)

    def start_confined(self, argv: list[str]) -> subprocess.Popen:
        """A process of the node (the SuperNode, the launcher): in a process group of its own,
        within the volunteer's limits, its output in the node's log."""
        threads = self.limits.threads()
        env = flwr_env(**thread_env(threads))
        cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else None
        with open(self.log_path(), "ab") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.home.data,
                start_new_session=True,
                preexec_fn=confinement(cpus, self.limits.max_memory_mb),
            )

    def node_log(self) -> str:
        try:
            with open(self.log_path(), "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def node_procs(self) -> list[subprocess.Popen]:
        """The processes the session started for the node: the SuperNode and the launcher."""
        return [p for p in (self.proc, self.launcher.proc) if p is not None]

    def stop_node(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """Signal the SuperNode's and the launcher's process groups, then SIGKILL whatever is left
        after timeout_s."""
        stop_groups(self.node_procs(), sig, timeout_s)

    def memory_mb(self) -> float:
        """What the node uses: the SuperNode and every process under it, the warm launcher and
        the ClientApps that forked from it, by proportional set size, so a page the launcher
        shares with them counts once; reading it costs ~10 ms a process, so the session looks
        every MEMORY_CHECK_S."""
        procs = []
        for proc in self.node_procs():
            try:
                root = psutil.Process(proc.pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.Error:  # gone
                pass
        total = 0
        for p in procs:
            try:
                info = p.memory_full_info()
                total += getattr(info, "pss", info.rss)  # Linux has PSS; elsewhere shared pages count twice
            except psutil.Error:
                pass
        return total / 2**20

    # ------------------------------------------------------------------ withdrawal

    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            self.say(f"\nleaving ({self.on_exit}): press Ctrl-C again to stop at once")
            self.request_leave()
        else:  # at once: every cache write is atomic, a kill corrupts nothing
            self.stop_node(signal.SIGKILL, 5.0)
            os._exit(EXIT_INTERRUPTED)

    def request_leave(self) -> None:
        if self.leave_at is None:
            write_json(self.home.state_dir / LEAVE, {"on_exit": self.on_exit, "at": time.time()})
            self.leave_at = time.monotonic()

    def left(self, status: dict, log: str) -> bool:
        """Nothing is left to send: no message is being handled and no reply is on its way
        (stopping the SuperNode sooner loses the reply and the delta it carries), the coordinator
        said goodbye, that the run is over or that the node rests (or GOODBYE_WAIT_S passed since
        the last reply without any of them), and no delta waits to be handed in with a next message
        (for at most IDLE_LEAVE_S)."""
        waited = time.monotonic() - self.leave_at
        busy = log.count(SENT) + log.count(DROPPED) < log.count(STARTED) or status.get("phase") == "working"
        if busy:
            return waited > self.exit_timeout_s
        # every reply was pulled (a rest follows a reply the coordinator pulled and refused)
        if status.get("acknowledged") or status.get("run_over") or status.get("phase") == "resting":
            return True
        if status.get("phase") == "idle" and status.get("holds_delta") and self.on_exit == "flush":
            return waited > IDLE_LEAVE_S
        return time.time() - status.get("updated_at", 0.0) > GOODBYE_WAIT_S

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        if (pid := self.home.running_pid()) is not None:  # two nodes on one key and one state: refused
            raise VolunteerError(
                EXIT_BAD_INPUT,
                f"a volunteer already runs for this federation (pid {pid}, home {self.home.data}): "
                f"stop it first (Ctrl-C where it runs, or `fedrl volunteer leave`)",
            )
        self.home.remember(self.invite)
        (self.home.state_dir / LEAVE).unlink(missing_ok=True)
        # not the last session's "left" or "run over"
        update_status(self.home.state_dir, phase="connecting", acknowledged=False, run_over=False)
        self.held_until = self.home.key_held_until()
        session = {
            "pid": os.getpid(),
            "clean": False,
            "heartbeat_s": self.heartbeat_s,
            "started": time.time(),
        }
        write_json(self.home.session, session)
        handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self.start_and_serve()
        except VolunteerError:
            # it gave up (refused, unreachable): no clean withdrawal, but a node that never
            # connected holds no session that the next join should wait out
            write_json(self.home.session, {**session, "connected": self.connected_once})
            raise
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.stop_node()
        write_json(
            self.home.session,
            {**session, "clean": True, "ended": time.time(), "connected": self.connected_once},
        )
        (self.home.state_dir / LEAVE).unlink(missing_ok=True)
        return code

    def start_and_serve(self) -> int:
        for stage in (self.preflight, self.enroll, self.probe):
            stage()
            if self.leave_at is not None:  # asked to leave before its node started: it owes nothing
                self.say("left before the node started: nothing to hand in; bye")
                return EXIT_OK
        return self.serve()

    def serve(self) -> int:
        line = LiveLine(self.console)
        restarts, next_memory_check = 0, 0.0
        self.launcher.ensure()  # first: its imports overlap the SuperNode's connecting
        self.start_node()
        while True:
            if self.leave_at is None and (self.until and time.time() >= self.until):
                self.say("\nthe time given is up: leaving")
                self.request_leave()
            if self.limits.max_memory_mb and time.monotonic() >= next_memory_check:
                next_memory_check = time.monotonic() + MEMORY_CHECK_S
                if self.memory_mb() > self.limits.max_memory_mb:
                    cap = self.limits.max_memory_mb
                    self.say(f"\nthe node went over --max-memory {cap:.0f} MB: stopping it")
                    self.on_exit = "drop"
                    self.request_leave()
                    self.stop_node()
                    return EXIT_FAILED
            if self.leave_at is None and (note := self.launcher.ensure()):
                self.say(f"\n{note}")
            log = self.node_log()
            if self.node_id is None and (found := re.search(r"SuperNode ID: (\d+)", log)):
                self.say(f"connected to {self.invite.superlink} as node {found.group(1)}")
                if not self.connected_once:
                    self.say("to leave cleanly: Ctrl-C here, or `fedrl volunteer leave` from another shell")
                self.node_id, self.connected_once = int(found.group(1)), True
            status = read_status(self.home)
            line.show(status_text(self.node_id, status))
            if self.leave_at is not None and self.left(status, log):
                line.done()
                self.say(f"left the federation cleanly ({how_it_left(status)}); bye")
                return EXIT_OK
            if self.proc.poll() is not None:
                if self.leave_at is not None:
                    return EXIT_OK
                if self.node_id is not None:  # it died connected, no goodbye: the SuperLink holds it
                    self.held_until = time.time() + session_hold_s(self.heartbeat_s)
                verdict = self.diagnose(log)
                if verdict:
                    raise VolunteerError(*verdict)
                restarts += 1
                self.node_id = None
                # a held session goes at a moment the SuperLink decides: ask again soon, steadily
                held = "Failed to activate SuperNode" in log
                time.sleep(SESSION_RETRY_S if held else min(30.0, 2.0 * restarts))
                self.start_node()
            time.sleep(0.5)

    def diagnose(self, log: str) -> tuple[int, str] | None:
        """Why the SuperNode exited: an (exit code, message) to give up with, or None to retry."""
        if "Failed to activate SuperNode" in log:
            if time.time() < self.held_until:
                until = time.strftime("%H:%M:%S", time.localtime(self.held_until))
                self.say(
                    f"the SuperLink still holds this node's last session (till {until} at most): retrying"
                )
                return None
            return (
                EXIT_REFUSED,
                "the SuperLink refused this node's key: the operator revoked it (or it was never "
                "registered). Ask the operator; your cached work stays on disk.",
            )
        if not self.connected_once and re.search(
            r"Connection refused|could not establish|ConnectError|timed out", log
        ):
            return EXIT_UNREACHABLE, f"cannot reach the coordinator's SuperLink at {self.invite.superlink}"
        if not self.connected_once:
            tail = " | ".join(log.strip().splitlines()[-4:])
            return EXIT_FAILED, f"the SuperNode exited with {self.proc.returncode}: {tail}"
        self.say("lost the connection to the SuperLink; rejoining")
        return None


def join(
    invite: Invite,
    limits: Limits | None = None,
    home: str | Path | None = None,
    on_exit: str = "flush",
    until: float = 0.0,
    **options,
) -> int:
    """Join the federation of `invite` and work until asked to leave (Ctrl-C, SIGTERM, `until`);
    returns the exit status (0 after a clean withdrawal). Call it from the main thread."""
    session = Session(
        invite, VolunteerHome.for_run(invite.run, home), limits or Limits(), on_exit, until, **options
    )
    try:
        return session.run()
    except VolunteerError as err:
        session.say(f"fedrl volunteer: {err}")
        return err.code
