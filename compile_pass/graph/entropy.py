"""The spelling ``entropy``: a sum over the vocabulary weighted by the softmax, a row statistic.

    (softmax(z, -1) * log_softmax(z, -1)).sum(-1)    the negated entropy: -(...) is the entropy
    (softmax(z, -1) * z).sum(-1)                     lse - entropy: logsumexp(z) - (...) is the entropy

The probabilities ``softmax(z, -1)`` or ``log_softmax(z, -1).exp()``, either factor first;
``torch.sum`` / ``Tensor.sum`` over the last dim (``keepdim`` too); every factor reads the same
``z``: one node, or the same casts / copies / views of one node written twice (``softmax(z.float())
* log_softmax(z.float())``: Dynamo keeps both ``.float()`` nodes). The sum node is replaced by the value from ``chunkce::linear_statistics``
(:mod:`compile_pass.graph.row_statistic`); a negation, a ``logsumexp(z)`` (the spelling
``logsumexp``) or a mean after it stay graph ops. The op takes ``0 log 0 = 0`` where a logit is
``-inf`` (torch's product gives nan there); finite logits give torch's values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from compile_pass.graph.calls import Spelling, SpellingKind, StatisticCall
from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import CASTS, COPIES, example_value, function_of, is_tensor_node, tensor_op_name
from compile_pass.graph.refusals import Reason
from compile_pass.graph.row_statistic import last_dim_reduction, statistic_replacement

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
    if ndim == 0 or isinstance(dim, bool) or not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None
    return logits


def _value(row_sum: RowSum) -> Callable[[Any], Any]:
    if row_sum is RowSum.NEGATIVE_ENTROPY:
        return lambda statistics: statistics.entropy.neg()
    return lambda statistics: statistics.lse - statistics.entropy


def replace_entropy(call: EntropyCall, projection: Projection) -> Callable[..., Any] | Reason:
    return statistic_replacement(call, projection, _value(call.row_sum), keepdim=call.keepdim)


ENTROPY = Spelling("entropy", read_entropy, replace_entropy, kind=SpellingKind.STATISTIC)
