"""Shared test fixtures: devices to parametrise over, seeded RNG, an empty user table cache.

Helpers (reference gradients, toy tables) live in ``tests/helpers.py``.
"""

import os

# The numba CPU kernels load in the calling thread on their first call, so every CPU test
# below exercises them, not the reference kernels that stand in while a background load
# runs (fewbit.ops._cpu_loader; tests/ops/test_cpu_loader.py tests that mode in
# subprocesses). Subprocesses started by the tests inherit it.
os.environ.setdefault("FEWBIT_CPU_KERNELS", "sync")

import pytest  # noqa: E402
import torch  # noqa: E402


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


@pytest.fixture
def fewbit_env(monkeypatch, tmp_path):
    """An empty user cache per test: tables come from fewbit.tables (shipped) or are
    written by the test; the user's own cache is never read or written.

    A module uses it for all its tests with ``pytestmark = pytest.mark.usefixtures("fewbit_env")``.
    """
    from fewbit import functional as FF

    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path / "cache"))
    FF.clear_table_cache()
    yield
    FF.clear_table_cache()
