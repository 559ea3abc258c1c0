"""The chunked linear-cross-entropy op: ``chunkce::linear_cross_entropy``.

Public entry point: :func:`linear_cross_entropy`, a drop-in for torch 2.13's
``torch.nn.functional.linear_cross_entropy`` (class-index targets) that never
materializes the ``[N, V]`` logits, their fp32 upcast, their log-softmax or their
gradient. It is a traceable Python function: argument checks, flattening, the
custom op below (one opaque node for Dynamo, AOTAutograd and Inductor) and the
reduction in ordinary torch ops, so that ``mean`` over class weights, and anything
the surrounding graph does with the loss, stays visible to the compiler.

The custom op returns the per-token loss ``[N]`` and the log-sum-exp ``[N]``
(both fp32). Autograd saves only the op's inputs and ``lse``; backward is a second
custom op, ``chunkce::linear_cross_entropy_backward``, that recomputes each
chunk's logits and applies the analytic gradient (see :mod:`compile_pass.kernels`).
No autograd graph is built inside either op and ``torch.func`` is not used, so the
op runs under any saved-tensor hooks and activation checkpointing, and the hooks
only ever see the tensors listed above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass import kernels
from compile_pass.chunking import VOCAB_BLOCKS, choose_chunk_size, min_chunk_bytes_for
from compile_pass.config import settings

_NAME = "chunkce.linear_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class _ChunkPlan:
    """What one call of either op needs besides its tensors."""

    ignore_index: int
    label_smoothing: float
    logits_dtype: torch.dtype
    chunk_size: int  # tokens per chunk, resolved
    eager_kernels: bool
    release_cache: bool

    @staticmethod
    def resolve(hidden_states, weight, ignore_index, label_smoothing, logits_dtype,
                chunk_size, release_cache) -> "_ChunkPlan":
        env = settings()
        num_tokens, hidden_size = hidden_states.shape
        if chunk_size <= 0:
            chunk_size = env.chunk_size or choose_chunk_size(
                num_tokens, hidden_size, weight.shape[0],
                hidden_states.element_size(), hidden_states.element_size(),
                min_chunk_bytes_for(hidden_states.device.type),
            )
        return _ChunkPlan(
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            logits_dtype=logits_dtype,
            chunk_size=max(1, chunk_size),
            eager_kernels=env.eager_kernels,
            release_cache=env.release_cache if release_cache is None else release_cache,
        )

    def variant(self, hidden_states: Tensor, class_weight: Tensor | None) -> tuple:
        return (
            hidden_states.device.type, hidden_states.dtype, self.logits_dtype,
            class_weight is not None, self.label_smoothing > 0.0,
        )

    def chunks(self, num_tokens: int, chunk_size: int | None = None) -> list[tuple[int, int]]:
        return spans(num_tokens, chunk_size or self.chunk_size)


def spans(total: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` pieces of ``range(total)`` of ``size`` elements each.

    A trailing piece of one element joins the one before it: the per-chunk kernels
    are compiled with dynamic shapes, and Dynamo specialises a dimension of size 1,
    so a one-token (or one-class) last piece would compile a second variant.
    """
    bounds = list(range(0, total, size)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def _project(hidden_chunk: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    """Logits of one chunk ``[n, V]`` in the projection dtype, as ``F.linear`` computes them."""
    if bias is None:
        return hidden_chunk @ weight_t
    return torch.addmm(bias, hidden_chunk, weight_t)


def _release_cache(device: torch.device, enabled: bool) -> None:
    """Return cached allocator blocks to the device (no-op on CPU or when disabled)."""
    if enabled and device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled`` for device types that have autocast (not e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


class _AutocastOff:
    """Run the op's body with autocast off: its inputs are already in the right dtypes."""

    def __init__(self, device: torch.device):
        self._ctx = None
        if _autocast_enabled(device.type):
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
    torch._assert_async(in_range.all(), f"{_NAME}: expected every target in [0, {vocab_size}) "
                                        f"or equal to ignore_index ({ignore_index})")


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
) -> tuple[Tensor, Tensor]:
    plan = _ChunkPlan.resolve(hidden_states, weight, ignore_index, label_smoothing,
                              logits_dtype, chunk_size, release_cache)
    _assert_targets_in_range(target, weight.shape[0], ignore_index)
    num_tokens = hidden_states.shape[0]
    accumulate = kernels.accumulate_dtype(logits_dtype)
    loss = hidden_states.new_empty(num_tokens, dtype=accumulate)  # [N]
    lse = hidden_states.new_empty(num_tokens, dtype=accumulate)  # [N]
    variant = plan.variant(hidden_states, class_weight)
    weight_t = weight.t()  # [H, V]
    with _AutocastOff(hidden_states.device):
        for start, end in plan.chunks(num_tokens):
            logits_chunk = _project(hidden_states[start:end], weight_t, bias)  # [n, V]
            loss[start:end], lse[start:end] = kernels.run(
                "chunk_forward", variant, plan.eager_kernels,
                logits_chunk, target[start:end], class_weight,
                ignore_index, label_smoothing, logits_dtype,
            )
            del logits_chunk
    _release_cache(hidden_states.device, plan.release_cache)
    return loss, lse


@_forward_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, ignore_index, label_smoothing,
      logits_dtype, chunk_size, release_cache):
    num_tokens = hidden_states.shape[0]
    accumulate = kernels.accumulate_dtype(logits_dtype)
    return (hidden_states.new_empty(num_tokens, dtype=accumulate),
            hidden_states.new_empty(num_tokens, dtype=accumulate))


_NO_MIXED_ADDMM: set[str] = set()  # device types without aten::addmm.dtype_out


def _add_matmul(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """``accumulator += a @ b``, accumulated in the accumulator's dtype.

    For half-precision operands and an fp32 accumulator, ``aten::addmm.dtype_out``
    (CUDA) accumulates in place with no temporary; where the device has no such
    kernel (CPU, whose half-precision matmul is emulated anyway), the operands are
    upcast and multiplied in the accumulator's dtype, so no product is rounded to
    half precision before it is summed.
    """
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
        return
    device_type = accumulator.device.type
    if device_type not in _NO_MIXED_ADDMM:
        try:
            torch.ops.aten.addmm.dtype_out(accumulator, a, b, accumulator.dtype, out=accumulator)
            return
        except (NotImplementedError, RuntimeError):
            _NO_MIXED_ADDMM.add(device_type)
    accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype))


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
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V, H]``, bias ``[V]``.

    A gradient that ``output_mask`` does not ask for comes back as an empty
    tensor and costs no work. Sums over chunks accumulate in fp32 (fp64 for fp64)
    and are cast to the parameter's dtype once. A half-precision weight over
    several token chunks is walked in ``VOCAB_BLOCKS`` vocabulary blocks, so its
    fp32 accumulator holds one block; the hidden-state gradient then sums over
    blocks in an fp32 ``[N, H]`` accumulator.
    """
    plan = _ChunkPlan.resolve(hidden_states, weight, ignore_index, label_smoothing,
                              logits_dtype, chunk_size, release_cache)
    want_hidden, want_weight, want_bias = output_mask
    want_bias = want_bias and bias is not None
    num_tokens, hidden_size = hidden_states.shape
    vocab_size = weight.shape[0]
    accumulate = kernels.accumulate_dtype(weight.dtype)
    blocks = VOCAB_BLOCKS if accumulate != weight.dtype and num_tokens > plan.chunk_size else 1
    block_size = -(-vocab_size // blocks)
    token_chunks = list(plan.chunks(num_tokens, plan.chunk_size * blocks))  # same logits bytes a chunk

    def new_or_empty(wanted, *shape, like, dtype=None):
        if not wanted:
            return like.new_empty(0)
        return like.new_zeros(*shape, dtype=dtype or like.dtype)

    grad_hidden = new_or_empty(want_hidden, num_tokens, hidden_size, like=hidden_states,
                               dtype=kernels.accumulate_dtype(hidden_states.dtype) if blocks > 1 else None)
    grad_weight = new_or_empty(want_weight, vocab_size, hidden_size, like=weight)
    grad_bias = new_or_empty(want_bias, vocab_size, like=weight, dtype=accumulate)
    variant = plan.variant(hidden_states, class_weight)
    with _AutocastOff(hidden_states.device):
        for vocab_start, vocab_end in spans(vocab_size, block_size):
            weight_block = weight[vocab_start:vocab_end]  # [Vb, H]
            bias_block = None if bias is None else bias[vocab_start:vocab_end]
            # [Vb, H] sum over token chunks: written straight into grad_weight when one
            # chunk (or an fp32 weight) needs no wider accumulator.
            grad_weight_block = grad_weight[vocab_start:vocab_end] if want_weight else None
            if want_weight and len(token_chunks) > 1 and accumulate != weight.dtype:
                grad_weight_block = weight_block.new_zeros(weight_block.shape, dtype=accumulate)
            for start, end in token_chunks:
                hidden_chunk = hidden_states[start:end]  # [n, H]
                logits_chunk = _project(hidden_chunk, weight_block.t(), bias_block)  # [n, Vb]
                grad_logits = kernels.run(
                    "chunk_backward", variant, plan.eager_kernels,
                    logits_chunk, lse[start:end], target[start:end], class_weight,
                    grad_loss[start:end], ignore_index, label_smoothing, logits_dtype,
                    vocab_start, vocab_size,
                )  # [n, Vb] projection dtype
                del logits_chunk
                if want_hidden and blocks == 1:
                    torch.mm(grad_logits, weight_block, out=grad_hidden[start:end])
                elif want_hidden:
                    _add_matmul(grad_hidden[start:end], grad_logits, weight_block)
                if want_weight and len(token_chunks) == 1:
                    torch.mm(grad_logits.t(), hidden_chunk, out=grad_weight_block)  # as F.linear's backward
                elif want_weight:
                    _add_matmul(grad_weight_block, grad_logits.t(), hidden_chunk)
                if want_bias:
                    grad_bias[vocab_start:vocab_end] += grad_logits.sum(0, dtype=accumulate)
                del grad_logits
            if want_weight and grad_weight_block.dtype != weight.dtype:
                grad_weight[vocab_start:vocab_end] = grad_weight_block
            del grad_weight_block
    if want_hidden:
        grad_hidden = grad_hidden.to(hidden_states.dtype)
    if want_bias:
        grad_bias = grad_bias.to(bias.dtype)
    _release_cache(hidden_states.device, plan.release_cache)
    return grad_hidden, grad_weight, grad_bias


@_backward_op.register_fake
def _(grad_loss, hidden_states, weight, target, bias, class_weight, lse, ignore_index,
      label_smoothing, logits_dtype, chunk_size, release_cache, output_mask):
    want_hidden, want_weight, want_bias = output_mask
    return (
        torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        if want_hidden else hidden_states.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if want_weight else weight.new_empty(0),
        torch.empty_like(bias) if want_bias and bias is not None else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden_states, weight, target, bias, class_weight, *options = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden_states, weight, target, bias, class_weight, lse)
    ctx.options = options  # ignore_index, label_smoothing, logits_dtype, chunk_size, release_cache


def _backward(ctx, grad_loss, _grad_lse):
    hidden_states, weight, target, bias, class_weight, lse = ctx.saved_tensors
    want_hidden, want_weight, _, want_bias = ctx.needs_input_grad[:4]
    backward_op = (_FuncBackward.apply if torch._C._are_functorch_transforms_active()
                   else torch.ops.chunkce.linear_cross_entropy_backward)
    grad_hidden, grad_weight, grad_bias = backward_op(
        grad_loss, hidden_states, weight, target, bias, class_weight, lse,
        *ctx.options, [want_hidden, want_weight, want_bias],
    )
    grads = [None] * (5 + len(ctx.options))
    grads[0] = grad_hidden if want_hidden else None
    grads[1] = grad_weight if want_weight else None
    grads[3] = grad_bias if want_bias else None
    return tuple(grads)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise NotImplementedError(
        f"{_NAME}: double backward (create_graph=True through the op) is not supported; "
        "compute higher-order gradients with the unfused F.linear + F.cross_entropy"
    )


_backward_op.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)


class _FuncForward(torch.autograd.Function):
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


class _FuncBackward(torch.autograd.Function):
    """The backward op under ``torch.func``: first order works, second order is refused."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return torch.ops.chunkce.linear_cross_entropy_backward(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_refuse_double_backward)


def _check_arguments(input, linear_weight, target, linear_bias, weight, reduction,
                     ignore_index, label_smoothing, logits_dtype, chunk_size):
    def fail(kind, message):
        raise kind(f"{_NAME}: {message}")

    for name, value in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(value, Tensor):
            fail(TypeError, f"expected {name} to be a Tensor, got {type(value).__name__}")
    if input.dim() < 2:
        fail(ValueError, f"expected input of shape [N, H] or [B, T, H], got {tuple(input.shape)}")
    if not input.is_floating_point():
        fail(TypeError, f"expected a floating-point input, got {input.dtype}")
    if linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1]:
        fail(ValueError, f"expected linear_weight of shape [V, {input.shape[-1]}], "
                         f"got {tuple(linear_weight.shape)}")
    if linear_weight.dtype != input.dtype and not _autocast_enabled(input.device.type):
        fail(TypeError, f"expected linear_weight of dtype {input.dtype} (the input's), "
                        f"got {linear_weight.dtype}")
    if target.is_floating_point():
        fail(NotImplementedError, "probability (soft) targets are not supported; "
                                  "pass class indices of dtype torch.int64")
    if target.dtype != torch.int64:
        fail(TypeError, f"expected target of dtype torch.int64, got {target.dtype}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        fail(ValueError, f"expected target of shape {tuple(input.shape[:-1])} (input's without "
                         f"the hidden dim), got {tuple(target.shape)}")
    vocab_size = linear_weight.shape[0]
    for name, value in (("linear_bias", linear_bias), ("weight", weight)):
        if value is not None and (not isinstance(value, Tensor) or tuple(value.shape) != (vocab_size,)):
            fail(ValueError, f"expected {name} of shape [{vocab_size}], got "
                             f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
    if weight is not None and not weight.is_floating_point():
        fail(TypeError, f"expected a floating-point weight (class weights), got {weight.dtype}")
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        fail(NotImplementedError, "class weights (weight=) that require grad are not supported: "
                                  "torch's cross_entropy does not differentiate them either; "
                                  "pass weight.detach()")
    for name, value in (("linear_weight", linear_weight), ("target", target),
                        ("linear_bias", linear_bias), ("weight", weight)):
        if value is not None and value.device != input.device:
            fail(ValueError, f"expected {name} on {input.device} (the input's device), got {value.device}")
    if reduction not in _REDUCTIONS:
        fail(ValueError, f"expected reduction in {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        fail(TypeError, f"expected ignore_index to be an int, got {type(ignore_index).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        fail(ValueError, f"expected label_smoothing in [0.0, 1.0], got {label_smoothing}")
    if logits_dtype is not None and (not isinstance(logits_dtype, torch.dtype)
                                     or not logits_dtype.is_floating_point):
        fail(TypeError, f"expected logits_dtype to be a floating torch.dtype, got {logits_dtype!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        fail(ValueError, f"expected chunk_size to be a positive int or None, got {chunk_size!r}")


def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    weight: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logits_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    release_cache: bool | None = None,
) -> Tensor:
    """Cross-entropy of a linear projection, without materializing the logits.

    Exactly (loss and every gradient, up to floating-point summation order)::

        logits = F.linear(input, linear_weight, linear_bias).to(logits_dtype)
        F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=weight,
                        reduction=reduction, ignore_index=ignore_index,
                        label_smoothing=label_smoothing)  # "none": shaped like target

    The argument names are those of torch 2.13's
    ``torch.nn.functional.linear_cross_entropy``. The logits are computed
    ``chunk_size`` tokens at a time in the projection's dtype, rounded to
    ``logits_dtype``, and reduced with an fp32 log-sum-exp; backward recomputes
    each chunk (formulas in :mod:`compile_pass.kernels`) and accumulates the
    weight and bias gradients in fp32.

    Args:
        input: hidden states ``[N, H]`` or ``[B, T, H]`` (any leading dims),
            floating dtype.
        linear_weight: the lm_head weight ``[V, H]``, same dtype as ``input``.
        target: class indices, int64, ``input.shape[:-1]``.
        linear_bias: ``[V]`` or None.
        weight: class weights ``[V]`` (floating) or None; not differentiated,
            as in ``F.cross_entropy``.
        reduction: ``"mean"`` (sum over tokens divided by the number of
            non-ignored tokens, or by the sum of their class weights; nan when
            every token is ignored), ``"sum"`` or ``"none"``.
        ignore_index: target value that contributes neither loss nor gradient.
        label_smoothing: in ``[0, 1]``, as in ``F.cross_entropy``.
        logits_dtype: dtype the logits are cast to before the loss (e.g.
            ``torch.float32`` for HF's ``logits.float()``); None = the
            projection's dtype. Under ``torch.autocast`` the projection runs in
            the autocast dtype and the loss in fp32, as torch's autocast does.
        chunk_size: tokens per chunk; None = ``CHUNKCE_CHUNK_SIZE`` or
            :func:`compile_pass.chunking.choose_chunk_size`.
        release_cache: empty the device allocator's cache after forward and
            backward; None = ``CHUNKCE_RELEASE_CACHE``. Read at run time.

    Returns:
        The loss: a 0-d tensor, or ``target``-shaped for ``"none"``, in
        ``logits_dtype``.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype or shape
            (the message names it).
        NotImplementedError: probability (floating) targets; double backward.
    """
    _check_arguments(input, linear_weight, target, linear_bias, weight, reduction,
                     ignore_index, label_smoothing, logits_dtype, chunk_size)
    device_type = input.device.type
    if _autocast_enabled(device_type):
        autocast_dtype = torch.get_autocast_dtype(device_type)
        input, linear_weight = input.to(autocast_dtype), linear_weight.to(autocast_dtype)
        linear_bias = None if linear_bias is None else linear_bias.to(autocast_dtype)
        logits_dtype = logits_dtype or torch.float32
    logits_dtype = logits_dtype or input.dtype
    hidden_states = input.reshape(-1, input.shape[-1])  # [N, H]
    flat_target = target.reshape(-1)  # [N]
    forward_op = (_FuncForward.apply if torch._C._are_functorch_transforms_active()
                  else torch.ops.chunkce.linear_cross_entropy)
    loss, _lse = forward_op(
        hidden_states, linear_weight, flat_target, linear_bias, weight,
        ignore_index, float(label_smoothing), logits_dtype, chunk_size or 0, release_cache,
    )  # [N] each, fp32 (fp64 for fp64 logits)
    if reduction == "none":
        return loss.view(target.shape).to(logits_dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits_dtype)
    valid = flat_target != ignore_index
    if weight is None:
        denominator = valid.sum()
    else:
        denominator = (weight.to(loss.dtype)[flat_target.masked_fill(~valid, 0)] * valid).sum()
    return (total / denominator).to(logits_dtype)
