"""A real deployment on one machine: every service its own OS process, TLS on every hop.

`fedrl deploy local --nodes N` (and the multi-process test) run, under one folder:
  certs/        CA, server certificate, node key pairs, the store secret (fedrl.certs)
  flwr/         FLWR_HOME: the `flwr` CLI's connection profile `fedrl-local`
  logs/         one log per process
  state/        the SuperLink's database, the coordinator's keys and checkpoints, node state
  run/          the coordinator's output: summary.json, the adapter
The processes: `fedrl patch-store` (TLS), `flower-superlink` (TLS, SuperNode authentication on,
a database so registrations survive restarts), N `flower-supernode`s (each with its own EC key
pair, registered with the SuperLink, started as `fedrl supernode`), one warm ClientApp launcher
that every SuperNode's ClientApps are forked from (they share the machine: torch and peft are
imported once, not once a node and again at each node's restart; started again where the nodes
look for it if it dies: `keep_launcher`), and `flwr run` submitting the
deployment app (fedrl/deploy/app: fedrl's real ServerApp and ClientApp). Each process gets its
own process group, so stopping one stops what it started (ClientApp processes; the SuperLink's
SuperExec runs in a session of its own and goes seconds after the SuperLink does, the ServerApp
it started seconds after that: `kill` reaches them at once); a ClientApp forked for a SuperNode
that is killed goes at once with the shim that the SuperNode started (warm_clientapp's
`go_with_the_shim`). Every service goes when the process that started it does, however it ends
(SIGKILL, a crash): the SuperNodes and the launcher watch for it themselves, the store and the
SuperLink run under `fedrl.deploy.parent_watch`'s guard.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil

from fedrl.certs import make_ca, make_node_key, make_server_cert
from fedrl.cores import thread_env, usable_cores
from fedrl.credentials import load_or_create_secret
from fedrl.deploy.federation import DeployError, Federation, app_config, run_config, tool
from fedrl.deploy.parent_watch import guarded
from fedrl.deploy.supernode_timing import HEARTBEAT_S
from fedrl.deploy.warm_clientapp import LauncherKeeper
from fedrl.invite import Invite, make_invite
from fedrl.ports import check_port_free, free_port
from fedrl.protocol import LearnerSettings

INVITE_LEARNER_KEYS = tuple(LearnerSettings.model_fields)
LAUNCHER = "clientapp-launcher"  # the process's name here and its log's


def learner_settings(run_overrides: dict) -> dict:
    """The learner settings an invite carries: the deployment app's defaults, then the run's
    overrides (dashes or underscores; any run config key, checked, the learner ones kept)."""
    config = {k.replace("-", "_"): v for k, v in (app_config() | run_config(run_overrides)).items()}
    return {k: config[k] for k in INVITE_LEARNER_KEYS}


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to a running process's whole group (what it started goes with it)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_groups(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    """Send `sig` to each process's group (what it started goes with it), wait up to `timeout_s`
    for the leaders, then SIGKILL each group until it is gone."""
    for proc in procs:
        signal_group(proc, sig)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # the sweep below kills it
    for proc in procs:  # a group may outlive its leader
        sweep_group(proc)


def has_exited(p: psutil.Process) -> bool:
    """A zombie has exited once its last thread has (its main thread is a zombie while the others
    still close its files, a listening port among them); an init that does not reap, as in some
    containers, keeps orphans as zombies for good."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE and p.num_threads() <= 1
    except psutil.NoSuchProcess:
        return True


def running_in_group(pgid: int) -> bool:
    """Whether a process of group `pgid` has yet to exit."""
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and not has_exited(p):
                return True
        except (ProcessLookupError, psutil.Error):
            pass
    return False


def kill_tree(pid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL `pid` and every process it started, whatever session they run in, and wait until
    all have exited. Flower's SuperLink starts its SuperExec in a session of its own, and the
    ServerApps come from that: a signal to the SuperLink's group misses them, and a ServerApp
    left behind goes on aggregating and checkpointing until it notices, some seconds later
    (8-12 s here). Each process is stopped (SIGSTOP) before its children are listed, so none
    starts another unseen."""
    stopped, frontier = [], [pid]
    while frontier:
        try:
            p = psutil.Process(frontier.pop())
            p.suspend()
            stopped.append(p)
            frontier += [c.pid for c in p.children()]
        except psutil.NoSuchProcess:
            pass
    for p in stopped:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    gone_by = time.monotonic() + timeout_s
    while any(not has_exited(p) for p in stopped) and time.monotonic() < gone_by:
        time.sleep(0.05)


def sweep_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL the group `proc` leads until none of its processes runs, up to `timeout_s`."""
    gone_by = time.monotonic() + timeout_s
    while time.monotonic() < gone_by:
        proc.poll()  # reap the leader
        if not running_in_group(proc.pid):
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


class LocalDeployment:
    """Start, stop, kill and restart the services of one local deployment (see the module doc)."""

    def __init__(
        self,
        root: str | Path,
        nodes: int = 3,
        host: str = "127.0.0.1",
        port: int = 0,
        node_heartbeat_s: float = HEARTBEAT_S,  # a killed node's restart waits up to twice this
    ):
        if nodes < 0:
            raise ValueError("nodes must be >= 0 (0: volunteers only)")
        self.root, self.host, self.num_nodes = Path(root).resolve(), host, nodes
        self.node_heartbeat_s = node_heartbeat_s
        self.certs, self.logs, self.state = self.root / "certs", self.root / "logs", self.root / "state"
        self.flwr_home, self.run_dir = self.root / "flwr", self.root / "run"
        self.superlink_port = port or free_port(host)
        self.store_port = free_port(host)
        self.node_ports: dict[int, int] = {}  # SuperNode i's own Runtime API port, picked on first start
        self.procs: dict[str, subprocess.Popen] = {}
        self.launcher = LauncherKeeper(lambda argv: self.start(LAUNCHER, argv))
        self.approver = None
        self.prepare()

    # ------------------------------------------------------------------ set-up

    @property
    def store_url(self) -> str:
        return f"https://{self.host}:{self.store_port}"

    def node_name(self, i: int) -> str:
        return f"node-{i + 1}"

    def prepare(self) -> None:
        """Certificates, node keys, the store secret and the CLI's connection profile (files that
        exist are kept: a deployment folder can be reused)."""
        for d in (self.logs, self.state, self.run_dir, self.flwr_home):
            d.mkdir(parents=True, exist_ok=True)
        make_ca(self.certs)
        make_server_cert(self.certs, [self.host, "localhost"])
        for i in range(self.num_nodes):
            make_node_key(self.certs, self.node_name(i))
        load_or_create_secret(self.certs / "store.secret")
        self.federation = Federation(
            self.flwr_home, f"{self.host}:{self.superlink_port}", self.certs / "ca.pem"
        )

    # ------------------------------------------------------------------ processes

    def start(
        self, name: str, argv: list[str], port: int | None = None, threads: int = 0
    ) -> subprocess.Popen:
        """Start a service (`threads`: its torch threads, see `thread_env`; 0: the default)."""
        if name in self.procs and self.procs[name].poll() is None:
            raise DeployError(f"{name} is already running (pid {self.procs[name].pid})")
        if port is not None:
            try:
                check_port_free(self.host, port)
            except OSError as err:
                raise DeployError(f"{name}: {err}") from None
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.federation.env() | thread_env(threads),
            cwd=self.root,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        if port is not None:
            self.wait_listening(name, port)
        return proc

    def wait_listening(self, name: str, port: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise DeployError(f"{name} exited with {self.procs[name].returncode}: {self.tail(name)}")
            try:
                with socket.create_connection((self.host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise DeployError(
            f"{name} did not listen on {self.host}:{port} within {timeout_s} s: {self.tail(name)}"
        )

    def tail(self, name: str, lines: int = 8) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"(see {path}) " + " | ".join(text.strip().splitlines()[-lines:])

    def start_store(self) -> None:
        self.start(
            "patch-store",
            guarded(
                [tool("fedrl"), "patch-store", "--host", self.host, "--port", str(self.store_port)]
                + ["--secret-file", str(self.certs / "store.secret")]
                + ["--certfile", str(self.certs / "server.pem"), "--keyfile", str(self.certs / "server.key")]
                + ["--state-dir", str(self.state / "patch-store")]
            ),
            self.store_port,
        )

    def start_superlink(self) -> None:
        self.start(
            "superlink",
            guarded(
                [tool("flower-superlink"), "--host", self.host, "--port", str(self.superlink_port)]
                + ["--ssl-ca-certfile", str(self.certs / "ca.pem")]
                + ["--ssl-certfile", str(self.certs / "server.pem")]
                + ["--ssl-keyfile", str(self.certs / "server.key")]
                + ["--enable-supernode-auth", "--disable-runtime-dependency-installation"]
                + ["--database", str(self.state / "superlink.db")]
            ),
            self.superlink_port,
            threads=self.server_threads(),  # the ServerApp it starts inherits them
        )

    def keep_launcher(self) -> str | None:
        """The deployment's warm ClientApp launcher: started with the first SuperNode, again
        (where its SuperNodes look for it) if it died; it exits when this process does. A line
        saying so if it had died (`LauncherKeeper.ensure`)."""
        return self.launcher.ensure()

    def node_threads(self) -> int:
        """The learner threads of each SuperNode: this machine's cores shared among them. With
        torch's default (every core each), nodes that train at the same time oversubscribe the
        cores and OpenMP's threads spin in their waits."""
        return max(1, usable_cores() // max(1, self.num_nodes))

    def server_threads(self) -> int:
        """The coordinator's torch threads (its held-out evaluations): the cores its nodes leave,
        at least one (`fedrl deploy local --nodes 2 --set versions=8` on 2 cores: the ServerApp's
        CPU 10.9-11.4 s with two, 8.6 s with one)."""
        return max(1, usable_cores() - self.num_nodes * self.node_threads())

    def node_dir(self, i: int) -> Path:
        return self.state / self.node_name(i)

    def start_node(self, i: int, key: Path | None = None) -> None:
        """SuperNode i with its own key (or `key`, e.g. an unregistered one)."""
        name = self.node_name(i)
        self.node_dir(i).mkdir(parents=True, exist_ok=True)
        self.keep_launcher()
        node_config = f'ca-file="{self.certs / "ca.pem"}" state-dir="{self.node_dir(i)}" '
        node_config += f"max-threads={self.node_threads()}"
        self.start(
            name,
            [tool("fedrl"), "supernode", "--superlink", f"{self.host}:{self.superlink_port}"]
            + ["--root-certificates", str(self.certs / "ca.pem")]
            + ["--auth-supernode-private-key", str(key or self.certs / "nodes" / f"{name}.key")]
            + ["--host", self.host, "--port", str(self.node_ports.setdefault(i, free_port(self.host)))]
            + ["--node-config", node_config, "--heartbeat-s", f"{self.node_heartbeat_s:g}"]
            + ["--warm-launcher", str(self.launcher.warm.directory), "--parent-pid", str(os.getpid())],
        )

    def heartbeat_intervals(self) -> dict[int, float]:
        """Node id: the heartbeat interval it registered with, from the SuperLink's database."""
        with sqlite3.connect(self.state / "superlink.db") as db:
            rows = db.execute("SELECT node_id, heartbeat_interval FROM node").fetchall()
        return {n % 2**64: interval for n, interval in rows}  # Flower keeps unsigned ids as signed 64-bit

    def up(self) -> None:
        """Everything but the run: store, SuperLink, registered and started nodes."""
        self.start_store()
        self.start_superlink()
        for i in range(self.num_nodes):
            self.federation.register(self.certs / "nodes" / f"{self.node_name(i)}.pub")
            self.start_node(i)
        self.federation.wait_nodes(self.num_nodes)

    # ------------------------------------------------------------------ volunteers

    @property
    def secret(self) -> bytes:
        return load_or_create_secret(self.certs / "store.secret")

    def invite(self, run: str = "local", **settings) -> Invite:
        """An invite to this deployment carrying the run's learner settings (see
        `learner_settings`); `settings` may be all of the run's overrides."""
        return make_invite(
            run,
            f"{self.host}:{self.superlink_port}",
            self.store_url,
            self.certs / "ca.pem",
            self.secret,
            **learner_settings(settings),
        )

    def start_approver(self, say=print) -> None:
        """Approve volunteers' enrolled keys (fedrl.deploy.approver) until the deployment stops."""
        from fedrl.deploy.approver import Approver

        self.approver = Approver(
            self.federation,
            self.store_url,
            self.secret,
            str(self.certs / "ca.pem"),
            self.state / "volunteer-keys",
        ).start(say)

    # ------------------------------------------------------------------ runs

    def submit(self, **overrides) -> int:
        """Submit a run with the deployment's own keys (store, TLS, state) plus `overrides`."""
        return self.federation.submit(
            {
                "store-url": self.store_url,
                "store-secret-file": str(self.certs / "store.secret"),
                "store-ca-file": str(self.certs / "ca.pem"),
                "out-dir": str(self.run_dir),
                "state-dir": str(self.state / "coordinator"),
                "min-nodes": max(1, self.num_nodes),  # volunteers only: override it
                **overrides,  # run_config spells keys with dashes; an override replaces the default above
            }
        )

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    # ------------------------------------------------------------------ stopping

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to a service's whole process group (what it started goes with it)."""
        if name in self.procs:
            signal_group(self.procs[name], sig)

    def kill(self, name: str) -> None:
        """SIGKILL a service and everything it started, its descendants in other sessions too;
        returns once all of it is gone (its port free: a guarded service's leader, the guard,
        goes before the service it runs)."""
        if name in self.procs:
            kill_tree(self.procs[name].pid)
            self.procs[name].wait(30)
            sweep_group(self.procs[name], 30.0)  # what its group holds that is no descendant

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every service, then SIGKILL whatever is still there after `timeout_s`."""
        if self.approver is not None:
            self.approver.close()
            self.approver = None
        stop_groups(list(reversed(self.procs.values())), signal.SIGTERM, timeout_s)

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
