"""The spellings of a row statistic (logsumexp, entropy, row sum) and their shared replacement.

The spellings of a row statistic, ``logsumexp``, ``entropy`` and ``row_sum``, and their shared
replacement: a value per row of the logits from ``chunkce::linear_statistics``
(:func:`compile_pass.op.statistics.chunked_statistics`).

    torch.logsumexp(z, -1)                          -> lse (z.logsumexp, torch.special.logsumexp; keepdim)
    (softmax(z, -1) * log_softmax(z, -1)).sum(-1)   -> -entropy
    (softmax(z, -1) * z).sum(-1)                    -> lse - entropy
    z.sum(-1), z.sum()                              -> row_sum, its sum over the rows
    .mean(-1), .mean() of z or of the products      -> the sum over V (and over the rows)

Which function is which reduction, and what each gives over which row values, is the lazy reads'
table (:data:`compile_pass.op.statistics.REDUCTIONS`,
:func:`~compile_pass.op.statistics.reduction_from_statistics`):
one definition for a reduction read inside a compiled graph and of the lazy logits it returns.

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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Node

from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    LOG_SOFTMAX,
    MULTIPLY,
    SOFTMAX,
    example_value,
    function_of,
    is_tensor_node,
    same_size,
    tensor_op_name,
)
from compile_pass.graph.projection import Projection
from compile_pass.graph.refusals import Reason, Refusal
from compile_pass.graph.spellings.call import Spelling, SpellingKind, StatisticCall
from compile_pass.op.checks import is_last_dim
from compile_pass.op.kernels import HeadScale
from compile_pass.op.statistics import (
    REDUCTIONS,
    FromStatistics,
    Reduction,
    RowContent,
    RowStatistics,
    chunked_statistics,
    reduction_from_statistics,
)

_REDUCTION = inspect.signature(lambda input, dim, keepdim=False: None)  # logsumexp's, sum's without dtype=
_EVERY_VALUE = inspect.signature(lambda input: None)  # sum's and mean's of every value, without dtype=


def statistic_replacement(hidden_states: Tensor, weight: Tensor, target: None, bias: Tensor | None,
                          class_weight: None, *, value: FromStatistics, shape: tuple[int, ...] | None, keepdim: bool,
                          logits_dtype: torch.dtype, projection_dtype: torch.dtype | None, transform: HeadScale,
                          chunk_size: int | None, chunk_bytes: int | None, every: Reduction | None = None,
                          walked: RowStatistics | None = None, rows: Tensor | None = None, **unused: Any) -> Tensor:
    """``value`` of the op's row statistics of ``z = transform(hidden_states @ weight.T + bias)
    .to(logits_dtype)`` (``hidden_states [..., H]``, ``weight [V, H]``): reshaped to ``shape``
    (None: ``hidden_states.shape[:-1]``), a trailing 1 added with ``keepdim``, in ``logits_dtype``;
    with ``every`` (``SUM`` or ``MEAN``), that reduction of the rows' values instead (0-d).
    The signature is :func:`compile_pass.op.loss.chunked_cross_entropy`'s (a statistic reads
    no target, class weight or loss argument: ``unused``). ``walked``: the statistics of every head
    row from a loss's walk of the same values (no walk here; graph/plan.py, ``_fold``), and
    ``rows`` the head rows this statistic reads (None: all, in order)."""
    statistics = walked if walked is not None else chunked_statistics(
        hidden_states.flatten(0, -2), weight, bias, None, None, projection_dtype=projection_dtype,
        logits_dtype=logits_dtype, statistics_dtype=logits_dtype, transform=transform, chunk_size=chunk_size,
        chunk_bytes=chunk_bytes)
    row = value(statistics, weight.shape[0])  # [N], fp32 (fp64 for fp64 logits)
    if rows is not None:
        row = row.index_select(0, rows.reshape(-1))  # [n]
    if every is not None:  # every row's values, reduced in the accumulate dtype and rounded once, as torch's
        return (row.mean() if every is Reduction.MEAN else row.sum()).to(logits_dtype)
    row = row.view_as(hidden_states[..., 0]) if shape is None else row.reshape(shape)  # [...]
    if keepdim:
        row = row.unsqueeze(-1)  # [..., 1]
    return row.to(logits_dtype)


@dataclass(frozen=True, kw_only=True)
class ReductionCall(StatisticCall):
    """A reduction of row values over the last dim (``every``: of every value, a sum or mean):
    which (:data:`compile_pass.op.statistics.REDUCTIONS`), of which values of ``z``."""

    reduction: Reduction
    values: RowContent = RowContent.LOGITS
    every: bool = False


def replace_reduction(call: ReductionCall, projection: Projection) -> Callable[..., Any] | Reason:
    """:func:`statistic_replacement` with the value
    :func:`compile_pass.op.statistics.reduction_from_statistics`
    gives ``call``'s reduction of its values, for its rows (:func:`row_shape`), or why not."""
    if projection.sharded is not None:
        return Reason(Refusal.TENSOR_PARALLEL, detail="a row statistic of a vocabulary-sharded head (the "
                                                      "vocabulary-parallel op computes a loss)")
    value = reduction_from_statistics(call.reduction, call.values)
    if call.every:
        return partial(statistic_replacement, value=value, shape=None, keepdim=False, every=call.reduction)
    shape = row_shape(call.input, projection)
    if isinstance(shape, Reason):
        return shape
    return partial(statistic_replacement, value=value, shape=shape, keepdim=call.keepdim)


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


def _functions(*reductions: Reduction) -> tuple[Any, ...]:
    return tuple(function for function, reduction in REDUCTIONS.items() if reduction in reductions)


_LOGSUMEXP = _functions(Reduction.LOGSUMEXP)
_SUM_OR_MEAN = _functions(Reduction.SUM, Reduction.MEAN)


def read_logsumexp(node: Node) -> ReductionCall | None:
    """The logsumexp over the last dim of ``z`` (``Call.input``), or None."""
    reduced = last_dim_reduction(node, _LOGSUMEXP)
    if reduced is None:
        return None
    logits, keepdim = reduced
    return ReductionCall(input=logits, spelling=LOGSUMEXP, class_dim=-1, keepdim=keepdim,
                         reduction=Reduction.LOGSUMEXP)


LOGSUMEXP = Spelling("logsumexp", read_logsumexp, replace_reduction, kind=SpellingKind.STATISTIC)


def _sum_or_mean(node: Node) -> tuple[Node, bool, bool] | None:
    """``(input, keepdim, every)`` of a sum or mean over the last dim of a tensor, or of every
    value (``every``; no dim, no dtype), else None."""
    reduced = last_dim_reduction(node, _SUM_OR_MEAN)
    if reduced is not None:
        return (*reduced, False)
    if function_of(node) not in _SUM_OR_MEAN:
        return None
    try:
        source = _EVERY_VALUE.bind(*node.args, **node.kwargs).arguments["input"]
    except TypeError:
        return None
    return (source, False, True) if is_tensor_node(source) and example_value(source).dim() > 0 else None


def read_row_sum(node: Node) -> ReductionCall | None:
    """A sum or mean of ``z`` (``Call.input``) over its last dim or of every value, or None. A sum
    of a product of two tensors (an entropy's, a one-hot loss's) or of a softmax is no row sum of
    logits: left to the spellings that read those (an entropy is :data:`ENTROPY`'s, read first)."""
    reduced = _sum_or_mean(node)
    if reduced is None:
        return None
    logits, keepdim, every = reduced
    function = function_of(logits)
    if function in (*SOFTMAX, *LOG_SOFTMAX, *_EXP) or (
            function in MULTIPLY and sum(is_tensor_node(arg) for arg in logits.args) > 1):
        return None
    return ReductionCall(input=logits, spelling=ROW_SUM, class_dim=-1, keepdim=keepdim, every=every,
                         reduction=REDUCTIONS[function_of(node)])


ROW_SUM = Spelling("row_sum", read_row_sum, replace_reduction, kind=SpellingKind.STATISTIC)


_EXP = (torch.exp, torch.Tensor.exp)
_REPEATABLE = CASTS | COPIES | {"view", "reshape", "getitem", "flatten", "unsqueeze", "squeeze"}  # same input, same value
_MAX_DEPTH = 8  # nodes of a repeated chain compared


def read_entropy(node: Node) -> ReductionCall | None:
    """``(softmax(z) * log_softmax(z)).sum(-1)`` (``P_LOG_P``) or ``(softmax(z) * z).sum(-1)``
    (``P_Z``) of one ``z`` (``Call.input``), or their mean, or of every value; or None."""
    reduced = _sum_or_mean(node)
    if reduced is None:
        return None
    product, keepdim, every = reduced
    if function_of(product) not in MULTIPLY or len(product.args) != 2 or product.kwargs:
        return None
    for probabilities, other in (product.args, product.args[::-1]):
        probs = _probabilities(probabilities)
        if probs is None:
            continue
        logits, probs_nodes = probs
        repeated = _repeat_of(other, logits)
        if repeated is not None:
            what, other_nodes = RowContent.P_Z, repeated
        else:
            other_logits = _last_dim_softmax(other, LOG_SOFTMAX)
            repeated = None if other_logits is None else _repeat_of(other_logits, logits)
            if repeated is None:
                continue
            what, other_nodes = RowContent.P_LOG_P, (other, *repeated)
        if example_value(product).shape != example_value(logits).shape:
            return None  # a broadcast product: not one distribution per row
        inner = tuple(dict.fromkeys((product, *probs_nodes, *other_nodes)))
        return ReductionCall(input=logits, spelling=ENTROPY, class_dim=-1, inner=inner, keepdim=keepdim,
                             reduction=REDUCTIONS[function_of(node)], values=what, every=every)
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
    logits = _last_dim_softmax(node, SOFTMAX)
    if logits is not None:
        return logits, (node,)
    if isinstance(node, Node) and function_of(node) in _EXP and len(node.args) == 1 and not node.kwargs:
        logits = _last_dim_softmax(node.args[0], LOG_SOFTMAX)
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


ENTROPY = Spelling("entropy", read_entropy, replace_reduction, kind=SpellingKind.STATISTIC)
