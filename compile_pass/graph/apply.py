"""Apply: carry out a graph's plans, each site in one all-or-nothing edit, then its logits' fate.

    records = apply_plans(plans, walks, logits, options, take_out=True)
    returned = take_out_returned(plan_returned(graph, options), options)   # a graph with no site

Each op call of the plan (a :class:`compile_pass.graph.plan.WalkPlan`, in graph order) is one
:class:`compile_pass.graph.nodes.Edit` (the rewrite, then a lint), and so is each row statistic
folded into one, which then reads its statistics: a failure undoes it and the site is refused as
``internal_error`` (a statistic folded into a failed walk walks alone). Then the logits planned
``LAZY`` / ``DROPPED`` are taken out (``take_out``), each projection in an edit of its own: a
failure leaves them computed (``LOGITS_KEPT``). The records are the plans' with what was done.

Replace one accepted cross-entropy site with a call of the chunked op.

    logits = linear(h, W, b)            # kept only if something else uses it
    x = (logits * s).float()[..., :-1, :].contiguous().view(-1, V)   # s: a number or a 0-d tensor
    loss = cross_entropy(x, labels, ...)
becomes
    h2 = h[..., :-1, :]                 # token-dim indexing replayed on the hidden states
    loss, lse = torch.ops.chunkce.linear_cross_entropy(h2.flatten(0, -2), W, labels.reshape(-1), b, ...,
                                                       torch.float32, chunk_size, None, s, ...)
    loss = (loss.sum() / (labels.reshape(-1) != ignore_index).sum()).to(torch.float32)   # "mean"

The scaling is passed to the op as its head transform (``transform=``: the site's
:class:`compile_pass.op.kernels.HeadScale`, through :func:`compile_pass.graph.projection.op_scale`)
and its node erased with the casts when nothing else uses it.
Everything after the loss (e.g. HF's ``loss / num_items_in_batch``) is left alone. What is
traced in place of the loss node is the spelling's replacement (:mod:`compile_pass.graph.spellings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, Node

from compile_pass.graph import guard, tensor_parallel
from compile_pass.graph.guard import cast_chains
from compile_pass.graph.nodes import (
    Edit,
    create_node,
    example_value,
    is_tensor_node,
    size_hint,
    trace_into,
)
from compile_pass.graph.plan import LogitsPlan, SitePlan, WalkPlan
from compile_pass.graph.projection import Projection, op_scale
from compile_pass.graph.report import (
    DROP_LOGITS_FIX,
    LOGITS_DROPPED,
    LOGITS_KEPT,
    LOGITS_LAZY,
    Decision,
    ReturnedRecord,
    SiteRecord,
    module_of,
    source_of,
)
from compile_pass.graph.returned_logits import Fate
from compile_pass.graph.returned_logits import take_out as take_out_logits
from compile_pass.graph.sites import Replay, Reshape, Site, StepKind
from compile_pass.graph.spellings.call import LossCall
from compile_pass.graph.stages import reached, tolerant
from compile_pass.op.grads_in_forward import grads_wanted
from compile_pass.op.kernels import HeadScale
from compile_pass.op.loss import planned_tiles
from compile_pass.op.statistics import RowStatistics
from compile_pass.op.tiling import Tiles
from compile_pass.options import Options


def apply_plans(plans: list[SitePlan], walks: list[WalkPlan], logits: list[LogitsPlan], options: Options,
                take_out: bool) -> list[SiteRecord]:
    """The records of ``plans`` once carried out: each of ``walks``, then the row statistics folded
    into each, then each projection's logits' fate; ``take_out``: the caller wraps the compiled
    graph (:func:`compile_pass.graph.returned_logits.add_outputs`), so returned logits may leave it."""
    statistics: dict[WalkPlan, tuple[Node, ...]] = {}  # the row statistics each walk returned
    for walk in walks:
        walk.plan.record, statistics[walk] = _rewrite(walk, options, strict=options.strict)
    for walk in walks:  # a statistic folded into a walk reads its statistics; into a failed one, it walks alone
        for plan in walk.folded:
            if walk.plan.record.decision is Decision.REWRITTEN:
                plan.record = _rewrite_folded(plan, statistics[walk], options, strict=options.strict)
            else:
                plan.record, _ = _rewrite(WalkPlan(plan, plan.replacement, plan.site.node), options,
                                          strict=options.strict)
    served = {walk.plan.site.projection.node: statistics[walk] for walk in walks if walk.serves_reads}
    for group in logits:
        done = [plan for plan in group.sites if plan.record.decision is Decision.REWRITTEN]
        # a failed rewrite's loss still reads the logits
        fate, droppable = (group.fate, group.droppable) if len(done) == len(group.sites) else (Fate.KEPT, False)
        saved = None
        if fate in (Fate.LAZY, Fate.DROPPED) and take_out:
            saved = _take_out(group, fate, options, served.get(group.projection.node, ()), strict=options.strict)
        if fate in (Fate.LAZY, Fate.DROPPED) and saved is None:
            fate = Fate.KEPT
        _note(done, fate, droppable, saved or 0)
    return [plan.record for plan in plans]


def take_out_returned(logits: list[LogitsPlan], options: Options) -> list[ReturnedRecord]:
    """Take out the returned logits :func:`compile_pass.graph.plan.plan_returned` planned (each in an
    edit of its own; a failure leaves them computed); the records of those taken out."""
    records = []
    for group in logits:
        node = group.projection.node
        source, module = source_of(node), module_of(node)
        vocab = size_hint(example_value(node).shape[-1])
        saved = _take_out(group, Fate.LAZY, options, strict=options.strict)
        if saved is not None:
            records.append(ReturnedRecord(source, module, vocab, saved))
    return records


def _refused(record: SiteRecord, exc: Exception) -> SiteRecord:
    reason = guard.internal_error(f"{type(exc).__name__}: {exc}")
    return dataclasses.replace(record, decision=Decision.REFUSED, reason=str(reason), reason_key=reason.key,
                               fix=reason.fix, tiles=None)


def _walk_failed(walk: WalkPlan, options: Options, exc: Exception) -> tuple[SiteRecord, tuple[Node, ...]]:
    return _refused(walk.plan.record, exc), ()


@tolerant("rewriting {walk.plan.site.node} failed; left it unfused", fallback=_walk_failed)
def _rewrite(walk: WalkPlan, options: Options) -> tuple[SiteRecord, tuple[Node, ...]]:
    """The record of ``walk``'s site once its op call is in, and the row statistics it returns."""
    graph = walk.at.graph
    with Edit(graph) as edit:
        for node in walk.moved:  # the labels of a loss whose walk runs at an earlier statistic
            edit.move_before(node, walk.at)
        reached("rewrite", walk.plan.site)
        done = rewrite_walk(walk, edit, options)
        graph.lint()
    return dataclasses.replace(walk.plan.record, logits_bytes_avoided=done.logits_bytes_avoided,
                               tiles=done.tiles), done.statistics


def _folded_failed(plan: SitePlan, walked: tuple[Node, ...], options: Options, exc: Exception) -> SiteRecord:
    return _refused(plan.record, exc)


@tolerant("rewriting {plan.site.node} failed; left it unfused", fallback=_folded_failed)
def _rewrite_folded(plan: SitePlan, walked: tuple[Node, ...], options: Options) -> SiteRecord:
    """The record of a row statistic's site once it reads ``walked``, a walk's statistics."""
    graph = plan.site.node.graph
    with Edit(graph) as edit:
        reached("rewrite", plan.site)
        done = read_walk(plan, walked, edit, options)
        graph.lint()
    return dataclasses.replace(plan.record, logits_bytes_avoided=done.logits_bytes_avoided, tiles=done.tiles,
                               folded=True)


@tolerant("taking the returned logits of {group.projection.node} out of the graph failed; the step computes them")
def _take_out(group: LogitsPlan, fate: Fate, options: Options, statistics: tuple = ()) -> int:
    graph = group.projection.node.graph
    with Edit(graph) as edit:
        reached("take_out", group.projection)
        saved = take_out_logits(group.projection, edit, fate,
                                tiles=options.tiles, statistics=statistics)
        reached("taken_out", group.projection)
        graph.lint()
    return saved


def _note(plans: list[SitePlan], fate: Fate | None, droppable: bool, saved: int) -> None:
    """What the records of the sites rewritten from one projection say of its logits (``fate``
    None: nothing); taken out logits are said, and their bytes counted, on the last site."""
    for i, plan in enumerate(plans):
        record = plan.record
        if fate is Fate.KEPT:
            plan.record = dataclasses.replace(record, reason=LOGITS_KEPT, fix=DROP_LOGITS_FIX if droppable else "",
                                              fate=fate)
        elif fate in (Fate.LAZY, Fate.DROPPED) and i == len(plans) - 1:
            note = LOGITS_DROPPED if fate is Fate.DROPPED else LOGITS_LAZY
            plan.record = dataclasses.replace(record, reason=note, fix="", fate=fate,
                                              logits_bytes_avoided=record.logits_bytes_avoided + saved)
        elif fate is not None:
            plan.record = dataclasses.replace(record, reason="", fix="")


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """What the rewrite of one site did."""

    # bytes no longer materialized: cross_entropy's own [N, V] buffers (the log-softmax it
    # saves for backward and the logits' gradient), plus the forward logits and their
    # casts where nothing else needs them
    logits_bytes_avoided: int
    tiles: Tiles  # the op's [n, Vb] tiles at the traced sizes (op.loss.planned_tiles)
    statistics: tuple[Node, ...] = ()  # a replacement's row statistics beside the loss (graph/plan.py)


def rewrite_walk(walk: WalkPlan, edit: Edit, options: Options) -> Rewritten:
    """Replace the node of ``walk``'s site by its op call, as part of ``edit``: ``walk.replacement``
    traced in before ``walk.at`` (:func:`_op_call`) on the hidden states indexed as the logits were
    on the way to the site, or, with ``walk.head_rows``, on every head row, told which are the
    site's (``rows=``: the indexing replayed on their row numbers). A replacement returning a tuple
    gives the loss and its row statistics (:attr:`Rewritten.statistics`)."""
    site, meta = walk.plan.site, walk.plan.site.node.meta
    with site.node.graph.inserting_before(walk.at):
        if walk.head_rows:
            rows = _head_rows(site, meta)  # [...] int64
            new, statistics, tiles = _op_call(site, walk.replacement, site.projection.hidden, options, rows=rows)
        else:
            new, statistics, tiles = _op_call(site, walk.replacement, _hidden_states(site, meta), options)
    reached("traced", site)
    return Rewritten(_replace(site, new, edit), tiles, statistics)


def read_walk(plan: SitePlan, walked: tuple[Node, ...], edit: Edit, options: Options) -> Rewritten:
    """Replace the node of ``plan``'s row statistic by its replacement reading ``walked`` (the
    ``(lse, entropy, max, argmax, row_sum)`` nodes of every head row from the walk it is folded
    into: no walk of its own), as part of ``edit``; its rows, where its token-dim indexing picks
    some, as ``rows=`` (the indexing replayed on the row numbers)."""
    site, meta = plan.site, plan.site.node.meta
    with site.node.graph.inserting_before(site.node):
        rows = {"rows": _head_rows(site, meta)} if any(isinstance(step, Replay) for step in site.hidden_plan) else {}
        new, _, tiles = _op_call(site, plan.replacement, _hidden_states(site, meta), options,
                                 walked=RowStatistics(None, *walked), **rows)
    reached("traced", site)
    return Rewritten(_replace(site, new, edit), tiles)


def _op_call(site: Site, replacement: Callable[..., Any], hidden: Node, options: Options,
             **extra: Any) -> tuple[Node, tuple[Node, ...], Tiles]:
    """``replacement`` traced in at the insertion point on ``hidden [..., H]``, the projection's
    weight and bias (:func:`_weight_and_bias`) and the site's loss arguments (a row statistic
    reads none), with the op's options from ``options`` (``grads_in_forward`` picks the
    grads-in-forward op where the site's loss wants gradients) and ``extra`` (``rows=``: it walks
    every head row; ``walked=``): the node of its value (under ``loss_parallel`` a replicated
    DTensor), those of the row statistics it returns besides, and its tiles."""
    graph, meta = site.node.graph, site.node.meta
    projection, sharded = site.projection, site.projection.sharded  # a vocabulary-sharded head, or None
    weight, bias = _weight_and_bias(projection, meta)
    wanted = None  # the grads-in-forward op's output_mask, from the fake values; None: recompute
    if options.grads_in_forward and sharded is None:
        wanted = grads_wanted(*(example_value(node) if is_tensor_node(node) else None
                                for node in (hidden, weight, bias)),
                              grad_enabled=example_value(site.node).requires_grad)
    loss = site.call if isinstance(site.call, LossCall) else None  # a row statistic reads no target or argument
    tiles = _tiles(site, loss, "rows" in extra, wanted, options)
    new = trace_into(
        graph, replacement, hidden, weight, loss and loss.target, bias, loss and loss.weight,
        reduction=loss.reduction if loss else "none", ignore_index=loss.ignore_index if loss else -100,
        label_smoothing=float(loss.label_smoothing) if loss else 0.0, logits_dtype=cast_chains(site)[-1][-1],
        projection_dtype=projection.autocast_dtype(),
        transform=HeadScale() if site.scale is None else op_scale(site.scale, meta),
        grads_in_forward=wanted, meta=meta, **options.op_options(), **extra,
    )
    new, *statistics = new if isinstance(new, tuple) else (new,)
    if sharded is not None and sharded.loss_parallel:  # the loss a replicated DTensor, as loss_parallel's
        new = tensor_parallel.as_dtensor_loss(sharded, new, graph, meta)
    return new, tuple(statistics), tiles


def _weight_and_bias(projection: Projection, meta: dict) -> tuple[Node, Node | None]:
    """The op's ``weight [V, H]`` and ``bias [V]`` (or None) of ``projection``, nodes inserted at
    the insertion point where it needs them: a sharded head's shards on this rank, ``[V_local, H]``
    and ``[V_local]``; an added ``[1, ..., 1, V]`` bias reshaped; an ``[H, V]`` weight transposed."""
    graph: Graph = projection.node.graph
    weight, bias = projection.weight, projection.bias
    if projection.sharded is not None:
        _, weight, bias = tensor_parallel.local_operands(projection, graph, meta, hidden=False)
    elif bias is not None and example_value(bias).dim() > 1:
        bias = create_node(graph, "call_method", "reshape", (bias, -1), meta=meta)
    if projection.weight_is_hv:
        weight = create_node(graph, "call_method", "t", (weight,), meta=meta)  # [H, V] -> [V, H]
    return weight, bias


def _tiles(site: Site, loss: LossCall | None, every_head_row: bool, grads_in_forward: list[bool] | None,
           options: Options) -> Tiles:
    """The op's ``[n, Vb]`` tiles at the traced sizes (:func:`compile_pass.op.loss.planned_tiles`),
    over the site's rows (its loss's, or a row statistic's values) or ``every_head_row``."""
    projection = site.projection
    logits = example_value(projection.node)  # [..., V]
    vocab = size_hint(logits.shape[-1]) if projection.sharded is None else projection.sharded.local_size
    if every_head_row:
        num_rows = example_value(projection.hidden).shape[:-1].numel()
    else:
        num_rows = example_value(loss.target if loss else site.node).numel()
    return planned_tiles(size_hint(num_rows), vocab, logits.dtype, logits.device.type,
                         reduction=loss.reduction if loss else "none", grads_in_forward=grads_in_forward,
                         **options.op_options())


def _replace(site: Site, new: Node, edit: Edit) -> int:
    """Replace the site's node by ``new`` and erase the site's nodes nothing reads any more, as part
    of ``edit``; the bytes no longer materialized: the loss's own ``[N, V]`` buffers, and of the
    nodes erased the projection's output (and the matmul under a bias add), every dtype-changing
    cast of the logits and the scaled logits."""
    projection = site.projection
    materialized = {projection.node}
    if projection.bias is not None and projection.inner:
        materialized.add(projection.inner[-1])  # the matmul under `matmul + bias`
    materialized.update(step.node for step in site.steps if step.kind is StepKind.CAST
                        and example_value(step.node).dtype != example_value(step.node.args[0]).dtype)
    # [N, V] as cross_entropy saw it (a DTensor's bytes: this rank's local tensor, [N, V_local] under loss_parallel)
    loss_input = tensor_parallel.local_value(example_value(site.call.input))
    bytes_avoided = 2 * size_hint(loss_input.numel()) * loss_input.element_size()
    edit.replace_all_uses_with(site.node, new)
    edit.erase(site.node)
    for node in site.erasable():
        if node.users:
            continue
        value = tensor_parallel.local_value(example_value(node))  # a DTensor: this rank's bytes
        if node in materialized and isinstance(value, torch.Tensor):
            bytes_avoided += size_hint(value.numel()) * value.element_size()
        edit.erase(node)
    reached("erased", site)
    if site.scale is not None and not site.scale_node.users:  # erased with the casts: its [..., V] is gone too
        scaled = tensor_parallel.local_value(example_value(site.scale_node))
        bytes_avoided += size_hint(scaled.numel()) * scaled.element_size()
    return bytes_avoided


def _head_rows(site: Site, meta: dict) -> Node:
    """``[...]`` int64: the head row of each of the site's rows (its token-dim indexing replayed on
    the row numbers)."""
    graph: Graph = site.node.graph
    rows = _replayed(site, trace_into(graph, _row_numbers, site.projection.hidden, meta=meta), meta)  # [..., 1]
    return create_node(graph, "call_method", "squeeze", (rows, -1), meta=meta)


def _hidden_states(site: Site, meta: dict) -> Node:
    """The hidden states, indexed as the logits were on the way to the loss: ``[N, H]``,
    or ``[B, T, H]`` when the loss took ``[B, V, T]`` logits."""
    graph: Graph = site.node.graph
    hidden = site.projection.hidden
    if site.projection.sharded is not None:  # the replicated DTensor's local tensor
        hidden, _, _ = tensor_parallel.local_operands(site.projection, graph, meta, weight=False)
    hidden = _replayed(site, hidden, meta)
    if site.class_dim_moved is None and example_value(hidden).dim() == 1:
        hidden = create_node(graph, "call_method", "unsqueeze", (hidden, 0), meta=meta)  # one token, then [1, V]
    return hidden


def _row_numbers(hidden_states: torch.Tensor) -> torch.Tensor:
    """``[..., 1]`` int64: each row's number in ``hidden_states [..., H]`` flattened (read no size)."""
    ones = torch.ones_like(hidden_states[..., :1], dtype=torch.int64)  # [..., 1]
    return ones.flatten().cumsum(0).sub(1).view_as(ones)


def _replayed(site: Site, hidden: Node, meta: dict) -> Node:
    """``hidden [..., H]`` (or row numbers, ``[..., 1]``) through the site's hidden-states plan:
    its reshapes of the token dims and their indexing replayed."""
    graph: Graph = site.node.graph
    hidden_size = example_value(hidden).shape[-1]
    for step in site.hidden_plan:
        if isinstance(step, Reshape):
            hidden = create_node(graph, "call_method", "reshape", (hidden, *step.shape, hidden_size), meta=meta)
        else:  # replay the token-dim indexing of the logits on the hidden states
            node = step.node
            hidden = create_node(graph, node.op, node.target, (hidden, *node.args[1:]), node.kwargs, meta=meta)
    return hidden
