"""The gradient products of the two backward loops, and how each is accumulated.

The recompute op's backward (:func:`compile_pass.op.loops.chunked_backward`) and the
grads-in-forward op's loop (:func:`compile_pass.op.grads_in_forward.chunked_grads_in_forward`)
multiply each tile's ``grad_logits [n, Vb]`` into the gradients: ``grad_logits @ weight_block``
into the hidden states' (:func:`_add_vocabulary_products`, summed over the vocabulary in
pieces of at most :data:`REDUCTION_COLUMNS` columns for a full-precision head) and
``grad_logits.T @ hidden_chunk`` into the weight's (:func:`_matmul_into`). A half-precision
head's products are accumulated in fp32 (:func:`_add_matmul`; ``aten::addmm.dtype_out``
where the device has it, :func:`has_mixed_addmm`). The gradients' buffers:
:func:`_gradient_buffer`, and the scratch of the hidden-state product's pieces:
:func:`_product_scratch`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from compile_pass.op import kernels
from compile_pass.op.chunking import spans

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
