"""The spelling ``gather``: the log-probability of each token's label, gathered from a log_softmax.

    -log_softmax(z, -1).gather(-1, y.unsqueeze(-1))   torch.gather, take_along_dim; y[..., None],
        y.reshape(-1, 1), y[:, 1:, None], any [..., 1] index; the negation before or after the
        gather, or after the reduction

It reads one log-probability per token, ``[..., 1]``: the gather node is replaced by the op's
``reduction="none"`` output, negated and unsqueezed (:func:`gathered_log_probs`), and everything
after it (squeeze, negation, ``mean`` / ``sum`` / a mask) stays as graph ops. A gather has no
ignore_index: the call gets one no label can equal (:data:`NO_IGNORE_INDEX`). The index must be
shaped ``[..., 1]`` like the log-probabilities (a smaller one reads a corner of them:
``unsupported``); the labels are what it was made from when it is ``labels.unsqueeze(-1)`` /
``labels[..., None]`` / a view with a trailing 1 added, or ``labels.reshape(-1, 1)`` of ``[N, V]``
log-probabilities; any other index is squeezed (``gather(-1, index)`` reads class ``index[..., 0]``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.fx import Node

from compile_pass.graph.calls import LossCall, Spelling
from compile_pass.graph.forms import Projection
from compile_pass.graph.log_softmax import find_log_softmax
from compile_pass.graph.nodes import example_value, function_of, is_tensor_node, same_size, tensor_op_name
from compile_pass.graph.refusals import Reason, Refusal
from compile_pass.op.function import chunked_cross_entropy

_GATHER = (torch.gather, torch.Tensor.gather)
_TAKE_ALONG_DIM = (torch.take_along_dim, torch.Tensor.take_along_dim)
_UNSQUEEZE_LAST = {"unsqueeze", "getitem", "view", "reshape"}

NO_IGNORE_INDEX = torch.iinfo(torch.int64).min  # the op's ignore_index for a gather: no label is ignored


@dataclass(frozen=True, kw_only=True)
class GatherCall(LossCall):
    """A gather of log-probabilities: ``[..., 1]``, one per token (a ``reduction="none"``
    cross-entropy of the logits and the labels, and how its value is the gather's)."""

    negated: bool  # the log-probabilities were negated before the gather (its value is the loss)
    flat: bool  # the index was ``labels.reshape(-1, 1)`` of ``[N, V]`` log-probabilities: ``[N, 1]``
    squeeze: bool  # the call's target is the ``[..., 1]`` index itself, not labels it was made from
    wraps: bool = False  # take_along_dim: it reads class ``index % V`` (its reference wraps, checks nothing)


def read_gather(node: Node) -> GatherCall | None:
    """A ``reduction="none"`` cross-entropy of ``z`` and the labels (:class:`GatherCall` says how its
    value is the gather's), or None."""
    target = function_of(node) if node.op in ("call_function", "call_method") else None
    if target in _GATHER:
        signature = inspect.signature(lambda input, dim, index, *, sparse_grad=False: None)
    elif target in _TAKE_ALONG_DIM:
        signature = inspect.signature(lambda input, index, dim=None: None)
    else:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:  # e.g. out=: no loss
        return None
    bound.apply_defaults()
    args = bound.arguments
    source, dim, index = args["input"], args["dim"], args["index"]
    if not (is_tensor_node(source) and is_tensor_node(index) and isinstance(dim, int)) or args.get("sparse_grad"):
        return None
    log_probs, picked = example_value(source), example_value(index)
    if log_probs.dim() == 0 or picked.dim() != log_probs.dim() or dim % log_probs.dim() != log_probs.dim() - 1:
        return None  # not one class per token along the last dim
    found = find_log_softmax(source, negations=True)
    if found is None:
        return None
    unsupported = found.unsupported
    labels, flat = _squeezed_labels(index)
    full = all(same_size(a, b) for a, b in zip(picked.shape[:-1], log_probs.shape[:-1]))
    if not (full and same_size(picked.shape[-1], 1)):
        unsupported = unsupported or (f"gather index of shape {tuple(picked.shape)} for log-probabilities of shape "
                                      f"{tuple(log_probs.shape)}: chunkce reads one label per token "
                                      "(an index shaped [..., 1] like the log-probabilities)")
    return GatherCall(input=source, target=index if labels is None else labels, ignore_index=NO_IGNORE_INDEX,
                      reduction="none", spelling=GATHER, passes=found.passes, class_dim=-1,
                      inner=(index,) if labels is not None else (), unsupported=unsupported,
                      negated=found.negated, flat=flat, squeeze=labels is None, wraps=target in _TAKE_ALONG_DIM)


def _squeezed_labels(index: Node) -> tuple[Node | None, bool]:
    """``(labels, flat)``: ``labels`` when ``index`` is ``labels`` with a trailing dim of 1
    added (``flat`` False), or a ``[N, 1]`` view of ``N`` labels (``flat``); else ``(None, False)``."""
    if tensor_op_name(index) not in _UNSQUEEZE_LAST or not index.args or not is_tensor_node(index.args[0]):
        return None, False
    labels = index.args[0]
    before, after = example_value(labels), example_value(index)
    if not same_size(after.shape[-1], 1):
        return None, False
    if after.dim() == before.dim() + 1 and all(same_size(a, b) for a, b in zip(after.shape[:-1], before.shape)):
        return labels, False
    if after.dim() == 2 and tensor_op_name(index) in ("view", "reshape") and same_size(after.numel(), before.numel()):
        return labels, True
    return None, False


def gathered_log_probs(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                       class_weight: Tensor | None, *, negated: bool, flat: bool, ignore_index: int,
                       squeeze: bool = False, wraps: bool = False, **options: Any) -> Tensor:
    """``log_softmax(hidden_states @ weight.T + bias, -1).gather(-1, target[..., None])`` through the
    op: ``[..., 1]`` (``[N, 1]`` when ``flat``), negated when ``negated``; the other arguments are
    ``chunked_cross_entropy``'s. A label equal to ``ignore_index`` becomes -1, so that the op raises
    for it as ``gather`` does; ``wraps``: labels taken modulo ``V`` first, as ``take_along_dim``'s
    reference does; ``squeeze``: ``target`` is the ``[..., 1]`` index itself."""
    if squeeze:
        target = target.squeeze(-1)  # [..., 1] -> [...]
    if wraps:
        target = target.remainder(weight.shape[0])  # [...] in [0, V)
    target = target.masked_fill(target == ignore_index, -1)  # [...]
    nll = chunked_cross_entropy(hidden_states, weight, target, bias, class_weight, ignore_index=ignore_index,
                                **options)  # [...] = -log p(target)
    log_p = nll if negated else nll.neg()  # shaped like target
    return log_p.reshape(-1, 1) if flat else log_p.unsqueeze(-1)


def replace_gather(call: GatherCall, projection: Projection) -> Callable[..., Any] | Reason:
    """:func:`gathered_log_probs` as the call says; none for a vocabulary-sharded head."""
    if projection.sharded is not None:
        return Reason(Refusal.TENSOR_PARALLEL, detail="a gather of log-probabilities (the vocabulary-parallel op "
                                                      "computes a loss)")
    return partial(gathered_log_probs, negated=call.negated, flat=call.flat, squeeze=call.squeeze,
                   wraps=call.wraps)


GATHER = Spelling("gather", read_gather, replace_gather)
