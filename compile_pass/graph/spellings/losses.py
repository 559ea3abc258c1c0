"""The spellings of a loss: cross_entropy, nll_loss and gather of a log_softmax.

The spellings of a loss: ``cross_entropy``, ``nll_loss`` (of a log_softmax) and ``gather`` (of a
log_softmax: per-token log-probabilities), each a reader and a replacement.

    F.cross_entropy(z, y, ...)            call_function torch.nn.functional.cross_entropy
    nn.CrossEntropyLoss(...)(z, y)        (Dynamo inlines the module, every keyword spelled out)
    torch._C._nn.cross_entropy_loss(...)  (reduction as torch's enum int)
    F.nll_loss(F.log_softmax(z, -1), y)   nn.NLLLoss of nn.LogSoftmax, torch._C._nn.nll_loss_nd / nll_loss
    -log_softmax(z, -1).gather(-1, y.unsqueeze(-1))   torch.gather, take_along_dim; y[..., None],
        y.reshape(-1, 1), y[:, 1:, None], any [..., 1] index; negated before or after

``cross_entropy`` is replaced by the op's loss (:func:`compile_pass.op.loss.chunked_cross_entropy`)
or, for a vocabulary-sharded head, the vocabulary-parallel loss
(:func:`compile_pass.graph.tensor_parallel.loss_function`); in one walk with its returned logits'
row statistics (:mod:`compile_pass.graph.plan`), by :func:`loss_and_statistics`. ATen's
``cross_entropy`` is ``nll_loss_nd(log_softmax(z, 1), ...)``, so ``nll_loss`` of a log_softmax is
that cross-entropy without label smoothing, replaced as it is. ``gather`` reads one
log-probability per token: the gather node is replaced by the op's ``reduction="none"`` output,
negated and unsqueezed (:func:`gathered_log_probs`), and everything after it stays as graph ops; a
gather has no ignore_index, so the call gets one no label can equal (:data:`NO_IGNORE_INDEX`). In
one walk with row statistics of the same values, a cross-entropy is :func:`loss_and_statistics` and
a gather :func:`log_probs_and_statistics`.
The walk back from a loss of log-probabilities to its log_softmax (:func:`find_log_softmax`) says
what lies on the way and what of it the op cannot reproduce (``unsupported``); the walk of
:mod:`compile_pass.graph.sites` checks the rest.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph import tensor_parallel
from compile_pass.graph.nodes import (
    CALLS,
    LOG_SOFTMAX,
    SOFTMAX,
    example_value,
    function_of,
    is_tensor_node,
    same_size,
    tensor_op_name,
)
from compile_pass.graph.projection import Projection, as_projection
from compile_pass.graph.refusals import Reason, Refusal
from compile_pass.graph.spellings.call import LossCall, Spelling, StepKind
from compile_pass.op.checks import is_last_dim
from compile_pass.op.kernels import HeadScale
from compile_pass.op.loss import chunked_cross_entropy
from compile_pass.op.loops import reduce_total
from compile_pass.op.statistics import RowStatistics, chunked_statistics

REDUCTION_ENUM = {0: "none", 1: "mean", 2: "sum"}  # torch's reduction ints (cross_entropy_loss, nll_loss_nd)
_ENUM_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_ENUM_DEFAULTS = (None, None, None, 1, -100, 0.0)


def read_cross_entropy(node: Node) -> LossCall | None:
    """The call's arguments normalised; None when ``node`` is no cross-entropy call."""
    if node.op != "call_function":
        return None
    if node.target is internals.cross_entropy_loss.get():
        return LossCall(**enum_arguments(node, len(_ENUM_ARGS)), spelling=CROSS_ENTROPY)
    if node.target is not F.cross_entropy:
        return None
    args = bound_arguments(F.cross_entropy, node)
    return LossCall(input=args["input"], target=args["target"], weight=args["weight"],
                    ignore_index=args["ignore_index"], reduction=args["reduction"],
                    label_smoothing=args["label_smoothing"], spelling=CROSS_ENTROPY)


def enum_arguments(node: Node, count: int) -> dict[str, Any]:
    """The first ``count`` of ``(input, target, weight, reduction, ignore_index, label_smoothing)``
    of a ``torch._C._nn`` loss, defaults filled in, the reduction read from torch's enum."""
    args = dict(zip(_ENUM_ARGS[:count], _ENUM_DEFAULTS))
    args.update(zip(_ENUM_ARGS[:count], node.args))
    args.update(node.kwargs)
    args["reduction"] = REDUCTION_ENUM.get(args["reduction"], args["reduction"])
    return args


def bound_arguments(function: Callable[..., Any], node: Node) -> Mapping[str, Any]:
    """``function``'s arguments at ``node``, defaults filled in, the deprecated ``size_average`` /
    ``reduce`` mapped onto ``reduction`` as torch maps them."""
    bound = inspect.signature(function).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    if args["size_average"] is not None or args["reduce"] is not None:
        args["reduction"] = internals.legacy_reduction(args["size_average"], args["reduce"], emit_warning=False)
    return args


def replace_cross_entropy(call: LossCall, projection: Projection) -> Callable[..., Any]:
    """The op's loss; a vocabulary-sharded head's vocabulary-parallel loss."""
    if projection.sharded is not None:
        return tensor_parallel.loss_function(projection.sharded)
    return chunked_cross_entropy


def one_walk_cross_entropy(call: LossCall, projection: Projection) -> Callable[..., Any] | None:
    """:func:`loss_and_statistics`; None for a class weight, label smoothing or a sharded head."""
    if projection.sharded is not None or call.weight is not None or call.label_smoothing != 0.0:
        return None
    return loss_and_statistics


def loss_and_statistics(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                        class_weight: None, *, reduction: str, ignore_index: int, logits_dtype: torch.dtype,
                        statistics_dtype: torch.dtype, transform: HeadScale, projection_dtype: torch.dtype | None,
                        chunk_size: int | None, chunk_bytes: int | None, rows: Tensor | None = None,
                        **unused: Any) -> tuple[Tensor, ...]:
    """``(loss, lse, entropy, max, argmax, row_sum)``: :func:`chunked_cross_entropy`'s loss with no class
    weight or label smoothing, computed as ``lse - z[target]`` from one
    ``chunkce::linear_statistics`` walk of ``z = transform(hidden_states @ weight.T + bias)
    .to(statistics_dtype)`` (``hidden_states [..., H]``), and that walk's row statistics ``[N]``
    (fp32; fp64 for fp64). ``target`` has the leading shape of ``hidden_states``, or, given
    ``rows`` (int64, ``target``'s shape: the row of ``hidden_states`` each label is for, no row
    twice), of the loss's rows: the walk covers every row, the loss reads its own (logits sliced
    before the loss, ``logits[:, :-1]``). ``statistics_dtype`` rounds as ``logits_dtype`` does
    and has its accumulate dtype (the caller checks)."""
    flat_target = target.reshape(-1)  # [n]
    valid = flat_target != ignore_index  # [n]
    statistics, lse, selected = _walk_with_labels(
        hidden_states, weight, bias, flat_target.masked_fill(~valid, 0), rows,  # an ignored row gathers column 0
        statistics_dtype=statistics_dtype, transform=transform, projection_dtype=projection_dtype,
        chunk_size=chunk_size, chunk_bytes=chunk_bytes)
    loss = (lse - selected).masked_fill(~valid, 0.0)  # [n]
    if reduction == "none":
        loss = loss.view_as(target).to(logits_dtype)
    else:
        loss = reduce_total(loss.sum(), flat_target, None, reduction, ignore_index, 0.0, logits_dtype)
    return loss, statistics.lse, statistics.entropy, statistics.max, statistics.argmax, statistics.row_sum


def _walk_with_labels(hidden_states: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                      rows: Tensor | None, **options: Any) -> tuple[RowStatistics, Tensor, Tensor]:
    """``(statistics, lse, z_label)``: one ``chunkce::linear_statistics`` walk of every row of
    ``hidden_states [..., H]`` (``options``: :func:`chunked_statistics`' keywords, the statistics
    dtype its logits dtype too) that also gathers each row's ``z[label]``; ``lse`` and ``z_label``
    ``[n]`` of the labels' rows: ``labels [n]`` int64 in ``[0, V)``, one a row, or, given ``rows``
    (``[n]``-shaped: the row each label is for, no row twice), the rows ``rows`` names."""
    flat_hidden = hidden_states.flatten(0, -2)  # [N, H]
    picked = labels  # [N]
    if rows is not None:
        flat_rows = rows.reshape(-1)  # [n]
        picked = torch.zeros_like(flat_hidden[:, 0], dtype=torch.int64).index_put((flat_rows,), labels)  # [N]
    statistics = chunked_statistics(flat_hidden, weight, bias, picked.unsqueeze(-1), None,
                                    logits_dtype=options["statistics_dtype"], **options)
    lse, selected = statistics.lse, statistics.selected.squeeze(-1)  # [N]
    if rows is not None:
        lse, selected = lse.index_select(0, flat_rows), selected.index_select(0, flat_rows)  # [n]
    return statistics, lse, selected


CROSS_ENTROPY = Spelling("cross_entropy", read_cross_entropy, replace_cross_entropy,
                         one_walk=one_walk_cross_entropy)


_NLL_LOSS = (F.nll_loss, internals.nll_loss_nd.get(), internals.nll_loss.get())


def read_nll_loss(node: Node) -> LossCall | None:
    if node.op != "call_function" or node.target not in _NLL_LOSS:
        return None
    if node.target is F.nll_loss:
        args = bound_arguments(F.nll_loss, node)
    else:  # (input, target, weight, reduction: int, ignore_index)
        args = enum_arguments(node, 5)
    if not is_tensor_node(args["input"]):
        return None
    found = find_log_softmax(args["input"], negations=False)
    if found is None:
        return None
    return LossCall(input=args["input"], target=args["target"], weight=args["weight"],
                    ignore_index=args["ignore_index"], reduction=args["reduction"], spelling=NLL_LOSS,
                    passes=found.passes, unsupported=found.unsupported)


NLL_LOSS = Spelling("nll_loss", read_nll_loss, replace_cross_entropy,
                    one_walk=one_walk_cross_entropy)


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
    target = function_of(node) if node.op in CALLS else None
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
    if picked.dim() != log_probs.dim() or not is_last_dim(dim, log_probs.dim()):
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
    ``chunked_cross_entropy``'s. The labels as :func:`_gather_labels` makes them."""
    target = _gather_labels(target, weight.shape[0], ignore_index, squeeze, wraps)
    nll = chunked_cross_entropy(hidden_states, weight, target, bias, class_weight, ignore_index=ignore_index,
                                **options)  # [...] = -log p(target)
    return _shaped_as_gather(nll if negated else nll.neg(), flat)


def _gather_labels(target: Tensor, vocab_size: int, ignore_index: int, squeeze: bool, wraps: bool) -> Tensor:
    """The labels a gather reads, ``[...]`` int64: ``squeeze``: ``target`` is the ``[..., 1]`` index
    itself; ``wraps``: taken modulo ``V`` first, as ``take_along_dim``'s reference does. A label
    equal to ``ignore_index`` becomes -1, so that the op raises for it as ``gather`` does."""
    if squeeze:
        target = target.squeeze(-1)  # [..., 1] -> [...]
    if wraps:
        target = target.remainder(vocab_size)  # [...] in [0, V)
    return target.masked_fill(target == ignore_index, -1)  # [...]


def _shaped_as_gather(log_p: Tensor, flat: bool) -> Tensor:
    """Per-token values shaped like the labels, as the gather returns them: ``[..., 1]``, ``[N, 1]`` when ``flat``."""
    return log_p.reshape(-1, 1) if flat else log_p.unsqueeze(-1)


def log_probs_and_statistics(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                             class_weight: None, *, negated: bool, flat: bool, ignore_index: int, squeeze: bool,
                             wraps: bool, logits_dtype: torch.dtype, statistics_dtype: torch.dtype,
                             transform: HeadScale, projection_dtype: torch.dtype | None, chunk_size: int | None,
                             chunk_bytes: int | None, rows: Tensor | None = None,
                             **unused: Any) -> tuple[Tensor, ...]:
    """``(log_p, lse, entropy, max, argmax, row_sum)``: :func:`gathered_log_probs`' value, computed as
    ``z[label] - lse`` (``lse - z[label]`` when ``negated``) from one ``chunkce::linear_statistics``
    walk, and that walk's row statistics ``[N]``, as :func:`loss_and_statistics` gives them
    (``rows``: the labels' rows, as there)."""
    labels = _gather_labels(target, weight.shape[0], ignore_index, squeeze, wraps)
    statistics, lse, selected = _walk_with_labels(
        hidden_states, weight, bias, labels.reshape(-1), rows, statistics_dtype=statistics_dtype,
        transform=transform, projection_dtype=projection_dtype, chunk_size=chunk_size, chunk_bytes=chunk_bytes)
    log_p = (lse - selected) if negated else (selected - lse)  # [n]
    log_p = _shaped_as_gather(log_p.view_as(labels).to(logits_dtype), flat)
    return log_p, statistics.lse, statistics.entropy, statistics.max, statistics.argmax, statistics.row_sum


def replace_gather(call: GatherCall, projection: Projection) -> Callable[..., Any] | Reason:
    """:func:`gathered_log_probs` as the call says; none for a vocabulary-sharded head."""
    if projection.sharded is not None:
        return Reason(Refusal.TENSOR_PARALLEL, detail="a gather of log-probabilities (the vocabulary-parallel op "
                                                      "computes a loss)")
    return partial(gathered_log_probs, **_gather_keywords(call))


def one_walk_gather(call: GatherCall, projection: Projection) -> Callable[..., Any] | None:
    """:func:`log_probs_and_statistics` as the call says; None for a vocabulary-sharded head."""
    if projection.sharded is not None:
        return None
    return partial(log_probs_and_statistics, **_gather_keywords(call))


def _gather_keywords(call: GatherCall) -> dict[str, bool]:
    return {"negated": call.negated, "flat": call.flat, "squeeze": call.squeeze, "wraps": call.wraps}


GATHER = Spelling("gather", read_gather, replace_gather, one_walk=one_walk_gather)


_LOG = (torch.log, torch.Tensor.log)
_NEG = (operator.neg, torch.neg, torch.negative, torch.Tensor.neg, torch.Tensor.negative)
_MAX_STEPS = 16  # nodes between a loss and its log_softmax the reader looks through


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
    for _ in range(_MAX_STEPS):
        if node.op not in CALLS or not is_tensor_node(node):
            return None
        target = function_of(node)
        if not node.args or not is_tensor_node(node.args[0]):  # e.g. input= as a keyword: not read
            return None
        if target in LOG_SOFTMAX:
            return LogProbs({node: StepKind.LOG_SOFTMAX, **dict.fromkeys(negs, StepKind.NEG)}, len(negs) % 2 == 1,
                            _log_softmax_problem(node, path))
        if target in _LOG and isinstance(node.args[0], Node) and function_of(node.args[0]) in SOFTMAX:
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
    if not is_last_dim(dim, logits.dim()):
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
