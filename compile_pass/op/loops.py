"""The chunk loops of the three custom ops, and what each op's body runs around them.

:func:`chunked_forward` walks the tiles of :func:`compile_pass.op.chunking.resolve_tiles`:
for each token chunk, each vocabulary block's ``[n, Vb]`` logits are projected into one
tile buffer and the per-tile kernel of :mod:`compile_pass.op.kernels` carries the
row's log-sum-exp on to the next block. :func:`chunked_backward` walks the plan of
:func:`compile_pass.op.chunking.plan_backward`: it recomputes each tile's logits,
turns them into their gradient in place and multiplies that into the gradient buffers.
:func:`chunked_grads_in_forward` does both in one walk over whole rows (the
grads-in-forward op).
They run inside the ops' bodies (no autograd graph is built here), within
:func:`op_body`: the call's :class:`~compile_pass.op.schema.ChunkPlan`, the target
check, autocast off, the allocator cache released after.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from compile_pass.op import kernels
from compile_pass.op.chunking import plan_backward, spans
from compile_pass.op.schema import NAME, ChunkPlan, OpOptions


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled`` for device types that have autocast (not e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def release_cache(device: torch.device, enabled: bool) -> None:
    """Return cached allocator blocks to the device (no-op on CPU or when disabled)."""
    if enabled and device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def _assert_targets_in_range(target: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise (CPU) or device-assert (accelerators: no host sync) on a target outside
    ``[0, V)`` that is not ``ignore_index``, before any kernel indexes with it."""
    in_range = ((target >= 0) & (target < vocab_size)) | (target == ignore_index)
    ignored = "" if ignore_index == torch.iinfo(torch.int64).min else f" or equal to ignore_index ({ignore_index})"
    # (int64's minimum: no target is ignored, the graph pass's gather spelling)
    torch._assert_async(in_range.all(), f"{NAME}: expected every target in [0, {vocab_size}){ignored}")


@contextlib.contextmanager
def op_body(hidden_states: Tensor, weight: Tensor, options: OpOptions,
            target: Tensor | None = None, whole_rows: bool = False) -> Iterator[ChunkPlan]:
    """What every op's body runs around its chunk loop: yields the call's plan
    (:meth:`ChunkPlan.resolve` of ``hidden_states [N, H]``, ``weight [V, H]`` and the
    options; tiles of whole rows with ``whole_rows``); first checks ``target [N]`` when given (the forward ops: every target in
    ``[0, V)`` or ignored); runs the loop with autocast off (the inputs are already in
    the dtypes the op computes in); then, when the loop returned, releases the
    allocator's cache if the plan says so (:func:`release_cache`).

    Raises:
        ValueError: a ``CHUNKCE_*`` variable holds a bad value.
        RuntimeError: (CPU) a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    plan = ChunkPlan.resolve(hidden_states, weight, options, whole_rows)
    if target is not None:
        _assert_targets_in_range(target, weight.shape[0], options.ignore_index)
    device = hidden_states.device
    autocast_off = (torch.autocast(device.type, enabled=False) if autocast_enabled(device.type)
                    else contextlib.nullcontext())
    with autocast_off:
        yield plan
    release_cache(device, plan.release_cache)


def _dense(tensor: Tensor | None) -> Tensor | None:
    """A copy of stride 1 of a strided or expanded ``[N]`` / ``[V]`` tensor (``target``,
    ``class_weight``, the ``grad_loss`` of a ``sum``, which is expanded from a scalar);
    the tensor itself when its stride is already 1. The kernels then always see one stride
    pattern, and a new reduction or layout does not recompile them."""
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


def _forward_kernel(plan: ChunkPlan, logits_chunk: Tensor, target: Tensor, class_weight: Tensor | None,
                    state: tuple, vocab_start: int) -> tuple[Tensor, ...]:
    """``kernels.chunk_forward`` of one tile: ``(loss, row_max, row_log_sum, *state)``, ``[n]``
    each in ``kernels.accumulate_dtype(plan.options.logits_dtype)``, from ``logits_chunk [n, Vb]``
    (projection dtype; the vocabulary columns ``[vocab_start, vocab_start + Vb)``),
    ``target [n]`` int64, ``class_weight [V]`` or None and the state of the
    row's earlier blocks (``kernels.initial_state`` for the first); after a row's last
    block, the loss and the row statistics are the whole row's. The plan's constants
    (smoothing, transform, dtypes) go to the kernel as one record (``plan.kernel_args``)."""
    loss, row_max, row_log_sum, *state = kernels.run(
        "chunk_forward", plan.variant(logits_chunk, class_weight), plan.eager_kernels,
        logits_chunk, target, class_weight, *state, plan.kernel_args(vocab_start),
    )
    return loss, row_max, row_log_sum, (row_max, *state)


def _backward_kernel(plan: ChunkPlan, logits_chunk: Tensor, row_max: Tensor, row_log_sum: Tensor,
                     target: Tensor, class_weight: Tensor | None, grad_loss: Tensor, vocab_start: int) -> Tensor:
    """``kernels.chunk_backward`` of one block: the gradient ``[n, Vb]`` (projection dtype)
    w.r.t. ``logits_chunk [n, Vb]``, the vocabulary columns ``[vocab_start, vocab_start + Vb)``;
    ``grad_loss [n]``, and the forward kernel's ``row_max [n]`` and
    ``row_log_sum [n]`` of the whole rows, fp32 (fp64 for fp64).

    The gradient is written into ``logits_chunk`` (which is returned): the chunk's
    logits are consumed, and a chunk costs one ``[n, Vb]`` buffer, not two."""
    kernels.run(
        "chunk_backward", plan.variant(logits_chunk, class_weight), plan.eager_kernels,
        logits_chunk, row_max, row_log_sum, target, class_weight, grad_loss, plan.kernel_args(vocab_start),
    )
    return logits_chunk


def row_statistics(plan: ChunkPlan, buffer: TileBuffer, hidden_chunk: Tensor, weight: Tensor,
                   target: Tensor, bias: Tensor | None, class_weight: Tensor | None,
                   vocab_blocks: list) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One token chunk's walk over its vocabulary blocks: ``loss [n]``, ``row_max [n]``,
    ``row_log_sum [n]`` of the whole rows, and the last block's logits ``[n, Vb]`` (in
    ``buffer``: the whole rows' when there is one block).

    ``hidden_chunk [n, H]``, ``target [n]``; ``weight``, ``bias``, ``class_weight`` whole."""
    accumulate = kernels.accumulate_dtype(plan.options.logits_dtype)
    state = kernels.initial_state(hidden_chunk.shape[0], hidden_chunk.new_empty(0, dtype=accumulate),
                                  plan.kernel_label_smoothing is not None)
    for vocab_start, vocab_end in vocab_blocks:
        bias_block = None if bias is None else bias[vocab_start:vocab_end]  # [Vb]
        logits = buffer.project(hidden_chunk, weight[vocab_start:vocab_end], bias_block)  # [n, Vb]
        loss, row_max, row_log_sum, state = _forward_kernel(plan, logits, target, class_weight, state,
                                                            vocab_start)
    return loss, row_max, row_log_sum, logits


def chunked_forward(plan: ChunkPlan, hidden_states: Tensor, weight: Tensor, target: Tensor,
                    bias: Tensor | None, class_weight: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``loss [N]``, and ``row_max [N]`` and ``row_log_sum [N]`` (the log-sum-exp in
    two parts, :func:`compile_pass.op.kernels.chunk_forward`: what backward needs), in
    ``kernels.accumulate_dtype(plan.options.logits_dtype)``.

    ``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64, ``bias [V]``
    and ``class_weight [V]`` (or None), as the op takes them. Holds one ``[n, Vb]`` tile.
    """
    num_tokens, vocab_size = hidden_states.shape[0], weight.shape[0]
    target, class_weight = _dense(target), _dense(class_weight)
    accumulate = kernels.accumulate_dtype(plan.options.logits_dtype)
    loss, row_max, row_log_sum = (hidden_states.new_empty(num_tokens, dtype=accumulate) for _ in range(3))  # [N]
    vocab_blocks, token_chunks = spans(vocab_size, plan.tiles.vocab_block), spans(num_tokens, plan.tiles.tokens)
    buffer = TileBuffer(hidden_states, token_chunks, vocab_blocks)
    for start, end in token_chunks:
        loss[start:end], row_max[start:end], row_log_sum[start:end], _ = row_statistics(
            plan, buffer, hidden_states[start:end], weight, target[start:end], bias, class_weight,
            vocab_blocks)
    return loss, row_max, row_log_sum


_MIXED_ADDMM_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def has_mixed_addmm(device_type: str, operand_dtype: torch.dtype, accumulator_dtype: torch.dtype) -> bool:
    """Whether ``aten::addmm.dtype_out`` multiplies ``operand_dtype`` operands into an
    ``accumulator_dtype`` buffer on ``device_type``: an explicit rule, decided once.

    The op must have a kernel for the device's dispatch key (CUDA has one; CPU,
    MPS and ``meta`` do not in torch 2.13; ROCm is treated as without it), and the
    dtypes must be the one pair it accepts: half-precision operands into fp32.
    """
    if operand_dtype not in _MIXED_ADDMM_DTYPES or accumulator_dtype != torch.float32:
        return False
    if device_type in ("cpu", "meta"):
        return False
    if device_type == "cuda" and torch.version.hip is not None:
        return False  # ROCm: not verified to have the kernel; the upcast path is always right
    try:
        dispatch_key = torch._C._dispatch_key_for_device(device_type)
    except RuntimeError:  # a device type this torch does not know: no kernel
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", dispatch_key)


def _add_matmul(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """``accumulator += a @ b``, accumulated in the accumulator's dtype.

    For half-precision operands and an fp32 accumulator, ``aten::addmm.dtype_out``
    accumulates in place with no temporary where the device has it
    (:func:`has_mixed_addmm`); elsewhere (CPU, whose half-precision matmul is
    emulated anyway) the operands are upcast and multiplied in the accumulator's
    dtype, so no product is rounded to half precision before it is summed. Errors
    (an out-of-memory error included) propagate and change no state.
    """
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
    """``out (+)= grad_logits @ weight_block`` (``grad_logits [n, Vb]``, ``weight_block
    [Vb, H]``, ``out [n, H]``): ``+=`` where ``out`` sums over the walk, else ``=``.

    For a full-precision head (``out`` in the operands' dtype) the product is summed over
    the vocabulary in pieces of at most :data:`REDUCTION_COLUMNS` columns, each multiplied
    afresh (into ``out`` itself for the first piece of a walk that does not sum, else into
    ``scratch [>= n, H]``) and then added to ``out``: never accumulated by the BLAS onto a
    loaded ``out`` (``addmm_``), nor over a long row by a small-``n`` product. Both sum
    every term onto an accumulator that already holds the target's ``-w_y`` term, and CPU
    BLAS (MKL) then rounds each term at that magnitude: with 8-token chunks at V 151936,
    H 16, the hidden-state gradient had 2.1x torch's error against fp64 (1.3e-6 against
    6.0e-7, ``docs/op.md``: "Accuracy over many vocabulary blocks"). Summed in fresh pieces of
    at most 4096 columns it had 0.5-0.7x. A half-precision head's product is accumulated
    in fp32 as :func:`_add_matmul` does (its own rounding dominates there).
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
    """``out`` is in the operands' dtype and that is a full-precision one (fp32, fp64): a
    half-precision product is rounded once, from fp32, as one product."""
    return out.dtype == grad_logits.dtype and kernels.accumulate_dtype(out.dtype) == out.dtype


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


def chunked_backward(plan: ChunkPlan, grad_loss: Tensor, hidden_states: Tensor, weight: Tensor,
                     target: Tensor, bias: Tensor | None, class_weight: Tensor | None, row_max: Tensor,
                     row_log_sum: Tensor, output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """``grad_hidden_states [N, H]``, ``grad_weight [V, H]``, ``grad_bias [V]``, each in
    its parameter's dtype; one that ``output_mask`` (``[hidden, weight, bias]``) does
    not ask for is an empty tensor and costs no work.

    ``grad_loss [N]``, ``row_max [N]`` and ``row_log_sum [N]`` (:func:`chunked_forward`'s)
    are fp32 (fp64 for fp64); the other tensors are as :func:`chunked_forward` takes them.
    """
    (num_tokens, hidden_size), vocab_size = hidden_states.shape, weight.shape[0]
    target, class_weight, grad_loss = _dense(target), _dense(class_weight), _dense(grad_loss)
    walk = plan_backward(num_tokens, vocab_size, plan.tiles, hidden_states.dtype,
                         weight.dtype, output_mask, bias is not None)
    buffer = TileBuffer(hidden_states, walk.token_chunks, walk.vocab_blocks)
    grad_hidden = _gradient_buffer(walk.want_hidden, hidden_states, (num_tokens, hidden_size),
                                   walk.grad_hidden_dtype, walk.zero_grad_hidden)  # [N, H]
    grad_weight = _gradient_buffer(walk.want_weight, weight, (vocab_size, hidden_size),
                                   weight.dtype, walk.zero_grad_weight)  # [V, H]
    grad_bias = _gradient_buffer(walk.want_bias, weight, (vocab_size,),
                                 walk.accumulate_dtype, zeroed=True)  # [V]
    scratch = _product_scratch(grad_hidden, hidden_states, walk.token_chunks, hidden_size)  # [n, H]
    # The forward's row statistics are of whole rows, so a vocabulary block's probabilities
    # round as torch's log-softmax does, and no row is reduced again here.
    for vocab_start, vocab_end in walk.vocab_blocks:
        weight_block = weight[vocab_start:vocab_end]  # [Vb, H]
        bias_block = None if bias is None else bias[vocab_start:vocab_end]  # [Vb]
        grad_weight_block = None  # [Vb, H]: the block's sum over token chunks
        if walk.weight_block_accumulator:
            grad_weight_block = weight_block.new_zeros(weight_block.shape, dtype=walk.accumulate_dtype)
        elif walk.want_weight:
            grad_weight_block = grad_weight[vocab_start:vocab_end]
        for start, end in walk.token_chunks:
            hidden_chunk = hidden_states[start:end]  # [n, H]
            logits_chunk = buffer.project(hidden_chunk, weight_block, bias_block)  # [n, Vb]
            grad_logits = _backward_kernel(plan, logits_chunk, row_max[start:end], row_log_sum[start:end],
                                           target[start:end], class_weight, grad_loss[start:end],
                                           vocab_start)  # [n, Vb] projection dtype, in place
            del logits_chunk
            if walk.want_hidden:
                _add_vocabulary_products(grad_hidden[start:end], grad_logits, weight_block, scratch,
                                         walk.hidden_sums)
            if walk.want_weight:  # as F.linear's backward
                _matmul_into(grad_weight_block, grad_logits.t(), hidden_chunk, walk.weight_sums)
            if walk.want_bias:
                grad_bias[vocab_start:vocab_end] += grad_logits.sum(0, dtype=walk.accumulate_dtype)
            del grad_logits
        if walk.weight_block_accumulator:
            grad_weight[vocab_start:vocab_end] = grad_weight_block
        del grad_weight_block
    if walk.want_hidden:
        grad_hidden = grad_hidden.to(hidden_states.dtype)
    if walk.want_bias:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def chunked_grads_in_forward(plan: ChunkPlan, hidden_states: Tensor, weight: Tensor, target: Tensor,
                             bias: Tensor | None, class_weight: Tensor | None,
                             output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop over whole rows (``plan.tiles`` of ``Vb = V``: a row's gradient needs the
    whole row's statistics, computed in the same walk): ``total`` (0-d),
    ``grad_hidden_states [N, H]``, ``grad_weight [V, H]``, ``grad_bias [V]`` of
    ``total = sum_i loss_i``, and ``counted [N]`` bool: the tokens that are not ignored.

    ``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64, ``bias [V]`` and
    ``class_weight [V]`` (or None), as :func:`compile_pass.op.loops.chunked_forward` takes
    them. ``total`` is in ``kernels.accumulate_dtype(plan.options.logits_dtype)``, summed as the
    recompute path sums its per-token losses (``loss[N].sum()``). A gradient that
    ``output_mask`` (``[hidden, weight, bias]``) does not ask for is an empty ``[0]``
    tensor and costs no work; ``grad_hidden_states`` is in its dtype, ``grad_weight`` and
    ``grad_bias`` in ``kernels.accumulate_dtype(weight.dtype)`` (fp32 for a half-precision
    head: backward rounds them to the parameter's dtype once, after the upstream gradient).
    """
    (num_tokens, hidden_size), vocab_size = hidden_states.shape, weight.shape[0]
    want_hidden, want_weight, want_bias = output_mask
    want_bias = want_bias and bias is not None
    target, class_weight = _dense(target), _dense(class_weight)
    accumulate = kernels.accumulate_dtype(plan.options.logits_dtype)
    weight_accumulate = kernels.accumulate_dtype(weight.dtype)
    loss = hidden_states.new_empty(num_tokens, dtype=accumulate)  # [N]
    ones = hidden_states.new_ones(num_tokens, dtype=accumulate)  # [N] d total / d loss_i
    chunks = spans(num_tokens, plan.tiles.tokens)
    vocab_blocks = spans(vocab_size, plan.tiles.vocab_block)
    assert len(vocab_blocks) <= 1, "the grads-in-forward op walks whole rows"
    buffer = TileBuffer(hidden_states, chunks, vocab_blocks)
    # the weight gradient sums one product per chunk, or is a half-precision weight's: then it
    # sums in (and is returned in) an fp32 accumulator, rounded once in backward, after the
    # upstream gradient (rounded now and again then, it had 1.7x the unfused path's bf16 error)
    sums = len(chunks) > 1 or weight_accumulate != weight.dtype
    grad_hidden = _gradient_buffer(want_hidden, hidden_states, (num_tokens, hidden_size),
                                   hidden_states.dtype, zeroed=False)  # [N, H]: out= fills each chunk
    grad_weight = _gradient_buffer(want_weight, weight, (vocab_size, hidden_size), weight_accumulate,
                                   zeroed=sums or not chunks)  # [V, H]: one product is written by out=
    grad_bias = _gradient_buffer(want_bias, weight, (vocab_size,), weight_accumulate, zeroed=True)  # [V]
    scratch = _product_scratch(grad_hidden, hidden_states, chunks, hidden_size)  # [n, H]
    for start, end in chunks:
        hidden_chunk = hidden_states[start:end]  # [n, H]
        loss[start:end], row_max, row_log_sum, logits_chunk = row_statistics(
            plan, buffer, hidden_chunk, weight, target[start:end], bias, class_weight, vocab_blocks)  # [n, V]
        if want_hidden or want_weight or want_bias:
            grad_logits = _backward_kernel(plan, logits_chunk, row_max, row_log_sum, target[start:end],
                                           class_weight, ones[start:end], 0)  # [n, V]
            del logits_chunk  # grad_logits is the same buffer, overwritten: one [n, V] a chunk
            if want_hidden:
                _add_vocabulary_products(grad_hidden[start:end], grad_logits, weight, scratch, sums=False)
            if want_weight:  # as F.linear's backward
                _matmul_into(grad_weight, grad_logits.t(), hidden_chunk, sums)
            if want_bias:
                grad_bias += grad_logits.sum(0, dtype=weight_accumulate)
            del grad_logits
    counted = target != plan.options.ignore_index  # [N] bool
    return loss.sum(), grad_hidden, grad_weight, grad_bias, counted
