"""The projection a site starts from, and the one scaling of its logits the op absorbs.

    nn.Linear / F.linear        call_function torch._C._nn.linear(h, W, b|None)
    h @ W.t() / matmul(h, W.T)  call_function operator.matmul / torch.matmul,
                                W.t() = call_method t, W.T = call_function getattr(W, "T")
    h @ W.t() + b               the matmul under operator.add of a [V] or [1, V] tensor (a bias;
                                HF's final_logits_bias [1, V] on a linear without bias)
    logits = h @ W.t(); logits += b
                                operator.iadd / Tensor.add_ of such a tensor on a matmul or linear
                                that nothing else reads (Cut Cross-Entropy's reference spelling);
                                one added to a linear that has a bias is not folded into it (refused)

The scaling (:func:`read_scale`): ``logits * s``, ``s * logits`` or ``logits / s`` (operator, torch
or method spellings) with ``s`` a Python number, a 0-d tensor node that needs no grad, or the
``.item()`` of one, read as the op's :class:`compile_pass.op.kernels.HeadScale` of nodes (the op's
call takes it through :func:`op_scale`); anything else is a stop of the walk
(:class:`compile_pass.graph.refusals.Refusal`). The other end, what consumes the logits, is a
spelling's (:mod:`compile_pass.graph.spellings`).
"""

from __future__ import annotations

import inspect
import numbers
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph.nodes import (
    CALLS,
    MULTIPLY,
    TRANSPOSES,
    create_node,
    dims_arg,
    example_value,
    function_of,
    is_tensor_node,
    same_size,
    tensor_op_name,
)
from compile_pass.graph.refusals import Refusal
from compile_pass.op.kernels import HeadScale

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

    def autocast_dtype(self) -> torch.dtype | None:
        """The logits' dtype where the hidden states or weight have another (autocast's), else None."""
        projected = example_value(self.node)
        operands = [example_value(a) for a in (self.hidden, self.weight) if is_tensor_node(a)]
        return projected.dtype if any(v.dtype != projected.dtype for v in operands) else None


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
    if name in TRANSPOSES:
        return source if len(rest) == 2 and {d % 2 for d in rest} == {0, 1} else None
    return source  # t, .T, .mT


def as_projection(node: Any) -> Projection | None:
    """The plain linear / matmul producing ``node``, or None."""
    if not isinstance(node, Node) or node.op not in CALLS:
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


# A scaling of the logits by a constant, out of place: absorbed into the op.
_DIVIDE = (operator.truediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div,
           torch.Tensor.divide, torch.Tensor.true_divide)
# ... in place: refused (``Refusal.IN_PLACE_SCALE``).
_SCALE_IN_PLACE = (operator.imul, operator.itruediv, torch.Tensor.mul_, torch.Tensor.multiply_,
                   torch.Tensor.div_, torch.Tensor.divide_, torch.Tensor.true_divide_)


class ScaleRead(NamedTuple):
    """What :func:`read_scale` found at a multiply / divide ``node``: the :class:`HeadScale` (its
    tensor a node) its ``logits`` operand is scaled by, or a stop kind and what of the scaling stops it."""

    scale: HeadScale[Node] | None
    node: Node | None = None
    logits: Node | None = None
    stop_kind: Refusal | None = None
    detail: str | None = None


def read_scale(node: Node) -> ScaleRead | None:
    """The scaling a multiply / divide ``node`` applies to the logits (in their own dtype), a stop
    (``IN_PLACE_SCALE``, ``SCALE_REQUIRES_GRAD``, ``SCALE_OPERAND``), or None for no such node."""
    function = function_of(node)
    if function in _SCALE_IN_PLACE or (function in MULTIPLY + _DIVIDE and "out" in node.kwargs):
        return ScaleRead(None, stop_kind=Refusal.IN_PLACE_SCALE)
    if function not in MULTIPLY + _DIVIDE:
        return None
    divides = function in _DIVIDE
    kwargs = dict(node.kwargs)
    rounding_mode = kwargs.pop("rounding_mode", None)
    operands = [*node.args, *(kwargs.pop(name) for name in ("input", "other") if name in kwargs)]
    if kwargs or len(operands) != 2 or not is_tensor_node(node):
        return ScaleRead(None, stop_kind=Refusal.SCALE_OPERAND, detail="arguments chunkce cannot read")
    if rounding_mode is not None:
        return ScaleRead(None, stop_kind=Refusal.SCALE_OPERAND, detail=f"a division with rounding_mode={rounding_mode!r}")
    output = example_value(node)
    candidates = [i for i, arg in enumerate(operands) if is_tensor_node(arg)
                  and example_value(arg).dim() >= 1 and example_value(arg).shape == output.shape]
    if len(candidates) != 1:
        return ScaleRead(None, stop_kind=Refusal.SCALE_OPERAND, detail="a product or quotient of two [..., V] tensors")
    position = candidates[0]
    if divides and position == 1:
        return ScaleRead(None, stop_kind=Refusal.SCALE_OPERAND, detail="the logits are the divisor: `s / logits`")
    logits, value = operands[position], operands[1 - position]
    item = _item_of_0d_tensor(value)
    problem = _scale_problem(value if item is None else item.args[0], example_value(logits), output)
    if problem is not None:
        return ScaleRead(None, stop_kind=problem[0], detail=problem[1])
    number, tensor = (None, value) if isinstance(value, Node) else (value, None)  # tensor: the node, or its .item()
    return ScaleRead(HeadScale(number, tensor, divides, output.dtype), node, logits)


def _item_of_0d_tensor(value: Any) -> Node | None:
    """``t`` when ``value`` is ``t.item()`` of a 0-d tensor node (a float Dynamo made dynamic),
    else None: scaling by either rounds the same."""
    if not (isinstance(value, Node) and value.op == "call_method" and value.target == "item"
            and len(value.args) == 1 and not value.kwargs and is_tensor_node(value.args[0])):
        return None
    return value if example_value(value.args[0]).dim() == 0 else None


def _scale_problem(value: Any, logits: torch.Tensor, output: torch.Tensor) -> tuple[Refusal, str] | None:
    """Why the op cannot take ``value`` as the scale of ``logits`` (giving ``output``):
    ``(stop kind, detail)``, or None."""
    if isinstance(value, Node):
        fake = example_value(value)
        if isinstance(fake, (torch.SymInt, torch.SymFloat)):
            return Refusal.SCALE_OPERAND, (f"the symbolic number `{value.name}`: a Python number Dynamo made "
                                     "dynamic; pass it as a 0-d tensor")
        if not isinstance(fake, torch.Tensor):
            return Refusal.SCALE_OPERAND, f"`{value.name}`, which is not a tensor or a number"
        if fake.dim() != 0:
            return Refusal.SCALE_OPERAND, (f"a multiplier of shape {tuple(fake.shape)}, broadcast over the "
                                     "logits, not a 0-d tensor")
        if fake.is_complex() or fake.dtype == torch.bool:
            return Refusal.SCALE_OPERAND, f"a 0-d tensor of dtype {fake.dtype}"
        if fake.requires_grad:
            return Refusal.SCALE_REQUIRES_GRAD, f"`{value.name}`"
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Refusal.SCALE_OPERAND, f"the constant {value!r}, not a real number"
    if output.dtype != logits.dtype or not output.is_floating_point():
        return Refusal.SCALE_OPERAND, f"a scale that changes the logits' dtype ({logits.dtype} -> {output.dtype})"
    return None


def op_scale(scale: HeadScale[Node], meta: dict) -> HeadScale[Node]:
    """The scaling the op's call takes for ``scale`` read from the graph: a number or a 0-d tensor
    node; for ``tensor.item()``, ``ones_like(tensor) * item`` (new nodes before the loss, with
    ``meta``), exactly ``tensor``: reading ``item`` keeps the float dynamic (unread, AOTAutograd
    would specialise it and recompile for every value)."""

    def zero_dim(node: Node) -> Node:
        if _item_of_0d_tensor(node) is None:
            return node
        ones = create_node(node.graph, "call_function", torch.ones_like, (node.args[0],), meta=meta)  # [] fp64
        return create_node(node.graph, "call_function", operator.mul, (ones, node), meta=meta)  # [] fp64

    return scale.map(zero_dim)
