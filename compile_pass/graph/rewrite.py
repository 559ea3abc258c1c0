"""Replace one accepted cross-entropy site with a call of the chunked op.

    logits = linear(h, W, b)            # kept only if something else uses it
    x = (logits * s).float()[..., :-1, :].contiguous().view(-1, V)   # s: a number or a 0-d tensor
    loss = cross_entropy(x, labels, ...)
becomes
    h2 = h[..., :-1, :]                 # token-dim indexing replayed on the hidden states
    loss, lse = torch.ops.chunkce.linear_cross_entropy(h2.flatten(0, -2), W, labels.reshape(-1), b, ...,
                                                       torch.float32, chunk_size, None, s, ...)
    loss = (loss.sum() / (labels.reshape(-1) != ignore_index).sum()).to(torch.float32)   # "mean"

The scaling is passed to the op as its head transform (``transform=``: what
:meth:`compile_pass.graph.scale.Scale.head_transform` read) and its node erased with the
casts when nothing else uses it.
Everything after the loss (e.g. HF's ``loss / num_items_in_batch``) is left alone.

What replaces the loss node is chosen here from what the reader read (:func:`replacement`):
:func:`compile_pass.op.function.chunked_cross_entropy` for a loss, :func:`gathered_log_probs`
for a gather of log-probabilities (``CrossEntropyCall.gather``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.fx import Graph, Node

from compile_pass.graph import tensor_parallel
from compile_pass.graph.dtype_chains import cast_chains
from compile_pass.graph.forms import CrossEntropyCall
from compile_pass.graph.nodes import (
    Edit,
    create_node,
    example_value,
    is_tensor_node,
    size_hint,
    trace_into,
)
from compile_pass.graph.sites import Site
from compile_pass.op.chunking import Tiles
from compile_pass.op.function import chunked_cross_entropy, planned_tiles
from compile_pass.op.grads_in_forward import grads_wanted
from compile_pass.op.transform import HeadTransform
from compile_pass.options import Options


@dataclass(frozen=True)
class Rewritten:
    """What the rewrite of one site did."""

    logits_kept: bool  # the projection stays for other users
    # bytes no longer materialized: cross_entropy's own [N, V] buffers (the log-softmax it
    # saves for backward and the logits' gradient), plus the forward logits and their
    # casts where nothing else needs them
    logits_bytes_avoided: int
    tiles: Tiles  # the op's [n, Vb] tiles at the traced sizes (op.function.planned_tiles)


def rewrite_site(site: Site, edit: Edit, options: Options) -> Rewritten:
    """Rewrite an accepted ``site`` in place (the guard must have returned None), as
    part of ``edit`` (which keeps or undoes the change as a whole), with the op's options
    from ``options`` (:meth:`compile_pass.options.Options.op_options`; ``grads_in_forward``
    picks the grads-in-forward op where the site's loss wants gradients).

    The new nodes are those :func:`compile_pass.op.function.chunked_cross_entropy`
    runs, traced into the graph: token-dim indexing replayed on the hidden states,
    ``torch.ops.chunkce.linear_cross_entropy`` (with the site's scaling, if any), and
    the reduction in tensor ops.
    """
    graph: Graph = site.node.graph
    projection, call, scale = site.projection, site.call, site.scale
    meta = site.node.meta
    sharded = projection.sharded  # a vocabulary-sharded head (graph/tensor_parallel.py), or None
    with graph.inserting_before(site.node):
        hidden = _hidden_states(site, meta)  # [..., H]
        weight, bias = projection.weight, projection.bias
        if sharded is not None:  # this rank's shards, [V_local, H] and [V_local]
            _, weight, bias = tensor_parallel.local_operands(projection, graph, meta, hidden=False)
        if projection.weight_is_hv:
            weight = create_node(graph, "call_method", "t", (weight,), meta=meta)  # [H, V] -> [V, H]
        projection_dtype = example_value(projection.node).dtype
        casts_inputs = any(example_value(arg).dtype != projection_dtype  # autocast
                           for arg in (hidden, weight) if is_tensor_node(arg))
        wanted = None  # the grads-in-forward op's output_mask, from the fake values; None: recompute
        if options.grads_in_forward and sharded is None:
            wanted = grads_wanted(*(example_value(node) if is_tensor_node(node) else None
                                    for node in (hidden, weight, bias)),
                                  grad_enabled=example_value(site.node).requires_grad)
        loss = replacement(call) if sharded is None else tensor_parallel.loss_function(sharded)
        new = trace_into(
            graph, loss, hidden, weight, call.target, bias, call.weight,
            reduction=call.reduction, ignore_index=call.ignore_index,
            label_smoothing=float(call.label_smoothing), logits_dtype=cast_chains(site)[-1][-1],
            projection_dtype=projection_dtype if casts_inputs else None,
            transform=HeadTransform() if scale is None else scale.head_transform(meta),
            grads_in_forward=wanted, meta=meta, **options.op_options(),
        )
        if sharded is not None and sharded.loss_parallel:  # the loss a replicated DTensor, as loss_parallel's
            new = tensor_parallel.as_dtensor_loss(sharded, new, graph, meta)
    logits = example_value(projection.node)  # [..., V]
    vocab = size_hint(logits.shape[-1]) if sharded is None else sharded.local_size  # the rows the op walks
    tiles = planned_tiles(size_hint(example_value(call.target).numel()), vocab,
                          projection_dtype, logits.device.type, reduction=call.reduction, grads_in_forward=wanted,
                          **options.op_options())
    # [N, V] as cross_entropy saw it (a DTensor's bytes: this rank's local tensor, [N, V_local] under loss_parallel)
    loss_input = tensor_parallel.local_value(example_value(call.input))
    loss_buffers = 2 * size_hint(loss_input.numel()) * loss_input.element_size()
    edit.replace_all_uses_with(site.node, new)
    edit.erase(site.node)
    bytes_avoided = loss_buffers + _erase_dead(site, edit)
    if scale is not None and not scale.node.users:  # erased with the casts: its [..., V] is gone too
        scaled = tensor_parallel.local_value(example_value(scale.node))
        bytes_avoided += size_hint(scaled.numel()) * scaled.element_size()
    return Rewritten(bool(projection.node.users), bytes_avoided, tiles)


def replacement(call: CrossEntropyCall) -> Callable[..., Any]:
    """The function whose traced nodes replace the loss node of ``call``, with
    :func:`compile_pass.op.function.chunked_cross_entropy`'s signature."""
    if call.gather is None:
        return chunked_cross_entropy
    gather = call.gather
    return partial(gathered_log_probs, negated=gather.negated, flat=gather.flat, squeeze=gather.squeeze,
                   wraps=gather.wraps)


def gathered_log_probs(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                       class_weight: Tensor | None, *, negated: bool, flat: bool, ignore_index: int,
                       squeeze: bool = False, wraps: bool = False, **options: Any) -> Tensor:
    """``log_softmax(hidden_states @ weight.T + bias, -1).gather(-1, target[..., None])``
    through the op: ``[..., 1]`` in the call's ``logits_dtype`` (negated when ``negated``;
    ``[N, 1]`` when ``flat``: the index was ``labels.reshape(-1, 1)``).

    Traced into the graph by the rewrite (:func:`compile_pass.graph.nodes.trace_into`);
    the arguments and ``options`` are :func:`compile_pass.op.function.chunked_cross_entropy`'s
    (the call gives ``reduction="none"``, ``ignore_index=NO_IGNORE_INDEX``, no class
    weight: :mod:`compile_pass.graph.spellings`). A label equal to ``ignore_index`` is mapped
    to -1 first, so that the op raises for it as for every other label outside ``[0, V)``,
    as ``gather`` does. ``wraps`` (``take_along_dim``): the label is taken modulo ``V`` first,
    as torch's ``take_along_dim`` does (``indices % V`` in ``torch._refs``: ``-1`` reads class
    ``V - 1``, ``-100`` class ``-100 % V``; it raises for none), so that labels such as
    ``-100`` masked out after the gather give what stock gives.
    ``squeeze``: ``target`` is the gather index itself, ``[..., 1]`` (e.g. ``labels[:, 1:, None]``),
    whose last dim is dropped.
    """
    if squeeze:
        target = target.squeeze(-1)  # [..., 1] -> [...]
    if wraps:
        target = target.remainder(weight.shape[0])  # [...] in [0, V)
    target = target.masked_fill(target == ignore_index, -1)  # [...]
    nll = chunked_cross_entropy(hidden_states, weight, target, bias, class_weight, ignore_index=ignore_index,
                                **options)  # [...] = -log p(target)
    log_p = nll if negated else nll.neg()  # shaped like target
    return log_p.reshape(-1, 1) if flat else log_p.unsqueeze(-1)


def _hidden_states(site: Site, meta: dict) -> Node:
    """The hidden states, indexed as the logits were on the way to the loss: ``[N, H]``,
    or ``[B, T, H]`` when the loss took ``[B, V, T]`` logits."""
    graph: Graph = site.node.graph
    hidden = site.projection.hidden
    if site.projection.sharded is not None:  # the replicated DTensor's local tensor
        hidden, _, _ = tensor_parallel.local_operands(site.projection, graph, meta, weight=False)
    hidden_size = example_value(hidden).shape[-1]
    for kind, what in site.hidden_plan:
        if kind == "reshape":
            hidden = create_node(graph, "call_method", "reshape", (hidden, *what, hidden_size), meta=meta)
        else:  # replay the token-dim indexing of the logits on the hidden states
            hidden = create_node(graph, what.op, what.target, (hidden, *what.args[1:]), what.kwargs, meta=meta)
    if site.class_dim_moved is None and example_value(hidden).dim() == 1:
        hidden = create_node(graph, "call_method", "unsqueeze", (hidden, 0), meta=meta)  # one token, then [1, V]
    return hidden


def _erase_dead(site: Site, edit: Edit) -> int:
    """Erase the site's nodes nothing uses any more; bytes of logits no longer materialized.

    Counted: the projection's output (and the matmul under a bias add) and every
    dtype-changing cast of the logits that is gone.
    """
    projection = site.projection
    materialized = {projection.node}
    if projection.bias is not None and projection.inner:
        materialized.add(projection.inner[-1])  # the matmul under `matmul + bias`
    materialized.update(step.node for step in site.steps if step.kind == "cast"
                        and example_value(step.node).dtype != example_value(step.node.args[0]).dtype)
    candidates = [*site.call.inner, *(step.node for step in site.steps[::-1]), projection.node,
                  *projection.inner[::-1]]  # call.inner: a spelling's own nodes (a gather's index)
    if site.class_dim_moved is not None:
        candidates.insert(0, site.class_dim_moved)
    bytes_avoided = 0
    for node in candidates:
        if node.users:
            continue
        value = tensor_parallel.local_value(example_value(node))  # a DTensor: this rank's bytes
        if node in materialized and isinstance(value, torch.Tensor):
            bytes_avoided += size_hint(value.numel()) * value.element_size()
        edit.erase(node)
    return bytes_avoided
