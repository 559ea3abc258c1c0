"""The two tiers: ``-m "not slow"`` (the fast tier) and ``-m slow`` (the rest).

A test is **slow** when it starts a process, builds a Hugging Face model, compiles a graph
with Inductor, or runs a hypothesis search or torch's op checks (``opcheck``,
``gradcheck``). It says so where it is written: ``pytestmark = pytest.mark.slow`` for a
module, ``@pytest.mark.slow`` on a test, ``pytest.param(..., marks=pytest.mark.slow)`` for
one case of a parametrized test.

:func:`_tier_check` (autouse, from ``conftest``) fails a test left fast that compiles a
graph with Inductor, starts a process or runs a hypothesis search, with the fix. Not
counted: the op's own per-chunk kernels (``compile_pass.op.kernel_runner.run``), which Inductor
compiles once per variant and process whoever calls the op, and what they start while
compiling.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import threading

import pytest

FIX = "mark it slow (@pytest.mark.slow, or marks=pytest.mark.slow on its case): see tests/tiers.py"


@pytest.fixture(autouse=True)
def _tier_check(request, monkeypatch):
    """A test not marked slow may not compile a graph with Inductor (the op's per-chunk
    kernels aside), start a process or search with hypothesis."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    if getattr(request.function, "is_hypothesis_test", False):
        pytest.fail(f"{request.node.nodeid} runs a hypothesis search: {FIX}")
    from torch._inductor import compile_fx

    from compile_pass.op import kernel_runner

    test_thread = threading.get_ident()
    in_kernels = [0]  # depth of kernel_runner.run calls on the test's thread
    done: list[str] = []

    def counted(run):
        def kernels_run(*args, **kwargs):
            in_kernels[0] += 1
            try:
                return run(*args, **kwargs)
            finally:
                in_kernels[0] -= 1
        return kernels_run

    def refused(real, what: str):
        def check(*args, **kwargs):
            if threading.get_ident() == test_thread and not in_kernels[0]:
                done.append(f"{request.node.nodeid} {what} but is not marked slow: {FIX}")
                raise RuntimeError(done[-1])
            return real(*args, **kwargs)
        return check

    monkeypatch.setattr(kernel_runner, "run", counted(kernel_runner.run))
    monkeypatch.setattr(compile_fx, "compile_fx", refused(compile_fx.compile_fx, "compiles a graph with Inductor"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refused(subprocess.Popen.__init__, "starts a process"))
    process = multiprocessing.process.BaseProcess
    monkeypatch.setattr(process, "start", refused(process.start, "starts a process"))
    yield
    assert not done, done[0]  # also when the test caught the error
