"""Plots of a run's summary: held-out metric and client reward vs time, bytes vs time,
a per-client timeline of compute and communication."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_report(summary: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    replies = [e for e in summary["events"] if e["kind"] == "reply"]
    paths = []

    fig, ax = plt.subplots(figsize=(6.5, 4))
    evals = summary["evals"]
    ax.plot([e["t"] for e in evals], [e["error"] for e in evals], "o-", color="C0", label="held-out greedy error")
    if replies:
        t = np.array([e["t"] for e in replies])
        r = np.array([e["reward"] for e in replies])
        window = max(1, len(r) // 20)
        smooth = np.convolve(r, np.ones(window) / window, mode="valid")
        ax.plot(t[window - 1 :], smooth, color="C1", label="client train reward (moving mean)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{summary['config']['mode']}: error {summary['initial_eval']:.3f} -> {summary['final_eval']:.3f}")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "metric_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    if replies:
        t = [e["t"] for e in replies]
        ax.plot(t, np.cumsum([e["bytes_up"] for e in replies]) / 1e6, label="up")
        ax.plot(t, np.cumsum([e["bytes_down"] for e in replies]) / 1e6, label="down")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("MB moved (all clients)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "bytes_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    clients = summary["clients"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(clients) + 1.5))
    for row, (node, c) in enumerate(sorted(clients.items())):
        for m in c["timeline"]:
            start = m["end"] - m["wall_s"]
            ax.barh(row - 0.18, m["compute_s"], left=start, height=0.32, color="C0")
            ax.barh(row + 0.18, m["comm_s"], left=start, height=0.32, color="C1")
    ax.set_yticks(range(len(clients)), [f"client {i}" for i in range(len(clients))])
    ax.set_xlabel("wall time (s)  (blue: compute, orange: communication)")
    ax.set_title("per-client timeline: overlapping bars are parallel compute and communication")
    fig.tight_layout()
    paths.append(out / "client_timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
