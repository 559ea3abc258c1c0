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
recipe cannot take, a ``loss_parallel`` head's ``Shard(-1)`` logits, or a caller that cannot take
them out: ``take_out=False``, the pre-grad pass and ``fuse_linear_cross_entropy``, plan as ``"keep"``). The two are decided
together: a site without grad whose logits stay ``KEPT`` is left as stock, since without grad
Inductor fuses the upcast and the log-softmax into reductions over the logits, and the rewrite
would only add a second projection.

One walk: a loss site without grad whose logits the step returns ``LAZY`` would walk the
vocabulary twice, once for the loss and once more when the caller reads the returned logits (an
``argmax`` for a metric). When the loss is the row statistics' (its spelling's ``one_walk``: a
cross-entropy with no class weight or label smoothing, or a gather of log-probs) and those
statistics are exactly what the lazy logits' first read would compute
(:func:`compile_pass.graph.returned_logits.returned_head`), the site is
replaced by one ``chunkce::linear_statistics`` walk that gives the loss and returns the
statistics, which the lazy logits keep (:func:`compile_pass.lazy_logits.wrap.wrap_compiled`).
Logits sliced before the loss (``logits[:, :-1]``) too: the walk covers every head row and the
loss reads its own (``head_rows``). Row statistics of the same values beside a loss (a z-loss's
logsumexp, an entropy) read that loss's walk too (``_plan_fold``): one op call forward and one
backward where each walked on its own.
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
from compile_pass.graph.guard import cast_chains, mutates
from compile_pass.graph.nodes import CALLS, example_value, is_tensor_node, size_hint
from compile_pass.graph.projection import Projection, as_projection
from compile_pass.graph.refusals import Reason
from compile_pass.graph.report import NO_GRAD_LOGITS_READ, Decision, SiteRecord, failed, module_of, source_of
from compile_pass.graph.returned_logits import Fate, recipe_nodes, returned_chain, returned_head
from compile_pass.graph.sites import Replay, Reshape, Site
from compile_pass.graph.spellings.call import LossCall, SpellingKind
from compile_pass.graph.stages import reached, tolerant
from compile_pass.op.checks import holds
from compile_pass.op.tiling import accumulate_dtype
from compile_pass.options import Options, ReturnedLogits

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
    head_rows: bool = False  # the replacement walks every head row, told which are the loss's (``rows=``)
    serves_reads: bool = False  # its statistics are those the returned logits' reads compute (_plan_one_walk)
    walk_of: SitePlan | None = None  # a row statistic folded into that loss site's walk (_plan_fold)
    at: Node | None = None  # a loss whose walk serves statistics before it: traced in before this node
    moved: tuple[Node, ...] = ()  # the nodes making its labels, moved before ``at`` first


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
    plans = [_plan_site(site, order, strict=options.strict) for site in sites]
    refused = [plan for plan in plans if plan.action is Action.REFUSE]
    if options.strict and refused:
        record = refused[0].record
        raise NotImplementedError(f"chunkce: cannot rewrite the cross-entropy at {record.source}: {record.reason} "
                                  "(strict=True; pass strict=False to leave such sites unfused)")
    returned = options.returned_logits if take_out else ReturnedLogits.KEEP  # nothing leaves: all computed
    groups: dict[Node, LogitsPlan] = {}
    for plan in plans:
        if plan.action is Action.REWRITE:
            groups.setdefault(plan.site.projection.node, LogitsPlan(plan.site.projection)).sites.append(plan)
    for logits in groups.values():
        _plan_logits(logits, returned, in_subgraph, strict=options.strict)
        if take_out and logits.fate is Fate.LAZY:
            _plan_one_walk(logits, options, strict=options.strict)
        if not options.grads_in_forward:
            _plan_fold(logits, order, strict=options.strict)
    return plans, list(groups.values())


def _unplanned(site: Site, order: dict[Node, int], exc: Exception) -> SitePlan:
    return SitePlan(site, Action.REFUSE, failed(site.node.name, guard.internal_error(f"{type(exc).__name__}: {exc}")))


@tolerant("could not plan the site {site.node.name}; left it unfused", fallback=_unplanned)
def _plan_site(site: Site, order: dict[Node, int]) -> SitePlan:
    reached("check", site)
    reason = guard.check(site, order)
    replacement = None
    if reason is None:
        replacement = site.call.spelling.replace(site.call, site.projection)
        if isinstance(replacement, Reason):
            reason, replacement = replacement, None
    reached("plan", site)
    source, spelling = source_of(site.node), site.call.spelling.name if site.call is not None else ""
    if reason is not None:
        module = module_of(site.projection.node if site.projection else site.stop)
        record = SiteRecord(source, module, Decision.REFUSED, str(reason), reason.key, fix=reason.fix,
                            spelling=spelling, warns=_saves_memory(site))
        return SitePlan(site, Action.REFUSE, record)
    record = SiteRecord(source, module_of(site.projection.node), Decision.REWRITTEN, "", spelling=spelling)
    return SitePlan(site, Action.REWRITE, record, replacement)


@tolerant("could not tell which rewritten sites' logits are kept; the graph is rewritten")
def _plan_logits(logits: LogitsPlan, returned: ReturnedLogits, in_subgraph: bool) -> None:
    """Fill ``logits.fate``; a site without grad among them is left as stock when they are ``KEPT``."""
    reached("fate", logits.projection.node)
    fate, droppable = logits_fate(logits.projection, [plan.site for plan in logits.sites], returned, in_subgraph)
    left = [plan for plan in logits.sites if not _requires_grad(plan.site.node)] if fate is Fate.KEPT else []
    if left:
        logits.sites = [plan for plan in logits.sites if plan not in left]
        fate, droppable = logits_fate(logits.projection, [plan.site for plan in logits.sites], returned, in_subgraph)
    for plan in left:
        plan.action, plan.replacement = Action.LEAVE, None
        plan.record = dataclasses.replace(plan.record, decision=Decision.LEFT, reason=NO_GRAD_LOGITS_READ,
                                          reason_key="no_grad_logits_read")
    logits.fate, logits.droppable = fate, droppable


@tolerant("could not plan one walk for the loss and the returned logits' reads; the loss walks alone")
def _plan_one_walk(logits: LogitsPlan, options: Options) -> None:
    """The first site without grad among ``logits.sites`` (``LAZY``) that can, replaced by one
    walk returning the row statistics of the returned logits (:mod:`compile_pass.graph.plan`)."""
    dead = dead_after(plan.site for plan in logits.sites)
    for plan in logits.sites:
        if _requires_grad(plan.site.node):
            continue
        found = one_walk_replacement(plan.site, dead, options.tiles)
        if found is not None:
            plan.replacement, plan.head_rows = found
            plan.serves_reads = True
            return


@tolerant("could not fold the row statistics into the loss's walk; each walks alone")
def _plan_fold(logits: LogitsPlan, order: dict[Node, int]) -> None:
    """A loss site and row statistics (a z-loss's logsumexp, an entropy) of the same logits: the
    statistics read the loss's walk (``walk_of``), which walks every head row and returns them
    (its spelling's ``one_walk``), where they read the same values (the same casts and scale) with
    grad as the loss, and the loss's inputs exist before the first of them (``at``: where the walk
    is traced in)."""
    losses = [plan for plan in logits.sites if isinstance(plan.site.call, LossCall)]
    statistics = [plan for plan in logits.sites if plan.site.call.spelling.kind is SpellingKind.STATISTIC]
    if len(losses) != 1 or not statistics:
        return
    (loss,) = losses
    site = loss.site
    replacement, head_rows = loss.replacement, loss.head_rows
    if not loss.serves_reads:
        spelling = site.call.spelling.one_walk
        replacement = spelling(site.call, site.projection) if spelling is not None else None
        if replacement is None:
            return
        replacement = partial(replacement, statistics_dtype=cast_chains(site)[-1][-1])
        head_rows = not all(isinstance(step, Reshape) for step in site.hidden_plan)
    grad = _requires_grad(site.node)  # a statistic under no_grad beside a loss with grad walks alone
    folded = [plan for plan in statistics if plan.site.scale_node is site.scale_node
              and cast_chains(plan.site) == cast_chains(site) and _requires_grad(plan.site.node) == grad]
    early = [plan for plan in folded if order[plan.site.node] < order[site.node]]
    moved: list[Node] = []
    if early:  # the walk runs at the first statistic: the labels must be what the loss reads, and made by then
        first = min(order[plan.site.node] for plan in early)
        nodes = list(site.node.graph.nodes)[first:order[site.node]]
        moved = _made_after(_loss_inputs(site), first, order)
        # labels made from an early statistic's value cannot be made before it
        reads_statistic = moved is not None and not {plan.site.node for plan in early}.isdisjoint(moved)
        if any(mutates(node) for node in nodes) or moved is None or reads_statistic:
            folded, moved = [plan for plan in folded if plan not in early], []
    if not folded:
        return
    loss.replacement, loss.head_rows = replacement, head_rows
    first_site = min((loss, *folded), key=lambda plan: order[plan.site.node])
    loss.at = first_site.site.node if first_site is not loss else None
    loss.moved = tuple(moved)
    for plan in folded:
        plan.walk_of = loss


def _loss_inputs(site: Site) -> list[Node]:
    """The nodes a loss's walk reads besides the head's: its labels, a scale, an indexing's arguments."""
    inputs = [node for node in (site.call.target, site.scale_node) if isinstance(node, Node)]
    return inputs + [arg for step in site.hidden_plan if isinstance(step, Replay)  # a narrow's start, say
                     for arg in step.node.all_input_nodes if arg is not step.node.args[0]]


def _made_after(inputs: list[Node], first: int, order: dict[Node, int]) -> list[Node] | None:
    """``inputs`` and their inputs the graph makes at or after position ``first``, in graph order
    (moved before it, they make the same values where nothing between mutates); None when one is
    not a plain call (moved, it could change what it computes)."""
    made, stack = set(), list(inputs)
    while stack:
        node = stack.pop()
        if order[node] < first or node in made:
            continue
        if node.op not in CALLS or mutates(node):
            return None
        made.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(made, key=order.__getitem__)


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


def _none_returned(graph: Graph, options: Options, exc: Exception) -> list[LogitsPlan]:
    return []


@tolerant("could not tell whether the graph's returned logits can be lazy; they are computed", fallback=_none_returned)
def plan_returned(graph: Graph, options: Options) -> list[LogitsPlan]:
    """The returned logits of ``graph`` (a top-level graph with no cross-entropy site: a forward
    without labels) to take out lazy: each projection to the vocabulary
    (:func:`compile_pass.graph.find.unmatched_projections`, with or without grad) that only the
    graph output reads, through the steps of :func:`compile_pass.graph.returned_logits.returned_chain`,
    under ``returned_logits="lazy"``, with more than one row per sequence (a decode step's
    ``[B, 1, V]`` stays computed: it is small, and the next token reads it at once)."""
    if options.returned_logits is not ReturnedLogits.LAZY:
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
                         tiles: tuple[int | None, int | None]) -> tuple[Callable[..., Any], bool] | None:
    """``(replacement, head_rows)``: ``site``'s replacement that also returns the row statistics
    of its returned logits' head, once the ``dead`` nodes are erased, and whether it walks every
    head row to read the loss's own (``head_rows``: the loss read token rows other than the head's,
    ``logits[:, :-1]``, indexing replayed on the row numbers, not on the hidden states); None where
    the loss's walk cannot serve the reads: a spelling without ``one_walk`` (or its refusal),
    another scale than the returned logits', or logits that the loss and the reads see as
    different values or accumulate in different dtypes."""
    one_walk = site.call.spelling.one_walk
    replacement = one_walk(site.call, site.projection) if one_walk is not None else None
    found = returned_head(site.projection, dead, tiles)
    if replacement is None or found is None or found[0].sharded:  # a shard walks its own columns
        return None
    head, chain = found
    if (site.scale is None) != head.scale.is_identity or (site.scale is not None and site.scale_node not in chain):
        return None
    loss_dtype, returned_dtype = cast_chains(site)[-1][-1], head.logits_dtype
    same_values = loss_dtype == returned_dtype or (holds(loss_dtype, head.computed_dtype)
                                                   and holds(returned_dtype, head.computed_dtype))
    if not same_values or accumulate_dtype(loss_dtype) != accumulate_dtype(returned_dtype):
        return None
    head_rows = not all(isinstance(step, Reshape) for step in site.hidden_plan)
    return partial(replacement, statistics_dtype=returned_dtype), head_rows


def logits_fate(projection: Projection, rewritten: list[Site], returned: ReturnedLogits,
                in_subgraph: bool) -> tuple[Fate, bool]:
    """``(fate, droppable)`` of ``projection``'s logits after ``rewritten`` (the sites reading
    them that will be rewritten) under ``returned_logits=returned``."""
    dead = dead_after(rewritten)
    if projection.node in dead:
        return Fate.GONE, False
    chain = returned_chain(projection.node, dead)
    loss_parallel = projection.sharded is not None and projection.sharded.loss_parallel
    droppable = chain is not None and not in_subgraph and not loss_parallel
    (output,) = projection.node.graph.find_nodes(op="output")
    if not droppable or returned is ReturnedLogits.KEEP or not isinstance(output.args[0], (tuple, list)):
        return Fate.KEPT, droppable
    if returned is ReturnedLogits.DROP and example_value(chain[-1]).requires_grad:
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
