"""The compiled kernels' direct calls (``kernel_runner.GraphCall``): taken once a kernel has compiled,
bitwise equal to the calls through ``torch.compile`` for the loss and statistics kernels over tile
widths, token counts and walk threads, and ``torch.compile`` alone where this torch lacks a name
they need (logged once)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

import compile_pass.torch_internals as internals
from compile_pass import linear_cross_entropy, linear_statistics
from compile_pass.op import kernel_runner

SHAPES = [(37, 53, 16), (64, 509, 8), (9, 130, 4)]  # N, V, chunk_size: ragged last chunks and blocks


def _inputs(num_tokens, vocab_size):
    gen = torch.Generator().manual_seed(num_tokens + vocab_size)
    hidden = torch.randn(num_tokens, 16, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab_size, 16, generator=gen) * 0.1).requires_grad_()
    target = torch.randint(vocab_size, (num_tokens,), generator=gen)
    target[::5] = -100
    return hidden, weight, target


def _loss_and_grads(num_tokens, vocab_size, chunk_size):
    hidden, weight, target = _inputs(num_tokens, vocab_size)
    tiles = {"chunk_size": chunk_size, "chunk_bytes": chunk_size * 48 * 4}  # blocks of 48 columns, the last narrower
    loss = linear_cross_entropy(hidden, weight, target, label_smoothing=0.1, **tiles)
    stats = linear_statistics(hidden, weight, None, target.clamp(min=0)[:, None], temperature=0.7, **tiles)
    total = loss + stats.lse.sum() + stats.entropy.sum() + stats.selected.sum()
    return (loss, stats.lse, stats.entropy, stats.argmax, *torch.autograd.grad(total, [hidden, weight]))


def _fresh_kernels():
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def compiled_kernels(monkeypatch):
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    _fresh_kernels()
    yield
    monkeypatch.undo()  # the test's patches of kernel_runner and the internals first
    kernel_runner.direct_calls_unavailable.cache_clear()
    _fresh_kernels()


@pytest.mark.parametrize("threads", ["1", "2"])
def test_direct_calls_are_taken_and_bitwise_equal_to_torch_compile(compiled_kernels, monkeypatch, threads):
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", threads)
    calls, found = [], []  # each run's kernel key; whether its direct call was resolved when the run began

    def hook(name, variant):
        key = (name, variant, kernel_runner.in_walk_thread())
        calls.append(key)
        found.append(kernel_runner.graph_call(*key) is not None)

    with kernel_runner.hooked_runs(hook):
        direct = [_loss_and_grads(*shape) for shape in SHAPES]
    direct_calls = {key: kernel_runner.graph_call(*key) for key in set(calls)}
    assert {name for name, _, _ in direct_calls} == {"chunk_forward", "chunk_backward", "statistics_forward",
                                                       "statistics_backward"}
    assert all(isinstance(call, kernel_runner.GraphCall) for call in direct_calls.values()), direct_calls
    # every run that found its kernel's direct call resolved ran it (its guards held); those that did not
    # are each kernel's compiling first ones and, with walk threads, those that began while it resolved
    assert sum(call.calls for call in direct_calls.values()) == sum(found)
    assert sum(found) >= len(calls) * 3 // 4, (sum(found), len(calls))
    assert counters["chunkce"]["kernel_graph_calls"] == len(direct_calls)
    assert counters["chunkce"]["kernel_graph_calls_refused"] == 0

    _fresh_kernels()
    monkeypatch.setattr(kernel_runner, "direct_calls_unavailable", lambda: "direct calls off for the test")
    through_compile = [_loss_and_grads(*shape) for shape in SHAPES]
    assert all(kernel_runner.graph_call(*key) is None for key in direct_calls)
    for ours, theirs in zip(direct, through_compile, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


def test_two_threads_resolving_one_kernel_make_one_direct_call(monkeypatch):
    """Two walk threads' first calls through ``torch.compile`` may end at once: one resolves the kernel's
    direct call, counted once, and the other finds it (two would leave a run counted on a discarded one)."""
    import threading
    import time

    graphs = kernel_runner.KernelGraphs(lambda: None, {}, ("test_kernel", ("cpu",), True))
    made = []

    def slow_resolve(result, observed):
        time.sleep(0.05)  # both threads inside resolve at once, were it unlocked
        made.append(kernel_runner.GraphCall(("x",), lambda named: True, lambda x: [x], lambda *a: None))
        return made[-1]

    monkeypatch.setattr(graphs, "_resolve", slow_resolve)
    monkeypatch.setattr(kernel_runner, "_DIRECT", {})  # the test's entry goes with it, the compiled kernels stay
    counters.clear()
    threads = [threading.Thread(target=graphs.resolve, args=(None, ())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and graphs.call is made[0] and kernel_runner.graph_call(*graphs._key) is made[0]
    assert counters["chunkce"]["kernel_graph_calls"] == 1


def test_a_missing_internal_falls_back_to_torch_compile_logged_once(compiled_kernels, monkeypatch, caplog):
    expected = _loss_and_grads(*SHAPES[0])
    _fresh_kernels()
    monkeypatch.setattr(internals, "inductor_wrapper", internals.Private("torch:_NoSuchWrapper", "a test"))
    kernel_runner.direct_calls_unavailable.cache_clear()
    with caplog.at_level(logging.INFO, logger="compile_pass.op.kernel_runner"):
        got = [_loss_and_grads(*SHAPES[0]) for _ in range(2)]
    messages = [r.getMessage() for r in caplog.records if r.name == "compile_pass.op.kernel_runner"]
    assert len(messages) == 1 and "run through torch.compile's call path" in messages[0], messages
    assert f"torch {torch.__version__} has no torch:_NoSuchWrapper" in messages[0]
    assert counters["chunkce"]["kernel_graph_calls"] == 0 and counters["chunkce"]["kernel_graphs"] > 0
    for run in got:
        for a, b in zip(expected, run, strict=True):
            assert torch.equal(a, b)


def test_a_failing_guard_runs_through_torch_compile(compiled_kernels, monkeypatch):
    """A call its graph's guards refuse (here a logits tile whose rows are not contiguous) is not run
    directly: ``torch.compile`` recompiles for it, as without direct calls."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "1")
    _loss_and_grads(*SHAPES[0])
    captured = []
    real_run = kernel_runner.run
    monkeypatch.setattr(kernel_runner, "run", lambda name, variant, eager, *a: captured.append(
        (name, variant, torch.is_grad_enabled(), a)) or real_run(name, variant, eager, *a))
    _loss_and_grads(*SHAPES[0])
    name, variant, grad_mode, args = next(c for c in captured if c[0] == "chunk_forward")
    direct = kernel_runner.graph_call(name, variant)  # one walk thread: the caller's variant
    with torch.no_grad():
        logits = args[0].clone()
        strided = torch.empty(logits.shape[0], logits.shape[1] + 3)[:, : logits.shape[1]].copy_(logits)
        state, expected_state, copy = ([a.clone() if isinstance(a, torch.Tensor) else a for a in args[1:]]
                                       for _ in range(3))
    with torch.set_grad_enabled(grad_mode), internals.below_autograd.get()():
        assert direct((logits, *copy)) and not direct((strided, *state))
        real_run(name, variant, False, logits, *expected_state)
        before = counters["chunkce"]["kernel_graphs"]
        real_run(name, variant, False, strided, *state)
    assert counters["chunkce"]["kernel_graphs"] == before + 1  # recompiled for the new layout
    for a, b in zip(state, expected_state, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


def _reference(num_tokens, vocab_size, chunk_size):
    """``_loss_and_grads``' loss, lse, entropy and gradients by torch's unfused ops."""
    hidden, weight, target = _inputs(num_tokens, vocab_size)
    logits = hidden @ weight.t()
    loss = torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1)
    scaled = logits / 0.7
    lse = scaled.logsumexp(-1)
    probs = scaled.softmax(-1)
    entropy = lse - (probs * scaled).sum(-1)
    selected = scaled.gather(1, target.clamp(min=0)[:, None]).sum()
    total = loss + lse.sum() + entropy.sum() + selected
    return (loss, lse, entropy, *torch.autograd.grad(total, [hidden, weight]))


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_second_call_runs_inductors_own_call_for_every_tile(compiled_kernels, monkeypatch, threads):
    """Once each kernel has compiled, an op call runs every tile through Inductor's generated call
    (below AOTAutograd's wrapper): no tile goes through ``torch.compile``, the direct calls count
    every tile, and the results match torch's unfused ops."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", threads)
    _loss_and_grads(*SHAPES[0])
    assert counters["chunkce"]["kernel_inductor_calls"] == counters["chunkce"]["kernel_graph_calls"] > 0
    tiles, through_compile = [], []
    real_through_compile = kernel_runner._through_compile
    monkeypatch.setattr(kernel_runner, "_through_compile",
                        lambda kernel, args: through_compile.append(kernel) or real_through_compile(kernel, args))
    direct = list(kernel_runner._DIRECT.values())
    before = sum(call.calls for call in direct)
    with kernel_runner.hooked_runs(lambda name, variant: tiles.append(name)):
        got = _loss_and_grads(*SHAPES[0])
    assert not through_compile and tiles
    assert all(call.inductor is not None for call in direct)
    assert sum(call.calls for call in direct) - before == len(tiles)
    loss, lse, entropy, _, grad_hidden, grad_weight = got
    for ours, theirs in zip((loss, lse, entropy, grad_hidden, grad_weight), _reference(*SHAPES[0]), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_call_through_aotautograds_wrapper_where_inductors_own_is_refused(compiled_kernels, monkeypatch, caplog):
    """Where Inductor's own call is refused (here: ``inductor_call`` says why), the direct call runs
    AOTAutograd's wrapper, logged at debug level, with the same results bitwise."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    expected = _loss_and_grads(*SHAPES[1])
    _fresh_kernels()
    monkeypatch.setattr(internals, "inductor_call", lambda compiled: "refused for the test")
    with caplog.at_level(logging.DEBUG, logger="compile_pass.op.kernel_runner"):
        got = [_loss_and_grads(*SHAPES[1]) for _ in range(2)]
    assert "runs AOTAutograd's wrapper: refused for the test" in caplog.text
    direct = list(kernel_runner._DIRECT.values())
    assert direct and all(call.inductor is None and call.calls for call in direct)
    assert counters["chunkce"]["kernel_inductor_calls"] == 0
    for run in got:
        for a, b in zip(expected, run, strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow  # compiles graphs of its own with Inductor
def test_inductor_call_refuses_a_graph_with_outputs_or_another_wrapper():
    """Inductor's own call under what its backend returned: for a graph that writes its input (run
    on the graph's inputs: it writes as the function does); refused for a graph with outputs and for
    a callable that is not AOTAutograd's."""
    graphs, inductor = [], internals.inductor_wrapper.get()(None, {}, True)

    def backend(gm, example_inputs):  # its inputs as writes() reads them (before Inductor compiles gm)
        graphs.append((internals.graph_input_reads(gm, writes), inductor(gm, example_inputs)))
        return graphs[-1][1]

    def writes(x, out):
        out.copy_(x.sin())

    def returns(x):
        return x.sin()

    torch._dynamo.reset()
    x, out = torch.randn(8), torch.empty(8)
    torch.compile(writes, backend=backend, fullgraph=True)(x, out)
    torch.compile(returns, backend=backend, fullgraph=True)(x)
    call, written = internals.inductor_call(graphs[0][1])
    inputs = graphs[0][0](x, out)
    assert [inputs[i] for i in written] == [out]
    compiled = out.clone()  # the compiled function's write: Inductor's sin may differ from eager's by ulps
    out.zero_()
    assert len(call(inputs)) == 0 and torch.equal(out, compiled)
    torch.testing.assert_close(out, x.sin())
    assert internals.inductor_call(graphs[1][1]) == "its compiled graph has outputs"
    assert internals.inductor_call(returns).endswith("returns lies between (not AOTAutograd's own)")
    torch._dynamo.reset()
