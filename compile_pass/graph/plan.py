"""Plan: what the pass will do at every site of a graph, decided before any edit (pure queries).

    plans, logits = plan_sites(sites, options, in_subgraph, take_out)
    returned = plan_returned(graph, options)   # a top-level graph with no site: its returned logits

A :class:`SitePlan` per site: ``REWRITE`` (with its spelling's replacement), ``REFUSE`` (a
:class:`compile_pass.graph.refusals.Reason`) or ``LEAVE``; a :class:`LogitsPlan` per projection
the rewritten sites read: what becomes of its logits (:func:`compile_pass.graph.logits_fate.logits_fate`).
The two are decided together: a site without grad whose logits stay computed (``KEPT``) is left
as stock, since without grad Inductor fuses the upcast and the log-softmax into reductions over
the logits, and the rewrite would only add a second projection; where they leave the graph
lazy, the first such site that can is replaced by one walk that also returns the row statistics
their reads need (:mod:`compile_pass.graph.one_walk`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any

import torch
from torch.fx import Graph, Node

from compile_pass.graph import guard, no_site
from compile_pass.graph.forms import Projection, as_projection
from compile_pass.graph.logits_fate import Fate, dead_after, logits_fate
from compile_pass.graph.nodes import example_value, is_tensor_node, size_hint
from compile_pass.graph.one_walk import one_walk_replacement
from compile_pass.graph.refusals import Reason
from compile_pass.graph.report import NO_GRAD_LOGITS_READ, Decision, SiteRecord, failed, module_of, source_of
from compile_pass.graph.sites import Site
from compile_pass.graph.stages import attempt, reached
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
    statistics: tuple[Node, ...] = ()  # rewritten by one walk (one_walk.py): its lse, entropy, max, argmax nodes


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
    walk returning the row statistics of the returned logits (:mod:`compile_pass.graph.one_walk`)."""
    dead = dead_after(plan.site for plan in logits.sites)
    for plan in logits.sites:
        if _requires_grad(plan.site.node):
            continue
        replacement = one_walk_replacement(plan.site, dead, (options.chunk_size, options.chunk_bytes))
        if replacement is not None:
            plan.replacement = replacement
            return


def _requires_grad(loss: Node) -> bool:
    """Whether the loss node's value requires grad (True when unknown: rewriting is the safe default)."""
    value = example_value(loss)
    return not isinstance(value, torch.Tensor) or value.requires_grad


def _saves_memory(site: Site) -> bool:
    """Whether rewriting ``site`` would have saved memory: its classes (the class dim of its loss's
    input) are a vocabulary's (:func:`compile_pass.graph.no_site.is_vocabulary`) against the hidden
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
        return no_site.is_vocabulary(vocab, hidden_size)
    except Exception:  # noqa: BLE001 - only a log level depends on it: warn
        log.debug("chunkce: could not tell the width of a refused site's logits", exc_info=True)
        return True


def plan_returned(graph: Graph, options: Options) -> list[LogitsPlan]:
    """The returned logits of ``graph`` (a top-level graph with no cross-entropy site: a forward
    without labels) to take out lazy: each projection to the vocabulary
    (:func:`compile_pass.graph.no_site.unmatched_projections`, with or without grad) that only the
    graph output reads, through the steps of :func:`compile_pass.graph.logits_fate.returned_chain`,
    under ``returned_logits="lazy"``, with more than one row per sequence (a decode step's
    ``[B, 1, V]`` stays computed: it is small, and the next token reads it at once)."""
    if options.returned_logits != "lazy":
        return []
    plans = []
    for found in no_site.unmatched_projections(graph, training=False):
        if not found.returned or no_site.decode_sized(found.projection):
            continue
        reached("fate", found.projection.node)
        if logits_fate(found.projection, [], options.returned_logits, False)[0] is Fate.LAZY:
            plans.append(LogitsPlan(found.projection, fate=Fate.LAZY, droppable=True))
    return plans
