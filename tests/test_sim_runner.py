import io
from types import SimpleNamespace

from fedrl.sim.runner import status_bar
from fedrl.sim.simulated_server import SimConfig
from fedrl.strategies.run_config import RunConfig


def test_the_status_line_draws_each_state_of_the_run_once():
    """Written to a log file, every state of the run reads once, not once per redraw."""
    out = io.StringIO()
    bar, progress = status_bar(RunConfig(versions=4), SimConfig(), file=out)
    counts = {"replies": 0, "rejected": 0}
    coord = SimpleNamespace(evals=[], counts=counts, run_time=lambda: 1.0, wall_start=0.0)
    for version in (1, 2, 3):
        coord.version = version
        coord.evals.append({"error": 0.5 / version})
        coord.counts["replies"] += 8
        progress(coord)
    bar.close()
    states = [s for s in out.getvalue().replace("\n", "\r").split("\r") if "version=" in s]
    drawn = [(int(s.split("version=")[1]), s.split("%")[0].split()[-1]) for s in states]
    assert drawn == [(1, "25"), (2, "50"), (3, "75"), (3, "75")]  # the last again: close's own draw
