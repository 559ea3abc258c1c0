"""benchmarks.calls_per_op's dry run counts what the op's walks run: its predicted kernel calls and
matmuls, forward and backward (and the grads-in-forward op's), equal the real op's on CPU at the same
tiles, on one walk thread (an accelerator's walk)."""

import collections

import pytest
import torch
from torch.profiler import profile

import compile_pass
from benchmarks import calls_per_op
from compile_pass.op import kernel_runner
from compile_pass.op.tiling import Tiles, resolve_tiles

MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_"}


@pytest.fixture(autouse=True)
def _one_walk_thread(monkeypatch):
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "1")  # as on an accelerator
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")  # the walk is the same; nothing to compile
    for name in ("CHUNKCE_CHUNK_SIZE", "CHUNKCE_CHUNK_BYTES"):
        monkeypatch.delenv(name, raising=False)


def _matmuls(prof) -> int:
    """Matmuls the profiled block ran (one inside another counted once)."""
    def inside_matmul(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in MATMULS:
                return True
            parent = parent.cpu_parent
        return False
    return sum(1 for event in prof.events() if event.name in MATMULS and not inside_matmul(event))


def _measure(monkeypatch, tokens, hidden, vocab, dtype, chunk_size, chunk_bytes, grads_in_forward):
    """The real op's kernel calls and matmuls, forward and backward: ``((calls, matmuls), (calls, matmuls))``."""
    calls = collections.Counter()
    real_run = kernel_runner.run

    def counted(fn_name, *args):
        calls[fn_name] += 1
        return real_run(fn_name, *args)

    monkeypatch.setattr(kernel_runner, "run", counted)
    gen = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.1).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    with profile() as forward_prof:
        loss = compile_pass.linear_cross_entropy(hidden_states, weight, target, chunk_size=chunk_size,
                                                 chunk_bytes=chunk_bytes, grads_in_forward=grads_in_forward)
    forward_calls = sum(calls.values())
    with profile() as backward_prof:
        loss.backward()
    assert hidden_states.grad is not None and weight.grad is not None
    return (forward_calls, _matmuls(forward_prof)), (sum(calls.values()) - forward_calls, _matmuls(backward_prof))


# (N, H, V, dtype, chunk_size, chunk_bytes): several token chunks and vocabulary blocks; bf16: the
# backward's blocks capped at V / 8; fp32 past REDUCTION_COLUMNS: the hidden product in pieces
CASES = [
    (200, 16, 1000, torch.bfloat16, 64, 64 * 256 * 2),
    (200, 16, 9000, torch.float32, 64, 64 * 8192 * 4),
    (100, 8, 700, torch.float32, 128, 128 * 700 * 4),  # one chunk, whole rows
]


@pytest.mark.parametrize("tokens, hidden, vocab, dtype, chunk_size, chunk_bytes", CASES)
def test_dry_run_counts_match_the_walks(monkeypatch, tokens, hidden, vocab, dtype, chunk_size, chunk_bytes):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tiles = resolve_tiles(chunk_size, tokens, vocab, itemsize, "cpu", chunk_bytes=chunk_bytes)
    gif_tiles = resolve_tiles(chunk_size, tokens, vocab, itemsize, "cpu", chunk_bytes=chunk_bytes, whole_rows=True)
    predicted = calls_per_op.count_op(tokens, vocab, dtype, tiles, gif_tiles)
    forward, backward = _measure(monkeypatch, tokens, hidden, vocab, dtype, chunk_size, chunk_bytes, False)
    assert forward == (predicted.forward.calls, predicted.forward.matmuls)
    assert backward == (predicted.backward.calls, predicted.backward.matmuls)
    forward, backward = _measure(monkeypatch, tokens, hidden, vocab, dtype, chunk_size, chunk_bytes, True)
    assert forward == (predicted.gif_forward.calls, predicted.gif_forward.matmuls)
    assert backward == (0, 0)


def test_anchor_counts():
    """The H200 anchors at the accelerator rule (128 MiB, 2048 tokens): 4096 x 4096 x 128256 bf16 walks
    2 token chunks by 4 blocks forward and by 8 blocks (V / 8) backward."""
    count = calls_per_op.plan(4096, 128256, torch.bfloat16, calls_per_op.DEVICES["h200"])
    assert count.tiles == Tiles(2048, 32768)
    assert (count.forward.calls, count.forward.matmuls) == (8, 8)
    assert (count.backward.calls, count.backward.matmuls) == (16, 48)
    assert (count.gif_forward.calls, count.gif_forward.matmuls) == (4, 6)
    largest = max(calls_per_op.overhead_share(c.calls, c.matmuls, 10.0, calls_per_op.LAUNCH_US,
                                              calls_per_op.quack_ms(n, h, v))
                  for n, h, v in calls_per_op.ANCHORS
                  for c in [calls_per_op.plan(n, v, torch.bfloat16, calls_per_op.DEVICES["h200"])])
    assert 0.02 < largest < 0.05
