"""The entry points of the compose stack's services that need more than one command.

`fedrl deploy node`: a SuperNode that brings its own identity. It makes an EC key pair on
first start (kept in the container's own layer, so each `--scale` replica is a node of its
own and a restarted container is the same node), registers the public key with the SuperLink,
picks a free port for its Runtime API, starts its warm ClientApp launcher
(fedrl.deploy.warm_clientapp) and then becomes `flower-supernode`.

`fedrl deploy submit`: the one-shot submitter. It waits for the nodes, submits the deployment
app with the stack's store, TLS and state settings, waits for the run to finish and prints
its summary; exit 0 only when the run completed and wrote its summary.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fedrl.certs import make_node_key
from fedrl.deploy.federation import DeployError, Federation, run_config
from fedrl.deploy.supernode_timing import supernode_argv
from fedrl.deploy.warm_clientapp import exec_with_launcher
from fedrl.ports import free_port


def node(superlink: str, certs: Path, home: Path, max_threads: int = 0, timeout_s: float = 300.0) -> None:
    """Register this node's key and exec `flower-supernode` (never returns on success);
    `max_threads`: the learner's (0: torch's default, every core)."""
    identity = home / "name"
    if not identity.exists():
        home.mkdir(parents=True, exist_ok=True)
        identity.write_text(f"node-{os.urandom(4).hex()}\n")
    name = identity.read_text().strip()
    key, public = make_node_key(home, name)
    federation = Federation(home / "flwr", superlink, certs / "ca.pem")
    deadline = time.monotonic() + timeout_s
    while True:  # the SuperLink may still be starting
        try:
            federation.register(public)
            break
        except DeployError as err:
            if time.monotonic() > deadline:
                raise DeployError(f"{name}: could not register with {superlink}: {err}") from None
            time.sleep(2)
    print(f"{name}: registered key ...{public.read_text().split()[1][-16:]} with {superlink}", flush=True)
    node_config = f'ca-file="{certs / "ca.pem"}" state-dir="{home / "state"}" max-threads={max_threads}'
    args = ["--superlink", superlink, "--root-certificates", str(certs / "ca.pem")]
    args += ["--auth-supernode-private-key", str(key), "--port", str(free_port())]
    args += ["--node-config", node_config]
    exec_with_launcher(supernode_argv(args), federation.env())


def submit(superlink: str, certs: Path, home: Path, nodes: int, config: dict, timeout_s: float) -> int:
    """Submit one run and wait for it; the exit code of the submitter."""
    config = run_config({"min-nodes": nodes, **config})  # checked before anything waits
    federation = Federation(home, superlink, certs / "ca.pem")
    federation.wait_nodes(nodes, timeout_s)
    run_id = federation.submit(config)
    print(f"submitted run {run_id} to {superlink} with {nodes} nodes", flush=True)
    seen = set()

    def changed(status: str) -> None:  # one line per status, not one per poll
        if status not in seen:
            seen.add(status)
            print(f"run {run_id}: {status}", flush=True)

    out_dir = Path(config.get("out-dir", ""))  # the results volume, mounted here too
    status = federation.wait_run(run_id, timeout_s, changed, out_dir / "events.jsonl")
    print(f"run {run_id}: {status}", flush=True)
    summary_path = out_dir / "summary.json"
    if status != "finished:completed" or not summary_path.exists():
        print(f"no completed run with a summary at {summary_path}", flush=True)
        return 1
    summary = json.loads(summary_path.read_text())
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "initial_eval",
                    "final_eval",
                    "versions",
                    "counts",
                    "bytes_up",
                    "bytes_down",
                    "best_adapter",  # its folder is in the ServerApp's results volume
                )
            }
        ),
        flush=True,
    )
    return 0
