"""The two custom ops behind :func:`compile_pass.linear_cross_entropy`, and their autograd.

``chunkce::linear_cross_entropy`` loops over token chunks
(:func:`compile_pass.op.loops.chunked_forward`): project one chunk (``[n, V]``
logits, freed before the next), then the per-chunk kernel of
:mod:`compile_pass.op.kernels` gives its per-token loss and fp32 log-sum-exp. It
returns ``loss [N]`` and ``lse [N]``. Autograd saves only its inputs and ``lse``.

``chunkce::linear_cross_entropy_backward`` recomputes each chunk's logits and
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
from compile_pass.op.loops import ChunkPlan

NAME = "chunkce.linear_cross_entropy"


def _release_cache(device: torch.device, enabled: bool) -> None:
    """Return cached allocator blocks to the device (no-op on CPU or when disabled)."""
    if enabled and device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled`` for device types that have autocast (not e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


class _AutocastOff:
    """Run the op's body with autocast off: its inputs are already in the right dtypes."""

    def __init__(self, device: torch.device):
        self._ctx = None
        if autocast_enabled(device.type):
            self._ctx = torch.autocast(device.type, enabled=False)

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _assert_targets_in_range(target: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise (CPU) or device-assert (accelerators: no host sync) on a target outside
    ``[0, V)`` that is not ``ignore_index``, before any kernel indexes with it."""
    in_range = ((target >= 0) & (target < vocab_size)) | (target == ignore_index)
    ignored = "" if ignore_index == torch.iinfo(torch.int64).min else f" or equal to ignore_index ({ignore_index})"
    # (int64's minimum: no target is ignored, the graph pass's gather spelling)
    torch._assert_async(in_range.all(), f"{NAME}: expected every target in [0, {vocab_size}){ignored}")


def _plan(hidden_states: Tensor, weight: Tensor, ignore_index: int, label_smoothing: float,
          logits_dtype: torch.dtype, chunk_size: int, release_cache: bool | None,
          logit_scale: float | None, logit_scale_tensor: Tensor | None, scale_divides: bool,
          scale_dtype: torch.dtype | None, chunk_bytes: int) -> ChunkPlan:
    """The :class:`ChunkPlan` of either op's arguments (the scale: whichever of the two is given)."""
    return ChunkPlan.resolve(
        hidden_states, weight, ignore_index, label_smoothing, logits_dtype, chunk_size, release_cache,
        logit_scale=logit_scale if logit_scale_tensor is None else logit_scale_tensor,
        scale_divides=scale_divides, scale_dtype=scale_dtype, chunk_bytes=chunk_bytes,
    )


@torch.library.custom_op("chunkce::linear_cross_entropy", mutates_args=())
def _forward_op(
    hidden_states: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    target: Tensor,  # [N] int64
    bias: Tensor | None,  # [V]
    class_weight: Tensor | None,  # [V]
    ignore_index: int,
    label_smoothing: float,
    logits_dtype: torch.dtype,
    chunk_size: int,  # 0 = automatic
    release_cache: bool | None,
    logit_scale: float | None = None,  # a Python number's scale
    logit_scale_tensor: Tensor | None = None,  # [] a 0-d tensor's scale (not differentiated)
    scale_divides: bool = False,  # logits / scale, else logits * scale
    scale_dtype: torch.dtype | None = None,  # the dtype it scales in; None = the projection's
    chunk_bytes: int = 0,  # the chunk budget in bytes; 0 = the default
) -> tuple[Tensor, Tensor]:
    """Per-token ``loss [N]`` and ``lse [N]``, fp32 (fp64 for fp64 logits); 0 loss where ignored.

    At most one of ``logit_scale`` and ``logit_scale_tensor`` is given: the logits are
    scaled by it (:func:`compile_pass.op.kernels.scale_logits`) before the loss.
    """
    plan = _plan(hidden_states, weight, ignore_index, label_smoothing, logits_dtype, chunk_size,
                 release_cache, logit_scale, logit_scale_tensor, scale_divides, scale_dtype, chunk_bytes)
    _assert_targets_in_range(target, weight.shape[0], ignore_index)
    with _AutocastOff(hidden_states.device):
        loss, lse = loops.chunked_forward(plan, hidden_states, weight, target, bias, class_weight)
    _release_cache(hidden_states.device, plan.release_cache)
    return loss, lse


@_forward_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, ignore_index, label_smoothing,
      logits_dtype, chunk_size, release_cache, logit_scale=None, logit_scale_tensor=None,
      scale_divides=False, scale_dtype=None, chunk_bytes=0):
    num_tokens = hidden_states.shape[0]
    accumulate = kernels.accumulate_dtype(logits_dtype)
    return (hidden_states.new_empty(num_tokens, dtype=accumulate),
            hidden_states.new_empty(num_tokens, dtype=accumulate))


@torch.library.custom_op("chunkce::linear_cross_entropy_backward", mutates_args=())
def _backward_op(
    grad_loss: Tensor,  # [N] fp32
    hidden_states: Tensor,  # [N, H]
    weight: Tensor,  # [V, H]
    target: Tensor,  # [N]
    bias: Tensor | None,  # [V]
    class_weight: Tensor | None,  # [V]
    lse: Tensor,  # [N] fp32
    ignore_index: int,
    label_smoothing: float,
    logits_dtype: torch.dtype,
    chunk_size: int,
    release_cache: bool | None,
    output_mask: list[bool],  # [grad_hidden_states, grad_weight, grad_bias] wanted
    logit_scale: float | None = None,  # the forward op's scaling arguments
    logit_scale_tensor: Tensor | None = None,
    scale_divides: bool = False,
    scale_dtype: torch.dtype | None = None,
    chunk_bytes: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V, H]``, bias ``[V]``.

    A gradient that ``output_mask`` does not ask for comes back as an empty
    tensor and costs no work. Sums over chunks accumulate in fp32 (fp64 for fp64)
    and are cast to the parameter's dtype once. A half-precision weight over
    several token chunks is walked in ``VOCAB_BLOCKS`` vocabulary blocks, so its
    fp32 accumulator holds one block; the hidden-state gradient then sums over
    blocks in an fp32 ``[N, H]`` accumulator. The scaling arguments (after
    ``output_mask``, so that their defaults leave the unscaled call as it was) are
    the forward op's.
    """
    plan = _plan(hidden_states, weight, ignore_index, label_smoothing, logits_dtype, chunk_size,
                 release_cache, logit_scale, logit_scale_tensor, scale_divides, scale_dtype, chunk_bytes)
    with _AutocastOff(hidden_states.device):
        grads = loops.chunked_backward(plan, grad_loss, hidden_states, weight, target, bias,
                                       class_weight, lse, output_mask)
    _release_cache(hidden_states.device, plan.release_cache)
    return grads


@_backward_op.register_fake
def _(grad_loss, hidden_states, weight, target, bias, class_weight, lse, ignore_index,
      label_smoothing, logits_dtype, chunk_size, release_cache, output_mask, logit_scale=None,
      logit_scale_tensor=None, scale_divides=False, scale_dtype=None, chunk_bytes=0):
    want_hidden, want_weight, want_bias = output_mask
    return (
        torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        if want_hidden else hidden_states.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if want_weight else weight.new_empty(0),
        torch.empty_like(bias) if want_bias and bias is not None else weight.new_empty(0),
    )


_OPTIONS = 5  # ignore_index, label_smoothing, logits_dtype, chunk_size, release_cache


def _setup_context(ctx, inputs, output):
    # inputs: every argument, defaults filled in
    hidden_states, weight, target, bias, class_weight, *rest = inputs
    options, (logit_scale, logit_scale_tensor, *scaling) = rest[:_OPTIONS], rest[_OPTIONS:]
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden_states, weight, target, bias, class_weight, lse, logit_scale_tensor)
    ctx.options = options
    ctx.scaling = (logit_scale, *scaling)  # logit_scale, scale_divides, scale_dtype, chunk_bytes
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_loss, _grad_lse):
    hidden_states, weight, target, bias, class_weight, lse, logit_scale_tensor = ctx.saved_tensors
    want_hidden, want_weight, _, want_bias = ctx.needs_input_grad[:4]
    backward_op = (FunctorchBackward.apply if torch._C._are_functorch_transforms_active()
                   else torch.ops.chunkce.linear_cross_entropy_backward)
    logit_scale, *scaling = ctx.scaling
    grad_hidden, grad_weight, grad_bias = backward_op(
        grad_loss, hidden_states, weight, target, bias, class_weight, lse,
        *ctx.options, [want_hidden, want_weight, want_bias], logit_scale, logit_scale_tensor, *scaling,
    )
    grads = [None] * ctx.num_inputs
    grads[0] = grad_hidden if want_hidden else None
    grads[1] = grad_weight if want_weight else None
    grads[3] = grad_bias if want_bias else None
    return tuple(grads)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise NotImplementedError(
        f"{NAME}: double backward (create_graph=True through the op) is not supported; "
        "compute higher-order gradients with the unfused F.linear + F.cross_entropy"
    )


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
