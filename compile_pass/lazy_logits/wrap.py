"""The compiled step handing out lazy logits in the slots the pass emptied.

The compiled step handing out lazy logits: :class:`LazyOutputs` (where they go),
:func:`wrap_compiled`.

The returned-logits pass (:mod:`compile_pass.graph.returned_logits`) took returned logits
out of the graph, put a stand-in (an expanded scalar of the logits' shape, dtype and
device) in their output slot, and appended the tensors their recipe reads to the graph's
output; :func:`wrap_compiled` takes those extra outputs off and puts a :class:`LazyLogits` (or a
:class:`DroppedLogits`) in each slot. Row statistics the step computed of a slot's head (an
evaluation step's loss walk, :mod:`compile_pass.graph.plan`) are kept for its reads.

Run on fake tensors (DDPOptimizer propagates each compiled piece of its split graph so, to
compile the next), the step hands out a fake tensor of the logits' layout; a piece compiled
with one as its input (:func:`computed_where_input`) gets the logits computed, not lazy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

import compile_pass.torch_internals as internals
from compile_pass.lazy_logits.cache import cache_of
from compile_pass.lazy_logits.staleness import Inputs, Recipe, DroppedRecipe
from compile_pass.lazy_logits.tensor import DroppedLogits, Layout, LazyLogits

# a fake tensor a step handed out for lazy logits -> (the positions its step computes, its position)
_FAKE_LOGITS: WeakIdKeyDictionary = WeakIdKeyDictionary()


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


def wrap_compiled(compiled: Callable[..., Any], lazy_outputs: LazyOutputs) -> Callable[..., Any]:
    """``compiled`` handing out a :class:`LazyLogits` at each slot of ``lazy_outputs`` (a
    :class:`DroppedLogits` where the recipe refuses), with the extra outputs taken off."""
    computed: set[int] = set()  # slots another compiled piece takes as its input (computed_where_input)

    @functools.wraps(compiled)  # keeps its attributes (e.g. _boxed_call): called as it would be
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        swapped = list(outputs[:lazy_outputs.num_outputs])
        extras = outputs[lazy_outputs.num_outputs:]
        for slot in lazy_outputs.slots:
            tensors = [extras[i] for i in slot.inputs]
            if internals.is_fake(swapped[slot.position]):  # compile-time propagation: no storage to read, no record
                swapped[slot.position] = _fake_logits(swapped[slot.position], tensors, computed, slot.position)
            elif slot.position in computed:
                swapped[slot.position] = slot.recipe(tensors)  # as a read computes them, with autograd
            else:
                swapped[slot.position] = lazy_logits(slot.recipe, tensors, swapped[slot.position],
                                                     [extras[i] for i in slot.statistics])
        return type(outputs)(swapped) if isinstance(outputs, tuple) else swapped

    return run


def computed_where_input(example_inputs: Sequence[Any]) -> None:
    """Have the steps that handed out lazy logits found among ``example_inputs`` (a piece of
    DDP's split graph being compiled: the fake outputs of an earlier piece) compute them: a
    compiled graph takes plain tensors, not a :class:`LazyLogits`."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value in _FAKE_LOGITS:
            computed, position = _FAKE_LOGITS[value]
            computed.add(position)


def _fake_logits(stand_in: torch.Tensor, tensors: Sequence[torch.Tensor], computed: set[int],
                 position: int) -> torch.Tensor:
    """A fake tensor of the logits' layout, ``requires_grad`` as the real ones (of ``stand_in``'s fake mode)."""
    fake = stand_in.new_empty_strided(stand_in.shape, _contiguous_strides(stand_in.shape))
    fake.requires_grad_(torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    _FAKE_LOGITS[fake] = (computed, position)
    return fake


def lazy_logits(recipe: Recipe | DroppedRecipe, tensors: Sequence[torch.Tensor], stand_in: torch.Tensor,
                statistics: Sequence[torch.Tensor] = ()) -> LazyLogits:
    """The :class:`LazyLogits` of ``recipe`` over ``tensors`` (as the step returned them;
    a :class:`DroppedLogits` for a refusing recipe), shaped as ``stand_in`` (the graph's
    stand-in: an expanded scalar of the logits' shape, dtype and device; the logits
    themselves are contiguous). ``statistics``: ``(lse, entropy, max, argmax, row_sum)`` of every head
    row as the recipe's head computes them without grad (:meth:`compile_pass.lazy_logits.cache.RowCache.keep`), or empty."""
    source = Inputs(recipe, tensors)
    layout = Layout(stand_in.shape, _contiguous_strides(stand_in.shape), stand_in.dtype, stand_in.device)
    if isinstance(recipe, DroppedRecipe):
        return DroppedLogits(layout, source=source)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        logits = _Recompute.apply(source, layout, *tensors)
    else:
        logits = LazyLogits(layout, source=source)
    storage = logits.root_storage if statistics else None  # the root's form: one key, every head row
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
