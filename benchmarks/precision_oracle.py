"""The precision oracle: chunkce's loss and gradients against fp64, next to torch's own fp32 error.

For each case, fp32 inputs ``hidden [N, H]``, ``weight [V, H]``, ``bias [V]`` (the head's
logits have standard deviation ``spread`` about an offset, optionally divided by
``logit_divisor``) go through torch's unfused ``F.linear`` + ``F.cross_entropy`` in fp32
and through ``chunkce.linear_cross_entropy`` (several token chunks); the reference is the
same unfused computation in fp64 on the same (fp32) values: the same roundings of the
inputs, none after. An error is the relative error ``||x - ref|| / ||ref||`` of the
per-token losses (``reduction="none"``, every fourth token ignored unless a case says
otherwise), and of ``d hidden``, ``d weight`` and ``d bias`` of the ``mean``
(``QUANTITIES``).

The cases: ``CASES``, a sweep of logit magnitudes (:func:`case_errors`), and
``MANY_BLOCKS``, Qwen's vocabulary in 8-token chunks over many vocabulary blocks
(:func:`many_blocks_errors`). ``tests/op/test_op_precision.py`` asserts chunkce's errors
against torch's on them; ``python -m benchmarks.precision_sweep`` prints them as a table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_pass.op.loss import linear_cross_entropy

N, H, V = 96, 32, 509  # tokens (several chunks of 32), hidden size, vocabulary (odd)
CHUNK = 32
BLOCK = 128  # vocabulary columns a tile with --tiles (509 = 3 x 128 + 125: a ragged last block)
# (name, logit spread (std), offset added to every logit, logit_divisor or None)
CASES = (
    ("spread 1", 1.0, 0.0, None),
    ("spread 30", 30.0, 0.0, None),
    ("spread 300", 300.0, 0.0, None),
    ("spread 3000", 3000.0, 0.0, None),
    ("offset 1e3, spread 1", 1.0, 1e3, None),
    ("divisor 1e-3 (logits ~1e3)", 1.0, 0.0, 1e-3),
    ("divisor 1e-3, spread 30 about 1e3", 0.03, 1.0, 1e-3),
)
QUANTITIES = ("loss", "d hidden", "d weight", "d bias")  # loss: the per-token losses
# Many vocabulary blocks: a freshly initialised head (logit spread 0.08: std 0.02
# weights on unit hidden states of 16 dims) at Qwen's vocabulary, in chunks of 8 tokens, no
# token ignored:
# (name, N, H, V, chunk_size, chunk_bytes or None, grads_in_forward)
MANY_BLOCKS_SPREAD = 0.08
MANY_BLOCKS = (
    ("8 x 3584 tiles (43 blocks)", 33, 16, 151936, 8, 8 * 3584 * 4, False),
    ("8 x 128 tiles (1187 blocks)", 33, 16, 151936, 8, 8 * 128 * 4, False),
    ("8-token whole rows", 33, 16, 151936, 8, None, False),
    ("8-token whole rows, grads_in_forward", 33, 16, 151936, 8, None, True),
)


def make_inputs(spread: float, offset: float, seed: int = 0, shape: tuple[int, int, int] = (N, H, V),
                ignore_every: int | None = 4) -> dict:
    """fp32 leaves: ``hidden [N, H]`` (unit rows), ``weight [V, H]`` scaled so that the
    logits have standard deviation ``spread``, ``bias [V]`` = ``offset`` + a tenth of that,
    ``target [N]`` with every ``ignore_every``-th token ignored (None: none; ``shape``:
    ``(N, H, V)``)."""
    num_tokens, hidden_size, vocab_size = shape
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    hidden = hidden / hidden.norm(dim=1, keepdim=True)
    weight = torch.randn(vocab_size, hidden_size, generator=generator) * spread
    bias = offset + 0.1 * spread * torch.randn(vocab_size, generator=generator)
    target = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    if ignore_every is not None:
        target[::ignore_every] = -100
    return {"hidden": hidden, "weight": weight, "bias": bias, "target": target}


def losses_and_grads(fn, inputs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """``[per-token losses, d hidden, d weight, d bias]`` (fp64) of ``fn`` on the inputs cast
    to ``dtype``: ``fn(hidden, weight, bias, target, reduction)``, the losses from
    ``"none"``, the gradients of ``"mean"``."""
    leaves = [inputs[k].to(dtype).requires_grad_() for k in ("hidden", "weight", "bias")]
    with torch.no_grad():
        losses = fn(*leaves, inputs["target"], "none")
    grads = torch.autograd.grad(fn(*leaves, inputs["target"], "mean"), leaves)
    return [t.detach().double() for t in (losses, *grads)]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def case_errors(spread: float, offset: float, divisor: float | None,
                grads_in_forward: bool = False, tiles: bool = False, *,
                shape: tuple[int, int, int] = (N, H, V), chunk_size: int = CHUNK,
                chunk_bytes: int | None = None, ignore_every: int | None = 4) -> tuple[list[float], list[float]]:
    """(torch's fp32 errors, chunkce's fp32 errors) against fp64, in ``QUANTITIES`` order;
    ``tiles``: chunkce's tiles are ``BLOCK`` vocabulary columns wide (the log-sum-exp online
    across four blocks), else ``chunk_bytes`` (None: whole rows). ``shape``: ``(N, H, V)``;
    ``chunk_size``: tokens a tile; ``ignore_every``: :func:`make_inputs`'."""
    inputs = make_inputs(spread, offset, shape=shape, ignore_every=ignore_every)
    if tiles:
        chunk_bytes = chunk_size * BLOCK * 4

    def unfused(hidden, weight, bias, target, reduction):
        logits = F.linear(hidden, weight, bias)
        if divisor is not None:
            logits = logits / divisor
        return F.cross_entropy(logits, target, reduction=reduction)

    def chunkce(hidden, weight, bias, target, reduction):
        return linear_cross_entropy(hidden, weight, target, linear_bias=bias, logit_divisor=divisor,
                                    reduction=reduction, chunk_size=chunk_size, chunk_bytes=chunk_bytes,
                                    grads_in_forward=grads_in_forward)

    reference = losses_and_grads(unfused, inputs, torch.float64)
    ours = losses_and_grads(chunkce, inputs, torch.float32)
    theirs = losses_and_grads(unfused, inputs, torch.float32)
    return ([relative_error(t, r) for t, r in zip(theirs, reference)],
            [relative_error(o, r) for o, r in zip(ours, reference)])


def many_blocks_errors(num_tokens: int, hidden_size: int, vocab_size: int, chunk_size: int,
                       chunk_bytes: int | None, grads_in_forward: bool) -> tuple[list[float], list[float]]:
    """:func:`case_errors` of a ``MANY_BLOCKS`` case (logit spread ``MANY_BLOCKS_SPREAD``, no
    token ignored: with every fourth ignored, a running-sum product's error does not show at this shape)."""
    return case_errors(MANY_BLOCKS_SPREAD, 0.0, None, grads_in_forward,
                       shape=(num_tokens, hidden_size, vocab_size), chunk_size=chunk_size,
                       chunk_bytes=chunk_bytes, ignore_every=None)
