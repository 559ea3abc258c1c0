"""Helpers of the fused-read tests: a LazyLogits built directly over a linear head, the same user
code run on it and on stock logits, every read and gradient compared, and proof of the path taken.

    lazy, stock = Head(...).pair()           # a LazyLogits and stock's F.linear logits, same leaves
    got = compare(read, head)                # read(logits) on both; values and every gradient equal

Not a test module: a helper of tests/lazy_logits/test_fused_reads.py and tests/lazy_logits/test_fused_steps.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compile_pass.lazy_logits import Recipe
from compile_pass.lazy_logits import head as head_module
from compile_pass.lazy_logits.head import Head
from compile_pass.lazy_logits.wrap import lazy_logits


class _Linear(torch.nn.Module):
    def forward(self, hidden, weight, bias=None):
        return F.linear(hidden, weight, bias)


@dataclass
class Leaves:
    """``hidden [B, T, H]``, ``weight [V, H]``, ``bias [V]`` or None; one set per side."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.hidden, self.weight, self.bias) if t is not None]


def leaves(shape=(2, 6, 8, 37), dtype=torch.float32, bias=True, grad=True, seed=0, spread=3.0) -> tuple[Leaves, Leaves]:
    """Two identical sets of leaves (lazy side, stock side) of ``shape`` ``(B, T, H, V)``; logits of a few units."""
    b, t, h, v = shape
    gen = torch.Generator().manual_seed(seed)
    made = [torch.randn(b, t, h, generator=gen), torch.randn(v, h, generator=gen) * spread / h ** 0.5,
            torch.randn(v, generator=gen) if bias else None]
    def copy():
        return Leaves(*(None if x is None else x.to(dtype).requires_grad_(grad) for x in made))
    return copy(), copy()


def make_lazy(side: Leaves) -> torch.Tensor:
    """The LazyLogits of ``F.linear(hidden, weight, bias)``, as the returned-logits pass makes it."""
    tensors = side.tensors()
    roles = ("hidden states", "lm_head weight", *(("lm_head bias",) if side.bias is not None else ()))
    dtype = side.hidden.dtype
    head = Head(hidden=0, weight=1, bias=2 if side.bias is not None else None, logits_dtype=dtype, computed_dtype=dtype)
    recipe = Recipe(torch.fx.symbolic_trace(_Linear()), roles, (False,) * len(tensors), None, head)
    stand_in = side.hidden.new_empty(()).expand(*side.hidden.shape[:-1], side.weight.shape[0])
    return lazy_logits(recipe, tensors, stand_in)


def stock_logits(side: Leaves) -> torch.Tensor:
    return F.linear(side.hidden, side.weight, side.bias)


class Calls:
    """Counts the op's calls (``row_statistics`` True: walks over the vocabulary, of them
    ``maximum_walks`` with ``maximum_only``; False: gathers only), the backward of each (``backwards``; of the walks alone: ``walk_backwards``), and the
    recipe's runs (the fallback)."""

    def __init__(self) -> None:
        self.walks = self.maximum_walks = self.gathers = self.backwards = self.walk_backwards = self.recipes = 0


class _CountBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, calls, walk, *tensors):
        ctx.calls, ctx.walk = calls, walk
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.calls.backwards += 1
        ctx.calls.walk_backwards += ctx.walk
        return (None, None, *grads)


@contextlib.contextmanager
def counting():
    """A :class:`Calls` counting in the block (the op wrapped in its caller's namespace, the
    recipe's ``__call__`` wrapped; both restored after)."""
    calls = Calls()
    op, run = head_module.linear_statistics, Recipe.__call__

    def counted(*args, row_statistics=True, maximum_only=False, **kwargs):
        stats = op(*args, row_statistics=row_statistics, maximum_only=maximum_only, **kwargs)
        if row_statistics:
            calls.walks += 1
            calls.maximum_walks += maximum_only
        else:
            calls.gathers += 1
        fields = [f for f in stats if f is not None and f.is_floating_point()]
        if torch.is_grad_enabled() and any(f.requires_grad for f in fields):
            wrapped = iter(_CountBackward.apply(calls, row_statistics, *fields))
            stats = type(stats)(*(next(wrapped) if f is not None and f.is_floating_point() else f for f in stats))
        return stats

    def recipe_runs(self, inputs):
        calls.recipes += 1
        return run(self, inputs)

    head_module.linear_statistics, Recipe.__call__ = counted, recipe_runs
    try:
        yield calls
    finally:
        head_module.linear_statistics, Recipe.__call__ = op, run


def flat(out) -> list:
    """The tensors of ``out`` (a tensor, or nested tuples / lists of them), in order."""
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in flat(item)]
    return [out]


def run_side(read, side: Leaves, lazy: bool, seed: int = 1):
    """``read(logits)`` and the gradients of a weighted sum of its floating outputs (None where none)."""
    logits = make_lazy(side) if lazy else stock_logits(side)
    out = read(logits)
    wanted = [x for x in flat(out) if x.is_floating_point() and x.requires_grad]
    grads = [None] * 3
    if wanted:
        gen = torch.Generator().manual_seed(seed)
        total = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64)).sum() for x in wanted)
        leaves_ = [t for t in (side.hidden, side.weight, side.bias) if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(total, leaves_, allow_unused=True))
        grads = [next(got) if t is not None and t.requires_grad else None for t in (side.hidden, side.weight, side.bias)]
    return out, grads


def assert_equal_reads(got, expected, **tolerance):
    got, expected = flat(got), flat(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert type(g) is torch.Tensor, type(g)
        assert (g.shape, g.dtype, g.requires_grad) == (e.shape, e.dtype, e.requires_grad)
        torch.testing.assert_close(g, e, **tolerance)

