"""The operator's side of a federation, through Flower's own `flwr` CLI: a connection profile
(address + CA) in a FLWR_HOME, node registration, the nodes online, submitting a run of the
deployment app (fedrl/deploy/app) and waiting for it. Used by `fedrl deploy local` and by the
compose stack's node and submitter services."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from fedrl.run_events import read_events

APP_DIR = Path(__file__).resolve().parent / "app"
CONNECTION = "fedrl"
STATUS_EVERY_S = 10.0  # how often wait_run asks the SuperLink before the run's events say it ended


class DeployError(OSError):
    """A service did not start or a step failed; the message says which and why."""


def tool(name: str) -> str:
    """A console script of this environment (beside the running Python), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise DeployError(f"{name} not found: install fedrl (it brings flwr) in this environment")
    return found


def flwr_env(**extra: str) -> dict[str, str]:
    """This process's environment for Flower's tools: this environment's scripts first on PATH
    (Flower's tools start each other by name: a SuperLink its `flower-superexec`, which failed to
    start from `.venv/bin/fedrl deploy local` run without the venv activated), no update checks,
    no runtime installs, unbuffered logs; plus `extra`."""
    scripts = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    return {
        **os.environ,
        "PATH": path if path.split(os.pathsep)[0] == scripts else os.pathsep.join([scripts, path]),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def app_config() -> dict:
    """The run config the deployment app accepts, with its defaults ([tool.flwr.app.config])."""
    return tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def toml_value(value) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


class Federation:
    """`flwr` CLI calls against one SuperLink, with their own FLWR_HOME."""

    def __init__(self, home: str | Path, address: str, ca_file: str | Path):
        self.home, self.address, self.ca_file = Path(home), address, Path(ca_file)
        if not self.ca_file.is_file():
            raise DeployError(f"CA certificate {self.ca_file} not found (make it with `fedrl certs`)")
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{address}"\nroot-certificates = "{self.ca_file.resolve()}"\n'
        )

    def env(self) -> dict[str, str]:
        return flwr_env(FLWR_HOME=str(self.home))

    def call(self, *args: str, timeout_s: float = 120.0) -> dict:
        """A `flwr` CLI call with JSON output; DeployError with its message when it fails."""
        out = subprocess.run(
            [tool("flwr"), *args, "--format", "json"],
            capture_output=True,
            text=True,
            env=self.env(),
            cwd=self.home,
            timeout=timeout_s,
        )
        try:
            result = json.loads(out.stdout[out.stdout.find("{") :])
        except ValueError:
            raise DeployError(
                f"flwr {args[0]} printed no JSON: {out.stdout[-300:]} {out.stderr[-300:]}"
            ) from None
        if not result.get("success", False):
            raise DeployError(f"flwr {' '.join(args[:2])}: {result.get('error-message', result)}")
        return result

    def register(self, public_key: Path) -> None:
        """Allow a node's public key on the SuperLink (a key already registered is fine)."""
        try:
            self.call("supernode", "register", str(public_key), CONNECTION)
        except DeployError as err:
            if "already in use" not in str(err):
                raise

    def node_status(self) -> dict[int, str]:
        """Every registered node's status (online, offline, registered) as the SuperLink sees it."""
        return {int(n["node-id"]): n["status"] for n in self.call("supernode", "list", CONNECTION)["nodes"]}

    def online_nodes(self) -> int:
        return sum(status == "online" for status in self.node_status().values())

    def wait_nodes(self, count: int, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                online = self.online_nodes()
            except DeployError:  # the SuperLink is not up yet
                online = 0
            if online >= count:
                return
            if time.monotonic() > deadline:
                raise DeployError(f"{online} of {count} SuperNodes online after {timeout_s} s")
            time.sleep(1)

    def submit(self, config: dict) -> int:
        """Submit a run of the deployment app with `config` (checked by run_config); its run id."""
        path = self.home / "run-config.toml"
        path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config(config).items()))
        return int(self.call("run", str(APP_DIR), CONNECTION, "--run-config", str(path))["run-id"])

    def run_status(self, run_id: int) -> str:
        runs = self.call("ls", CONNECTION, "--run-id", str(run_id))["runs"]
        return runs[0]["status"] if runs else "unknown"

    def wait_run(
        self, run_id: int, timeout_s: float = 600.0, progress=None, events: Path | None = None
    ) -> str:
        """Wait until the run is finished; returns its final status (e.g. finished:completed).
        `progress(status)` is called every second. A `flwr ls` costs about a CPU-second (at a
        steady 2 s, 17 s of a 90 s `fedrl deploy local` run), so the SuperLink is asked every
        STATUS_EVERY_S, and every second once the run's `events` file (its events.jsonl, where
        the caller can read it) says the coordinator finished; a ServerApp that crashed without
        a word is seen at the next ask."""
        start, deadline = time.time(), time.monotonic() + timeout_s
        status, asked, offset, ended = "", float("-inf"), 0, False
        while True:
            if ended or time.monotonic() - asked >= STATUS_EVERY_S:
                status, asked = self.run_status(run_id), time.monotonic()
                if status.startswith("finished"):
                    return status
            if time.monotonic() > deadline:
                said = f"; the coordinator's last events: {last_events(events)}" if events else ""
                raise DeployError(f"run {run_id} still {status} after {timeout_s} s{said}")
            if progress:
                progress(status)
            time.sleep(1)
            if events and not ended:
                ended, offset = finished_since(events, start, offset)

    def run_log(self, run_id: int, timeout_s: float = 60.0) -> str:
        """What the run's ServerApp logged, as `flwr log --show` prints it ("" if that fails)."""
        try:
            out = subprocess.run(
                [tool("flwr"), "log", str(run_id), CONNECTION, "--show"],
                capture_output=True,
                text=True,
                env=self.env(),
                cwd=self.home,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout


def finished_since(events: Path, start: float, offset: int) -> tuple[bool, int]:
    """Whether the events file, read on from `offset`, says a coordinator finished after `start`
    (Unix time: an earlier run's end in the same file does not count), and the offset to read on
    from (0 again where a new run started the file afresh)."""
    try:
        if events.stat().st_size < offset:
            offset = 0
        found, offset = read_events(events, offset)
    except OSError:  # not written yet
        return False, offset
    return any(e["kind"] == "finished" and e.get("wall", 0) >= start for e in found), offset


def last_events(events: Path, count: int = 8) -> str:
    """The last `count` events of a run's events file, short (time, kind, node, version, reason):
    what a run that did not end was doing."""
    try:
        found, _ = read_events(events)
    except OSError:
        return "none written"
    brief = [
        " ".join(str(e[k]) for k in ("t", "kind", "node", "version", "reason") if k in e)
        for e in found[-count:]
    ]
    return " | ".join(brief) or "none written"


def failure_of(log: str) -> str:
    """The exception a failed run's ServerApp ended with, from its log: the last
    `SomeError: message` line of a traceback ("" if there is none)."""
    found = re.findall(r"^[\w.]*(?:Error|Exception|Exit|Interrupt): .*$", log, flags=re.MULTILINE)
    return found[-1] if found else ""


def run_config(values: dict) -> dict:
    """`values` (dashes or underscores) checked against the app's keys; ints become floats where
    the setting is a float (`deadline-s=60` on a command line)."""
    defaults = app_config()
    config = {k.replace("_", "-"): v for k, v in values.items()}
    unknown = set(config) - set(defaults)
    if unknown:
        raise ValueError(f"unknown run config keys {sorted(unknown)}; see {APP_DIR / 'pyproject.toml'}")
    return {
        k: float(v) if isinstance(defaults[k], float) and type(v) is int else v for k, v in config.items()
    }
