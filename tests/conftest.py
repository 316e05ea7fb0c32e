import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrl.cores import usable_cores


def pytest_configure(config):
    # the commands the tests start (`fedrl`, `flwr`, `flower-supernode`) are this interpreter's:
    # `.venv/bin/python -m pytest` without the venv activated found none of them on PATH
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # pytest-xdist runs the suite on every core and one worker more (pyproject's addopts, and
    # pytest_xdist_auto_num_workers below); a worker then takes one thread: the tiny models' ops
    # gain nothing from a second (a FakeGrid federation: 4.5 s on two threads, 4.8 s on one), and
    # workers of two threads each would fight over the cores. The processes that tests start
    # (SuperNodes, CLIs) inherit the setting.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker more than the cores this process may use. The
    end-to-end tests spend part of their time waiting on their processes (heartbeats, deadlines,
    restarts); with a worker a core they left 66 s of a 2-core machine's CPU idle in a 369 s
    suite, with one more 13 s of 343 s. `PYTEST_XDIST_AUTO_NUM_WORKERS` still decides where set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return usable_cores() + 1  # (macOS has no sched_getaffinity: every core)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's worksteal (pyproject's addopts), worker i starts on the i-th contiguous
    share of this order and an idle worker steals from the end of the others' queues. So every
    share starts with end-to-end tests (marked slow; whole files, which share module fixtures such
    as a deployment) and ends with quick ones: a worker that runs out steals quick tests, and no
    worker is left alone on a long test at the end (one was for 32 s of a 387 s suite)."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2:  # a worker cannot tell the distribution mode (its own reads "no")
        return
    slow_files: dict[str, list] = {}
    quick = []
    for item in items:
        if item.get_closest_marker("slow"):
            slow_files.setdefault(str(item.path), []).append(item)
        else:
            quick.append(item)
    lanes = [[] for _ in range(workers)]
    for at, file_items in enumerate(slow_files.values()):
        lanes[at % workers] += file_items
    order, left = [], len(items)
    for lane_at, lane in enumerate(lanes):
        share = left // (workers - lane_at)  # how worksteal cuts the pending tests among workers
        take = max(0, share - len(lane))
        order += lane + quick[:take]
        quick, left = quick[take:], left - share
    items[:] = order + quick


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def tiny_base():
    from fedrl.models import load_model

    return load_model("tiny-base")
