"""Shared fixtures (the builders: ``builders.py``). The fixtures are not autouse (a test file opts in with
``pytestmark = pytest.mark.usefixtures("fresh_compile")``), but for the tiers' run-time
check (``tiers.py``: a test not marked slow may not compile with Inductor or start a process)."""

import contextlib
import os

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


@pytest.fixture
def fresh_compile(request):
    """Isolation for compile tests: Dynamo reset, counters cleared, and for a slow test a
    fresh Inductor cache dir.

    A fast test keeps Inductor's cache, as every other fast test does: the only graphs
    Inductor compiles in it are the op's per-chunk kernels (``tiers.py`` fails any other),
    which the cache keys by their graph, so a hit serves what a fresh compile would. (A fresh
    dir per test compiled each kernel variant's C++ again in every test.)"""
    torch._dynamo.reset()
    counters.clear()
    with fresh_cache() if request.node.get_closest_marker("slow") else contextlib.nullcontext():
        yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def eager_kernels(monkeypatch):
    """Run the op's per-chunk math eagerly: tests of the pass need not pay for compiling it."""
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")


@pytest.fixture
def chunkce_logs(caplog):
    """Every record the pass logs (``compile_pass`` loggers at DEBUG)."""
    caplog.set_level("DEBUG", logger="compile_pass")
    return caplog
