"""The spelling ``cross_entropy``: torch's own cross-entropy call.

    F.cross_entropy(z, y, ...)            call_function torch.nn.functional.cross_entropy
    nn.CrossEntropyLoss(...)(z, y)        (Dynamo inlines the module, every keyword spelled out)
    torch._C._nn.cross_entropy_loss(...)  (reduction as torch's enum int)

Replaced by the op's loss (:func:`compile_pass.op.function.chunked_cross_entropy`), or, for a
vocabulary-sharded head, the vocabulary-parallel loss (:func:`compile_pass.graph.tensor_parallel.loss_function`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from compile_pass.graph import tensor_parallel
from compile_pass.graph.calls import Call, Spelling
from compile_pass.graph.forms import Projection
from compile_pass.op.function import chunked_cross_entropy

REDUCTION_ENUM = {0: "none", 1: "mean", 2: "sum"}  # torch's reduction ints (cross_entropy_loss, nll_loss_nd)
_ENUM_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_ENUM_DEFAULTS = (None, None, None, 1, -100, 0.0)


def read(node: Node) -> Call | None:
    """The call's arguments normalised; None when ``node`` is no cross-entropy call."""
    if node.op != "call_function":
        return None
    if node.target is torch._C._nn.cross_entropy_loss:
        return Call(**enum_arguments(node, len(_ENUM_ARGS)), spelling=SPELLING)
    if node.target is not F.cross_entropy:
        return None
    args = bound_arguments(F.cross_entropy, node)
    return Call(args["input"], args["target"], args["weight"], args["ignore_index"], args["reduction"],
                args["label_smoothing"], SPELLING)


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
        args["reduction"] = torch.nn._reduction.legacy_get_string(args["size_average"], args["reduce"],
                                                                  emit_warning=False)
    return args


def replace(call: Call, projection: Projection) -> Callable[..., Any]:
    """The op's loss; a vocabulary-sharded head's vocabulary-parallel loss."""
    if projection.sharded is not None:
        return tensor_parallel.loss_function(projection.sharded)
    return chunked_cross_entropy


SPELLING = Spelling("cross_entropy", read, replace)
