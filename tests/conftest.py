"""Shared test fixtures: devices to parametrise over, seeded RNG."""

import pytest
import torch


def _devices():
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append("cuda")
    return devs


DEVICES = _devices()


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """Every device; CUDA cases skip with a reason where there is no GPU."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
