"""`fedrl bench overlap --netns`: the overlap across a real shaped network between hosts.

The patch store runs as its own process (`fedrl patch-store`) in a network namespace; each
client is a process in a namespace of its own, joined to the store's by a veth pair whose two
ends are shaped by `tc tbf`: the client's end at its upload rate, the store's end at its
download rate. Clients differ in rates (upload half the download, as on home links) and in
latency (netem is not available here, so latency stays in fedrl's own Link). Each client runs
the same block-sequential and parablock rounds as `fedrl bench overlap`, timed on the wall
clock, one client at a time so that they do not share the CPU. Rates are chosen from a
round measured unshaped first, so that each client's comm/compute ratio is 0.5, 1 or 2.

Addresses are link-local (169.254.77.0/24): they exist only inside the namespaces made here,
which are removed at the end, also on failure. Without the rights to make namespaces (root,
CAP_NET_ADMIN) or without iproute2, the benchmark says why and skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "169.254.77"
STORE_PORT = 8800


@dataclass(frozen=True)
class ShapedClient:
    ratio: float  # comm / compute this client's rates are chosen for
    up_bits_s: int
    down_bits_s: int
    latency_s: float


def run(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.stdout.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"fedrl-probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", probe)
    except RuntimeError as err:
        return f"cannot make a network namespace: {err}"
    run("ip", "netns", "del", probe)
    return None


class Topology:
    """The store's namespace and one namespace per client, each joined to the store's by a
    shaped veth pair. A context manager: every namespace (and so every veth) goes on exit."""

    def __init__(self, clients: list[ShapedClient]):
        tag = os.getpid() % 100000
        self.clients, self.store_ns = clients, f"fedrl-store-{tag}"
        self.client_ns = [f"fedrl-c{i}-{tag}" for i in range(len(clients))]
        self.links = [(f"fc{tag}x{i}", f"fs{tag}x{i}") for i in range(len(clients))]  # <= 15 chars

    def store_address(self, i: int) -> str:
        return f"{SUBNET}.{4 * i + 1}"

    def __enter__(self) -> Topology:
        try:
            run("ip", "netns", "add", self.store_ns)
            run("ip", "-n", self.store_ns, "link", "set", "lo", "up")
            for i, (client, (c_if, s_if)) in enumerate(zip(self.clients, self.links)):
                ns = self.client_ns[i]
                run("ip", "netns", "add", ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
                run(
                    "ip",
                    "link",
                    "add",
                    c_if,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    s_if,
                    "netns",
                    self.store_ns,
                )
                run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{4 * i + 2}/30", "dev", c_if)
                run("ip", "-n", self.store_ns, "addr", "add", f"{self.store_address(i)}/30", "dev", s_if)
                run("ip", "-n", ns, "link", "set", c_if, "up")
                run("ip", "-n", self.store_ns, "link", "set", s_if, "up")
                shape(ns, c_if, client.up_bits_s)  # what the client sends: its upload
                shape(self.store_ns, s_if, client.down_bits_s)  # what the store sends it: its download
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.client_ns, self.store_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def exec(self, ns: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)


def shape(ns: str, dev: str, bits_s: int) -> None:
    """A token bucket filter on the device's egress: `bits_s` with a burst of a few packets."""
    burst = max(3200, bits_s // 8 // 100)
    run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits_s}bit",
        "burst", str(burst), "latency", "400ms")  # fmt: skip


def plan_clients(compute_s: float, up_bytes: int, down_bytes: int) -> list[ShapedClient]:
    """Rates that make each client's round transfers take `ratio` x compute, upload at half the
    download rate, latencies of home, far and mobile links."""
    clients = []
    for ratio, latency in ((0.5, 0.01), (1.0, 0.03), (2.0, 0.06)):
        # comm = 2 latencies + up / u + down / (2 u) = ratio * compute
        up = (up_bytes + down_bytes / 2) / max(ratio * compute_s - 2 * latency, 1e-3)
        clients.append(ShapedClient(ratio, int(8 * up), int(16 * up), latency))
    return clients


def client_main(argv: list[str]) -> int:
    """Inside a client's namespace: the rounds, as one JSON line on stdout."""
    import argparse

    import torch

    from fedrl.credentials import read_secret
    from fedrl.sim.bench.overlap import Federation
    from fedrl.sim.link import LinkProfile

    p = argparse.ArgumentParser()
    p.add_argument("--store-url", required=True)
    p.add_argument("--secret-file", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--latency", type=float, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fed = Federation(args.store_url, read_secret(args.secret_file))
    link = LinkProfile(latency_s=args.latency)  # bandwidth: the kernel's tbf; latency: fedrl's Link
    fed.round("parablock", args.steps, link)  # warm-up
    rounds = {
        mode: [fed.round(mode, args.steps, link).model_dump() for _ in range(args.repeats)]
        for mode in ("block-sequential", "parablock")
    }
    print(json.dumps(rounds), flush=True)
    return 0


def measure(steps: int, repeats: int, unshaped) -> list[dict]:
    """Cases of the `netns` mode; `unshaped` is a parablock round report on loopback."""
    from fedrl.credentials import load_or_create_secret
    from fedrl.sim.bench.overlap import _case

    clients = plan_clients(unshaped.compute_s, unshaped.bytes_up, unshaped.bytes_down)
    cases = []
    with tempfile.TemporaryDirectory() as tmp, Topology(clients) as topo:
        secret_file = Path(tmp) / "store.secret"
        load_or_create_secret(secret_file)
        store = topo.exec(
            topo.store_ns,
            [sys.executable, "-m", "fedrl.cli", "patch-store", "--host", "0.0.0.0", "--port", str(STORE_PORT)]
            + ["--secret-file", str(secret_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(3)  # the store's start-up (its import of aiohttp)
            for i, client in enumerate(clients):
                url = f"http://{topo.store_address(i)}:{STORE_PORT}"
                argv = [sys.executable, "-m", "fedrl.sim.bench.netns", "--store-url", url]
                argv += ["--secret-file", str(secret_file), "--steps", str(steps), "--repeats", str(repeats)]
                proc = topo.exec(topo.client_ns[i], argv + ["--latency", str(client.latency_s)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
                out, err = proc.communicate(timeout=600)
                if proc.returncode:
                    raise RuntimeError(f"client {i} in {topo.client_ns[i]} failed: {err.strip()[-500:]}")
                rounds = json.loads(out.strip().splitlines()[-1])
                seq = min(r["duration_s"] for r in rounds["block-sequential"])
                par = min(rounds["parablock"], key=lambda r: r["duration_s"])
                case = _case("netns", client.ratio, seq, par["duration_s"], par["compute_s"], par["comm_s"])
                case.update(
                    up_kbit_s=client.up_bits_s / 1000,
                    down_kbit_s=client.down_bits_s / 1000,
                    latency_s=client.latency_s,
                    measured_link_bytes_s=par["link_bytes_per_s"],
                )
                cases.append(case)
        finally:
            store.terminate()
            store.wait(10)
    return cases


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1:]))
