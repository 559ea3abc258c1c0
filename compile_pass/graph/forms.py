"""The two ends of a site, the cross-entropy call and the projection, in every
spelling Dynamo 2.13 emits:

    nn.Linear / F.linear        call_function torch._C._nn.linear(h, W, b|None)
    h @ W.t() / matmul(h, W.T)  call_function operator.matmul / torch.matmul,
                                W.t() = call_method t, W.T = call_function getattr(W, "T")
    h @ W.t() + b               the matmul under operator.add of a [V] tensor (a bias)
    logits = h @ W.t(); logits += b
                                operator.iadd / Tensor.add_ of a [V] tensor on a matmul or linear
                                that nothing else reads (Cut Cross-Entropy's reference spelling)
    F.cross_entropy, nn.CrossEntropyLoss
                                call_function torch.nn.functional.cross_entropy
                                (the module is inlined, all its keywords spelled out)

The older loss spellings (``nll_loss(log_softmax(z))``, ``-log_softmax(z).gather``) are
read into the same :class:`CrossEntropyCall` by :mod:`compile_pass.graph.spellings`.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from compile_pass.graph.nodes import dims_arg, example_value, function_of, is_tensor_node, same_size, tensor_op_name

CROSS_ENTROPY_FUNCTIONS = (F.cross_entropy, torch._C._nn.cross_entropy_loss)
_LINEAR = (torch._C._nn.linear, F.linear)
_MATMUL = (operator.matmul, torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
_ADD = (operator.add, torch.add, torch.Tensor.add)
_ADD_IN_PLACE = (operator.iadd, torch.Tensor.add_)  # `logits += bias`: a bias add when nothing else reads `logits`
REDUCTION_ENUM = {0: "none", 1: "mean", 2: "sum"}  # torch's reduction ints (cross_entropy_loss, nll_loss_nd)
_TRANSPOSE_2D = {"t", "transpose", "swapaxes", "swapdims", "permute", ".T", ".mT"}


@dataclass(frozen=True)
class CrossEntropyCall:
    """A cross-entropy call with every argument spelled out (torch defaults filled in).

    The defaults describe ``F.cross_entropy`` itself; an older spelling
    (:mod:`compile_pass.graph.spellings`) says what differs: the nodes the walk back
    to the projection passes that are not shape/dtype-only, what the loss node's
    value is (``gather``), and what in it the op cannot reproduce. What replaces the
    call is the rewrite's choice (:mod:`compile_pass.graph.rewrite`).
    """

    input: Any  # what the loss node reads: logits, or log-probabilities of a spelling
    target: Any
    weight: Any  # class weights Node or None
    ignore_index: Any
    reduction: Any
    label_smoothing: Any
    form: str = "cross_entropy"  # the spelling: "cross_entropy", "nll_loss" (of a log_softmax), "gather"
    # nodes between the projection and `input` the walk passes although they are not
    # shape/dtype-only: the log_softmax of a spelling ("log_softmax") and its negations ("neg")
    passes: Mapping[Node, str] = field(default_factory=dict)
    class_dim: int = 1  # of an input with 3 or more dims: 1 (torch's losses) or -1 (a gather)
    inner: tuple[Node, ...] = ()  # nodes of the spelling besides the loss node (a gather's index)
    unsupported: str | None = None  # what of this spelling the op cannot reproduce (refused)
    gather: Gather | None = None  # form "gather": what the gather's value is


@dataclass(frozen=True)
class Gather:
    """What a gather of log-probabilities reads (``form="gather"``): ``[..., 1]``, one per token."""

    negated: bool  # the log-probabilities were negated before the gather (its value is the loss)
    flat: bool  # the index was ``labels.reshape(-1, 1)`` of ``[N, V]`` log-probabilities: ``[N, 1]``
    squeeze: bool  # the call's target is the ``[..., 1]`` index itself, not labels it was made from
    wraps: bool = False  # take_along_dim: it reads class ``index % V`` (its reference wraps, checks nothing)


@dataclass(frozen=True)
class Projection:
    """``logits = hidden @ weight.T + bias`` however it was spelled."""

    node: Node  # its output is the logits
    hidden: Any  # [..., H]
    weight: Any  # [V, H], or [H, V] when weight_is_hv
    bias: Any = None  # [V] or None
    weight_is_hv: bool = False
    inner: tuple[Node, ...] = ()  # nodes of the form besides `node` (W.t(), the matmul under a bias add)
    # a vocabulary-sharded (tensor-parallel) head: its tensor_parallel.VocabShard; `node` then is the
    # logits gathered or kept Shard(-1), `hidden` / `weight` / `bias` DTensors (graph/tensor_parallel.py)
    sharded: Any = None


def read_cross_entropy(node: Node) -> CrossEntropyCall | None:
    """Normalize a cross-entropy call's arguments; None when the node is not one."""
    if node.op != "call_function" or node.target not in CROSS_ENTROPY_FUNCTIONS:
        return None
    if node.target is torch._C._nn.cross_entropy_loss:  # (input, target, weight, reduction:int, ignore_index, ls)
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        values = dict(zip(names, (None, None, None, 1, -100, 0.0)))
        values.update(zip(names, node.args))
        values.update(node.kwargs)
        values["reduction"] = REDUCTION_ENUM.get(values["reduction"], values["reduction"])
        return CrossEntropyCall(**values)
    bound = inspect.signature(F.cross_entropy).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    args = bound.arguments
    return CrossEntropyCall(args["input"], args["target"], args["weight"], args["ignore_index"],
                            legacy_reduction(args), args["label_smoothing"])


def legacy_reduction(args: Mapping[str, Any]) -> Any:
    """``reduction`` of a loss's bound arguments, with the deprecated ``size_average`` /
    ``reduce`` mapped onto it as torch maps them when either is given."""
    if args["size_average"] is None and args["reduce"] is None:
        return args["reduction"]
    return torch.nn._reduction.legacy_get_string(args["size_average"], args["reduce"], emit_warning=False)


def _transposed_2d_input(node: Any) -> Node | None:
    """``W`` when ``node`` is ``W.t()`` / ``W.T`` / ``W.transpose(0, 1)`` / ... of a 2-D ``W``."""
    if not isinstance(node, Node) or tensor_op_name(node) not in _TRANSPOSE_2D:
        return None
    source = node.args[0]
    if not is_tensor_node(source) or example_value(source).dim() != 2:
        return None
    name, rest = tensor_op_name(node), list(node.args[1:])
    if name == "permute":
        return source if [d % 2 for d in dims_arg(rest)] == [1, 0] else None
    if name in ("transpose", "swapaxes", "swapdims"):
        return source if len(rest) == 2 and {d % 2 for d in rest} == {0, 1} else None
    return source  # t, .T, .mT


def as_projection(node: Any) -> Projection | None:
    """The plain linear / matmul producing ``node``, or None."""
    if not isinstance(node, Node) or node.op not in ("call_function", "call_method"):
        return None
    target = function_of(node)
    if target in _LINEAR:
        bound = inspect.signature(lambda input, weight, bias=None: None).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return Projection(node, a["input"], a["weight"], a["bias"])
    if target in _MATMUL and len(node.args) == 2 and not node.kwargs:
        hidden, rhs = node.args
        if not (is_tensor_node(hidden) and is_tensor_node(rhs)) or example_value(rhs).dim() != 2:
            return None
        weight = _transposed_2d_input(rhs)
        if weight is not None:
            return Projection(node, hidden, weight, inner=(rhs,))
        return Projection(node, hidden, rhs, weight_is_hv=True)
    in_place = target in _ADD_IN_PLACE
    if (target in _ADD or in_place) and len(node.args) == 2 and not node.kwargs:
        for base, bias in (node.args,) if in_place else (node.args, node.args[::-1]):  # `b += logits`: no bias
            inner = as_projection(base)
            if inner is None or inner.bias is not None or not is_tensor_node(bias):
                continue
            if in_place and len(base.users) != 1:  # another reader of the logits, before or after the add
                continue
            logits, b = example_value(base), example_value(bias)
            if b.dim() == 1 and same_size(b.shape[0], logits.shape[-1]) and b.dtype == logits.dtype:
                return Projection(node, inner.hidden, inner.weight, bias, inner.weight_is_hv,
                                  (*inner.inner, inner.node))
    return None


