"""A run's report: summary.json, PNG plots (held-out metric and client reward vs time, bytes
vs time, staleness of accepted updates, a per-client timeline of compute and communication)
and report.html that shows them with the run's figures."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from fedrl.ledger import accepted, refusals


def _time_label(summary: dict) -> str:
    return "virtual time (s)" if summary.get("clock") == "virtual" else "wall time (s)"


def write_report(summary: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    replies = [e for e in summary["events"] if e["kind"] == "reply"]
    xlabel = _time_label(summary)
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    evals = summary["evals"]
    ax.plot(
        [e["t"] for e in evals], [e["error"] for e in evals], "o-", color="C0", label="held-out greedy error"
    )
    if evals and "format_error" in evals[0]:
        ax.plot(
            [e["t"] for e in evals],
            [e.get("format_error", np.nan) for e in evals],
            "s--",
            color="C3",
            label="held-out format errors (no answer stated)",
        )
    best = summary.get("best_adapter")
    kept = next(
        (e for e in evals if best and (e["version"], e["error"]) == (best["version"], best["error"])), None
    )
    if kept:  # the eval whose adapter the run kept in adapter-best
        ax.plot(
            [kept["t"]],
            [kept["error"]],
            "*",
            color="C2",
            ms=14,
            label=f"kept in adapter-best (v{kept['version']})",
        )
    trained = [e for e in replies if e.get("steps", 1) > 0]  # a flush reply trains nothing: no reward
    if trained:
        t = np.array([e["t"] for e in trained])
        r = np.array([e["reward"] for e in trained])
        window = max(1, len(r) // 20)
        smooth = np.convolve(r, np.ones(window) / window, mode="valid")
        ax.plot(t[window - 1 :], smooth, color="C1", label="client train reward (moving mean)")
    ax.set_xlabel(xlabel)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(
        f"{summary['config']['mode']}: error {summary['initial_eval']:.3f} -> {summary['final_eval']:.3f}"
    )
    ax.legend()
    save(fig, "metric_vs_time.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    if replies:
        t = [e["t"] for e in replies]
        ax.plot(t, np.cumsum([e["bytes_up"] for e in replies]) / 1e6, label="up")
        ax.plot(t, np.cumsum([e["bytes_down"] for e in replies]) / 1e6, label="down")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MB moved (all clients)")
    ax.legend()
    save(fig, "bytes_vs_time.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    staleness = [e["staleness"] for e in summary["events"] if e["kind"] == "accepted"]
    if staleness:
        ax.hist(staleness, bins=np.arange(max(staleness) + 2) - 0.5, color="C2", rwidth=0.85)
    ax.set_xlabel("staleness of accepted updates (versions)")
    ax.set_ylabel("updates")
    ax.set_title(
        f"{len(staleness)} accepted, {summary['counts']['rejected']} rejected, "
        f"{summary['counts']['errors']} lost (errors, dropouts, deadlines)"
    )
    save(fig, "staleness_histogram.png")

    clients = summary["clients"]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(clients) + 1.5))
    for row, (_, c) in enumerate(sorted(clients.items(), key=lambda kv: int(kv[0]))):
        for m in c["timeline"]:
            start = m["end"] - m["duration_s"]
            # overlapped rounds start both threads together; sequential ones are drawn comm first
            compute_start = start if m["overlap_s"] > 0 else start + m["comm_s"]
            ax.barh(row - 0.18, m["compute_s"], left=compute_start, height=0.32, color="C0")
            ax.barh(row + 0.18, m["comm_s"], left=start, height=0.32, color="C1")
    ax.set_yticks(
        range(len(clients)),
        [
            f"{i} {c.get('profile', '')}"
            for i, c in enumerate(c for _, c in sorted(clients.items(), key=lambda kv: int(kv[0])))
        ],
        fontsize=7 if len(clients) > 20 else 9,
    )
    ax.set_xlabel(f"{xlabel}  (blue: compute, orange: communication)")
    ax.set_title("per-client timeline: overlapping bars are parallel compute and communication")
    save(fig, "client_timeline.png")

    paths.append(write_html(summary, out, [p.name for p in paths]))
    return paths


def write_html(summary: dict, out: Path, images: list[str]) -> Path:
    cfg = summary["config"]
    scenario = summary.get("scenario", {})
    figures = [
        ("scenario", f"{scenario.get('name', '-')}: {scenario.get('description', '')}"),
        ("mode", f"{cfg['mode']} ({'sync' if cfg['sync'] else 'async'}), clock {summary.get('clock')}"),
        ("model / task", f"{cfg['model']} / {cfg['task']} {cfg['task_params']}"),
        ("held-out greedy error", f"{summary['initial_eval']:.3f} -> {summary['final_eval']:.3f}"),
        *(
            [("larger held-out set", f"error {final_set['error']:.3f} on {final_set['problems']} problems")]
            if (final_set := summary.get("final_set_eval"))
            else []
        ),
        *(
            [("best held-out eval", f"{best['error']:.3f} at v{best['version']}: {best['adapter_dir']}")]
            if (best := summary.get("best_adapter"))
            else []
        ),
        ("versions / client rounds", f"{summary['versions']} / {summary['rounds']}"),
        ("time on the run's clock", f"{summary['time_s']:.1f} s"),
        ("wall time of the coordinator", f"{summary.get('wall_s', float('nan')):.0f} s"),
        ("bytes up / down", f"{summary['bytes_up'] / 1e6:.2f} MB / {summary['bytes_down'] / 1e6:.2f} MB"),
        (
            "Flower's messages up / down",
            f"{summary['control_bytes_up'] / 1e6:.2f} MB / {summary['control_bytes_down'] / 1e6:.2f} MB",
        ),
        ("updates", ", ".join(f"{k} {v}" for k, v in summary["counts"].items())),
    ]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in figures)
    staleness = client_staleness(summary["events"])
    ledger = summary.get("ledger", {})
    client_rows = "".join(
        f"<tr><td>{c['client_id']}</td><td>{html.escape(c.get('profile', ''))}</td><td>{c['messages']}</td>"
        f"<td>{c['compute_s']:.1f}</td><td>{c['comm_s']:.1f}</td><td>{c['overlap_s']:.1f}</td>"
        f"<td>{c['bytes_up'] / 1e3:.0f}</td><td>{c['bytes_down'] / 1e3:.0f}</td>"
        f"<td>{staleness.get(c['client_id'], '-')}</td>{ledger_cells(ledger.get(node))}</tr>"
        for node, c in sorted(summary["clients"].items(), key=lambda kv: kv[1]["client_id"])
    )
    imgs = "".join(
        f'<figure><img src="{html.escape(name)}" alt="{html.escape(name)}"></figure>' for name in images
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>fedrl run: {html.escape(scenario.get("name", cfg["mode"]))}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
th,td{{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}}
figure{{display:inline-block;margin:6px}}
img{{max-width:520px}}</style></head><body>
<h1>fedrl run report</h1><table>{rows}</table>
{imgs}
<h2>clients</h2><table><tr><th>client</th><th>profile</th><th>rounds</th><th>compute s</th><th>comm s</th>
<th>overlap s</th><th>kB up</th><th>kB down</th><th>staleness mean / max</th><th>uploads accepted</th>
<th>refused (cause)</th><th>errors / lost</th><th>samples credited</th></tr>{client_rows}</table>
<p>The last four columns are the run's ledger (fedrl/ledger.py says how each is counted).</p>
<p>Full data: <a href="summary.json">summary.json</a></p></body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path


def ledger_cells(row: dict | None) -> str:
    """A client's ledger entry as table cells (none for a summary of before the ledger)."""
    if row is None:
        return "<td>-</td>" * 4
    refused = refusals(row) or "0"
    return (
        f"<td>{accepted(row)}</td><td>{html.escape(refused)}</td>"
        f"<td>{row['errors']} / {row['lost']}</td><td>{row['samples']:,}</td>"
    )


def client_staleness(events: list[dict]) -> dict[int, str]:
    """Per client id: "mean / max" staleness of its replies (versions its local copy lagged)."""
    seen: dict[int, list[int]] = {}
    for e in events:
        if e["kind"] == "reply":
            seen.setdefault(e["client"], []).append(e["staleness"])
    return {c: f"{np.mean(v):.1f} / {max(v)}" for c, v in seen.items()}
