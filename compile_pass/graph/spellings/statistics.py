"""The spellings of a row statistic (logsumexp, entropy) and their shared replacement.

The spellings of a row statistic, ``logsumexp`` and ``entropy``, and their shared replacement: a
value per row of the logits from ``chunkce::linear_statistics`` (:func:`compile_pass.op.statistics.chunked_statistics`).

    torch.logsumexp(z, -1)                          -> lse (z.logsumexp, torch.special.logsumexp; keepdim)
    (softmax(z, -1) * log_softmax(z, -1)).sum(-1)   -> -entropy
    (softmax(z, -1) * z).sum(-1)                    -> lse - entropy

``logsumexp`` is the z-loss's (``logsumexp(logits.float(), -1).pow(2)``, masked and averaged after
it: those ops stay as written). For ``entropy`` the probabilities are ``softmax(z, -1)`` or
``log_softmax(z, -1).exp()``, either factor first, summed over the last dim; every factor reads the
same ``z``: one node, or the same casts / copies / views of one node written twice (Dynamo keeps
both ``.float()`` nodes of ``softmax(z.float()) * log_softmax(z.float())``). The op takes
``0 log 0 = 0`` where a logit is ``-inf`` (torch's product gives nan there); finite logits give
torch's values. A spelling's replacement is :func:`statistic_replacement` with its own ``value``
(the op's :class:`compile_pass.op.statistics.RowStatistics` -> ``[N]``), shaped as the statistic's
node was (:func:`row_shape`) and cast to its dtype; the op's backward recomputes the tiles.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Node

from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    example_value,
    function_of,
    is_tensor_node,
    same_size,
    tensor_op_name,
)
from compile_pass.graph.projection import Projection
from compile_pass.graph.refusals import Reason, Refusal
from compile_pass.graph.spellings.call import Spelling, SpellingKind, StatisticCall
from compile_pass.lazy_logits.keys import is_last_dim
from compile_pass.op.statistics import RowStatistics, chunked_statistics

_REDUCTION = inspect.signature(lambda input, dim, keepdim=False: None)  # logsumexp's, sum's without dtype=
Value = Callable[[RowStatistics], Tensor]  # the statistic of each row, [N], from the op's


def row_statistic(hidden_states: Tensor, weight: Tensor, target: None, bias: Tensor | None,
                  class_weight: None, *, value: Value, shape: tuple[int, ...] | None, keepdim: bool,
                  logits_dtype: torch.dtype, projection_dtype: torch.dtype | None, transform: Any,
                  chunk_size: int | None, chunk_bytes: int | None, walked: RowStatistics | None = None,
                  rows: Tensor | None = None, **unused: Any) -> Tensor:
    """``value`` of the op's row statistics of ``z = transform(hidden_states @ weight.T + bias)
    .to(logits_dtype)`` (``hidden_states [..., H]``, ``weight [V, H]``): reshaped to ``shape``
    (None: ``hidden_states.shape[:-1]``), a trailing 1 added with ``keepdim``, in ``logits_dtype``.
    The signature is :func:`compile_pass.op.loss.chunked_cross_entropy`'s (a statistic reads
    no target, class weight or loss argument: ``unused``). ``walked``: the statistics of every head
    row from a loss's walk of the same values (no walk here; graph/plan.py, ``_plan_fold``), and
    ``rows`` the head rows this statistic reads (None: all, in order)."""
    statistics = walked if walked is not None else chunked_statistics(
        hidden_states.flatten(0, -2), weight, bias, None, None, projection_dtype=projection_dtype,
        logits_dtype=logits_dtype, statistics_dtype=logits_dtype, transform=transform, chunk_size=chunk_size,
        chunk_bytes=chunk_bytes)
    row = value(statistics)  # [N], fp32 (fp64 for fp64 logits)
    if rows is not None:
        row = row.index_select(0, rows.reshape(-1))  # [n]
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
    if not is_last_dim(dim, ndim):
        return None
    return source, keepdim


_LOGSUMEXP = (torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp)


def read_logsumexp(node: Node) -> StatisticCall | None:
    """The logsumexp over the last dim of ``z`` (``Call.input``), or None."""
    reduced = last_dim_reduction(node, _LOGSUMEXP)
    if reduced is None:
        return None
    logits, keepdim = reduced
    return StatisticCall(input=logits, spelling=LOGSUMEXP, class_dim=-1, keepdim=keepdim)


def replace_logsumexp(call: StatisticCall, projection: Projection) -> Callable[..., Any] | Reason:
    return statistic_replacement(call, projection, lambda statistics: statistics.lse, keepdim=call.keepdim)


LOGSUMEXP = Spelling("logsumexp", read_logsumexp, replace_logsumexp, kind=SpellingKind.STATISTIC)


_SUM = (torch.sum, torch.Tensor.sum)
_MUL = (operator.mul, torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply)
_SOFTMAX = (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax)
_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, torch.special.log_softmax, torch.Tensor.log_softmax)
_EXP = (torch.exp, torch.Tensor.exp)
_REPEATABLE = CASTS | COPIES | {"view", "reshape", "getitem", "flatten", "unsqueeze", "squeeze"}  # same input, same value
_MAX_DEPTH = 8  # nodes of a repeated chain compared



class RowSum(Enum):
    """What the sum of a softmax-weighted row is."""

    NEGATIVE_ENTROPY = "negative_entropy"  # (softmax(z) * log_softmax(z)).sum(-1)
    EXPECTED_LOGIT = "expected_logit"  # (softmax(z) * z).sum(-1), lse - entropy


@dataclass(frozen=True, kw_only=True)
class EntropyCall(StatisticCall):
    """A softmax-weighted sum over the vocabulary, and which."""

    row_sum: RowSum


def read_entropy(node: Node) -> EntropyCall | None:
    """``(softmax(z) * log_softmax(z)).sum(-1)`` or ``(softmax(z) * z).sum(-1)`` of one ``z``
    (``Call.input``), or None."""
    reduced = last_dim_reduction(node, _SUM)
    if reduced is None:
        return None
    product, keepdim = reduced
    if function_of(product) not in _MUL or len(product.args) != 2 or product.kwargs:
        return None
    for probabilities, other in (product.args, product.args[::-1]):
        probs = _probabilities(probabilities)
        if probs is None:
            continue
        logits, probs_nodes = probs
        repeated = _repeat_of(other, logits)
        if repeated is not None:
            what, other_nodes = RowSum.EXPECTED_LOGIT, repeated
        else:
            other_logits = _last_dim_softmax(other, _LOG_SOFTMAX)
            repeated = None if other_logits is None else _repeat_of(other_logits, logits)
            if repeated is None:
                continue
            what, other_nodes = RowSum.NEGATIVE_ENTROPY, (other, *repeated)
        if example_value(product).shape != example_value(logits).shape:
            return None  # a broadcast product: not one distribution per row
        inner = tuple(dict.fromkeys((product, *probs_nodes, *other_nodes)))
        return EntropyCall(input=logits, spelling=ENTROPY, class_dim=-1, inner=inner, keepdim=keepdim,
                           row_sum=what)
    return None


def _repeat_of(node: Any, logits: Node, depth: int = _MAX_DEPTH) -> tuple[Node, ...] | None:
    """The nodes of ``node``'s chain that repeat ``logits``' (``()`` when ``node`` is ``logits``), or
    None when ``node`` is not the same casts, copies and views of the same node."""
    if node is logits:
        return ()
    if (depth == 0 or not isinstance(node, Node) or node.op != logits.op or node.target != logits.target
            or tensor_op_name(node) not in _REPEATABLE or node.kwargs != logits.kwargs
            or len(node.args) != len(logits.args) or node.args[1:] != logits.args[1:]):
        return None
    below = _repeat_of(node.args[0], logits.args[0], depth - 1)
    return None if below is None else (node, *below)


def _probabilities(node: Any) -> tuple[Node, tuple[Node, ...]] | None:
    """``(z, nodes)`` when ``node`` is ``softmax(z, -1)`` or ``log_softmax(z, -1).exp()``."""
    logits = _last_dim_softmax(node, _SOFTMAX)
    if logits is not None:
        return logits, (node,)
    if isinstance(node, Node) and function_of(node) in _EXP and len(node.args) == 1 and not node.kwargs:
        logits = _last_dim_softmax(node.args[0], _LOG_SOFTMAX)
        if logits is not None:
            return logits, (node, node.args[0])
    return None


def _last_dim_softmax(node: Any, functions: tuple) -> Node | None:
    """``z`` when ``node`` is one of ``functions`` (a softmax or log_softmax) of ``z`` over its
    last dim, in ``z``'s dtype; else None."""
    if not isinstance(node, Node) or function_of(node) not in functions or not node.args:
        return None
    logits = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if not is_tensor_node(logits) or not is_tensor_node(node) or node.kwargs.get("dtype") is not None:
        return None
    positional = 3 if node.target in (F.softmax, F.log_softmax) else 2  # F's third is _stacklevel
    if len(node.args) > positional or example_value(node).dtype != example_value(logits).dtype:
        return None  # a dtype= given positionally
    ndim = example_value(logits).dim()
    if not is_last_dim(dim, ndim):
        return None
    return logits


def _value(row_sum: RowSum) -> Callable[[Any], Any]:
    if row_sum is RowSum.NEGATIVE_ENTROPY:
        return lambda statistics: statistics.entropy.neg()
    return lambda statistics: statistics.lse - statistics.entropy


def replace_entropy(call: EntropyCall, projection: Projection) -> Callable[..., Any] | Reason:
    return statistic_replacement(call, projection, _value(call.row_sum), keepdim=call.keepdim)


ENTROPY = Spelling("entropy", read_entropy, replace_entropy, kind=SpellingKind.STATISTIC)
