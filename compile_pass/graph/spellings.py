"""The older spellings of a cross-entropy loss, read as a :class:`CrossEntropyCall`.

    F.nll_loss(F.log_softmax(z, -1), y, weight, ignore_index=, reduction=)
    nn.NLLLoss(...)(nn.LogSoftmax(dim=-1)(z), y)      (Dynamo inlines both modules)
        call_function torch.nn.functional.nll_loss(log_probs, y, ...)
        log_probs from F.log_softmax / torch.log_softmax / Tensor.log_softmax over the
        class dim, ``dtype=`` kwarg or not; shape/dtype-only ops in between
    -log_softmax(z, -1).gather(-1, y.unsqueeze(-1))   (torch.gather, take_along_dim; y[..., None],
        y.reshape(-1, 1), y[:, 1:, None], any [..., 1] index; the negation before or after the
        gather, or after the reduction)

``nll_loss(log_softmax(z), ...)`` is what ``F.cross_entropy(z, ...)`` computes for
class-index targets and no label smoothing (``cross_entropy_loss`` in ATen's
``LossNLL.cpp`` calls ``nll_loss_nd(log_softmax(z, 1), ...)``), every reduction,
class weight and ignore_index included: the site is read as that cross-entropy.

A gather reads one log-probability per token, ``[..., 1]`` (:class:`compile_pass.graph.forms.Gather`
says how): the rewrite replaces the gather node by the op's ``reduction="none"`` output,
negated and unsqueezed, and everything after it (squeeze, negation, ``mean`` / ``sum`` /
a mask) stays as graph ops, so every reduction is the user's own. A gather has no
ignore_index: the call gets one no label can equal (:data:`NO_IGNORE_INDEX`).

Each reader returns None for a node that is not such a loss. A spelling the op
cannot reproduce exactly is still read, with ``unsupported`` saying why (the guard
refuses it with that reason).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.fx import Node

from compile_pass.graph.forms import (
    REDUCTION_ENUM,
    CrossEntropyCall,
    Gather,
    as_projection,
    legacy_reduction,
    read_cross_entropy,
)
from compile_pass.graph.nodes import example_value, function_of, is_tensor_node, same_size, tensor_op_name

NLL_LOSS_FUNCTIONS = (F.nll_loss, torch._C._nn.nll_loss_nd, torch._C._nn.nll_loss)
_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, torch.special.log_softmax, torch.Tensor.log_softmax)
_SOFTMAX = (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax)
_LOG = (torch.log, torch.Tensor.log)
_NEG = (operator.neg, torch.neg, torch.negative, torch.Tensor.neg, torch.Tensor.negative)
_GATHER = (torch.gather, torch.Tensor.gather)
_TAKE_ALONG_DIM = (torch.take_along_dim, torch.Tensor.take_along_dim)
_UNSQUEEZE_LAST = {"unsqueeze", "getitem", "view", "reshape"}
_MAX_DEPTH = 16  # nodes between a loss and its log_softmax the reader looks through

NO_IGNORE_INDEX = torch.iinfo(torch.int64).min  # the op's ignore_index for a gather: no label is ignored


def read_loss(node: Node) -> CrossEntropyCall | None:
    """The cross-entropy a node computes, in any spelling chunkce reads; None when it is none.

    ``F.cross_entropy`` (:func:`compile_pass.graph.forms.read_cross_entropy`),
    ``F.nll_loss`` of a log_softmax (:func:`read_nll_loss`), a gather of a log_softmax
    (:func:`read_gathered_log_probs`).
    """
    if node.op not in ("call_function", "call_method"):
        return None
    return read_cross_entropy(node) or read_nll_loss(node) or read_gathered_log_probs(node)


class _LogProbs(NamedTuple):
    """What lies between a loss's input and the log_softmax that made it."""

    passes: dict[Node, str]  # the log_softmax and the negations on the way
    negated: bool  # an odd number of negations
    unsupported: str | None


def _log_softmax_dim(node: Node) -> Any:
    args = node.args[1:] if node.op == "call_method" else node.args[1:2]
    return node.kwargs.get("dim", args[0] if args else None)


def _find_log_softmax(start: Node, negations: bool) -> _LogProbs | None:
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
            return _LogProbs({node: "log_softmax", **dict.fromkeys(negs, "neg")}, len(negs) % 2 == 1,
                             _log_softmax_problem(node, path))
        if target in _LOG and isinstance(node.args[0], Node) and function_of(node.args[0]) in _SOFTMAX:
            return _LogProbs({}, False, "log(softmax(logits)) is not torch's log_softmax (it rounds differently "
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


def read_nll_loss(node: Node) -> CrossEntropyCall | None:
    """``nll_loss(log_softmax(z, dim=-1), target, ...)`` as ``cross_entropy(z, target, ...)``, or None.

    Reads ``F.nll_loss`` (``nn.NLLLoss`` inlined), ``torch._C._nn.nll_loss_nd`` and
    ``torch._C._nn.nll_loss`` (reduction as torch's enum int). The log_softmax must be
    over the last dim of the logits; shape/dtype-only ops (and a class-dim transpose)
    may come before and after it, a dtype-changing cast only before (else ``unsupported``).
    An nll_loss whose input is not a log_softmax is not a cross-entropy: None.
    """
    if node.op != "call_function" or node.target not in NLL_LOSS_FUNCTIONS:
        return None
    if node.target is F.nll_loss:
        bound = inspect.signature(F.nll_loss).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        args = dict(bound.arguments)
        args["reduction"] = legacy_reduction(args)
    else:  # (input, target, weight, reduction: int, ignore_index)
        names = ("input", "target", "weight", "reduction", "ignore_index")
        args = dict(zip(names, (None, None, None, 1, -100)))
        args.update(zip(names, node.args))
        args.update(node.kwargs)
        args["reduction"] = REDUCTION_ENUM.get(args["reduction"], args["reduction"])
    if not is_tensor_node(args["input"]):
        return None
    found = _find_log_softmax(args["input"], negations=False)
    if found is None:
        return None
    return CrossEntropyCall(args["input"], args["target"], args["weight"], args["ignore_index"],
                            args["reduction"], 0.0, form="nll_loss", passes=found.passes,
                            unsupported=found.unsupported)


def read_gathered_log_probs(node: Node) -> CrossEntropyCall | None:
    """``log_softmax(z, -1).gather(-1, labels.unsqueeze(-1))`` (negated or not), or None.

    The call reads as a ``reduction="none"`` cross-entropy of ``z`` and ``labels``
    whose per-token loss, negated unless the log-probabilities were, and unsqueezed
    to ``[..., 1]``, is the gather's value (``gather``: :class:`compile_pass.graph.forms.Gather`). The index
    must be shaped ``[..., 1]``, exactly as large as the log-probabilities in every
    other dim (a smaller gather index reads a corner of them: ``unsupported``). The
    labels are what the index was made from when it is ``labels.unsqueeze(-1)`` /
    ``labels[..., None]`` / a view with a trailing 1 added, or ``labels.reshape(-1, 1)``
    for ``[N, V]`` log-probabilities; any other index (``labels[:, 1:, None]``, a
    permute) is squeezed: ``gather(-1, index)`` reads class ``index[..., 0]`` of each row.
    """
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
    found = _find_log_softmax(source, negations=True)
    if found is None:
        return None
    unsupported = found.unsupported
    labels, flat = _squeezed_labels(index)
    full = all(same_size(a, b) for a, b in zip(picked.shape[:-1], log_probs.shape[:-1]))
    if not (full and same_size(picked.shape[-1], 1)):
        unsupported = unsupported or (f"gather index of shape {tuple(picked.shape)} for log-probabilities of shape "
                                      f"{tuple(log_probs.shape)}: chunkce reads one label per token "
                                      "(an index shaped [..., 1] like the log-probabilities)")
    return CrossEntropyCall(source, index if labels is None else labels, None, NO_IGNORE_INDEX, "none", 0.0,
                            form="gather", passes=found.passes, class_dim=-1,
                            inner=(index,) if labels is not None else (), unsupported=unsupported,
                            gather=Gather(negated=found.negated, flat=flat, squeeze=labels is None,
                                          wraps=target in _TAKE_ALONG_DIM))


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
