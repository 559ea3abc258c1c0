"""Per-row statistics of a linear head's logits, without materializing them.

:func:`linear_statistics` (checked, eager) and :func:`chunked_statistics` (the traceable entry,
every decision made by the caller) call ``chunkce::linear_statistics``
(:mod:`compile_pass.op.statistics_ops`), or, for a vocabulary-sharded weight, the combination of
:mod:`compile_pass.op.statistics_parallel`.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from compile_pass.op import statistics_parallel
from compile_pass.op.checks import check_bool, check_positive_int
from compile_pass.op.dtypes import accumulate_dtype
from compile_pass.op.schema import op_arguments
from compile_pass.op.statistics_ops import NAME
from compile_pass.op.transform import HeadTransform
from compile_pass.op.vocab_parallel import is_dtensor, shard_of, vocabulary_mesh_dim


class RowStatistics(NamedTuple):
    """What :func:`linear_statistics` returns, per row ``i`` of the values ``z [N, V]`` (the
    logits after every transform, in ``statistics_dtype``), each in
    ``accumulate_dtype(statistics_dtype)`` (fp32 for half precision and fp32, fp64 for fp64)."""

    selected: Tensor | None  # [N, K]: z[i, indices[i, k]]; None without indices (differentiable)
    lse: Tensor  # [N]: log sum_c exp(z_ic) (differentiable)
    entropy: Tensor  # [N]: -sum_c p_ic log p_ic, p = softmax(z) (differentiable)
    max: Tensor  # [N]: max_c z_ic (differentiable: the gradient goes to the argmax column, as torch.max(dim))
    argmax: Tensor  # [N] int64: the first column holding the maximum (torch.argmax's rule)


def linear_statistics(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    indices: Tensor | None = None,
    *,
    logits_dtype: torch.dtype | None = None,
    projection_dtype: torch.dtype | None = None,
    transform: HeadTransform = HeadTransform(),
    temperature: float | Tensor | None = None,
    temperature_multiplies: bool = False,
    statistics_dtype: torch.dtype | None = None,
    row_statistics: bool = True,
    maximum_only: bool = False,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
) -> RowStatistics:
    """Row statistics of ``z`` (below) computed tile by tile; the values are, exactly (up to
    floating-point summation order)::

        x = F.linear(hidden_states.to(projection_dtype), weight.to(projection_dtype), bias)  # [N, V]
        z = transform.apply(x).to(logits_dtype)        # the head's own scale, then the logits' dtype
        z = (z / temperature).to(statistics_dtype)     # temperature: a number or a [N] tensor (per row),
                                                       # divided in accumulate_dtype(statistics_dtype);
                                                       # * temperature with temperature_multiplies
        selected = z.gather(-1, indices); lse = z.logsumexp(-1)
        entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1); max, argmax = z.max(-1)

    with ``0 log 0 = 0`` in the entropy and a row holding ``+inf`` or only ``-inf`` as torch's
    (docs/op.md, "Row statistics").

    Args:
        hidden_states: ``[N, H]``, floating.
        weight: ``[V, H]``, or a DTensor ``Shard(0)`` on a 1-D mesh (every rank must call and gets
            the global values); bias: ``[V]`` (sharded as ``weight``) or None.
        indices: ``[N, K]`` int64 in ``[0, V)``, or None.
        logits_dtype: the head's output dtype (None = the projection's); projection_dtype:
            autocast's, the operands cast to it first (None = no cast).
        transform: the head's own scale (:class:`compile_pass.op.transform.HeadTransform`).
        temperature: a number or a ``[N]`` / 0-d floating tensor, never differentiated (None =
            none); ``temperature_multiplies``: multiply instead of divide.
        statistics_dtype: the dtype of ``z``; None = ``logits_dtype``.
        row_statistics: False: only ``selected``, from the gathered weight rows (no vocabulary
            walk); the others empty ``[0]``.
        maximum_only: only ``max`` / ``argmax`` (and ``selected``), no exponential; ``lse`` and
            ``entropy`` empty ``[0]`` (a sharded head computes them all).
        chunk_size, chunk_bytes: the tiles, as :func:`compile_pass.op.function.linear_cross_entropy`.

    Returns:
        :class:`RowStatistics`. Gradients flow to ``hidden_states``, ``weight`` and ``bias`` from
        ``selected``, ``lse``, ``entropy`` and ``max``; a backward recomputes the tiles.

    Raises:
        ValueError / TypeError: an argument of the wrong shape, dtype or type.
        NotImplementedError: a ``temperature`` tensor that requires grad; double backward.
        RuntimeError: (CPU) an index outside ``[0, V)``.
    """
    _check_arguments(hidden_states, weight, bias, indices, temperature, projection_dtype, transform,
                     logits_dtype=logits_dtype, statistics_dtype=statistics_dtype)
    for name, flag in (("temperature_multiplies", temperature_multiplies), ("row_statistics", row_statistics),
                       ("maximum_only", maximum_only)):
        check_bool(name, flag, NAME)
    for name, size in (("chunk_size", chunk_size), ("chunk_bytes", chunk_bytes)):
        check_positive_int(name, size, NAME)
    vocab_parallel = None
    if is_dtensor(weight):
        mesh_dim = vocabulary_mesh_dim(weight, bias, where=NAME, names=("weight", "bias"))
        vocab_parallel = (*shard_of(weight, mesh_dim), weight.shape[0])  # (vocab_start, group_name, V)
        weight, bias = weight.to_local(), None if bias is None else bias.to_local()
    if isinstance(temperature, Tensor) and temperature.dim() == 0:
        temperature = temperature.expand(hidden_states.shape[0])  # [N]
    elif temperature is not None and not isinstance(temperature, Tensor):
        temperature = float(temperature)
    logits_dtype = logits_dtype or projection_dtype or hidden_states.dtype
    return chunked_statistics(
        hidden_states, weight, bias, indices, temperature, projection_dtype=projection_dtype,
        vocab_parallel=vocab_parallel, logits_dtype=logits_dtype, statistics_dtype=statistics_dtype or logits_dtype,
        transform=transform, temperature_multiplies=temperature_multiplies, row_statistics=row_statistics,
        maximum_only=maximum_only, chunk_size=chunk_size, chunk_bytes=chunk_bytes)


def chunked_statistics(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    indices: Tensor | None,
    temperature: float | Tensor | None,
    *,
    logits_dtype: torch.dtype,
    statistics_dtype: torch.dtype,
    transform: HeadTransform | None = None,
    temperature_multiplies: bool = False,
    row_statistics: bool = True,
    maximum_only: bool = False,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    projection_dtype: torch.dtype | None = None,
    vocab_parallel: tuple[int, str, int] | None = None,
) -> RowStatistics:
    """:func:`linear_statistics` after its checks, traceable with FX proxies (as
    :func:`compile_pass.op.function.chunked_cross_entropy`): ``temperature`` a number, a ``[N]``
    tensor or None; ``logits_dtype`` / ``statistics_dtype`` resolved; ``vocab_parallel``:
    ``(vocab_start, group_name, V)`` of a vocabulary shard (``weight`` / ``bias`` this rank's),
    None = the whole head; the others as :func:`linear_statistics` takes them."""
    number = temperature is None or isinstance(temperature, numbers.Real)
    scale_tensor, arguments = op_arguments(
        HeadTransform() if transform is None else transform,  # made here: Dynamo cannot wrap a default's instance
        logits_dtype=logits_dtype, statistics_dtype=statistics_dtype, temperature_value=temperature if number else None,
        temperature_multiplies=temperature_multiplies, row_statistics=row_statistics,
        maximum_only=maximum_only and vocab_parallel is None, chunk_size=chunk_size, chunk_bytes=chunk_bytes)
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    if indices is None and not row_statistics:  # nothing to compute
        empty = hidden_states.new_empty(0, dtype=accumulate_dtype(statistics_dtype))
        return RowStatistics(None, empty, empty, empty, empty.long())
    inputs = (hidden_states, weight, bias, indices, None if number else temperature, scale_tensor)
    if vocab_parallel is None:
        selected, lse, entropy, row_max, argmax, _, _ = torch.ops.chunkce.linear_statistics.default(*inputs, **arguments)
    else:
        vocab_start, group_name, vocab_size = vocab_parallel
        selected, lse, entropy, row_max, argmax = statistics_parallel.vocab_parallel_statistics(
            inputs, {**arguments, "vocab_start": vocab_start, "vocab_size": vocab_size}, group_name)
    return RowStatistics(None if indices is None else selected, lse, entropy, row_max, argmax)


def _fail(kind: type[Exception], message: str) -> None:
    raise kind(f"{NAME}: {message}")


def _check_arguments(hidden_states, weight, bias, indices, temperature, projection_dtype, transform,
                     **dtypes) -> None:
    """Types, shapes, dtypes and devices (:func:`linear_statistics`' Raises)."""
    for name, value in (("hidden_states", hidden_states), ("weight", weight)):
        if not isinstance(value, Tensor):
            _fail(TypeError, f"expected {name} to be a Tensor, got {type(value).__name__}")
    if hidden_states.dim() != 2 or not hidden_states.is_floating_point():
        _fail(ValueError, f"expected floating hidden_states of shape [N, H], got {hidden_states.dtype} "
                          f"{tuple(hidden_states.shape)}; flatten the leading dims first")
    (num_tokens, hidden_size), device = hidden_states.shape, hidden_states.device
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        _fail(ValueError, f"expected weight of shape [V, {hidden_size}], got {tuple(weight.shape)}")
    vocab_size = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (vocab_size,)):
        _fail(ValueError, f"expected bias of shape [{vocab_size}] or None, got "
                          f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and projection_dtype is None and value.dtype != hidden_states.dtype:
            _fail(TypeError, f"expected {name} of dtype {hidden_states.dtype} (the hidden states'), got "
                             f"{value.dtype}; pass projection_dtype= to cast them")
    if indices is not None:
        if not isinstance(indices, Tensor) or indices.dtype != torch.int64 or indices.dim() != 2 \
                or indices.shape[0] != num_tokens:
            got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, Tensor) else type(indices).__name__
            _fail(ValueError, f"expected indices of dtype torch.int64 and shape [{num_tokens}, K], got {got}")
    if isinstance(temperature, Tensor):
        if not temperature.is_floating_point() or tuple(temperature.shape) not in ((), (num_tokens,)):
            _fail(ValueError, f"expected a floating temperature of shape [{num_tokens}] or [], got "
                              f"{temperature.dtype} {tuple(temperature.shape)}")
        if temperature.requires_grad and torch.is_grad_enabled():
            _fail(NotImplementedError, "a temperature that requires grad is not supported; pass temperature.detach()")
    elif temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)):
        _fail(TypeError, f"expected temperature to be a number, a tensor or None, got {type(temperature).__name__}")
    for name, dtype in (("projection_dtype", projection_dtype), *dtypes.items()):
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            _fail(TypeError, f"expected {name} to be a floating torch.dtype or None, got {dtype!r}")
    if not isinstance(transform, HeadTransform):
        _fail(TypeError, f"expected transform to be a HeadTransform, got {type(transform).__name__}")
    for name, value in (("weight", weight), ("bias", bias), ("indices", indices), ("temperature", temperature)):
        if isinstance(value, Tensor) and value.device != device:
            _fail(ValueError, f"expected {name} on {device} (the hidden states' device), got {value.device}")
