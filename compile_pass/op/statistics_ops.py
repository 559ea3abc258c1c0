"""The row-statistics custom ops and their autograd (the function: :mod:`compile_pass.op.statistics`).

``chunkce::linear_statistics`` walks the ``[n, Vb]`` tiles once
(:func:`compile_pass.op.statistics_loops.statistics_walk`), or with ``row_statistics=False``
gathers the selected logits only (:func:`~compile_pass.op.statistics_loops.selected_forward`).
Its outputs: ``selected [N, K]``, ``lse``, ``entropy``, ``max``, ``argmax`` and the two ``[N]``
parts backward takes, ``row_log_sum = log s`` and ``row_mean = t / s``
(:mod:`compile_pass.op.statistics_kernels`); with ``maximum_only=True`` the walk computes ``max``
and ``argmax`` (and ``selected``) only, no exponential, and the other four are empty ``[0]``. Autograd saves its tensor inputs and the ``[N]``
statistics; ``chunkce::linear_statistics_backward`` recomputes (its own autograd refuses double
backward). A gradient not given (None: ``ctx.set_materialize_grads(False)``) costs no term.

The tensors are positional (torch refuses keyword-only tensors in a custom op), the options
keyword-only; ``vocab_start`` / ``vocab_size`` place a shard of the vocabulary
(:mod:`compile_pass.op.statistics_parallel`): its columns' global indices, and the range the
indices are checked against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import loops, statistics_loops
from compile_pass.op.dtypes import accumulate_dtype
from compile_pass.op.custom_ops import fake_gradients, input_grads, refuse_double_backward
from compile_pass.op.schema import defaults

_assert_async = internals.assert_async.get()  # checks a range with no host sync

NAME = "chunkce.linear_statistics"  # how the op names itself in messages
UNFUSED = "the unfused F.linear and torch's logsumexp / softmax / gather"
TENSORS = "Tensor hidden_states, Tensor weight, Tensor? bias, Tensor? indices, Tensor? temperature, " \
          "Tensor? logit_scale_tensor"
STATISTICS = "Tensor row_max, Tensor row_log_sum, Tensor row_mean, Tensor argmax"
OPTIONS = ("ScalarType logits_dtype, ScalarType statistics_dtype, float? logit_scale=None, bool scale_divides=False, "
           "ScalarType? scale_dtype=None, float? temperature_value=None, bool temperature_multiplies=False, "
           "bool row_statistics=True, bool maximum_only=False, SymInt? chunk_size=None, SymInt? chunk_bytes=None, "
           "SymInt vocab_start=0, SymInt? vocab_size=None")
GRADS = "Tensor? grad_selected, Tensor? grad_lse, Tensor? grad_entropy, Tensor? grad_max"
FORWARD_SCHEMA = f"({TENSORS}, *, {OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
BACKWARD_SCHEMA = f"({GRADS}, {TENSORS}, {STATISTICS}, *, bool[] output_mask, {OPTIONS}) -> (Tensor, Tensor, Tensor)"


DEFAULTS = defaults(OPTIONS)


def _check_indices(indices: Tensor | None, vocab_size: int) -> None:
    """Raise (CPU) or device-assert (no host sync) on an index outside ``[0, V)``."""
    if indices is not None and indices.numel():
        in_range = (indices >= 0) & (indices < vocab_size)
        _assert_async(in_range.all(), f"{NAME}: expected every index in [0, {vocab_size})")


@torch.library.custom_op("chunkce::linear_statistics", mutates_args=(), schema=FORWARD_SCHEMA)
def _forward_op(hidden_states: Tensor, weight: Tensor, bias: Tensor | None, indices: Tensor | None,
                temperature: Tensor | None, logit_scale_tensor: Tensor | None, **arguments) -> tuple[Tensor, ...]:
    """``(selected [N, K], lse, entropy, max, argmax, row_log_sum, row_mean)`` (module docstring);
    with ``row_statistics=False`` the last six are empty ``[0]``."""
    arguments = {**DEFAULTS, **arguments}
    vocab_start, vocab_size = arguments["vocab_start"], arguments["vocab_size"]
    _check_indices(indices, weight.shape[0] if vocab_size is None else vocab_size)
    with loops.op_body(hidden_states, weight, logit_scale_tensor, arguments) as plan:
        if arguments["row_statistics"]:
            return statistics_loops.statistics_walk(plan, hidden_states, weight, bias, indices, temperature,
                                                    vocab_start)
        selected = statistics_loops.selected_forward(plan, hidden_states, weight, bias, indices, temperature,
                                                     vocab_start)
        return (selected, *_empty_statistics(selected))


def _empty_statistics(like: Tensor) -> tuple[Tensor, ...]:
    empty = like.new_empty(0)
    return empty, empty.clone(), empty.clone(), empty.long(), empty.clone(), empty.clone()


@_forward_op.register_fake
def _(hidden_states, weight, bias, indices, temperature, logit_scale_tensor, **arguments):
    arguments = {**DEFAULTS, **arguments}
    accumulate = accumulate_dtype(arguments["statistics_dtype"])
    num_tokens = hidden_states.shape[0]
    num_indices = 0 if indices is None else indices.shape[1]
    selected = hidden_states.new_empty(num_tokens, num_indices, dtype=accumulate)
    if not arguments["row_statistics"]:
        return (selected, *_empty_statistics(selected))
    lse, entropy, row_max, row_log_sum, row_mean = (
        hidden_states.new_empty(0 if arguments["maximum_only"] and k != 2 else num_tokens, dtype=accumulate)
        for k in range(5))
    return selected, lse, entropy, row_max, hidden_states.new_empty(num_tokens, dtype=torch.int64), row_log_sum, row_mean


@torch.library.custom_op("chunkce::linear_statistics_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward_op(grad_selected: Tensor | None, grad_lse: Tensor | None, grad_entropy: Tensor | None,
                 grad_max: Tensor | None, hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                 indices: Tensor | None, temperature: Tensor | None, logit_scale_tensor: Tensor | None,
                 row_max: Tensor, row_log_sum: Tensor, row_mean: Tensor, argmax: Tensor,
                 **arguments) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V_local, H]``, bias ``[V_local]`` (each in
    its parameter's dtype; empty where ``output_mask`` does not ask) of the given output gradients
    (accumulate dtype; None: no term), from the forward's ``[N]`` statistics."""
    output_mask = arguments.pop("output_mask")
    arguments = {**DEFAULTS, **arguments}
    vocab_start = arguments["vocab_start"]
    with loops.op_body(hidden_states, weight, logit_scale_tensor, arguments) as plan:
        return statistics_loops.statistics_gradients(
            plan, (grad_selected, grad_lse, grad_entropy, grad_max), hidden_states, weight, bias, indices,
            temperature, (row_max, row_log_sum, row_mean, argmax), output_mask, vocab_start)


@_backward_op.register_fake
def _(grad_selected, grad_lse, grad_entropy, grad_max, hidden_states, weight, bias, *rest, **arguments):
    return fake_gradients(hidden_states, weight, bias, arguments["output_mask"])


def backward(grads: tuple, saved: tuple[Tensor, ...], arguments: dict[str, Any],
             needs_input_grad: tuple[bool, ...]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward op's gradients of ``hidden_states``, ``weight``, ``bias`` (None where not
    needed, or where no output gradient is given): ``saved`` are the forward op's six tensors and
    its ``(row_max, row_log_sum, row_mean, argmax)``; shared with the vocabulary-parallel op."""
    want = list(needs_input_grad[:3])
    if not arguments.get("row_statistics", True):  # lse, entropy, max, argmax are empty
        grads = (grads[0], None, None, None)
    elif arguments.get("maximum_only", False):  # lse and entropy were not computed (empty): no term
        grads = (grads[0], None, None, grads[3])
    if all(grad is None for grad in grads) or not any(want):
        return None, None, None
    gradients = torch.ops.chunkce.linear_statistics_backward(*grads, *saved, output_mask=want, **arguments)
    return tuple(grad if wanted else None for grad, wanted in zip(gradients, want))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    _, _, _, row_max, argmax, row_log_sum, row_mean = output
    ctx.mark_non_differentiable(argmax, row_log_sum, row_mean)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs, row_max, row_log_sum, row_mean, argmax)
    ctx.arguments = keyword_only_inputs
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_selected, grad_lse, grad_entropy, grad_max, *_non_differentiable):
    grads = (grad_selected, grad_lse, grad_entropy, grad_max)
    grad_hidden, grad_weight, grad_bias = backward(grads, ctx.saved_tensors, ctx.arguments, ctx.needs_input_grad)
    return input_grads(ctx, {0: grad_hidden, 1: grad_weight, 2: grad_bias})


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_backward_op.register_autograd(refuse_double_backward(NAME, UNFUSED),
                               setup_context=lambda ctx, inputs, keyword_only_inputs, output: None)
