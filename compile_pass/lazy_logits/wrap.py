"""The compiled step handing out lazy logits in the slots the pass emptied.

The compiled step handing out lazy logits: :class:`LazyOutputs` (where they go),
:func:`wrap_compiled`.

The returned-logits pass (:mod:`compile_pass.graph.returned_logits`) took returned logits
out of the graph, put a stand-in (an expanded scalar of the logits' shape, dtype and
device) in their output slot, and appended the tensors their recipe reads to the graph's
output; :func:`wrap_compiled` takes those extra outputs off and puts a :class:`LazyLogits` (or a
:class:`DroppedLogits`) in each slot. Row statistics the step computed of a slot's head (an
evaluation step's loss walk, :mod:`compile_pass.graph.plan`) are kept for its reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_pass.lazy_logits.cache import cache_of
from compile_pass.lazy_logits.staleness import Inputs, Recipe, DroppedRecipe
from compile_pass.lazy_logits.tensor import DroppedLogits, Layout, LazyLogits


@dataclass(frozen=True)
class Slot:
    """One output slot of lazy logits: its position, its recipe, and the positions of the
    recipe's inputs among the extra outputs, then of its head's row statistics ``lse``,
    ``entropy``, ``max``, ``argmax`` (``[N]`` each, every head row; none: ``()``)."""

    position: int
    recipe: Recipe | DroppedRecipe
    inputs: tuple[int, ...]
    statistics: tuple[int, ...] = ()


@dataclass(frozen=True)
class LazyOutputs:
    """Where :func:`wrap_compiled` finds what it hands back: the graph's original output count, and its slots."""

    num_outputs: int
    slots: tuple[Slot, ...]


def wrap_compiled(compiled: Callable[..., Any], plan: LazyOutputs) -> Callable[..., Any]:
    """``compiled`` handing out a :class:`LazyLogits` at each slot of ``plan`` (a
    :class:`DroppedLogits` where the recipe refuses), with the extra outputs taken off."""
    @functools.wraps(compiled)  # keeps its attributes (e.g. _boxed_call): called as it would be
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        swapped = list(outputs[:plan.num_outputs])
        extras = outputs[plan.num_outputs:]
        for slot in plan.slots:
            swapped[slot.position] = lazy_logits(slot.recipe, [extras[i] for i in slot.inputs],
                                                 swapped[slot.position], [extras[i] for i in slot.statistics])
        return type(outputs)(swapped) if isinstance(outputs, tuple) else swapped

    return run


def lazy_logits(recipe: Recipe | DroppedRecipe, tensors: Sequence[torch.Tensor], stand_in: torch.Tensor,
                statistics: Sequence[torch.Tensor] = ()) -> LazyLogits:
    """The :class:`LazyLogits` of ``recipe`` over ``tensors`` (as the step returned them;
    a :class:`DroppedLogits` for a refusing recipe), shaped as ``stand_in`` (the graph's
    stand-in: an expanded scalar of the logits' shape, dtype and device; the logits
    themselves are contiguous). ``statistics``: ``(lse, entropy, max, argmax)`` of every head
    row as the recipe's head computes them without grad (:meth:`compile_pass.lazy_logits.cache.RowCache.keep`), or empty."""
    source = Inputs(recipe, tensors)
    layout = Layout(stand_in.shape, _contiguous_strides(stand_in.shape), stand_in.dtype, stand_in.device)
    if isinstance(recipe, DroppedRecipe):
        return DroppedLogits(layout, source=source)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        logits = _Recompute.apply(source, layout, *tensors)
    else:
        logits = LazyLogits(layout, source=source)
    storage = logits._storage if statistics else None  # the root's form: one key, every head row
    if storage is not None:
        cache_of(storage.keys[0]).keep(*statistics)
    return logits


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Recompute(torch.autograd.Function):
    """The lazy logits as an autograd node over the recipe's inputs.

    Forward makes no values (a :class:`LazyLogits`); backward recomputes the logits from
    the same inputs with autograd on and backpropagates ``grad`` through them."""

    @staticmethod
    def forward(ctx: Any, source: Inputs, layout: Layout, *tensors: torch.Tensor) -> LazyLogits:
        ctx.source = source
        return LazyLogits(layout, source=source)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        source: Inputs = ctx.source
        source.check("backpropagate through")
        needs = ctx.needs_input_grad[2:]
        leaves = [t.detach().requires_grad_(need) if need else t for t, need in zip(source.tensors, needs)]
        with torch.enable_grad():
            logits = source.recipe(leaves)
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        grads = iter(torch.autograd.grad(logits, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if need else None for need in needs))
