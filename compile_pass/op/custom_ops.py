"""The two custom ops behind :func:`compile_pass.linear_cross_entropy`, and their autograd.

``chunkce::linear_cross_entropy`` loops over token chunks: project one chunk
(``[n, V]`` logits, freed before the next), then the per-chunk kernel of
:mod:`compile_pass.op.kernels` gives its per-token loss and fp32 log-sum-exp. It
returns ``loss [N]`` and ``lse [N]``. Autograd saves only its inputs and ``lse``.

``chunkce::linear_cross_entropy_backward`` recomputes each chunk's logits and
applies the analytic gradient (formulas in :mod:`compile_pass.op.kernels`); being a
custom op itself, AOTAutograd traces the backward graph with it as one node, and
its own autograd refuses double backward. No autograd graph is built inside
either op and ``torch.func`` is not used, so both run under any saved-tensor
hooks and activation checkpointing. While a ``torch.func`` transform is active
(never while tracing), the same forward and backward run through two thin
``autograd.Function`` adapters, which ``torch.func`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass.op import kernels
from compile_pass.op.chunking import VOCAB_BLOCKS, choose_chunk_size, min_chunk_bytes_for
from compile_pass.op.settings import settings

NAME = "chunkce.linear_cross_entropy"


@dataclass(frozen=True)
class _ChunkPlan:
    """What one call of either op needs besides its tensors."""

    label_smoothing: float
    logits_dtype: torch.dtype
    chunk_size: int  # tokens per chunk, resolved
    eager_kernels: bool
    release_cache: bool

    @staticmethod
    def resolve(hidden_states, weight, label_smoothing, logits_dtype,
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
    torch._assert_async(in_range.all(), f"{NAME}: expected every target in [0, {vocab_size}) "
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
    plan = _ChunkPlan.resolve(hidden_states, weight, label_smoothing,
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
    plan = _ChunkPlan.resolve(hidden_states, weight, label_smoothing,
                              logits_dtype, chunk_size, release_cache)
    want_hidden, want_weight, want_bias = output_mask
    want_bias = want_bias and bias is not None
    num_tokens, hidden_size = hidden_states.shape
    vocab_size = weight.shape[0]
    accumulate = kernels.accumulate_dtype(weight.dtype)
    blocks = VOCAB_BLOCKS if accumulate != weight.dtype and num_tokens > plan.chunk_size else 1
    block_size = -(-vocab_size // blocks)
    token_chunks = list(plan.chunks(num_tokens, plan.chunk_size * blocks))  # same logits bytes a chunk

    def new_buffer(wanted, *shape, like, dtype=None, accumulates=True):
        """Zeros where chunks add into it (or no chunk runs); uninitialised where ``out=`` fills it."""
        if not wanted:
            return like.new_empty(0)
        make = like.new_zeros if accumulates or not token_chunks else like.new_empty
        return make(*shape, dtype=dtype or like.dtype)

    grad_hidden = new_buffer(want_hidden, num_tokens, hidden_size, like=hidden_states,
                             dtype=kernels.accumulate_dtype(hidden_states.dtype) if blocks > 1 else None,
                             accumulates=blocks > 1)
    grad_weight = new_buffer(want_weight, vocab_size, hidden_size, like=weight,
                             accumulates=len(token_chunks) > 1 and accumulate == weight.dtype)
    grad_bias = new_buffer(want_bias, vocab_size, like=weight, dtype=accumulate)
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
    backward_op = (FunctorchBackward.apply if torch._C._are_functorch_transforms_active()
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
