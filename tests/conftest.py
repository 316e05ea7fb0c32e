import os

import numpy as np
import pytest
import torch


def pytest_configure(config):
    # pytest-xdist runs the suite on every core (pyproject's addopts); a worker then takes one
    # thread: the tiny models' ops gain nothing from a second (a FakeGrid federation: 4.5 s on two
    # threads, 4.8 s on one), and workers of two threads each would fight over the cores. The
    # processes that tests start (SuperNodes, CLIs) inherit the setting.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def tiny_base():
    from fedrl.models import load_model

    return load_model("tiny-base")
