"""The spelling ``cross_entropy``: torch's own cross-entropy call.

    F.cross_entropy(z, y, ...)            call_function torch.nn.functional.cross_entropy
    nn.CrossEntropyLoss(...)(z, y)        (Dynamo inlines the module, every keyword spelled out)
    torch._C._nn.cross_entropy_loss(...)  (reduction as torch's enum int)

Replaced by the op's loss (:func:`compile_pass.op.function.chunked_cross_entropy`), or, for a
vocabulary-sharded head, the vocabulary-parallel loss (:func:`compile_pass.graph.tensor_parallel.loss_function`);
in one walk with its returned logits' row statistics (:mod:`compile_pass.graph.one_walk`), by
:func:`loss_and_statistics`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph import tensor_parallel
from compile_pass.graph.calls import Call, Spelling
from compile_pass.graph.forms import Projection
from compile_pass.op.function import chunked_cross_entropy
from compile_pass.op.reduction import reduce_total
from compile_pass.op.statistics import chunked_statistics

REDUCTION_ENUM = {0: "none", 1: "mean", 2: "sum"}  # torch's reduction ints (cross_entropy_loss, nll_loss_nd)
_ENUM_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_ENUM_DEFAULTS = (None, None, None, 1, -100, 0.0)


def read(node: Node) -> Call | None:
    """The call's arguments normalised; None when ``node`` is no cross-entropy call."""
    if node.op != "call_function":
        return None
    if node.target is internals.cross_entropy_loss.get():
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
        args["reduction"] = internals.legacy_reduction(args["size_average"], args["reduce"], emit_warning=False)
    return args


def replace(call: Call, projection: Projection) -> Callable[..., Any]:
    """The op's loss; a vocabulary-sharded head's vocabulary-parallel loss."""
    if projection.sharded is not None:
        return tensor_parallel.loss_function(projection.sharded)
    return chunked_cross_entropy


def one_walk(call: Call, projection: Projection) -> Callable[..., Any] | None:
    """:func:`loss_and_statistics`; None for a class weight, label smoothing or a sharded head."""
    if projection.sharded is not None or call.weight is not None or call.label_smoothing != 0.0:
        return None
    return loss_and_statistics


def loss_and_statistics(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                        class_weight: None, *, reduction: str, ignore_index: int, logits_dtype: torch.dtype,
                        statistics_dtype: torch.dtype, transform: Any, projection_dtype: torch.dtype | None,
                        chunk_size: int | None, chunk_bytes: int | None, **unused: Any) -> tuple[Tensor, ...]:
    """``(loss, lse, entropy, max, argmax)``: :func:`chunked_cross_entropy`'s loss with no class
    weight or label smoothing, computed as ``lse - z[target]`` from one
    ``chunkce::linear_statistics`` walk of ``z = transform(hidden_states @ weight.T + bias)
    .to(statistics_dtype)`` (``hidden_states [..., H]``, ``target`` its leading shape), and that
    walk's row statistics ``[N]`` (fp32; fp64 for fp64). ``statistics_dtype`` rounds as
    ``logits_dtype`` does and has its accumulate dtype (the caller checks)."""
    flat_target = target.reshape(-1)  # [N]
    valid = flat_target != ignore_index  # [N]
    indices = flat_target.masked_fill(~valid, 0).unsqueeze(-1)  # [N, 1]: an ignored row gathers column 0
    statistics = chunked_statistics(hidden_states.flatten(0, -2), weight, bias, indices, None,
                                    logits_dtype=statistics_dtype, statistics_dtype=statistics_dtype,
                                    transform=transform, projection_dtype=projection_dtype, chunk_size=chunk_size,
                                    chunk_bytes=chunk_bytes)
    loss = (statistics.lse - statistics.selected.squeeze(-1)).masked_fill(~valid, 0.0)  # [N]
    if reduction == "none":
        loss = loss.view_as(target).to(logits_dtype)
    else:
        loss = reduce_total(loss.sum(), flat_target, None, reduction, ignore_index, 0.0, logits_dtype)
    return loss, statistics.lse, statistics.entropy, statistics.max, statistics.argmax


SPELLING = Spelling("cross_entropy", read, replace, one_walk=one_walk)
