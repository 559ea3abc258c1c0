"""The walks over the tiles every op shares, the threads that run them, and the loss op's loops.

The recompute ops' two walks (:func:`forward_walk`, :func:`backward_walk`), split over the
walk threads on CPU (:mod:`compile_pass.op.kernel_runner`: docs/op.md, "Walk threads"), and
what every op's body runs around its walk (:func:`op_body`). :func:`chunked_forward` projects
each ``[n, Vb]`` tile into its part's buffer and carries the row's log-sum-exp across vocabulary
blocks; :func:`chunked_backward` recomputes each tile, turns it into its gradient in place and
multiplies that into the gradient buffers. Walk: docs/op.md, "Forward" and "Backward (recompute)".
The backward's products of ``grad_logits [n, Vb]`` into the gradients, and how each is
accumulated (a half-precision head's in fp32; docs/op.md, "Backward"). :func:`reduce_total`: the
summed loss reduced as ``F.cross_entropy`` reduces it, shared by the single-device loss and the
vocabulary-parallel one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import kernel_runner, kernels
from compile_pass.op.schema import LOSS_NAME, ResolvedCall
from compile_pass.op.tiling import accumulate_dtype, plan_backward, spans

_assert_async = internals.assert_async.get()  # checks a range with no host sync


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled`` for device types that have autocast (not e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def release_cache(device: torch.device, enabled: bool) -> None:
    """Return cached allocator blocks to the device (no-op on CPU or when disabled)."""
    if enabled and device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def _assert_targets_in_range(target: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise (CPU) or device-assert (no host sync) on a target outside ``[0, V)`` that is not
    ``ignore_index``."""
    in_range = ((target >= 0) & (target < vocab_size)) | (target == ignore_index)
    ignored = "" if ignore_index == torch.iinfo(torch.int64).min else f" or equal to ignore_index ({ignore_index})"
    # (int64's minimum: no target is ignored, the graph pass's gather spelling)
    _assert_async(in_range.all(), f"{LOSS_NAME}: expected every target in [0, {vocab_size}){ignored}")


@contextlib.contextmanager
def op_body(hidden_states: Tensor, weight: Tensor, scale_tensor: Tensor | None, options: Mapping[str, Any],
            target: Tensor | None = None, **placement: Any) -> Iterator[ResolvedCall]:
    """Around an op body's chunk loop: yields the call's :class:`ResolvedCall` (``placement``: the
    keywords of :meth:`ResolvedCall.resolve`), after checking ``target [N]`` when given; runs the loop
    with autocast off; then applies ``CHUNKCE_RELEASE_CACHE`` (:func:`release_cache`).

    Raises:
        ValueError: a ``CHUNKCE_*`` variable holds a bad value.
        RuntimeError: (CPU) a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    op_call = ResolvedCall.resolve(hidden_states, weight, scale_tensor, options, **placement)
    if target is not None:
        _assert_targets_in_range(target, weight.shape[0], op_call.options["ignore_index"])
    device = hidden_states.device
    autocast_off = (torch.autocast(device.type, enabled=False) if autocast_enabled(device.type)
                    else contextlib.nullcontext())
    with autocast_off:
        yield op_call
    release_cache(device, op_call.release_cache)


def dense_vector(tensor: Tensor | None) -> Tensor | None:
    """``tensor`` with stride 1 (a copy where it is strided or expanded, as a ``sum``'s
    ``grad_loss``): the kernels see one stride pattern and do not recompile."""
    if tensor is None or tensor.stride(0) == 1:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)  # [1] of stride 0 too


class TileBuffer:
    """One ``[n, Vb]`` buffer for every tile of a call, in the projection dtype: each tile's
    logits are projected into it (``out=``), so a walk allocates its largest tile once."""

    def __init__(self, like: Tensor, token_chunks, vocab_blocks):
        def widest(pieces) -> int:
            return max((end - start for start, end in pieces), default=0)

        self.storage = like.new_empty(widest(token_chunks) * widest(vocab_blocks))

    def project(self, hidden_chunk: Tensor, weight_block: Tensor, bias_block: Tensor | None) -> Tensor:
        """Logits of one tile ``[n, Vb]`` (``hidden_chunk [n, H]``, ``weight_block [Vb, H]``,
        ``bias_block [Vb]`` or None), as ``F.linear`` computes them, in the buffer."""
        rows, columns = hidden_chunk.shape[0], weight_block.shape[0]
        logits = self.storage[:rows * columns].view(rows, columns)
        if bias_block is None:
            return torch.mm(hidden_chunk, weight_block.t(), out=logits)
        return torch.addmm(bias_block, hidden_chunk, weight_block.t(), out=logits)


def _forward_kernel(op_call: ResolvedCall, logits_chunk: Tensor, target: Tensor, class_weight: Tensor | None,
                    rows: tuple, vocab_start: int) -> None:
    """``kernels.chunk_forward`` of one tile ``logits_chunk [n, Vb]`` (columns from
    ``vocab_start``) on ``rows``, a :class:`kernels.ForwardState`'s rows, updated in place."""
    kernel_runner.run(
        "chunk_forward", op_call.variant(logits_chunk, class_weight), op_call.eager_kernels,
        logits_chunk, target, class_weight, *rows, op_call.kernel_args(vocab_start),
    )


def _backward_kernel(op_call: ResolvedCall, logits_chunk: Tensor, row_max: Tensor, row_log_sum: Tensor,
                     target: Tensor, class_weight: Tensor | None, grad_loss: Tensor, vocab_start: int) -> Tensor:
    """``kernels.chunk_backward`` of one tile: the gradient w.r.t. ``logits_chunk [n, Vb]``,
    written into it (returned), from ``grad_loss [n]`` and the whole rows' statistics."""
    kernel_runner.run(
        "chunk_backward", op_call.variant(logits_chunk, class_weight), op_call.eager_kernels,
        logits_chunk, row_max, row_log_sum, target, class_weight, grad_loss, op_call.kernel_args(vocab_start),
    )
    return logits_chunk


def walk_buffers(op_call: ResolvedCall, like: Tensor, num_tokens: int) -> kernels.ForwardState:
    """The forward walk's ``[N]`` buffers (:func:`kernels.forward_state`) in the accumulate dtype."""
    accumulate = accumulate_dtype(op_call.options["logits_dtype"])
    return kernels.forward_state(num_tokens, like.new_empty(0, dtype=accumulate),
                                 op_call.kernel_label_smoothing is not None)


def walk_token_chunk(op_call: ResolvedCall, buffer: TileBuffer, state: kernels.ForwardState, start: int, end: int,
                     hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                     class_weight: Tensor | None, vocab_blocks: list) -> Tensor:
    """The token chunk ``[start, end)``'s walk over its vocabulary blocks: writes the whole rows'
    ``loss``, ``row_max`` and ``row_log_sum`` into ``state`` (:func:`walk_buffers`); returns the
    last block's logits ``[n, Vb]`` (in ``buffer``)."""
    rows, hidden_chunk, target = state.rows(start, end), hidden_states[start:end], target[start:end]
    for vocab_start, vocab_end in vocab_blocks:
        bias_block = None if bias is None else bias[vocab_start:vocab_end]  # [Vb]
        logits = buffer.project(hidden_chunk, weight[vocab_start:vocab_end], bias_block)  # [n, Vb]
        _forward_kernel(op_call, logits, target, class_weight, rows, vocab_start)
    return logits


def forward_walk(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                 tile_kernel: Callable[[Tensor, int, int, int], None]) -> None:
    """The forward walk every recompute op shares: each token chunk ``[start, end)`` over every
    vocabulary block in order, ``tile_kernel(logits [n, Vb], start, end, vocab_start)`` on each
    projected tile (it writes its rows of the walk's ``[N]`` buffers). The token chunks are split
    over the walk threads (:func:`~compile_pass.op.kernel_runner.split`, :func:`~compile_pass.op.kernel_runner.run_parts`); each part holds one tile, allocated here."""
    vocab_blocks = spans(weight.shape[0], op_call.tiles.vocab_block)
    parts = kernel_runner.split(op_call, spans(hidden_states.shape[0], op_call.tiles.tokens))
    buffers = [TileBuffer(hidden_states, token_chunks, vocab_blocks) for token_chunks in parts]

    def walk_chunks(part: int) -> None:
        for start, end in parts[part]:
            hidden_chunk = hidden_states[start:end]  # [n, H]
            for vocab_start, vocab_end in vocab_blocks:
                bias_block = None if bias is None else bias[vocab_start:vocab_end]  # [Vb]
                logits = buffers[part].project(hidden_chunk, weight[vocab_start:vocab_end], bias_block)  # [n, Vb]
                tile_kernel(logits, start, end, vocab_start)

    kernel_runner.run_parts(op_call, walk_chunks, len(parts))


def chunked_forward(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, target: Tensor,
                    bias: Tensor | None, class_weight: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``loss [N]``, ``row_max [N]`` and ``row_log_sum [N]`` in the accumulate dtype,
    from the op's tensors (``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64,
    ``bias`` / ``class_weight`` ``[V]`` or None): :func:`forward_walk`, each tile's kernel writing
    straight into the ``[N]`` buffers."""
    target, class_weight = dense_vector(target), dense_vector(class_weight)
    state = walk_buffers(op_call, hidden_states, hidden_states.shape[0])

    def tile_kernel(logits: Tensor, start: int, end: int, vocab_start: int) -> None:
        _forward_kernel(op_call, logits, target[start:end], class_weight, state.rows(start, end), vocab_start)

    forward_walk(op_call, hidden_states, weight, bias, tile_kernel)
    return state.loss, state.row_max, state.row_log_sum


def chunked_backward(op_call: ResolvedCall, grad_loss: Tensor, hidden_states: Tensor, weight: Tensor,
                     target: Tensor, bias: Tensor | None, class_weight: Tensor | None, row_max: Tensor,
                     row_log_sum: Tensor, output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """``grad_hidden_states [N, H]``, ``grad_weight [V, H]``, ``grad_bias [V]`` in their
    parameters' dtypes (empty where ``output_mask`` does not ask), from ``grad_loss [N]`` and
    :func:`chunked_forward`'s row statistics of whole rows."""
    target, class_weight, grad_loss = dense_vector(target), dense_vector(class_weight), dense_vector(grad_loss)

    def tile_gradient(logits_chunk: Tensor, start: int, end: int, vocab_start: int) -> Tensor:
        return _backward_kernel(op_call, logits_chunk, row_max[start:end], row_log_sum[start:end],
                                target[start:end], class_weight, grad_loss[start:end], vocab_start)

    return backward_walk(op_call, hidden_states, weight, bias, output_mask, tile_gradient)


def backward_walk(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                  output_mask: list[bool], tile_gradient) -> tuple[Tensor, Tensor, Tensor]:
    """The backward walk every recompute op shares (:func:`compile_pass.op.tiling.plan_backward`):
    ``tile_gradient(logits, start, end, vocab_start)`` turns each projected tile into its gradient
    in place, which is multiplied into the three gradients (as :func:`chunked_backward` returns them).

    The vocabulary blocks are split over the walk threads (:func:`~compile_pass.op.kernel_runner.run_parts`): a block's weight and
    bias gradient rows are one part's; the hidden-state gradient is summed over the parts, each
    part's own ``[N, H]`` sum (the first part's in the returned buffer) added in part order, so the
    result does not depend on timing. Parts beyond the first hold ``[N, H]`` each: no more of them
    than :data:`MAX_PART_BYTES` allows; with no room for one, the walk runs as one thread would.
    Every buffer is allocated here, on the caller's thread."""
    (num_tokens, hidden_size), vocab_size = hidden_states.shape, weight.shape[0]
    walk = plan_backward(num_tokens, vocab_size, op_call.tiles, hidden_states.dtype,
                         weight.dtype, output_mask, bias is not None)
    grad_hidden = _gradient_buffer(walk.want_hidden, hidden_states, (num_tokens, hidden_size),
                                   walk.grad_hidden_dtype, walk.zero_grad_hidden)  # [N, H]
    grad_weight = _gradient_buffer(walk.want_weight, weight, (vocab_size, hidden_size),
                                   weight.dtype, walk.zero_grad_weight)  # [V, H]
    grad_bias = _gradient_buffer(walk.want_bias, weight, (vocab_size,),
                                 walk.accumulate_dtype, zeroed=True)  # [V]

    extra_parts = MAX_PART_BYTES // max(1, grad_hidden.numel() * grad_hidden.element_size())
    parts = kernel_runner.split(op_call, walk.vocab_blocks, parts=1 + extra_parts)
    whole = len(parts) == 1 and len(walk.vocab_blocks) > 1  # no room for a part's sum: as one thread
    buffers = [TileBuffer(hidden_states, walk.token_chunks, vocab_blocks) for vocab_blocks in parts]
    part_hidden = [grad_hidden, *(_gradient_buffer(walk.want_hidden, hidden_states, grad_hidden.shape,
                                                   grad_hidden.dtype, walk.zero_grad_hidden) for _ in parts[1:])]
    scratch = [_product_scratch(buffer, hidden_states, walk.token_chunks, hidden_size) for buffer in part_hidden]
    accumulators = [None if not walk.weight_block_accumulator else weight.new_empty(
        (max(end - start for start, end in vocab_blocks), hidden_size), dtype=walk.accumulate_dtype)
        for vocab_blocks in parts]  # [Vb, H] each

    def walk_blocks(part: int) -> None:
        for index, (vocab_start, vocab_end) in enumerate(parts[part]):
            _backward_block(walk, buffers[part], scratch[part], part_hidden[part], accumulators[part], grad_weight,
                            grad_bias, hidden_states, weight, bias, vocab_start, vocab_end, index == 0, tile_gradient)

    kernel_runner.run_parts(op_call, walk_blocks, len(parts), whole=whole)
    if walk.want_hidden:
        for part_sum in part_hidden[1:]:
            grad_hidden += part_sum
        grad_hidden = grad_hidden.to(hidden_states.dtype)
    if walk.want_bias:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


MAX_PART_BYTES = 32 * 1024 * 1024  # bytes: the backward's extra [N, H] sums, all parts together


def _backward_block(walk, buffer: TileBuffer, scratch: Tensor, grad_hidden: Tensor, accumulator: Tensor | None,
                    grad_weight: Tensor, grad_bias: Tensor, hidden_states: Tensor, weight: Tensor,
                    bias: Tensor | None, vocab_start: int, vocab_end: int, first: bool, tile_gradient) -> None:
    """One vocabulary block of :func:`backward_walk` over every token chunk in order: its weight
    and bias gradient rows (summed in ``accumulator``'s first ``Vb`` rows where the walk has one),
    and its products added into ``grad_hidden [N, H]`` (written by the part's ``first`` block where
    the walk writes, not adds, the first products)."""
    weight_block = weight[vocab_start:vocab_end]  # [Vb, H]
    hidden_sums = walk.hidden_sums and not (first and walk.hidden_first_written)
    bias_block = None if bias is None else bias[vocab_start:vocab_end]  # [Vb]
    grad_weight_block = None  # [Vb, H]: the block's sum over token chunks
    if walk.weight_block_accumulator:
        grad_weight_block = accumulator[:vocab_end - vocab_start].zero_()
    elif walk.want_weight:
        grad_weight_block = grad_weight[vocab_start:vocab_end]
    for start, end in walk.token_chunks:
        hidden_chunk = hidden_states[start:end]  # [n, H]
        logits_chunk = buffer.project(hidden_chunk, weight_block, bias_block)  # [n, Vb]
        grad_logits = tile_gradient(logits_chunk, start, end, vocab_start)  # [n, Vb], in place
        del logits_chunk
        if walk.want_hidden:
            _add_vocabulary_products(grad_hidden[start:end], grad_logits, weight_block, scratch, hidden_sums)
        if walk.want_weight:  # as F.linear's backward
            _matmul_into(grad_weight_block, grad_logits.t(), hidden_chunk, walk.weight_sums)
        if walk.want_bias:
            grad_bias[vocab_start:vocab_end] += grad_logits.sum(0, dtype=walk.accumulate_dtype)
        del grad_logits
    if walk.weight_block_accumulator:
        grad_weight[vocab_start:vocab_end] = grad_weight_block


_MIXED_ADDMM_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def has_mixed_addmm(device_type: str, operand_dtype: torch.dtype, accumulator_dtype: torch.dtype) -> bool:
    """Whether ``aten::addmm.dtype_out`` multiplies half-precision ``operand_dtype`` operands into
    an fp32 buffer on ``device_type`` (a kernel for its dispatch key; not CPU, meta, ROCm)."""
    if operand_dtype not in _MIXED_ADDMM_DTYPES or accumulator_dtype != torch.float32:
        return False
    if device_type in ("cpu", "meta"):
        return False
    if device_type == "cuda" and torch.version.hip is not None:
        return False  # ROCm: not verified to have the kernel; the upcast path is always right
    try:
        dispatch_key = internals.dispatch_key_for_device(device_type)
    except RuntimeError:  # a device type this torch does not know: no kernel
        return False
    return internals.dispatch_has_kernel("aten::addmm.dtype_out", dispatch_key)


def _add_matmul(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """``accumulator += a @ b`` in the accumulator's dtype (``addmm.dtype_out`` where the device
    has it, else upcast operands): no product is rounded to half precision before the sum."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
    elif has_mixed_addmm(accumulator.device.type, a.dtype, accumulator.dtype):
        torch.ops.aten.addmm.dtype_out(accumulator, a, b, accumulator.dtype, out=accumulator)
    else:
        accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype))


def _matmul_into(out: Tensor, a: Tensor, b: Tensor, sums: bool) -> None:
    """``out += a @ b`` where ``out`` sums over the walk, else ``out = a @ b`` by ``out=``."""
    if sums:
        _add_matmul(out, a, b)
    else:
        torch.mm(a, b, out=out)


REDUCTION_COLUMNS = 4096  # vocabulary columns at most in one product of the hidden-state gradient


def _add_vocabulary_products(out: Tensor, grad_logits: Tensor, weight_block: Tensor, scratch: Tensor,
                             sums: bool) -> None:
    """``out [n, H] (+)= grad_logits [n, Vb] @ weight_block [Vb, H]`` (``+=`` where ``sums``).

    For a full-precision head, summed in fresh products of at most :data:`REDUCTION_COLUMNS`
    columns (via ``scratch``) then added: CPU BLAS accumulating onto a loaded ``out`` had 2.1x
    torch's error (docs/op.md, "Accuracy over many vocabulary blocks").
    """
    if not _full_precision_product(out, grad_logits):
        _matmul_into(out, grad_logits, weight_block, sums)
        return
    rows, columns = grad_logits.shape
    for start, end in spans(columns, REDUCTION_COLUMNS):
        if start == 0 and not sums:
            torch.mm(grad_logits[:, start:end], weight_block[start:end], out=out)
        else:
            product = scratch[:rows]
            torch.mm(grad_logits[:, start:end], weight_block[start:end], out=product)
            out.add_(product)


def _full_precision_product(out: Tensor, grad_logits: Tensor) -> bool:
    """``out`` and the operands share a full-precision dtype (fp32, fp64)."""
    return out.dtype == grad_logits.dtype and accumulate_dtype(out.dtype) == out.dtype


def _product_scratch(grad_hidden: Tensor, like: Tensor, token_chunks, hidden_size: int) -> Tensor:
    """The ``[n, H]`` buffer of :func:`_add_vocabulary_products`' pieces for the widest of
    ``token_chunks`` (empty ``[0]`` when ``grad_hidden`` is not wanted or not full precision)."""
    if grad_hidden.numel() == 0 or not _full_precision_product(grad_hidden, like):
        return grad_hidden.new_empty(0)
    rows = max((end - start for start, end in token_chunks), default=0)
    return grad_hidden.new_empty((rows, hidden_size))


def _gradient_buffer(wanted: bool, like: Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                     zeroed: bool) -> Tensor:
    """A gradient's buffer: empty ``[0]`` when not wanted, zeros when it sums, else uninitialised."""
    if not wanted:
        return like.new_empty(0)
    return (like.new_zeros if zeroed else like.new_empty)(shape, dtype=dtype)


def reduce_total(total: Tensor, flat_target: Tensor, class_weight: Tensor | None, reduction: str,
                 ignore_index: int, label_smoothing: float, logits_dtype: torch.dtype) -> Tensor:
    """The summed loss ``total`` (0-d, fp32 or fp64) reduced as ``F.cross_entropy`` reduces it,
    ``"sum"`` or ``"mean"`` (over the non-ignored targets ``flat_target [N]``, or over their class
    weights ``class_weight [V]``), in ``logits_dtype``."""
    if reduction == "sum":
        return total.to(logits_dtype)
    valid = flat_target != ignore_index  # [N]
    if class_weight is None:
        denominator = valid.sum()
    else:
        class_weight = class_weight.to(accumulate_dtype(logits_dtype))
        denominator = (class_weight[flat_target.masked_fill(~valid, 0)] * valid).sum()
    mean = total / denominator
    if class_weight is not None and label_smoothing > 0.0:
        # torch divides the nll and the smoothing terms by the weight sum separately: with
        # a zero sum its nll's 0 / 0 makes the loss nan, where total / 0 would be inf
        mean = mean + torch.zeros_like(denominator) / denominator  # + 0, or nan when the sum is 0
    return mean.to(logits_dtype)
