"""The walk threads (docs/op.md, "Walk threads"): on CPU a walk's tiles are split over threads of
its own, each running its tiles' matmuls and kernel on one intra-op thread. Which thread ran
each tile (seen through ``kernel_runner.hooked_runs``), the values and every gradient against
torch's on both walks (split and one thread), a split that does not depend on timing, errors
raised in a walk thread, the contexts that keep a walk on its caller's thread, and the tiles a
split chooses."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
import types

import pytest
import torch
import torch.nn.functional as F
from statistics_reference import OUTPUTS, gradients, problem, unfused, upstream
from torch.utils._python_dispatch import TorchDispatchMode

from compile_pass import linear_cross_entropy, linear_statistics
from compile_pass.op import kernel_runner, loops
from compile_pass.op.tiling import ALIGN, VOCAB_ALIGN, choose_tiles, spans

TOL = {"atol": 2e-5, "rtol": 2e-5}


def _inputs(num_tokens=300, hidden_size=16, vocab_size=1000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) * 0.3).requires_grad_()
    bias = torch.randn(vocab_size, generator=gen).requires_grad_()
    target = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    target[:7] = -100
    return hidden, weight, bias, target


def _threads_of_runs(fn):
    """``fn()``'s result and the names of the threads each compiled kernel ran on, by kernel."""
    ran: dict[str, set[str]] = {}

    def hook(fn_name, variant):
        ran.setdefault(fn_name, set()).add(threading.current_thread().name)

    with kernel_runner.hooked_runs(hook):
        result = fn()
    return result, ran


def _loss_and_gradients(fn, hidden, weight, bias, target):
    loss = fn(hidden, weight, target, bias, reduction="none", label_smoothing=0.1)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1))
    return (loss, *torch.autograd.grad(loss, (hidden, weight, bias), upstream))


def _ours(hidden, weight, target, bias, **options):
    return linear_cross_entropy(hidden, weight, target, linear_bias=bias, **options)


def _reference(hidden, weight, target, bias, **options):
    return F.cross_entropy(F.linear(hidden, weight, bias), target, **options)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_the_loss_on_either_walk_is_torchs_and_runs_where_it_says(monkeypatch, threads):
    """Chunk size 64 (five token chunks); the default budget's vocabulary blocks."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", threads)
    hidden, weight, bias, target = _inputs()
    ours, ran = _threads_of_runs(lambda: _loss_and_gradients(
        lambda *a, **k: _ours(*a, chunk_size=64, **k), hidden, weight, bias, target))
    for got, expected in zip(ours, _loss_and_gradients(_reference, hidden, weight, bias, target), strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    expected_threads = ({"MainThread"} if threads == "1"
                        else {f"chunkce-walk-{index}" for index in range(int(threads))})
    assert ran == {"chunk_forward": expected_threads, "chunk_backward": expected_threads}


@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_row_statistics_on_either_walk_are_the_unfused_ones(monkeypatch, threads):
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", threads)
    hidden, weight, bias, indices = problem(300, 16, 1000, seed=3)
    theirs = unfused(hidden, weight, bias, indices)
    grads = upstream(theirs, vocab_size=1000)
    leaves = [hidden, weight, bias]

    def statistics_and_gradients():
        ours = linear_statistics(hidden, weight, bias, indices, chunk_size=64)
        return ours, gradients(ours, leaves, grads)

    (ours, mine), ran = _threads_of_runs(statistics_and_gradients)
    for name in (*OUTPUTS, "argmax"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), **TOL)
    for got, expected in zip(mine, gradients(theirs, leaves, grads), strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    expected_threads = {"MainThread"} if threads == "1" else {"chunkce-walk-0", "chunkce-walk-1"}
    assert ran == {"statistics_forward": expected_threads, "statistics_backward": expected_threads}


def test_a_split_walk_gives_the_same_bits_every_time(monkeypatch):
    """The parts are static and the hidden-state gradient's part sums are added in part order."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    hidden, weight, bias, target = _inputs(seed=5)
    first = _loss_and_gradients(_ours, hidden, weight, bias, target)
    for _ in range(3):
        again = _loss_and_gradients(_ours, hidden, weight, bias, target)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("failing", ["chunkce-walk-0", "chunkce-walk-1"])
def test_an_error_in_a_walk_thread_is_raised_by_the_call_and_the_next_call_works(monkeypatch, failing):
    """Part 0 failing before its first call of a kernel: part 1, waiting to call it first, goes on."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    monkeypatch.setattr(kernel_runner, "_CALLED", set())  # every kernel's first call again (compiled already)
    monkeypatch.setattr(kernel_runner, "_GRAPHS", {})  # and no direct call of its graph
    monkeypatch.setattr(kernel_runner, "_DIRECT", {})
    hidden, weight, bias, target = _inputs()

    def fail_in_one_thread(fn_name, variant):
        if threading.current_thread().name == failing:
            raise RuntimeError("a tile failed")

    with kernel_runner.hooked_runs(fail_in_one_thread), pytest.raises(RuntimeError, match="a tile failed"):
        _ours(hidden, weight, target, bias, chunk_size=64)
    torch.testing.assert_close(_ours(hidden, weight, target, bias, chunk_size=64),
                               _reference(hidden, weight, target, bias), **TOL)


class _FirstCallers(set):
    """``kernel_runner._CALLED`` that notes which thread made each kernel's first call."""

    def __init__(self):
        super().__init__()
        self.threads: dict[str, str] = {}

    def add(self, kernel):
        self.threads[kernel.__wrapped__.__name__] = threading.current_thread().name
        super().add(kernel)


def test_a_kernels_first_call_is_the_first_parts_whichever_thread_comes_first(monkeypatch):
    """Dynamo takes a compiled kernel's symbols' hints (``vocab_start``, a tile's width) from its first
    call, and AOTAutograd's cache key holds them (torch 2.15): part 1's first block starts at another
    column. Part 0's thread is held back at its first tile; part 0 still makes every first call."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    first_callers = _FirstCallers()
    monkeypatch.setattr(kernel_runner, "_CALLED", first_callers)  # every kernel's first call again
    monkeypatch.setattr(kernel_runner, "_GRAPHS", {})  # and no direct call of its graph
    monkeypatch.setattr(kernel_runner, "_DIRECT", {})
    held_back = threading.Event()

    def hold_back_part_0(fn_name, variant):
        if threading.current_thread().name == "chunkce-walk-0" and not held_back.is_set():
            held_back.set()
            threading.Event().wait(0.5)

    hidden, weight, bias, target = _inputs()
    with kernel_runner.hooked_runs(hold_back_part_0):
        ours = _loss_and_gradients(_ours, hidden, weight, bias, target)
    for got, expected in zip(ours, _loss_and_gradients(_reference, hidden, weight, bias, target), strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    assert first_callers.threads == {"chunk_forward": "chunkce-walk-0", "chunk_backward": "chunkce-walk-0"}


def test_no_grad_and_inference_mode_walks(monkeypatch):
    """A walk thread takes its caller's inference mode: the buffers it writes are inference tensors."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    hidden, weight, bias, target = _inputs()
    expected = _reference(hidden, weight, target, bias)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            (loss, ran) = _threads_of_runs(lambda: _ours(hidden, weight, target, bias, chunk_size=64))
            statistics = linear_statistics(hidden, weight, bias, None, chunk_size=64)
        torch.testing.assert_close(loss, expected, **TOL)
        torch.testing.assert_close(statistics.lse, torch.logsumexp(F.linear(hidden, weight, bias), -1).detach(),
                                   **TOL)
        assert ran == {"chunk_forward": {"chunkce-walk-0", "chunkce-walk-1"}}


def test_a_walk_leaves_its_callers_thread_only_where_nothing_of_the_thread_is_left_behind():
    """A dispatch mode and a profiler are their thread's own (a walk thread would run the tiles
    outside them): there the parts run one after another on the caller's thread, as a walk thread
    runs them (one intra-op thread, restored after). A walk thread's own walk is not split again."""
    plan = types.SimpleNamespace(threads=2)
    parts = kernel_runner.split(plan, [1, 2, 3, 4, 5])
    assert parts == [[1, 3, 5], [2, 4]]

    def where(part):
        return threading.current_thread().name, torch.get_num_threads(), parts[part]

    on_walk_threads = [("chunkce-walk-0", 1, [1, 3, 5]), ("chunkce-walk-1", 1, [2, 4])]
    here = [("MainThread", 1, [1, 3, 5]), ("MainThread", 1, [2, 4])]
    assert kernel_runner.run_parts(plan, where, len(parts)) == on_walk_threads
    intra_op = torch.get_num_threads()
    with TorchDispatchMode():
        assert kernel_runner.run_parts(plan, where, len(parts)) == here
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert kernel_runner.run_parts(plan, where, len(parts)) == here
    assert torch.get_num_threads() == intra_op

    def nested(part):
        return kernel_runner.run_parts(plan, where, len(parts))

    assert kernel_runner.run_parts(plan, nested, 2) == [[("chunkce-walk-0", 1, [1, 3, 5]), ("chunkce-walk-0", 1, [2, 4])],
                                                [("chunkce-walk-1", 1, [1, 3, 5]), ("chunkce-walk-1", 1, [2, 4])]]


def test_walks_compiling_on_two_threads_leave_torchs_config_as_it_was(monkeypatch):
    """Each kernel compiles under chunkce's shape settings and torch.compile's own patches; two walk threads
    compiling at once leave none of them behind (where a patch is the whole process's, torch 2.11, a walk
    thread's calls through torch.compile take turns)."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()
    fx_config, dynamo_config = torch.fx.experimental._config, torch._dynamo.config
    settings = [(fx_config, "use_duck_shape"), (fx_config, "backed_size_oblivious"),
                (dynamo_config, "assume_static_by_default"), (dynamo_config, "automatic_dynamic_shapes")]
    before = [getattr(module, name) for module, name in settings]
    for num_tokens, vocab_size, seed in ((300, 1000, 0), (64, 509, 1), (37, 130, 2)):
        hidden, weight, bias, target = _inputs(num_tokens, vocab_size=vocab_size, seed=seed)
        _loss_and_gradients(lambda *a, **k: _ours(*a, chunk_size=16, chunk_bytes=16 * 48 * 4, **k),
                            hidden, weight, bias, target)
        linear_statistics(hidden, weight, bias, target.clamp(min=0)[:, None], temperature=0.7, chunk_size=16)
    assert [getattr(module, name) for module, name in settings] == before
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()


def test_the_backward_keeps_its_extra_sums_within_their_budget(monkeypatch):
    """Parts beyond the first each hold an ``[N, H]`` sum: with no room for one, the backward runs on
    the caller's thread (the forward still splits)."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    monkeypatch.setattr(loops, "MAX_PART_BYTES", 300 * 16 * 4 - 1)
    hidden, weight, bias, target = _inputs()
    ours, ran = _threads_of_runs(lambda: _loss_and_gradients(_ours, hidden, weight, bias, target))
    for got, expected in zip(ours, _loss_and_gradients(_reference, hidden, weight, bias, target), strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    assert ran == {"chunk_forward": {"chunkce-walk-0", "chunkce-walk-1"}, "chunk_backward": {"MainThread"}}


@pytest.mark.parametrize("num_tokens, vocab_size", [(2048, 32000), (1536, 32000), (2048, 128256), (300, 5000),
                                                    (100, 1000), (8192, 262144)])
def test_a_split_walks_tiles_share_the_budget_and_come_in_multiples_of_the_threads(num_tokens, vocab_size):
    budget = 7 * 2**20
    one = choose_tiles(num_tokens, vocab_size, 4, default_chunk_bytes=budget)
    split = choose_tiles(num_tokens, vocab_size, 4, default_chunk_bytes=budget, parts=2)
    assert split.bytes(4) <= budget // 2 < one.bytes(4) or split.bytes(4) <= one.bytes(4) <= budget // 2
    assert split.tokens % ALIGN == 0 and split.vocab_block % VOCAB_ALIGN == 0
    assert len(spans(num_tokens, split.tokens)) % 2 == 0
    assert len(spans(vocab_size, split.vocab_block)) % 2 == 0


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_bad_walk_threads_variable_is_refused(monkeypatch, value):
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", value)
    with pytest.raises(ValueError, match=f"CHUNKCE_WALK_THREADS to be a positive integer, got '{value}'"):
        linear_cross_entropy(*_inputs()[:2], _inputs()[3])


def test_a_child_forked_while_another_thread_holds_the_walks_locks_still_walks():
    """A fork copies only the forking thread (a DataLoader's workers, made while another thread
    walks): a lock that thread held stays held in the child. The child's walk, split over two
    walk threads of its own, still ends, with torch's loss (it hung before).

    The child runs torch's ops on one thread, as a DataLoader worker does (``_worker_loop`` sets
    it): a child forked after the parent's OpenMP pool ran hangs in its first parallel op
    (libgomp's; no chunkce code involved). Under pytest-xdist each worker has one thread and no
    pool; without it the parent runs two threads and has one."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with kernel_runner._POOLS_LOCK, kernel_runner._COMPILED_LOCK, kernel_runner._FIRST_CALL:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child: its exit status is the test's verdict
        code = 1
        try:
            os.environ["CHUNKCE_WALK_THREADS"] = "2"
            torch.set_num_threads(1)
            hidden, weight, bias, target = _inputs()
            with torch.no_grad():  # torch's autograd cannot run in a child forked after it ran threaded
                ours = _ours(hidden, weight, target, bias, chunk_size=64, reduction="none", label_smoothing=0.1)
                theirs = _reference(hidden, weight, target, bias, reduction="none", label_smoothing=0.1)
            torch.testing.assert_close(ours, theirs, **TOL)
            code = 0
        except BaseException:
            traceback.print_exc()  # the parent's test output shows why the child failed
        finally:
            os._exit(code)
    release.set()
    holder.join()
    deadline = time.monotonic() + 120
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's walk did not end in 120 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status[1]) == 0
