"""The two custom ops behind :func:`compile_pass.linear_cross_entropy`, and their autograd.

``chunkce::linear_cross_entropy`` walks ``[n, Vb]`` tiles (:func:`compile_pass.op.loops.chunked_forward`)
and returns ``loss [N]``, ``row_max [N]``, ``row_log_sum [N]``; autograd saves its tensor inputs and
those two. ``chunkce::linear_cross_entropy_backward`` recomputes each tile
(:func:`compile_pass.op.loops.chunked_backward`) and refuses double backward. Tensors are
positional, options keyword-only (:data:`compile_pass.op.schema.LOSS_OPTIONS`). Under a ``torch.func``
transform both run through ``autograd.Function`` adapters. Structure: docs/op.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import loops
from compile_pass.op.schema import INPUTS, LOSS_DEFAULTS, LOSS_NAME, OUTPUT_MASK, ROW_LOG_SUM_EXP, Argument, OpSchema
from compile_pass.op.tiling import accumulate_dtype

_are_functorch_transforms_active = internals.are_functorch_transforms_active.get()
LOSS_FORWARD_SCHEMA = OpSchema("chunkce::linear_cross_entropy", INPUTS, returns=3)
LOSS_BACKWARD_SCHEMA = OpSchema("chunkce::linear_cross_entropy_backward",
                                (Argument("grad_loss", "Tensor"), *INPUTS, *ROW_LOG_SUM_EXP), returns=3,
                                own=(OUTPUT_MASK,))


@LOSS_FORWARD_SCHEMA.custom_op
def _cross_entropy_op(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                      class_weight: Tensor | None, logit_scale_tensor: Tensor | None,
                      **options) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``loss [N]`` (0 where ignored), ``row_max [N]`` and ``row_log_sum [N]`` (the
    log-sum-exp in two parts, so that backward rounds as torch's log-softmax does), fp32 (fp64
    for fp64 logits), from ``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64,
    ``bias`` / ``class_weight`` ``[V]`` or None, a 0-d scale tensor or None, and the options."""
    with loops.op_body(hidden_states, weight, logit_scale_tensor, options, target) as op_call:
        return loops.chunked_forward(op_call, hidden_states, weight, target, bias, class_weight)


@_cross_entropy_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, logit_scale_tensor, **options):
    accumulate = accumulate_dtype(options["logits_dtype"])
    num_tokens = hidden_states.shape[0]
    return tuple(hidden_states.new_empty(num_tokens, dtype=accumulate) for _ in range(3))


@LOSS_BACKWARD_SCHEMA.custom_op
def _cross_entropy_backward_op(grad_loss: Tensor, hidden_states: Tensor, weight: Tensor, target: Tensor,
                               bias: Tensor | None, class_weight: Tensor | None, logit_scale_tensor: Tensor | None,
                               row_max: Tensor, row_log_sum: Tensor, *, output_mask: list[bool],
                               **options) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V, H]``, bias ``[V]``, from
    ``grad_loss [N]`` (the forward's accumulate dtype), the forward op's tensors and row
    statistics, ``output_mask`` and its options; a gradient not asked for is empty and costs no
    work. Walk and accumulators: :func:`compile_pass.op.tiling.plan_backward`."""
    with loops.op_body(hidden_states, weight, logit_scale_tensor, options) as op_call:
        return loops.chunked_backward(op_call, grad_loss, hidden_states, weight, target, bias,
                                      class_weight, row_max, row_log_sum, output_mask)


@_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden_states, weight, target, bias, class_weight, logit_scale_tensor, row_max, row_log_sum,
      *, output_mask, **options):
    return fake_gradients(hidden_states, weight, bias, output_mask)


def fake_gradients(hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                   output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """A backward op's outputs on fake tensors: the gradients of hidden states, weight and bias
    that ``output_mask`` asks for (contiguous, as the loops write them), empty ones for the rest."""
    want_hidden, want_weight, want_bias = output_mask
    return (
        torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        if want_hidden else hidden_states.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if want_weight else weight.new_empty(0),
        torch.empty_like(bias) if want_bias and bias is not None else weight.new_empty(0),
    )


def _cross_entropy_setup_context(ctx, inputs, keyword_only_inputs, output):
    # inputs: the six tensors (or None); keyword_only_inputs: every option, defaults filled in
    _, row_max, row_log_sum = output
    ctx.mark_non_differentiable(row_max, row_log_sum)
    ctx.save_for_backward(*inputs, row_max, row_log_sum)
    ctx.options = keyword_only_inputs
    ctx.num_inputs = len(inputs)


def _cross_entropy_backward(ctx, grad_loss, _grad_row_max, _grad_row_log_sum):
    hidden_states, weight, target, bias, class_weight, scale_tensor, row_max, row_log_sum = ctx.saved_tensors
    # the op's inputs' flags (FunctorchForward's first input, the options, comes before them)
    want_hidden, want_weight, _, want_bias = ctx.needs_input_grad[-ctx.num_inputs:][:4]
    tensors = (grad_loss, hidden_states, weight, target, bias, class_weight, scale_tensor, row_max, row_log_sum)
    options = {**ctx.options, "output_mask": [want_hidden, want_weight, want_bias]}
    if _are_functorch_transforms_active():
        grad_hidden, grad_weight, grad_bias = FunctorchBackward.apply(options, *tensors)
    else:
        grad_hidden, grad_weight, grad_bias = torch.ops.chunkce.linear_cross_entropy_backward(*tensors, **options)
    return input_grads(ctx, {0: grad_hidden if want_hidden else None, 1: grad_weight if want_weight else None,
                             3: grad_bias if want_bias else None})


def input_grads(ctx, at: dict[int, Tensor | None]) -> tuple[Tensor | None, ...]:
    """What a ``register_autograd`` backward returns: a gradient for each of the op's
    ``ctx.num_inputs`` inputs, None but at the positions of ``at``."""
    grads: list[Tensor | None] = [None] * ctx.num_inputs
    for position, grad in at.items():
        grads[position] = grad
    return tuple(grads)


def refuse_double_backward(op_name: str, unfused: str):
    """The autograd of an op's backward op: a second backward raises ``NotImplementedError``
    naming ``unfused``, the computation to differentiate twice instead."""
    def refuse(ctx, *grads):
        raise NotImplementedError(f"{op_name}: double backward (create_graph=True through the op) is not "
                                  f"supported; compute higher-order gradients with {unfused}")
    return refuse


_refuse_double_backward = refuse_double_backward(LOSS_NAME, "the unfused F.linear + F.cross_entropy")
_cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup_context)
_cross_entropy_backward_op.register_autograd(_refuse_double_backward,
                                             setup_context=lambda ctx, inputs, keyword_only_inputs, output: None)


def _options_first(op) -> staticmethod:
    """A Function's ``forward(options, *tensors)``: ``op(*tensors, **options)``."""
    return staticmethod(lambda options, *tensors: op(*tensors, **options))


class FunctorchForward(torch.autograd.Function):
    """The forward op with the same autograd as ``apply(options, *tensors)``, the form
    ``torch.func`` accepts (a custom op's ``register_autograd`` raises under its transforms);
    called only while a transform is active, so Dynamo and AOTAutograd see the custom op."""

    generate_vmap_rule = True
    forward = _options_first(_cross_entropy_op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _cross_entropy_setup_context(ctx, inputs[1:], {**LOSS_DEFAULTS, **inputs[0]}, output)

    @staticmethod
    def backward(ctx, *grads):
        return None, *_cross_entropy_backward(ctx, *grads)  # no gradient for the options


class FunctorchBackward(torch.autograd.Function):
    """The backward op under ``torch.func`` (``apply(options, *tensors)``): first order works,
    second order is refused."""

    generate_vmap_rule = True
    forward = _options_first(_cross_entropy_backward_op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_refuse_double_backward)
