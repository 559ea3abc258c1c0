"""The two custom ops behind :func:`compile_pass.linear_cross_entropy`, and their autograd.

Their schemas are generated from :class:`compile_pass.op.schema.OpOptions` (the
options, defined once): the bodies, fakes and ``setup_context`` read the options
with ``OpOptions.parse``, and the backward is called with ``OpOptions.args``.

``chunkce::linear_cross_entropy`` walks ``[n, Vb]`` tiles
(:func:`compile_pass.op.loops.chunked_forward`): project one tile into the call's one
tile buffer, then the per-tile kernel of :mod:`compile_pass.op.kernels` carries the
row's fp32 log-sum-exp across its vocabulary blocks and gives the per-token loss. It
returns ``loss [N]`` and the log-sum-exp in two parts, ``row_max [N]`` and
``row_log_sum [N]``. Autograd saves only its tensor inputs (the scale's 0-d tensor
among them) and those two; ``ctx.options`` keeps the other options.

``chunkce::linear_cross_entropy_backward`` recomputes each tile's logits and
applies the analytic gradient (:func:`compile_pass.op.loops.chunked_backward`,
formulas in :mod:`compile_pass.op.kernels`); being a custom op itself,
AOTAutograd traces the backward graph with it as one node, and its own autograd
refuses double backward. No autograd graph is built inside
either op and ``torch.func`` is not used, so both run under any saved-tensor
hooks and activation checkpointing. While a ``torch.func`` transform is active
(never while tracing), the same forward and backward run through two thin
``autograd.Function`` adapters, which ``torch.func`` accepts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_pass.op import kernels, loops
from compile_pass.op.schema import INPUTS, NAME, OpOptions, op_schema

FORWARD_SCHEMA = op_schema(INPUTS, "(Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = op_schema(f"Tensor grad_loss, {INPUTS}, Tensor row_max, Tensor row_log_sum",
                            "(Tensor, Tensor, Tensor)",
                            extras="bool[] output_mask")


@torch.library.custom_op("chunkce::linear_cross_entropy", mutates_args=(), schema=FORWARD_SCHEMA)
def _forward_op(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                class_weight: Tensor | None, *options) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``loss [N]`` (0 where ignored), ``row_max [N]`` and ``row_log_sum [N]`` (the
    log-sum-exp is their sum, kept in two parts so that backward's probabilities round as
    torch's log-softmax does, with no row reduction), fp32 (fp64 for fp64 logits).

    ``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64, ``bias [V]`` and
    ``class_weight [V]`` or None, then the :class:`~compile_pass.op.schema.OpOptions`
    (the head's transform as its schema arguments: at most one of ``logit_scale`` and
    ``logit_scale_tensor`` is given; the logits are scaled by it before the loss,
    :class:`compile_pass.op.transform.HeadTransform`).
    """
    _, options = OpOptions.parse(options)
    with loops.op_body(hidden_states, weight, options, target) as plan:
        return loops.chunked_forward(plan, hidden_states, weight, target, bias, class_weight)


@_forward_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, *options):
    _, options = OpOptions.parse(options)
    accumulate = kernels.accumulate_dtype(options.logits_dtype)
    num_tokens = hidden_states.shape[0]
    return tuple(hidden_states.new_empty(num_tokens, dtype=accumulate) for _ in range(3))


@torch.library.custom_op("chunkce::linear_cross_entropy_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward_op(grad_loss: Tensor, hidden_states: Tensor, weight: Tensor, target: Tensor,
                 bias: Tensor | None, class_weight: Tensor | None, row_max: Tensor, row_log_sum: Tensor,
                 *options_and_mask) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V, H]``, bias ``[V]``.

    ``grad_loss [N]`` fp32 (fp64 for fp64), the forward op's tensors, its ``row_max [N]``
    and ``row_log_sum [N]``, then the forward op's options with ``output_mask`` (``[grad_hidden_states,
    grad_weight, grad_bias]`` wanted) after those without a default, so that the
    defaults of the others leave an older call as it was. A gradient that
    ``output_mask`` does not ask for comes back as an empty tensor and costs no work.
    Sums over chunks accumulate in fp32 (fp64 for fp64) and are cast to the parameter's
    dtype once. It walks the forward's tiles (:func:`compile_pass.op.chunking.plan_backward`):
    a half-precision weight over several token chunks accumulates one vocabulary block in
    fp32 (at most ``V / VOCAB_BLOCKS`` wide); with several blocks the hidden-state gradient
    of a half-precision head sums over them in an fp32 ``[N, H]`` accumulator.
    """
    (output_mask,), options = OpOptions.parse(options_and_mask, extras=1)
    with loops.op_body(hidden_states, weight, options) as plan:
        return loops.chunked_backward(plan, grad_loss, hidden_states, weight, target, bias,
                                      class_weight, row_max, row_log_sum, output_mask)


@_backward_op.register_fake
def _(grad_loss, hidden_states, weight, target, bias, class_weight, row_max, row_log_sum, *options_and_mask):
    (output_mask,), _ = OpOptions.parse(options_and_mask, extras=1)
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


def _setup_context(ctx, inputs, output):
    # inputs: every argument, defaults filled in
    _, options = OpOptions.parse(inputs[5:])
    _, row_max, row_log_sum = output
    ctx.mark_non_differentiable(row_max, row_log_sum)
    ctx.save_for_backward(*inputs[:5], row_max, row_log_sum, *options.tensors())
    ctx.options = options.without_tensors()  # its tensors are saved above
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_loss, _grad_row_max, _grad_row_log_sum):
    hidden_states, weight, target, bias, class_weight, row_max, row_log_sum, *option_tensors = ctx.saved_tensors
    options = ctx.options.with_tensors(option_tensors)
    want_hidden, want_weight, _, want_bias = ctx.needs_input_grad[:4]
    backward_op = (FunctorchBackward.apply if torch._C._are_functorch_transforms_active()
                   else torch.ops.chunkce.linear_cross_entropy_backward)
    grad_hidden, grad_weight, grad_bias = backward_op(
        grad_loss, hidden_states, weight, target, bias, class_weight, row_max, row_log_sum,
        *options.args([want_hidden, want_weight, want_bias]),
    )
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
_backward_op.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)


class FunctorchForward(torch.autograd.Function):
    """The forward op with the same autograd, in the form ``torch.func`` accepts.

    The autograd that ``register_autograd`` gives a custom op raises under
    ``torch.func`` transforms (grad, vjp, jacrev); the public function calls the op
    through this Function only while a transform is active; Dynamo and
    AOTAutograd still see the custom op itself.
    ``vmap`` runs the op once per sample, as it does the bare custom op.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return torch.ops.chunkce.linear_cross_entropy(*inputs)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


class FunctorchBackward(torch.autograd.Function):
    """The backward op under ``torch.func``: first order works, second order is refused."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return torch.ops.chunkce.linear_cross_entropy_backward(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_refuse_double_backward)
