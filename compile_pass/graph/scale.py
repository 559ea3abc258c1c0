"""Read a scaling of the logits by a constant between projection and loss, which the op takes
as its head transform: ``logits * s``, ``s * logits`` or ``logits / s`` (operator, torch or
method spellings) with ``s`` a Python number, a 0-d tensor node that needs no grad, or the
``.item()`` of one. Anything else is a stop of the walk (:class:`compile_pass.graph.refusals.Refusal`).
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.fx import Graph, Node

from compile_pass.graph.nodes import create_node, example_value, function_of, is_tensor_node
from compile_pass.graph.refusals import Refusal
from compile_pass.op.transform import HeadTransform

# A scaling of the logits by a constant, out of place: absorbed into the op.
_MULTIPLY = (operator.mul, torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply)
_DIVIDE = (operator.truediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div,
           torch.Tensor.divide, torch.Tensor.true_divide)
# ... in place: refused (``Refusal.IN_PLACE_SCALE``).
_SCALE_IN_PLACE = (operator.imul, operator.itruediv, torch.Tensor.mul_, torch.Tensor.multiply_,
                   torch.Tensor.div_, torch.Tensor.divide_, torch.Tensor.true_divide_)


@dataclass(frozen=True)
class Scale:
    """``logits * value`` (``logits / value`` when ``divides``) between projection and loss."""

    node: Node  # the mul / div; its dtype (the logits', no promotion) is the dtype it scales in
    logits: Node  # its logits operand
    value: Any  # a Python int / float, or the node of a 0-d tensor that does not require grad
    divides: bool
    item: Node | None = None  # the `value.item()` the graph scaled by (a float input Dynamo made dynamic)

    @property
    def dtype(self) -> torch.dtype:
        return example_value(self.node).dtype

    def head_transform(self, meta: dict) -> HeadTransform:
        """What the op takes for this scaling (its ``transform``), in the dtype the graph
        scaled in; the scale a number or a 0-d tensor node (for ``tensor.item()``, a new
        node before the loss, with ``meta``: :func:`_scale_from_item`)."""
        value = self.value if self.item is None else _scale_from_item(self.node.graph, self.value, self.item, meta)
        return HeadTransform(scale=value, divides=self.divides, dtype=self.dtype)


class ScaleRead(NamedTuple):
    """What :func:`read_scale` found: a :class:`Scale`, or a stop kind and what of the scaling stops it."""

    scale: Scale | None
    stop_kind: Refusal | None = None
    detail: str | None = None


def read_scale(node: Node) -> ScaleRead | None:
    """The scaling a multiply / divide ``node`` applies to the logits (in their own dtype), a stop
    (``IN_PLACE_SCALE``, ``SCALE_REQUIRES_GRAD``, ``SCALE_OPERAND``), or None for no such node."""
    function = function_of(node)
    if function in _SCALE_IN_PLACE or (function in _MULTIPLY + _DIVIDE and "out" in node.kwargs):
        return ScaleRead(None, Refusal.IN_PLACE_SCALE)
    if function not in _MULTIPLY + _DIVIDE:
        return None
    divides = function in _DIVIDE
    kwargs = dict(node.kwargs)
    rounding_mode = kwargs.pop("rounding_mode", None)
    operands = [*node.args, *(kwargs.pop(name) for name in ("input", "other") if name in kwargs)]
    if kwargs or len(operands) != 2 or not is_tensor_node(node):
        return ScaleRead(None, Refusal.SCALE_OPERAND, "arguments chunkce cannot read")
    if rounding_mode is not None:
        return ScaleRead(None, Refusal.SCALE_OPERAND, f"a division with rounding_mode={rounding_mode!r}")
    output = example_value(node)
    candidates = [i for i, arg in enumerate(operands) if is_tensor_node(arg)
                  and example_value(arg).dim() >= 1 and example_value(arg).shape == output.shape]
    if len(candidates) != 1:
        return ScaleRead(None, Refusal.SCALE_OPERAND, "a product or quotient of two [..., V] tensors")
    position = candidates[0]
    if divides and position == 1:
        return ScaleRead(None, Refusal.SCALE_OPERAND, "the logits are the divisor: `s / logits`")
    logits, value = operands[position], operands[1 - position]
    item = _item_of_0d_tensor(value)
    value = value if item is None else item.args[0]
    problem = _scale_problem(value, example_value(logits), output)
    if problem is not None:
        return ScaleRead(None, *problem)
    return ScaleRead(Scale(node, logits, value, divides, item))


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


def _scale_from_item(graph: Graph, tensor: Node, item: Node, meta: dict) -> Node:
    """The op's 0-d scale for ``logits / tensor.item()``: ``ones_like(tensor) * item``, exactly
    ``tensor``; reading ``item`` keeps the float dynamic (unread, AOTAutograd would specialise
    it and recompile for every value)."""
    ones = create_node(graph, "call_function", torch.ones_like, (tensor,), meta=meta)  # [] fp64
    return create_node(graph, "call_function", operator.mul, (ones, item), meta=meta)  # [] fp64
