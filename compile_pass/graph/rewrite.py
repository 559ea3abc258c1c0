"""Replace one accepted cross-entropy site with a call of the chunked op.

    logits = linear(h, W, b)            # kept only if something else uses it
    x = logits.float()[..., :-1, :].contiguous().view(-1, V)
    loss = cross_entropy(x, labels, ...)
becomes
    h2 = h[..., :-1, :].flatten(0, -2)  # token-dim indexing replayed on the hidden states
    loss = linear_cross_entropy(h2, W, labels, linear_bias=b, logits_dtype=torch.float32, ...)

Everything after the loss (e.g. HF's ``loss / num_items_in_batch``) is left alone.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from compile_pass.op import function as op
from compile_pass.graph.forms import example_value, size_hint
from compile_pass.graph.sites import Site, logits_dtypes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rewritten:
    """What the rewrite of one site did."""

    node: Node  # the new op call
    logits_kept: bool  # the projection stays for other users
    # bytes no longer materialized: cross_entropy's own [N, V] buffers (the log-softmax it
    # saves for backward and the logits' gradient), plus the forward logits and their
    # casts where nothing else needs them
    logits_bytes_avoided: int


def rewrite_site(site: Site, chunk_size: int | None) -> Rewritten:
    """Rewrite an accepted ``site`` in place (the guard must have returned None)."""
    graph: Graph = site.node.graph
    projection, call = site.projection, site.call
    hidden_size = example_value(projection.hidden).shape[-1]
    with graph.inserting_before(site.node):
        hidden = projection.hidden
        for kind, what in site.hidden_plan:
            if kind == "reshape":
                hidden = _node(graph, "call_method", "reshape", (hidden, *what, hidden_size))
            else:  # replay the token-dim indexing of the logits on the hidden states
                hidden = _node(graph, what.op, what.target, (hidden, *what.args[1:]), dict(what.kwargs))
        if site.class_dim_moved is None:  # the loss saw [N, V] logits: give the op [N, H]
            ndim = example_value(hidden).dim()
            if ndim == 1:  # a single token selected, then reshaped back to [1, V]
                hidden = _node(graph, "call_method", "unsqueeze", (hidden, 0))
            elif ndim > 2:
                hidden = _node(graph, "call_method", "flatten", (hidden, 0, -2))
        weight = projection.weight
        if projection.weight_is_hv:
            weight = _node(graph, "call_method", "t", (weight,))  # [H, V] -> [V, H]
        dtypes = logits_dtypes(site)
        kwargs = _non_default_kwargs(
            linear_bias=projection.bias,
            weight=call.weight,
            reduction=call.reduction,
            ignore_index=call.ignore_index,
            label_smoothing=float(call.label_smoothing),
            logits_dtype=dtypes[-1] if len(dtypes) > 1 else None,
            chunk_size=chunk_size,
        )
        new = graph.call_function(op.linear_cross_entropy, (hidden, weight, call.target), kwargs)
    new.meta.update({k: v for k, v in site.node.meta.items() if k != "source_fn_stack"})
    loss_input = example_value(call.input)  # [N, V] as cross_entropy saw it
    loss_buffers = 2 * size_hint(loss_input.numel()) * loss_input.element_size()
    site.node.replace_all_uses_with(new)
    graph.erase_node(site.node)
    bytes_avoided = loss_buffers + _erase_dead(site)
    return Rewritten(new, projection.node in graph.nodes, bytes_avoided)


def _node(graph: Graph, kind: str, target: Any, args: tuple, kwargs: dict | None = None) -> Node:
    """Create a node and fill its ``example_value`` by running it on the fake inputs."""
    node = graph.create_node(kind, target, args, kwargs or {})
    values_args, values_kwargs = map_arg((args, kwargs or {}), lambda n: n.meta.get("example_value"))
    fake = next((v for v in values_args if hasattr(v, "fake_mode")), None)
    try:
        with fake.fake_mode if fake is not None else contextlib.nullcontext():
            if kind == "call_method":
                value = getattr(values_args[0], target)(*values_args[1:], **values_kwargs)
            else:
                value = target(*values_args, **values_kwargs)
        node.meta["example_value"] = value
    except Exception:  # noqa: BLE001 - metadata only; the graph is right without it
        log.debug("chunkce: no example_value for %s", node.format_node())
    return node


_OP_DEFAULTS = {"linear_bias": None, "weight": None, "reduction": "mean", "ignore_index": -100,
                "label_smoothing": 0.0, "logits_dtype": None, "chunk_size": None}


def _non_default_kwargs(**kwargs: Any) -> dict[str, Any]:
    """The op's keyword arguments that differ from its defaults (a readable graph)."""
    return {k: v for k, v in kwargs.items() if not (v is _OP_DEFAULTS[k] or
                                                     (not isinstance(v, Node) and v == _OP_DEFAULTS[k]))}


def _erase_dead(site: Site) -> int:
    """Erase the site's nodes nothing uses any more; bytes of logits no longer materialized.

    Counted: the projection's output (and the matmul under a bias add) and every
    dtype-changing cast of the logits that is gone.
    """
    graph = site.node.graph
    projection = site.projection
    materialized = {projection.node}
    if projection.bias is not None and projection.inner:
        materialized.add(projection.inner[-1])  # the matmul under `matmul + bias`
    materialized.update(n for n in site.steps if example_value(n).dtype != example_value(n.args[0]).dtype)
    candidates = [*site.steps[::-1], projection.node, *projection.inner[::-1]]
    if site.class_dim_moved is not None:
        candidates.insert(0, site.class_dim_moved)
    bytes_avoided = 0
    for node in candidates:
        if node.users:
            continue
        value = example_value(node)
        if node in materialized and isinstance(value, torch.Tensor):
            bytes_avoided += size_hint(value.numel()) * value.element_size()
        graph.erase_node(node)
    return bytes_avoided
