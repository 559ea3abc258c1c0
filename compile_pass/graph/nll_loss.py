"""The spelling ``nll_loss``: ``F.nll_loss(F.log_softmax(z, -1), y, ...)``, ``nn.NLLLoss`` of
``nn.LogSoftmax`` (inlined), ``torch._C._nn.nll_loss_nd`` / ``nll_loss`` (reduction as an int).

ATen's ``cross_entropy`` is ``nll_loss_nd(log_softmax(z, 1), ...)``: this is that cross-entropy of
``z`` without label smoothing, replaced as it is. An nll_loss of anything but a log_softmax
is none; one the op cannot reproduce (:mod:`compile_pass.graph.log_softmax`) is ``unsupported``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph import cross_entropy
from compile_pass.graph.calls import Call, Spelling
from compile_pass.graph.log_softmax import find_log_softmax
from compile_pass.graph.nodes import is_tensor_node

_NLL_LOSS = (F.nll_loss, internals.nll_loss_nd.get(), internals.nll_loss.get())


def read(node: Node) -> Call | None:
    if node.op != "call_function" or node.target not in _NLL_LOSS:
        return None
    if node.target is F.nll_loss:
        args = cross_entropy.bound_arguments(F.nll_loss, node)
    else:  # (input, target, weight, reduction: int, ignore_index)
        args = cross_entropy.enum_arguments(node, 5)
    if not is_tensor_node(args["input"]):
        return None
    found = find_log_softmax(args["input"], negations=False)
    if found is None:
        return None
    return Call(args["input"], args["target"], args["weight"], args["ignore_index"], args["reduction"], 0.0,
                SPELLING, passes=found.passes, unsupported=found.unsupported)


SPELLING = Spelling("nll_loss", read, cross_entropy.replace, one_walk=cross_entropy.one_walk)
