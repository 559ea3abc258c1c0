"""The two custom ops behind :func:`compile_pass.linear_cross_entropy`, and their autograd.

Their tensors are positional (``hidden_states, weight, target, bias, class_weight,
logit_scale_tensor``) and their options keyword-only (:data:`compile_pass.op.schema.OPTIONS`):
the bodies and fakes take them as keywords, ``setup_context`` keeps them, and the backward op is
called with them again.

``chunkce::linear_cross_entropy`` walks ``[n, Vb]`` tiles
(:func:`compile_pass.op.loops.chunked_forward`): project one tile into the call's one
tile buffer, then the per-tile kernel of :mod:`compile_pass.op.kernels` carries the
row's fp32 log-sum-exp across its vocabulary blocks and gives the per-token loss. It
returns ``loss [N]`` and the log-sum-exp in two parts, ``row_max [N]`` and
``row_log_sum [N]``. Autograd saves only its tensor inputs (the scale's 0-d tensor
among them) and those two; ``ctx.options`` keeps the keyword options.

``chunkce::linear_cross_entropy_backward`` recomputes each tile's logits and
applies the analytic gradient (:func:`compile_pass.op.loops.chunked_backward`,
formulas in :mod:`compile_pass.op.kernels`); being a custom op itself,
AOTAutograd traces the backward graph with it as one node, and its own autograd
refuses double backward. No autograd graph is built inside
either op and ``torch.func`` is not used, so both run under any saved-tensor
hooks and activation checkpointing. While a ``torch.func`` transform is active
(never while tracing), the same forward and backward run through two thin
``autograd.Function`` adapters, which ``torch.func`` accepts (their first argument: the
options as one dict, since an ``autograd.Function`` under ``torch.func`` takes no keywords).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_pass.op import loops
from compile_pass.op.dtypes import accumulate_dtype
from compile_pass.op.schema import DEFAULTS, INPUTS, NAME, op_schema

FORWARD_SCHEMA = op_schema(INPUTS, "(Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = op_schema(f"Tensor grad_loss, {INPUTS}, Tensor row_max, Tensor row_log_sum",
                            "(Tensor, Tensor, Tensor)", own="bool[] output_mask")


@torch.library.custom_op("chunkce::linear_cross_entropy", mutates_args=(), schema=FORWARD_SCHEMA)
def _forward_op(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                class_weight: Tensor | None, logit_scale_tensor: Tensor | None,
                **options) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``loss [N]`` (0 where ignored), ``row_max [N]`` and ``row_log_sum [N]`` (the
    log-sum-exp is their sum, kept in two parts so that backward's probabilities round as
    torch's log-softmax does, with no row reduction), fp32 (fp64 for fp64 logits).

    ``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64, ``bias [V]`` and
    ``class_weight [V]`` or None, the head's 0-d scale tensor or None, then the keyword
    options (:data:`compile_pass.op.schema.OPTIONS`; at most one of ``logit_scale`` and
    ``logit_scale_tensor`` is given; the logits are scaled by it before the loss,
    :class:`compile_pass.op.transform.HeadTransform`).
    """
    with loops.op_body(hidden_states, weight, logit_scale_tensor, options, target) as plan:
        return loops.chunked_forward(plan, hidden_states, weight, target, bias, class_weight)


@_forward_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, logit_scale_tensor, **options):
    accumulate = accumulate_dtype(options["logits_dtype"])
    num_tokens = hidden_states.shape[0]
    return tuple(hidden_states.new_empty(num_tokens, dtype=accumulate) for _ in range(3))


@torch.library.custom_op("chunkce::linear_cross_entropy_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward_op(grad_loss: Tensor, hidden_states: Tensor, weight: Tensor, target: Tensor,
                 bias: Tensor | None, class_weight: Tensor | None, logit_scale_tensor: Tensor | None,
                 row_max: Tensor, row_log_sum: Tensor, *, output_mask: list[bool],
                 **options) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V, H]``, bias ``[V]``.

    ``grad_loss [N]`` fp32 (fp64 for fp64), the forward op's tensors, its ``row_max [N]``
    and ``row_log_sum [N]``, then keyword ``output_mask`` (``[grad_hidden_states,
    grad_weight, grad_bias]`` wanted) and the forward op's options. A gradient that
    ``output_mask`` does not ask for comes back as an empty tensor and costs no work.
    Sums over chunks accumulate in fp32 (fp64 for fp64) and are cast to the parameter's
    dtype once. It walks the forward's tiles (:func:`compile_pass.op.chunking.plan_backward`):
    a half-precision weight over several token chunks accumulates one vocabulary block in
    fp32 (at most ``V / VOCAB_BLOCKS`` wide); with several blocks the hidden-state gradient
    of a half-precision head sums over them in an fp32 ``[N, H]`` accumulator.
    """
    with loops.op_body(hidden_states, weight, logit_scale_tensor, options) as plan:
        return loops.chunked_backward(plan, grad_loss, hidden_states, weight, target, bias,
                                      class_weight, row_max, row_log_sum, output_mask)


@_backward_op.register_fake
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


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    # inputs: the six tensors (or None); keyword_only_inputs: every option, defaults filled in
    _, row_max, row_log_sum = output
    ctx.mark_non_differentiable(row_max, row_log_sum)
    ctx.save_for_backward(*inputs, row_max, row_log_sum)
    ctx.options = keyword_only_inputs
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_loss, _grad_row_max, _grad_row_log_sum):
    hidden_states, weight, target, bias, class_weight, scale_tensor, row_max, row_log_sum = ctx.saved_tensors
    # the op's inputs' flags (FunctorchForward's first input, the options, comes before them)
    want_hidden, want_weight, _, want_bias = ctx.needs_input_grad[-ctx.num_inputs:][:4]
    tensors = (grad_loss, hidden_states, weight, target, bias, class_weight, scale_tensor, row_max, row_log_sum)
    options = {**ctx.options, "output_mask": [want_hidden, want_weight, want_bias]}
    if torch._C._are_functorch_transforms_active():
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


_refuse_double_backward = refuse_double_backward(NAME, "the unfused F.linear + F.cross_entropy")
_forward_op.register_autograd(_backward, setup_context=_setup_context)
_backward_op.register_autograd(_refuse_double_backward,
                               setup_context=lambda ctx, inputs, keyword_only_inputs, output: None)


def _options_first(op) -> staticmethod:
    """A Function's ``forward(options, *tensors)``: ``op(*tensors, **options)``."""
    return staticmethod(lambda options, *tensors: op(*tensors, **options))


class FunctorchForward(torch.autograd.Function):
    """The forward op with the same autograd, in the form ``torch.func`` accepts:
    ``apply(options, *tensors)``, the keyword options as one dict.

    The autograd that ``register_autograd`` gives a custom op raises under
    ``torch.func`` transforms (grad, vjp, jacrev); the public function calls the op
    through this Function only while a transform is active; Dynamo and
    AOTAutograd still see the custom op itself.
    ``vmap`` runs the op once per sample, as it does the bare custom op.
    """

    generate_vmap_rule = True
    forward = _options_first(_forward_op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs[1:], {**DEFAULTS, **inputs[0]}, output)

    @staticmethod
    def backward(ctx, *grads):
        return None, *_backward(ctx, *grads)  # no gradient for the options


class FunctorchBackward(torch.autograd.Function):
    """The backward op under ``torch.func`` (``apply(options, *tensors)``): first order works,
    second order is refused."""

    generate_vmap_rule = True
    forward = _options_first(_backward_op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_refuse_double_backward)
