"""Plan: per site rewrite / refuse / leave, per projection its logits' fate, before any edit.

Plan: what the pass will do at every site of a graph and with the logits the sites read,
decided before any edit (pure queries).

    plans, logits = plan_sites(sites, options, in_subgraph, take_out)
    returned = plan_returned(graph, options)   # a top-level graph with no site: its returned logits

A :class:`SitePlan` per site: ``REWRITE`` (with its spelling's replacement), ``REFUSE`` (a
:class:`compile_pass.graph.refusals.Reason`) or ``LEAVE``; a :class:`LogitsPlan` per projection
the rewritten sites read, with its logits' :class:`compile_pass.graph.returned_logits.Fate`
(:func:`logits_fate`): ``GONE``, nothing reads them any more (the rewrites erase the
projection); ``LAZY`` / ``DROPPED``, only the graph output reads them, directly or through
dtype casts, copies and a scale the pass absorbs, and ``returned_logits`` takes them out;
``KEPT``, computed in the step (another reader, ``"keep"``, a higher-order op's body, inputs a
recipe cannot take, a ``loss_parallel`` head's ``Shard(-1)`` logits). The two are decided
together: a site without grad whose logits stay ``KEPT`` is left as stock, since without grad
Inductor fuses the upcast and the log-softmax into reductions over the logits, and the rewrite
would only add a second projection.

One walk: a loss site without grad whose logits the step returns ``LAZY`` would walk the
vocabulary twice, once for the loss and once more when the caller reads the returned logits (an
``argmax`` for a metric). When the loss is the row statistics' (its spelling's ``one_walk``: no
class weight, no label smoothing) and those statistics are exactly what the lazy logits' first
read would compute (:func:`compile_pass.graph.returned_logits.returned_head`), the site is
replaced by one ``chunkce::linear_statistics`` walk that gives the loss and returns the
statistics, which the lazy logits keep (:func:`compile_pass.lazy_logits.wrap.wrap_compiled`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any

import torch
from torch.fx import Graph, Node

from compile_pass.graph import find, guard
from compile_pass.graph.guard import cast_chains
from compile_pass.graph.nodes import example_value, is_tensor_node, size_hint
from compile_pass.graph.projection import Projection, as_projection
from compile_pass.graph.refusals import Reason
from compile_pass.graph.report import NO_GRAD_LOGITS_READ, Decision, SiteRecord, failed, module_of, source_of
from compile_pass.graph.returned_logits import Fate, recipe_nodes, returned_chain, returned_head
from compile_pass.graph.sites import Reshape, Site
from compile_pass.graph.stages import attempt, reached
from compile_pass.lazy_logits.keys import holds
from compile_pass.op.tiling import accumulate_dtype
from compile_pass.options import Options

log = logging.getLogger(__name__)



class Action(Enum):
    """What the pass will do at a site."""

    REWRITE = "rewrite"  # with its spelling's replacement
    REFUSE = "refuse"  # a Reason: left as it was, reported
    LEAVE = "leave"  # left as stock: the rewrite would only cost (not a refusal)


@dataclass
class SitePlan:
    """One site's plan; ``record`` is what the report says of it (a rewrite adds its tiles and bytes)."""

    site: Site
    action: Action
    record: SiteRecord
    replacement: Callable[..., Any] | None = None  # REWRITE: what the rewrite traces in
    statistics: tuple[Node, ...] = ()  # rewritten by one walk (plan.py): its lse, entropy, max, argmax, row_sum nodes


@dataclass
class LogitsPlan:
    """The logits of one projection: the sites rewritten from them, in graph order, and their fate."""

    projection: Projection
    sites: list[SitePlan] = field(default_factory=list)
    fate: Fate | None = None  # None when it could not be told (nothing taken out, no note)
    droppable: bool = False  # only the graph output reads them


def plan_sites(sites: list[Site], options: Options, in_subgraph: bool,
               take_out: bool = False) -> tuple[list[SitePlan], list[LogitsPlan]]:
    """The plans of ``sites`` (one graph's) and of the logits they read; ``take_out``: returned
    logits may leave the graph (the caller wraps it).

    Raises:
        NotImplementedError: ``options.strict`` and a site is refused (the message has the reason).
    """
    order = {node: i for i, node in enumerate(sites[0].node.graph.nodes)} if sites else {}
    plans = [attempt(options.strict, partial(_plan_site, site, order), partial(_unplanned, site),
                     "could not plan the site %s; left it unfused", site.node.name) for site in sites]
    refused = [plan for plan in plans if plan.action is Action.REFUSE]
    if options.strict and refused:
        record = refused[0].record
        raise NotImplementedError(f"chunkce: cannot rewrite the cross-entropy at {record.source}: {record.reason} "
                                  "(strict=True; pass strict=False to leave such sites unfused)")
    groups: dict[Node, LogitsPlan] = {}
    for plan in plans:
        if plan.action is Action.REWRITE:
            groups.setdefault(plan.site.projection.node, LogitsPlan(plan.site.projection)).sites.append(plan)
    for logits in groups.values():
        attempt(options.strict, partial(_plan_logits, logits, options.returned_logits, in_subgraph),
                lambda exc: None, "could not tell which rewritten sites' logits are kept; the graph is rewritten")
        if take_out and logits.fate is Fate.LAZY:
            attempt(options.strict, partial(_plan_one_walk, logits, options), lambda exc: None,
                    "could not plan one walk for the loss and the returned logits' reads; the loss walks alone")
    return plans, list(groups.values())


def _plan_site(site: Site, order: dict[Node, int]) -> SitePlan:
    reached("check", site)
    reason = guard.check(site, order)
    replacement = None
    if reason is None:
        replacement = site.call.spelling.replace(site.call, site.projection)
        if isinstance(replacement, Reason):
            reason, replacement = replacement, None
    reached("plan", site)
    source, form = source_of(site.node), site.call.form if site.call is not None else ""
    if reason is not None:
        module = module_of(site.projection.node if site.projection else site.stop)
        record = SiteRecord(source, module, Decision.REFUSED, str(reason), reason.key, fix=reason.fix, form=form,
                            warns=_saves_memory(site))
        return SitePlan(site, Action.REFUSE, record)
    record = SiteRecord(source, module_of(site.projection.node), Decision.REWRITTEN, "", form=form)
    return SitePlan(site, Action.REWRITE, record, replacement)


def _unplanned(site: Site, exc: Exception) -> SitePlan:
    return SitePlan(site, Action.REFUSE, failed(site.node.name, guard.internal_error(f"{type(exc).__name__}: {exc}")))


def _plan_logits(logits: LogitsPlan, mode: str, in_subgraph: bool) -> None:
    """Fill ``logits.fate``; a site without grad among them is left as stock when they are ``KEPT``."""
    reached("fate", logits.projection.node)
    fate, droppable = logits_fate(logits.projection, [plan.site for plan in logits.sites], mode, in_subgraph)
    left = [plan for plan in logits.sites if not _requires_grad(plan.site.node)] if fate is Fate.KEPT else []
    if left:
        logits.sites = [plan for plan in logits.sites if plan not in left]
        fate, droppable = logits_fate(logits.projection, [plan.site for plan in logits.sites], mode, in_subgraph)
    for plan in left:
        plan.action, plan.replacement = Action.LEAVE, None
        plan.record = dataclasses.replace(plan.record, decision=Decision.LEFT, reason=NO_GRAD_LOGITS_READ,
                                          reason_key="no_grad_logits_read")
    logits.fate, logits.droppable = fate, droppable


def _plan_one_walk(logits: LogitsPlan, options: Options) -> None:
    """The first site without grad among ``logits.sites`` (``LAZY``) that can, replaced by one
    walk returning the row statistics of the returned logits (:mod:`compile_pass.graph.plan`)."""
    dead = dead_after(plan.site for plan in logits.sites)
    for plan in logits.sites:
        if _requires_grad(plan.site.node):
            continue
        replacement = one_walk_replacement(plan.site, dead, options.tiles)
        if replacement is not None:
            plan.replacement = replacement
            return


def _requires_grad(loss: Node) -> bool:
    """Whether the loss node's value requires grad (True when unknown: rewriting is the safe default)."""
    value = example_value(loss)
    return not isinstance(value, torch.Tensor) or value.requires_grad


def _saves_memory(site: Site) -> bool:
    """Whether rewriting ``site`` would have saved memory: its classes (the class dim of its loss's
    input) are a vocabulary's (:func:`compile_pass.graph.find.is_vocabulary`) against the hidden
    size of the projection reached, or right under the stop; True when not known."""
    try:
        logits = site.call.input if site.call is not None else None
        if not is_tensor_node(logits) or example_value(logits).dim() == 0:
            return True
        value = example_value(logits)
        vocab = size_hint(value.shape[0 if value.dim() == 1 else site.call.class_dim])
        projection = site.projection
        if projection is None and site.stop is not None and site.stop.args:
            projection = as_projection(site.stop.args[0])
        hidden = projection.hidden if projection is not None else None
        hidden_size = size_hint(example_value(hidden).shape[-1]) if is_tensor_node(hidden) else None
        return find.is_vocabulary(vocab, hidden_size)
    except Exception:  # noqa: BLE001 - only a log level depends on it: warn
        log.debug("chunkce: could not tell the width of a refused site's logits", exc_info=True)
        return True


def plan_returned(graph: Graph, options: Options) -> list[LogitsPlan]:
    """The returned logits of ``graph`` (a top-level graph with no cross-entropy site: a forward
    without labels) to take out lazy: each projection to the vocabulary
    (:func:`compile_pass.graph.find.unmatched_projections`, with or without grad) that only the
    graph output reads, through the steps of :func:`compile_pass.graph.returned_logits.returned_chain`,
    under ``returned_logits="lazy"``, with more than one row per sequence (a decode step's
    ``[B, 1, V]`` stays computed: it is small, and the next token reads it at once)."""
    if options.returned_logits != "lazy":
        return []
    plans = []
    for found in find.unmatched_projections(graph, training=False):
        if not found.returned or find.decode_sized(found.projection):
            continue
        reached("fate", found.projection.node)
        if logits_fate(found.projection, [], options.returned_logits, False)[0] is Fate.LAZY:
            plans.append(LogitsPlan(found.projection, fate=Fate.LAZY, droppable=True))
    return plans


def one_walk_replacement(site: Site, dead: set[Node],
                         tiles: tuple[int | None, int | None]) -> Callable[..., Any] | None:
    """``site``'s replacement that also returns the row statistics of its returned logits'
    head, once the ``dead`` nodes are erased; None where the loss's walk cannot serve the reads:
    a spelling without ``one_walk`` (or its refusal), token rows other than the head's (indexing
    replayed on the hidden states), another scale than the returned logits', or logits that
    the loss and the reads see as different values or accumulate in different dtypes."""
    spelling = site.call.spelling.one_walk
    replacement = spelling(site.call, site.projection) if spelling is not None else None
    found = returned_head(site.projection, dead, tiles)
    if replacement is None or found is None or found[0].sharded:  # a shard walks its own columns
        return None
    head, chain = found
    if not all(isinstance(step, Reshape) for step in site.hidden_plan):
        return None
    if (site.scale is None) != (head.scale is None) or (site.scale is not None and site.scale.node not in chain):
        return None
    loss_dtype, returned_dtype = cast_chains(site)[-1][-1], head.logits_dtype
    same_values = loss_dtype == returned_dtype or (holds(loss_dtype, head.computed_dtype)
                                                   and holds(returned_dtype, head.computed_dtype))
    if not same_values or accumulate_dtype(loss_dtype) != accumulate_dtype(returned_dtype):
        return None
    return partial(replacement, statistics_dtype=returned_dtype)


def logits_fate(projection: Projection, rewritten: list[Site], mode: str, in_subgraph: bool) -> tuple[Fate, bool]:
    """``(fate, droppable)`` of ``projection``'s logits after ``rewritten`` (the sites reading
    them that will be rewritten) under ``returned_logits=mode``."""
    dead = dead_after(rewritten)
    if projection.node in dead:
        return Fate.GONE, False
    chain = returned_chain(projection.node, dead)
    loss_parallel = projection.sharded is not None and projection.sharded.loss_parallel
    droppable = chain is not None and not in_subgraph and not loss_parallel
    (output,) = projection.node.graph.find_nodes(op="output")
    if not droppable or mode not in ("lazy", "drop") or not isinstance(output.args[0], (tuple, list)):
        return Fate.KEPT, droppable
    if mode == "drop" and example_value(chain[-1]).requires_grad:
        return Fate.DROPPED, True
    return (Fate.LAZY if recipe_nodes(projection, chain) is not None else Fate.KEPT), True


def dead_after(sites: Iterable[Site]) -> set[Node]:
    """The nodes the rewrites of ``sites`` leave unread (each site's loss node, and what of
    :meth:`compile_pass.graph.sites.Site.erasable` only dead nodes read), as the rewrites erase them."""
    sites = list(sites)
    dead = {site.node for site in sites}
    candidates = [node for site in sites for node in site.erasable()]
    grew = True
    while grew:
        grew = False
        for node in candidates:
            if node not in dead and all(user in dead for user in node.users):
                dead.add(node)
                grew = True
    return dead
