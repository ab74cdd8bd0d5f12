"""Shared fixtures: paths to the bundled real data (assets/), used by every test; the in-process
process group some tests start is shut down before pytest exits."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
C4_TRAIN = ASSETS / "c4" / "en" / "c4-train.00000-of-01024.json.gz"
C4_VALIDATION = ASSETS / "c4" / "en" / "c4-validation.00000-of-00008.json.gz"
SPIECE = ASSETS / "t5" / "spiece.model"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def spiece_path() -> Path:
    return SPIECE


@pytest.fixture(scope="session")
def c4_train_path() -> Path:
    return C4_TRAIN


@pytest.fixture(scope="session")
def c4_validation_path() -> Path:
    return C4_VALIDATION


@pytest.fixture
def compile_caches_on():
    """AOTAutograd's and inductor's compile caches on for one test, through the configs' own `patch`
    (monkeypatch deletes an entry of torch's config modules when it undoes it, and every later
    compile in the process then fails on the missing setting). The config modules are imported
    here: a test run on its own has not compiled anything that would have imported them."""
    import torch
    import torch._functorch.config
    import torch._inductor.config

    with (
        torch._functorch.config.patch(enable_autograd_cache=True),
        torch._inductor.config.patch(fx_graph_cache=True),
    ):
        yield


def pytest_sessionfinish(session, exitstatus):
    """Tests that need a world-size-1 group keep one in this process (tests/test_checkpoint.py's
    `dist1`); freed here, not at interpreter exit, where a gloo worker thread can abort the process
    after the results are printed (training/distributed.py, shutdown_distributed)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from training.distributed import shutdown_distributed

        shutdown_distributed()
