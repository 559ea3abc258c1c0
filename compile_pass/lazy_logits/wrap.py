"""The compiled step handing out lazy logits: :class:`Plan` (where they go),
:func:`wrap_compiled`.

The returned-logits pass (:mod:`compile_pass.graph.returned_logits`) took returned logits
out of the graph, put a stand-in (an expanded scalar of the logits' shape, dtype and
device) in their output slot, and appended the tensors their recipe reads to the graph's
output; :func:`wrap_compiled` takes those extra outputs off and puts a :class:`LazyLogits` (or a
:class:`DroppedLogits`) in each slot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_pass.lazy_logits.recipe import Recipe, Refusing
from compile_pass.lazy_logits.staleness import Inputs
from compile_pass.lazy_logits.tensor import DroppedLogits, LazyLogits, Layout


@dataclass(frozen=True)
class Slot:
    """One output slot of lazy logits: its position, its recipe, and the positions of the
    recipe's inputs among the extra outputs."""

    position: int
    recipe: Recipe | Refusing
    inputs: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Where :func:`wrap_compiled` finds what it hands back: the graph's original output count, and its slots."""

    num_outputs: int
    slots: tuple[Slot, ...]


def wrap_compiled(compiled: Callable[..., Any], plan: Plan) -> Callable[..., Any]:
    """``compiled`` handing out a :class:`LazyLogits` at each slot of ``plan`` (a
    :class:`DroppedLogits` where the recipe refuses), with the extra outputs taken off."""
    @functools.wraps(compiled)  # keeps its attributes (e.g. _boxed_call): called as it would be
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        swapped = list(outputs[:plan.num_outputs])
        extras = outputs[plan.num_outputs:]
        for slot in plan.slots:
            swapped[slot.position] = lazy_logits(slot.recipe, [extras[i] for i in slot.inputs],
                                                 swapped[slot.position])
        return type(outputs)(swapped) if isinstance(outputs, tuple) else swapped

    return run


def lazy_logits(recipe: Recipe | Refusing, tensors: Sequence[torch.Tensor], stand_in: torch.Tensor) -> LazyLogits:
    """The :class:`LazyLogits` of ``recipe`` over ``tensors`` (as the step returned them;
    a :class:`DroppedLogits` for a refusing recipe), shaped as ``stand_in`` (the graph's
    stand-in: an expanded scalar of the logits' shape, dtype and device; the logits
    themselves are contiguous)."""
    source = Inputs(recipe, tensors)
    layout = Layout(stand_in.shape, _contiguous_strides(stand_in.shape), stand_in.dtype, stand_in.device)
    if isinstance(recipe, Refusing):
        return DroppedLogits(layout, source=source)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Recompute.apply(source, layout, *tensors)
    return LazyLogits(layout, source=source)


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
