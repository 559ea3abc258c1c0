"""The chunk-size rule: its values, the byte budget (argument, option, environment),
who wins, and the working set it buys, measured."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import Head

from compile_pass import Options, last_report, linear_cross_entropy
from compile_pass.memory import measure_peak_bytes
from compile_pass.op import chunking, kernels
from compile_pass.op.chunking import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    choose_chunk_size,
    min_full_speed_tokens,
    resolve_chunk_size,
)

MiB = 2**20


@pytest.fixture(autouse=True)
def no_chunk_environment(monkeypatch):
    monkeypatch.delenv("CHUNKCE_CHUNK_SIZE", raising=False)
    monkeypatch.delenv("CHUNKCE_CHUNK_BYTES", raising=False)


# (N, V, itemsize, device) -> tokens a chunk: the shapes, and the H200 shape
@pytest.mark.parametrize("shape, expected", [
    ((4096, 32768, 4, "cpu"), 256),  # 32 MiB a chunk: the full-speed floor, above the 16 MiB budget
    ((4096, 128256, 4, "cpu"), 256),
    ((8192, 128256, 4, "cpu"), 256),
    ((4096, 4096, 4, "cpu"), 1024),  # a small vocabulary: the budget, 16 MiB / (4096 * 4)
    ((100, 1000, 4, "cpu"), 100),  # capped at the tokens there are
    ((8192, 128256, 2, "cuda"), 2048),  # the H200's measured best
])
def test_rule_values(shape, expected):
    assert resolve_chunk_size(None, *shape) == expected


def test_rule_bounds():
    for n, v, itemsize, device in itertools.product((1, 37, 300, 5000, 70000), (97, 32000, 262144),
                                                     (2, 4), ("cpu", "cuda")):
        size = choose_chunk_size(n, v, itemsize, min_tokens=min_full_speed_tokens(device))
        assert 1 <= size <= n
        assert size == n or size % ALIGN == 0
        assert size >= min(n, min_full_speed_tokens(device))  # never below full speed by default
        budget_tokens = DEFAULT_CHUNK_BYTES // (v * itemsize)
        assert size == n or size <= max(budget_tokens, min_full_speed_tokens(device))


def test_explicit_budget_is_not_raised_to_the_floor():
    # 4 MiB of fp32 logits at V 32768: 32 tokens, below the CPU's full-speed floor
    assert resolve_chunk_size(None, 4096, 32768, 4, "cpu", chunk_bytes=4 * MiB) == 32
    assert resolve_chunk_size(None, 4096, 32768, 4, "cpu", chunk_bytes=1) == ALIGN  # at least ALIGN
    assert resolve_chunk_size(None, 4096, 32768, 4, "cpu", chunk_bytes=0) == 256  # 0: default


def test_who_wins(monkeypatch):
    shape = (4096, 32768, 4, "cpu")
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", str(8 * MiB))
    assert resolve_chunk_size(None, *shape) == 64  # the environment's budget
    assert resolve_chunk_size(None, *shape, chunk_bytes=4 * MiB) == 32  # the argument's
    monkeypatch.setenv("CHUNKCE_CHUNK_SIZE", "100")
    assert resolve_chunk_size(None, *shape) == 100  # CHUNKCE_CHUNK_SIZE over CHUNKCE_CHUNK_BYTES
    assert resolve_chunk_size(None, *shape, chunk_bytes=4 * MiB) == 32  # an argument over both
    assert resolve_chunk_size(7, *shape, chunk_bytes=4 * MiB) == 7  # chunk_size over everything


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_bad_environment_budget(monkeypatch, value):
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", value)
    with pytest.raises(ValueError, match=f"CHUNKCE_CHUNK_BYTES to be a positive integer, got '{value}'"):
        resolve_chunk_size(None, 4096, 32768, 4, "cpu")


def count_kernel_calls(monkeypatch):
    calls = []
    real_run = kernels.run
    monkeypatch.setattr(kernels, "run", lambda name, *a: calls.append(name) or real_run(name, *a))
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
    assert site.chunk_size == ALIGN  # 80 tokens at 32 a chunk: what the op uses
    assert calls.count("chunk_forward") == 3
    torch.testing.assert_close(loss, model(hidden, labels))
    with pytest.raises(ValueError, match="option chunk_bytes to be a positive int or None, got 0"):
        Options.from_mapping({"chunk_bytes": 0})


def working_set(n, h, v, **kwargs):
    """Peak bytes of one forward + backward of the op above its inputs, minus its inputs'
    gradients (and the gradients a grads-in-forward call holds until backward)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)

    def step():
        linear_cross_entropy(hidden, weight, target, **kwargs).backward()

    step()  # first call: compiles the kernels outside the measured region
    hidden.grad = weight.grad = None
    _, peak = measure_peak_bytes(step)
    gradients = (n * h + v * h) * 4
    held = gradients if kwargs.get("grads_in_forward") else 0  # the saved ones, beside the returned
    return peak - gradients - held


@pytest.mark.parametrize("grads_in_forward", [False, True])
def test_working_set_is_one_chunk(grads_in_forward):
    # 4096 tokens x V 8192 fp32: the unfused logits alone are 128 MiB; the automatic chunk is
    # the 16 MiB budget's 512 tokens, and the op holds one chunk of logits, which the compiled
    # kernel overwrites with their gradient (no second [n, V] buffer).
    n, h, v = 4096, 32, 8192
    chunk = resolve_chunk_size(None, n, v, 4, "cpu")
    assert chunk == DEFAULT_CHUNK_BYTES // (v * 4) == 512
    measured = working_set(n, h, v, grads_in_forward=grads_in_forward)
    chunk_bytes = chunk * v * 4
    assert measured <= chunk_bytes + 2 * MiB, measured / MiB  # + per-token [N] vectors
    assert measured <= 0.3 * n * v * 4, measured / MiB
    smaller = working_set(n, h, v, grads_in_forward=grads_in_forward, chunk_bytes=4 * MiB)
    assert smaller <= 4 * MiB + 2 * MiB, smaller / MiB  # the budget is what it costs


def test_documented_tuning_is_the_rule_s():
    """The module docstring's floors and budget are the constants the rule uses, and the
    accelerator floor is the fastest chunk of the measurements it quotes."""
    doc = " ".join(chunking.__doc__.split())
    assert int(re.search(r"a CPU floor of (\d+) tokens", doc)[1]) == min_full_speed_tokens("cpu")
    assert int(re.search(r"an accelerator floor of (\d+) tokens", doc)[1]) == min_full_speed_tokens("cuda")
    assert int(re.search(r"a (\d+) MiB budget", doc)[1]) * MiB == DEFAULT_CHUNK_BYTES
    measured = re.search(r"(\d+) ms with (\d+)-token chunks, (\d+) ms with (\d+), (\d+) ms with (\d+)", doc)
    ms_and_tokens = [(int(measured[i]), int(measured[i + 1])) for i in (1, 3, 5)]
    assert min(ms_and_tokens)[1] == min_full_speed_tokens("cuda"), ms_and_tokens
