"""The projection a site starts from, in every spelling Dynamo 2.13 emits:

    nn.Linear / F.linear        call_function torch._C._nn.linear(h, W, b|None)
    h @ W.t() / matmul(h, W.T)  call_function operator.matmul / torch.matmul,
                                W.t() = call_method t, W.T = call_function getattr(W, "T")
    h @ W.t() + b               the matmul under operator.add of a [V] or [1, V] tensor (a bias;
                                HF's final_logits_bias [1, V] on a linear without bias)
    logits = h @ W.t(); logits += b
                                operator.iadd / Tensor.add_ of such a tensor on a matmul or linear
                                that nothing else reads (Cut Cross-Entropy's reference spelling);
                                one added to a linear that has a bias is not folded into it (refused)

The other end, what consumes the logits, is a spelling's (:mod:`compile_pass.graph.spellings`).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph.nodes import dims_arg, example_value, function_of, is_tensor_node, same_size, tensor_op_name

_LINEAR = (internals.nn_linear.get(), F.linear)
_MATMUL = (operator.matmul, torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
_ADD = (operator.add, torch.add, torch.Tensor.add)
_ADD_IN_PLACE = (operator.iadd, torch.Tensor.add_)  # `logits += bias`: a bias add when nothing else reads `logits`
_TRANSPOSE_2D = {"t", "transpose", "swapaxes", "swapdims", "permute", ".T", ".mT"}


@dataclass(frozen=True)
class Projection:
    """``logits = hidden @ weight.T + bias`` however it was spelled."""

    node: Node  # its output is the logits
    hidden: Any  # [..., H]
    weight: Any  # [V, H], or [H, V] when weight_is_hv
    bias: Any = None  # [V], [1, ..., 1, V] (an added one: the rewrite flattens it) or None
    weight_is_hv: bool = False
    inner: tuple[Node, ...] = ()  # nodes of the form besides `node` (W.t(), the matmul under a bias add)
    # a vocabulary-sharded (tensor-parallel) head: its tensor_parallel.VocabShard; `node` then is the
    # logits gathered or kept Shard(-1), `hidden` / `weight` / `bias` DTensors (graph/tensor_parallel.py)
    sharded: Any = None


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
            if _is_bias_of(example_value(bias), example_value(base)):
                return Projection(node, inner.hidden, inner.weight, bias, inner.weight_is_hv,
                                  (*inner.inner, inner.node))
    return None


def _is_bias_of(b: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether ``logits [..., V] + b`` adds one ``[V]`` row to every token: ``b`` is ``[V]`` or
    ``[1, ..., 1, V]`` (HF's ``final_logits_bias [1, V]``), with no more dims than the logits
    (the sum keeps their shape) and their dtype (the sum is not promoted)."""
    if b.dim() == 0 or b.dim() > logits.dim() or b.dtype != logits.dtype:
        return False
    return same_size(b.shape[-1], logits.shape[-1]) and all(same_size(size, 1) for size in b.shape[:-1])
