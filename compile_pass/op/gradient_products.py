"""The backward loops' products of ``grad_logits [n, Vb]`` into the gradients, and how each
is accumulated (a half-precision head's in fp32; docs/op.md, "Backward").
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op.dtypes import accumulate_dtype
from compile_pass.op.chunking import spans

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
