"""Log-probabilities a spelling reads: the walk from a loss's input back to its log_softmax.

Shared by the spellings of a loss of log-probabilities (:mod:`compile_pass.graph.nll_loss`,
:mod:`compile_pass.graph.gather`): it finds the log_softmax, says what lies on the way and
what of it the op cannot reproduce (the walk of :mod:`compile_pass.graph.sites` checks the rest).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.fx import Node

from compile_pass.graph.calls import StepKind
from compile_pass.graph.forms import as_projection
from compile_pass.graph.nodes import example_value, function_of, is_tensor_node

_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, torch.special.log_softmax, torch.Tensor.log_softmax)
_SOFTMAX = (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax)
_LOG = (torch.log, torch.Tensor.log)
_NEG = (operator.neg, torch.neg, torch.negative, torch.Tensor.neg, torch.Tensor.negative)
_MAX_DEPTH = 16  # nodes between a loss and its log_softmax the reader looks through


class LogProbs(NamedTuple):
    """What lies between a loss's input and the log_softmax that made it."""

    passes: dict[Node, StepKind]  # the log_softmax and the negations on the way
    negated: bool  # an odd number of negations
    unsupported: str | None


def _log_softmax_dim(node: Node) -> Any:
    args = node.args[1:] if node.op == "call_method" else node.args[1:2]
    return node.kwargs.get("dim", args[0] if args else None)


def find_log_softmax(start: Node, negations: bool) -> LogProbs | None:
    """Walk back from a loss's input along first arguments to a log_softmax; None when
    there is none (then the loss is not a cross-entropy chunkce reads).

    The walk only finds the log_softmax; the walk of :func:`compile_pass.graph.sites.match_site`
    checks every node on the way (each must be shape/dtype-only, or a negation here).
    """
    negs: list[Node] = []
    path: list[Node] = []  # from the loss input back, the log_softmax excluded
    node = start
    for _ in range(_MAX_DEPTH):
        if node.op not in ("call_function", "call_method") or not is_tensor_node(node):
            return None
        target = function_of(node)
        if not node.args or not is_tensor_node(node.args[0]):  # e.g. input= as a keyword: not read
            return None
        if target in _LOG_SOFTMAX:
            return LogProbs({node: StepKind.LOG_SOFTMAX, **dict.fromkeys(negs, StepKind.NEG)}, len(negs) % 2 == 1,
                            _log_softmax_problem(node, path))
        if target in _LOG and isinstance(node.args[0], Node) and function_of(node.args[0]) in _SOFTMAX:
            return LogProbs({}, False, "log(softmax(logits)) is not torch's log_softmax (it rounds differently "
                                       "and overflows to -inf): write F.log_softmax(logits, dim=-1) or "
                                       "F.cross_entropy")
        if as_projection(node) is not None:
            return None
        if target in _NEG and negations:
            negs.append(node)
        path.append(node)
        node = node.args[0]
    return None


def _log_softmax_problem(log_softmax: Node, path: list[Node]) -> str | None:
    """Why the op cannot reproduce this log_softmax and what follows it, or None."""
    logits = example_value(log_softmax.args[0])
    dim = _log_softmax_dim(log_softmax)
    if not isinstance(dim, int) or isinstance(dim, bool):
        return f"log_softmax with dim={dim!r}: give the class dim (dim=-1) explicitly"
    if logits.dim() == 0 or dim % logits.dim() != logits.dim() - 1:
        return (f"log_softmax over dim {dim} of shape {tuple(logits.shape)}: chunkce reads a log_softmax over "
                "the last (vocabulary) dim only; take it over dim=-1 of the [..., V] logits, then move the "
                "class dim (e.g. .transpose(1, 2)) for the loss")
    for node in reversed(path):  # forward from the log_softmax
        before, after = example_value(node.args[0]), example_value(node)
        if after.dtype != before.dtype:
            return (f"log-probabilities cast from {before.dtype} to {after.dtype} after the log_softmax (the op "
                    "would not round them to the first dtype): cast the logits before the log_softmax, or pass "
                    "log_softmax(..., dtype=...)")
    return None
