"""Shared fixtures (the builders: ``builders.py``). The fixtures are not autouse (a test file opts in with
``pytestmark = pytest.mark.usefixtures("fresh_compile")``), but for the tiers' run-time
check (``tiers.py``: a test not marked slow may not compile with Inductor or start a process).

One run shares one Inductor cache (``TORCHINDUCTOR_CACHE_DIR``, made empty when the run starts and removed
when it ends, :func:`pytest_configure`): its workers, the processes its tests start, and every test. A graph
two tests compile alike is compiled once; a hit still hands ``run_and_get_code`` the code (Inductor's
cache calls ``GraphLowering.save_output_code``), and the backend's cache-key tag holds the package's
source hash. A test that must see Inductor compile takes :func:`fresh_inductor_cache`."""

import os
import shutil
import tempfile

import pytest
import torch
import torch._dynamo

import compile_pass  # noqa: F401 - registers the chunkce ops
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache
from tiers import _tier_check  # noqa: F401 - the tiers' run-time check (tiers.py)


def pytest_configure(config):
    """Under pytest-xdist (the README runs ``-n 2``) each worker takes its share of the cores:
    two workers each running the op's small per-tile kernels on every core would wait on each
    other's threads (the many-block precision case: 7 s alone, 15 s with both on 2 threads).

    The op's walks still split over two walk threads (``CHUNKCE_WALK_THREADS=2``, unless set): what
    a user's walk does on any machine of two cores or more, whatever this worker's share of them
    (the one-thread walk: ``tests/op/test_walk_threads.py``, and every spawned rank that sets it)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("CHUNKCE_WALK_THREADS", "2")
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's own process: its workers inherit the cache
        config.chunkce_inductor_cache = tempfile.mkdtemp(prefix="chunkce-tests-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.chunkce_inductor_cache


def pytest_unconfigure(config):
    """Remove the run's Inductor cache (:func:`pytest_configure`)."""
    if getattr(config, "chunkce_inductor_cache", None):
        shutil.rmtree(config.chunkce_inductor_cache, ignore_errors=True)


@pytest.fixture
def fresh_compile():
    """Isolation for compile tests: Dynamo reset and counters cleared, before and after.

    Inductor's cache stays the run's (module docstring): it keys a graph by the graph, the
    config and the backend's tag, so a hit serves what a fresh compile would. (A fresh dir per
    test compiled the same C++ kernels again in every test.)"""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def fresh_inductor_cache():
    """An empty Inductor cache for the test: for one that asserts what Inductor compiles or
    what its cache serves."""
    with fresh_cache():
        yield


@pytest.fixture
def eager_kernels(monkeypatch):
    """Run the op's per-chunk math eagerly: tests of the pass need not pay for compiling it."""
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")


@pytest.fixture
def chunkce_logs(caplog):
    """Every record the pass logs (``compile_pass`` loggers at DEBUG)."""
    caplog.set_level("DEBUG", logger="compile_pass")
    return caplog
