"""The replacement shared by the spellings of a row statistic (``kind=STATISTIC``): a value per row
of the logits, computed by ``chunkce::linear_statistics`` (:func:`compile_pass.op.statistics.chunked_statistics`).

    logsumexp.py   logsumexp(z, -1)                          -> lse
    entropy.py     (softmax(z, -1) * log_softmax(z, -1)).sum(-1), (softmax(z, -1) * z).sum(-1)
                                                             -> -entropy, lse - entropy

A spelling's replacement is :func:`statistic_replacement` with its own ``value`` (the
:class:`compile_pass.op.statistics.RowStatistics` -> ``[N]``); the result is shaped as the
statistic's node was (:func:`row_shape`) and cast to its dtype.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.fx import Node

from compile_pass.graph.calls import StatisticCall
from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import example_value, function_of, is_tensor_node, same_size
from compile_pass.graph.refusals import Reason, Refusal
from compile_pass.op.statistics import RowStatistics, chunked_statistics

_REDUCTION = inspect.signature(lambda input, dim, keepdim=False: None)  # logsumexp's, sum's without dtype=
Value = Callable[[RowStatistics], Tensor]  # the statistic of each row, [N], from the op's


def row_statistic(hidden_states: Tensor, weight: Tensor, target: None, bias: Tensor | None,
                  class_weight: None, *, value: Value, shape: tuple[int, ...] | None, keepdim: bool,
                  logits_dtype: torch.dtype, projection_dtype: torch.dtype | None, transform: Any,
                  chunk_size: int | None, chunk_bytes: int | None,
                  **unused: Any) -> Tensor:
    """``value`` of the op's row statistics of ``z = transform(hidden_states @ weight.T + bias)
    .to(logits_dtype)`` (``hidden_states [..., H]``, ``weight [V, H]``): reshaped to ``shape``
    (None: ``hidden_states.shape[:-1]``), a trailing 1 added with ``keepdim``, in ``logits_dtype``.
    The signature is :func:`compile_pass.op.function.chunked_cross_entropy`'s (a statistic reads
    no target, class weight or loss argument: ``unused``)."""
    statistics = chunked_statistics(hidden_states.flatten(0, -2), weight, bias, None, None,
                                    projection_dtype=projection_dtype, logits_dtype=logits_dtype,
                                    statistics_dtype=logits_dtype, transform=transform, chunk_size=chunk_size,
                                    chunk_bytes=chunk_bytes)
    row = value(statistics)  # [N], fp32 (fp64 for fp64 logits)
    row = row.view_as(hidden_states[..., 0]) if shape is None else row.reshape(shape)  # [...]
    if keepdim:
        row = row.unsqueeze(-1)  # [..., 1]
    return row.to(logits_dtype)


def statistic_replacement(call: StatisticCall, projection: Projection, value: Value,
                          keepdim: bool = False) -> Callable[..., Any] | Reason:
    """:func:`row_statistic` with ``value`` for ``call``'s rows (:func:`row_shape`), or why not."""
    if projection.sharded is not None:
        return Reason(Refusal.TENSOR_PARALLEL, detail="a row statistic of a vocabulary-sharded head (the "
                                                      "vocabulary-parallel op computes a loss)")
    shape = row_shape(call.input, projection)
    if isinstance(shape, Reason):
        return shape
    return partial(row_statistic, value=value, shape=shape, keepdim=keepdim)


def row_shape(logits: Node, projection: Projection) -> tuple[int, ...] | None | Reason:
    """The shape of one value per row of ``logits [..., V]``: its leading sizes (one symbolic
    size as -1); None when several are symbolic and they are the projection's (the hidden states'
    leading shape, as the rewrite indexes them); else a ``SYMBOLIC_RESHAPE`` reason."""
    leading = tuple(example_value(logits).shape[:-1])
    symbolic = [i for i, size in enumerate(leading) if not isinstance(size, int)]
    if len(symbolic) <= 1:
        return tuple(-1 if i in symbolic else size for i, size in enumerate(leading))
    projected = tuple(example_value(projection.node).shape[:-1])
    if len(projected) == len(leading) and all(same_size(a, b) for a, b in zip(leading, projected)):
        return None
    return Reason(Refusal.SYMBOLIC_RESHAPE, op=logits.name)


def last_dim_reduction(node: Node, functions: tuple[Any, ...],
                       signature: inspect.Signature = _REDUCTION) -> tuple[Node, bool] | None:
    """``(input, keepdim)`` of a call of one of ``functions`` that reduces the last dim of a
    tensor (``dim`` -1, ``ndim - 1`` or a one-element list of it; ``keepdim`` a constant), else None."""
    if function_of(node) not in functions:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:  # e.g. out=, dtype=: not read
        return None
    bound.apply_defaults()
    source, dim, keepdim = bound.arguments["input"], bound.arguments["dim"], bound.arguments["keepdim"]
    if not is_tensor_node(source) or not isinstance(keepdim, bool):
        return None
    ndim = example_value(source).dim()
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if ndim == 0 or isinstance(dim, bool) or not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None
    return source, keepdim
