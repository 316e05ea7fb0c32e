import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def tiny_base():
    from fedrl.models import load_model

    return load_model("tiny-base")
