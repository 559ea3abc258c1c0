"""The chunk-size rule: its values, the byte budget (argument, option, environment),
how the arguments and the environment combine, and the working set it buys, measured."""

from __future__ import annotations

import collections
import itertools
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from builders import Head
from torch.profiler import profile

import compile_pass
from compile_pass import Options, last_report, linear_cross_entropy
from compile_pass.memory import measure_peak_bytes
from compile_pass.op import tiling, kernel_runner
from compile_pass.op.tiling import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    MIN_VOCAB_BLOCK,
    VOCAB_ALIGN,
    Tiles,
    choose_tiles,
    default_chunk_bytes,
    min_full_speed_tokens,
    resolve_tiles,
)

MiB = 2**20


@pytest.fixture(autouse=True)
def no_chunk_environment(monkeypatch):
    """The rule on one walk thread (a walk split over threads: the tests that set two)."""
    monkeypatch.delenv("CHUNKCE_CHUNK_SIZE", raising=False)
    monkeypatch.delenv("CHUNKCE_CHUNK_BYTES", raising=False)
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "1")


# (N, V, itemsize, device) -> the tile (tokens, vocabulary columns): the target shapes, and the H200 shape
@pytest.mark.parametrize("shape, expected", [
    ((4096, 32768, 4, "cpu"), (512, 3584)),  # the floor's tokens, the 7 MiB budget's columns
    ((8192, 128256, 4, "cpu"), (512, 3584)),  # the same tile whatever the vocabulary
    ((2048, 262144, 4, "cpu"), (512, 3584)),
    ((4096, 1024, 4, "cpu"), (1792, 1024)),  # a small vocabulary: whole rows, the budget's tokens
    ((100, 1000, 4, "cpu"), (100, 1000)),  # capped at the tokens and columns there are
    ((8192, 128256, 2, "cuda"), (2048, 32768)),  # the accelerator floor and its 128 MiB budget
])
def test_rule_values(shape, expected):
    assert resolve_tiles(None, *shape) == Tiles(*expected)


# the same shapes on two walk threads: each thread's tile in half the budget; token chunks and
# vocabulary blocks in multiples of two (1664 x 20 = 33280 >= 32768; 704 x 6 = 4224 >= 4096)
@pytest.mark.parametrize("shape, expected", [
    ((4096, 32768, 4, "cpu"), (512, 1664)),
    ((8192, 128256, 4, "cpu"), (512, 1792)),
    ((2048, 262144, 4, "cpu"), (512, 1664)),
    ((4096, 1024, 4, "cpu"), (704, 512)),  # whole rows would fit: two blocks, for the backward's split
    ((100, 1000, 4, "cpu"), (64, 256)),
    ((8192, 128256, 2, "cuda"), (2048, 32768)),  # one walk thread on accelerators
])
def test_rule_values_on_two_walk_threads(monkeypatch, shape, expected):
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    tiles = resolve_tiles(None, *shape)
    assert tiles == Tiles(*expected)
    if shape[3] == "cpu":
        assert tiles.bytes(shape[2]) <= DEFAULT_CHUNK_BYTES // 2
        assert len(tiling.spans(shape[0], tiles.tokens)) % 2 == 0
        assert len(tiling.spans(shape[1], tiles.vocab_block)) % 2 == 0


def test_rule_bounds():
    for n, v, itemsize, device in itertools.product((1, 37, 300, 5000, 70000), (97, 32000, 262144),
                                                     (2, 4), ("cpu", "cuda")):
        tiles = choose_tiles(n, v, itemsize, min_tokens=min_full_speed_tokens(device),
                             default_chunk_bytes=default_chunk_bytes(device))
        assert 1 <= tiles.tokens <= n and 1 <= tiles.vocab_block <= v
        assert tiles.tokens == n or tiles.tokens % ALIGN == 0
        assert tiles.tokens >= min(n, min_full_speed_tokens(device))  # never below full speed by default
        assert tiles.bytes(itemsize) <= default_chunk_bytes(device)  # the budget holds the tile
        assert tiles.vocab_block == v or tiles.vocab_block % VOCAB_ALIGN == 0
        whole = choose_tiles(n, v, itemsize, min_tokens=min_full_speed_tokens(device), whole_rows=True,
                             default_chunk_bytes=default_chunk_bytes(device))
        assert whole.vocab_block == v and whole.tokens >= min(n, min_full_speed_tokens(device))


def test_explicit_budget_sets_the_columns_and_is_not_raised():
    # 4 MiB of fp32 tiles at V 32768: the floor's 512 tokens by 2048 columns
    assert resolve_tiles(None, 4096, 32768, 4, "cpu", chunk_bytes=4 * MiB) == Tiles(512, 2048)
    # a budget below the floor's tokens of VOCAB_ALIGN columns: fewer tokens (at least ALIGN)
    assert resolve_tiles(None, 4096, 32768, 4, "cpu", chunk_bytes=64 * 1024) == Tiles(128, 128)
    assert resolve_tiles(None, 4096, 32768, 4, "cpu", chunk_bytes=1) == Tiles(ALIGN, MIN_VOCAB_BLOCK)
    for size in (0, -1):  # None is the one "automatic": a size below 1 is an error, not the default
        with pytest.raises(ValueError, match=f"expected chunk_bytes to be a positive int or None .automatic., got {size}"):
            resolve_tiles(None, 4096, 32768, 4, "cpu", chunk_bytes=size)
        with pytest.raises(ValueError, match=f"expected chunk_size to be a positive int or None .automatic., got {size}"):
            resolve_tiles(size, 4096, 32768, 4, "cpu")
    # whole rows (grads-in-forward): an explicit budget is not raised to the floor
    assert resolve_tiles(None, 4096, 32768, 4, "cpu", chunk_bytes=4 * MiB, whole_rows=True) == Tiles(32, 32768)
    assert resolve_tiles(None, 4096, 32768, 4, "cpu", whole_rows=True) == Tiles(512, 32768)


def test_arguments_and_environment_combine(monkeypatch):
    """CHUNKCE_CHUNK_SIZE sets n and CHUNKCE_CHUNK_BYTES the budget (Vb): both apply together,
    neither wins over the other; an argument wins over its own variable only (docs/op.md, "Tiles")."""
    shape = (4096, 32768, 4, "cpu")
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", str(2 * MiB))
    assert resolve_tiles(None, *shape) == Tiles(512, 1024)  # the environment's budget
    assert resolve_tiles(None, *shape, chunk_bytes=4 * MiB) == Tiles(512, 2048)  # the argument's
    monkeypatch.setenv("CHUNKCE_CHUNK_SIZE", "100")
    assert resolve_tiles(None, *shape) == Tiles(100, 5120)  # CHUNKCE_CHUNK_SIZE's tokens, the env budget's columns
    assert resolve_tiles(None, *shape, chunk_bytes=4 * MiB) == Tiles(100, 10368)  # the variable's n, the argument's budget
    assert resolve_tiles(7, *shape, chunk_bytes=4 * MiB) == Tiles(7, 32768)  # chunk_size over the tokens
    assert resolve_tiles(7, *shape) == Tiles(7, 32768)


@pytest.mark.parametrize("size_argument", [None, 200])
@pytest.mark.parametrize("size_variable", [None, 100])
@pytest.mark.parametrize("bytes_argument", [None, 4 * MiB])
@pytest.mark.parametrize("bytes_variable", [None, 2 * MiB])
def test_one_precedence_for_each_size(monkeypatch, size_argument, size_variable, bytes_argument, bytes_variable):
    """For ``chunk_size`` and ``chunk_bytes`` alike, independently: the argument, else its
    ``CHUNKCE_*`` variable, else the default; the tiles are those of the winning values passed
    as arguments with the environment unset."""
    shape = (4096, 32768, 4, "cpu")
    for name, value in (("CHUNKCE_CHUNK_SIZE", size_variable), ("CHUNKCE_CHUNK_BYTES", bytes_variable)):
        monkeypatch.delenv(name, raising=False)
    expected = resolve_tiles(size_argument or size_variable, *shape, chunk_bytes=bytes_argument or bytes_variable)
    for name, value in (("CHUNKCE_CHUNK_SIZE", size_variable), ("CHUNKCE_CHUNK_BYTES", bytes_variable)):
        if value is not None:
            monkeypatch.setenv(name, str(value))
    tiles = resolve_tiles(size_argument, *shape, chunk_bytes=bytes_argument)
    assert tiles == expected
    assert tiles.tokens == (size_argument or size_variable or 512)  # the CPU floor: the default n here


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_bad_environment_budget(monkeypatch, value):
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", value)
    with pytest.raises(ValueError, match=f"CHUNKCE_CHUNK_BYTES to be a positive integer, got '{value}'"):
        resolve_tiles(None, 4096, 32768, 4, "cpu")


def count_kernel_calls(monkeypatch):
    calls = []
    real_run = kernel_runner.run
    monkeypatch.setattr(kernel_runner, "run", lambda name, *a: calls.append(name) or real_run(name, *a))
    return calls


def make_inputs(n=37, h=16, v=64):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.3).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=gen)


@pytest.mark.parametrize("grads_in_forward", [False, True])
def test_budget_reaches_the_op(monkeypatch, grads_in_forward):
    calls = count_kernel_calls(monkeypatch)
    hidden, weight, target = make_inputs()  # V 64 fp32: 256 bytes a token's logits
    loss = linear_cross_entropy(hidden, weight, target, chunk_bytes=ALIGN * 256,
                                grads_in_forward=grads_in_forward)  # 32 tokens: 2 chunks
    loss.backward()
    assert calls.count("chunk_forward") == 2 and calls.count("chunk_backward") == 2
    reference = F.cross_entropy(F.linear(hidden, weight), target)
    torch.testing.assert_close(loss, reference)
    grads = torch.autograd.grad(reference, (hidden, weight))
    hidden_grad, weight_grad = hidden.grad, weight.grad
    torch.testing.assert_close(hidden_grad, grads[0])
    torch.testing.assert_close(weight_grad, grads[1])
    calls.clear()
    linear_cross_entropy(hidden, weight, target, chunk_bytes=ALIGN * 256, chunk_size=10)
    assert calls.count("chunk_forward") == 4  # chunk_size wins


def test_bad_budget_argument():
    hidden, weight, target = make_inputs()
    with pytest.raises(ValueError, match="expected chunk_bytes to be a positive int or None"):
        linear_cross_entropy(hidden, weight, target, chunk_bytes=-1)


def test_backend_option_budget_is_reported_and_used(monkeypatch):
    torch._dynamo.reset()
    calls = count_kernel_calls(monkeypatch)
    model = Head(hidden_size=16, vocab=64)
    hidden, labels = torch.randn(2, 40, 16), torch.randint(0, 64, (2, 40))
    compiled = torch.compile(model, backend="chunkce",
                             options={"chunk_bytes": ALIGN * 256, "inner_backend": "aot_eager"})
    loss = compiled(hidden, labels)
    (site,) = last_report().records
    assert site.tiles == Tiles(ALIGN, 64) and site.chunk_size == ALIGN  # 80 tokens at 32 a chunk: what the op uses
    assert calls.count("chunk_forward") == 3
    torch.testing.assert_close(loss, model(hidden, labels))
    with pytest.raises(ValueError, match="option chunk_bytes to be a positive int or None, got 0"):
        Options.from_mapping({"chunk_bytes": 0})


@pytest.mark.parametrize("grads_in_forward, expected", [(False, Tiles(80, 128)), (True, Tiles(ALIGN, 4096))])
def test_report_shows_the_tiles_the_op_walks(monkeypatch, grads_in_forward, expected):
    """The report's tiles are the op's (resolve_tiles, whole rows for grads-in-forward), with an
    explicit budget: 64 KiB of fp32 logits at V 4096 is 128 x 128 tiles (80 tokens: 80 x 128)
    for the recompute op, and whole rows, 32 x 4096 (16 rows raised to ALIGN), for the
    grads-in-forward op. (The report re-derived the recompute op's 80 tokens for both before.)"""
    torch._dynamo.reset()
    calls = count_kernel_calls(monkeypatch)
    model = Head(hidden_size=16, vocab=4096)
    hidden, labels = torch.randn(2, 40, 16), torch.randint(0, 4096, (2, 40))
    compiled = torch.compile(model, backend="chunkce", options={
        "chunk_bytes": 64 * 1024, "grads_in_forward": grads_in_forward, "inner_backend": "aot_eager"})
    loss = compiled(hidden, labels)
    (site,) = last_report().records
    assert site.tiles == expected and site.chunk_size == expected.tokens
    assert f"{expected.tokens} x {expected.vocab_block}" in str(last_report())
    tiles_walked = len(tiling.spans(80, expected.tokens)) * len(tiling.spans(4096, expected.vocab_block))
    assert calls.count("chunk_forward") == tiles_walked  # what the op walked: those tiles
    torch.testing.assert_close(loss, model(hidden, labels))


def working_set(n, h, v, **kwargs):
    """Peak bytes of one forward + backward of the op above its inputs, minus its inputs'
    gradients (a grads-in-forward call's held gradients are those: backward hands them over)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)

    def step():
        linear_cross_entropy(hidden, weight, target, **kwargs).backward()

    step()  # first call: compiles the kernels outside the measured region
    hidden.grad = weight.grad = None
    _, peak = measure_peak_bytes(step)
    return peak - (n * h + v * h) * 4


def test_working_set_is_one_tile_whatever_the_vocabulary():
    # 1024 tokens (two token chunks) x V 8192 / 32768 fp32: the unfused logits alone are
    # 32 / 128 MiB; the op holds one [512, 3584] tile (7 MiB), which the compiled backward
    # kernel overwrites with its gradient (no second buffer), and a few [N] vectors: under
    # 8 MiB at both.
    n, h = 1024, 16
    for v in (8192, 32768):
        tiles = resolve_tiles(None, n, v, 4, "cpu")
        assert tiles == Tiles(512, 3584)
        measured = working_set(n, h, v)
        assert tiles.bytes(4) <= measured <= 8 * MiB, (v, measured / MiB)
    smaller = working_set(n, h, 32768, chunk_bytes=2 * MiB)
    assert smaller <= 2 * MiB + 256 * 1024, smaller / MiB  # the budget is what it costs


def test_working_set_on_two_walk_threads_is_the_same_budget(monkeypatch):
    """Split over two walk threads, each holds its own tile of at most half the budget ([512, 1408]
    and [512, 1664]: 2.75 and 3.25 MiB) and the second its own [N, H] sum of the hidden-state
    gradient (64 KiB): under 8 MiB, as one thread's. (Measured with the parts run one after another
    on this thread, every buffer allocated first: the profiler sees this thread's allocations only.)"""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", "2")
    n, h = 1024, 16
    for v, expected in ((8192, Tiles(512, 1408)), (32768, Tiles(512, 1664))):
        tiles = resolve_tiles(None, n, v, 4, "cpu")
        assert tiles == expected and tiles.bytes(4) <= DEFAULT_CHUNK_BYTES // 2
        measured = working_set(n, h, v)
        assert 2 * tiles.bytes(4) <= measured <= 8 * MiB, (v, measured / MiB)


def test_grads_in_forward_working_set_is_one_whole_row_chunk():
    # The grads-in-forward op walks whole rows: one [512, V] chunk (16 MiB at V 8192; 1024
    # tokens, two chunks), overwritten by its gradient; the gradients it computes are the ones
    # backward returns.
    n, h, v = 1024, 32, 8192
    tiles = resolve_tiles(None, n, v, 4, "cpu", whole_rows=True)
    assert tiles == Tiles(512, v)
    measured = working_set(n, h, v, grads_in_forward=True)
    assert tiles.bytes(4) <= measured <= tiles.bytes(4) + 1 * MiB, measured / MiB
    smaller = working_set(n, h, v, grads_in_forward=True, chunk_bytes=4 * MiB)  # 128 tokens
    assert smaller <= 4 * MiB + 1 * MiB, smaller / MiB


def _bookkeeping(hidden, weight, target, **kwargs) -> collections.Counter:
    """The aten fills, zeroings, copies and adds of one forward + backward (compiled kernels: their
    own work is no aten op), after a first call that compiles them."""
    def step():
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, target, **kwargs)
        loss.backward()
        return loss

    step()
    with profile() as prof:
        loss = step()
    reference = F.cross_entropy(F.linear(hidden, weight), target)
    torch.testing.assert_close(loss, reference)
    for grad, expected in zip((hidden.grad, weight.grad), torch.autograd.grad(reference, (hidden, weight))):
        torch.testing.assert_close(grad, expected)
    names = ("aten::fill_", "aten::zero_", "aten::copy_", "aten::add_")
    return collections.Counter(event.name for event in prof.events() if event.name in names)


def test_a_walk_does_no_bookkeeping_per_tile():
    """The forward fills its state once a call and its kernel writes the outputs in place; the
    backward's first vocabulary block writes the hidden-state gradient by ``out=``: a walk of one
    tile and one of 4 x 4 tiles fill and copy alike; the second zeroes the weight gradient it sums
    over token chunks (once a call) and adds each later block's hidden-state product (4 x 3)."""
    hidden, weight, target = make_inputs(n=128, h=16, v=512)
    one = _bookkeeping(hidden, weight, target, chunk_size=128, chunk_bytes=128 * 512 * 4)
    many = _bookkeeping(hidden, weight, target, chunk_size=32, chunk_bytes=32 * 128 * 4)
    assert (many["aten::fill_"], many["aten::copy_"]) == (one["aten::fill_"], one["aten::copy_"]), (one, many)
    assert many["aten::zero_"] == one["aten::zero_"] + 1, (one, many)
    assert many["aten::add_"] == one["aten::add_"] + 4 * 3, (one, many)


def _statistics_bookkeeping(hidden, weight, indices, **kwargs) -> collections.Counter:
    """The aten fills, zeroings and copies of one ``linear_statistics`` forward (compiled kernels),
    after a first call that compiles them; its outputs checked against torch's."""
    def walk():
        with torch.no_grad():
            return compile_pass.linear_statistics(hidden, weight, indices=indices, **kwargs)

    walk()
    with profile() as prof:
        ours = walk()
    logits = F.linear(hidden, weight).detach()
    log_probs = logits.log_softmax(-1)
    torch.testing.assert_close(ours.lse, logits.logsumexp(-1))
    torch.testing.assert_close(ours.entropy, -(log_probs.exp() * log_probs).sum(-1))
    torch.testing.assert_close(ours.max, logits.amax(-1))
    assert torch.equal(ours.argmax, logits.argmax(-1))
    # a sum of 512 columns in another order (Inductor's vectorised one): fp32's rounding of it
    torch.testing.assert_close(ours.row_sum, logits.double().sum(-1).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours.selected, logits.gather(1, indices))
    names = ("aten::fill_", "aten::zero_", "aten::copy_", "aten::log", "aten::div")
    return collections.Counter(event.name for event in prof.events() if event.name in names)


def test_a_statistics_walk_does_no_bookkeeping_per_tile():
    """The statistics forward fills its state once a call and its kernel writes the state and the
    finished statistics in place: a walk of one tile and one of 4 x 4 tiles fill, copy and finish
    alike."""
    hidden, weight, target = make_inputs(n=128, h=16, v=512)
    indices = target.clamp(min=0).unsqueeze(1)
    one = _statistics_bookkeeping(hidden, weight, indices, chunk_size=128, chunk_bytes=128 * 512 * 4)
    many = _statistics_bookkeeping(hidden, weight, indices, chunk_size=32, chunk_bytes=32 * 128 * 4)
    assert one == many, (one, many)


def test_documented_tuning_is_the_rule_s():
    """docs/op.md's "Tiles" floors and budget are the constants the rule uses, and the
    accelerator floor is the fastest chunk of the measurements it quotes."""
    doc = " ".join((Path(__file__).parents[2] / "docs" / "op.md").read_text().split())
    tiles = doc[doc.index("## Tiles"):]
    assert int(re.search(r"(\d+) tokens on CPU", tiles)[1]) == min_full_speed_tokens("cpu")
    assert int(re.search(r"(\d+) on accelerators", tiles)[1]) == min_full_speed_tokens("cuda")
    assert int(re.search(r"default (\d+) MiB on CPU", tiles)[1]) * MiB == DEFAULT_CHUNK_BYTES
    measured = re.search(r"(\d+)-token chunks took (\d+) ms, (\d+) (\d+) ms, (\d+) (\d+) ms", tiles)
    ms_and_tokens = [(int(measured[i + 1]), int(measured[i])) for i in (1, 3, 5)]
    assert min(ms_and_tokens)[1] == min_full_speed_tokens("cuda"), ms_and_tokens
