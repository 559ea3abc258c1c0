"""Plan: per site rewrite / refuse / leave, per projection its logits' fate and op calls, before any edit.

Plan: what the pass will do at every site of a graph, with the logits the sites read and in the
op calls that rewrite them, decided before any edit (pure queries).

    plans, walks, logits = plan_sites(sites, options, in_subgraph, take_out)
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

A :class:`WalkPlan` per op call (:func:`_plan_walks`): what it computes, the sites that read it
and the rows it serves. Each rewritten site walks alone, except where a loss's walk returns the
row statistics too (its spelling's ``one_walk``: a cross-entropy with no class weight or label
smoothing, or a gather of log-probs) for readers that would walk again. One walk: a loss without
grad whose logits the step returns ``LAZY`` would walk the vocabulary twice, once for the loss and
once more when the caller reads the returned logits (an ``argmax`` for a metric); where its
statistics are exactly what the lazy logits' first read would compute
(:func:`compile_pass.graph.returned_logits.returned_head`), its walk returns them
(``serves_reads``), which the lazy logits keep (:func:`compile_pass.lazy_logits.wrap.wrap_compiled`).
Logits sliced before the loss (``logits[:, :-1]``) too: the walk covers every head row and the
loss reads its own (``head_rows``). The fold: row statistics of the same values beside a loss (a
z-loss's logsumexp, an entropy) read that loss's walk (``folded``): one op call forward and one
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
    replacement: Callable[..., Any] | None = None  # REWRITE: its spelling's replacement


@dataclass(eq=False)
class WalkPlan:
    """One op call over a projection's head, in place of the node of one rewritten site (``plan``).

    ``replacement``: what is traced in (the site's own, or its spelling's ``one_walk`` that returns
    the row statistics too); ``head_rows``: it walks every head row and is told which are the
    site's (``rows=``); ``folded``: row statistic sites of the same values that read its statistics
    instead of walking; ``serves_reads``: its statistics are those the returned logits' reads
    compute; ``at``: the node it is traced in before (the site's, or the first folded statistic's);
    ``moved``: the nodes making the site's labels, moved before ``at`` first.
    """

    plan: SitePlan
    replacement: Callable[..., Any]
    at: Node
    head_rows: bool = False
    folded: tuple[SitePlan, ...] = ()
    serves_reads: bool = False
    moved: tuple[Node, ...] = ()


@dataclass
class LogitsPlan:
    """The logits of one projection: the sites rewritten from them, in graph order, and their fate."""

    projection: Projection
    sites: list[SitePlan] = field(default_factory=list)
    fate: Fate | None = None  # None when it could not be told (nothing taken out, no note)
    droppable: bool = False  # only the graph output reads them


def plan_sites(sites: list[Site], options: Options, in_subgraph: bool,
               take_out: bool = False) -> tuple[list[SitePlan], list[WalkPlan], list[LogitsPlan]]:
    """The plans of ``sites`` (one graph's), of the op calls that rewrite them (in graph order of
    the nodes they replace) and of the logits they read; ``take_out``: returned logits may leave
    the graph (the caller wraps it).

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
    walks: list[WalkPlan] = []
    for logits in groups.values():
        _plan_logits(logits, returned, in_subgraph, strict=options.strict)
        walks += _plan_walks(logits, options, order, serve_reads=take_out and logits.fate is Fate.LAZY)
    walks.sort(key=lambda walk: order[walk.plan.site.node])
    return plans, walks, list(groups.values())


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
    sites = [plan for plan in logits.sites if plan not in left]
    if left:
        fate, droppable = logits_fate(logits.projection, [plan.site for plan in sites], returned, in_subgraph)
    for plan in left:
        plan.action, plan.replacement = Action.LEAVE, None
        plan.record = dataclasses.replace(plan.record, decision=Decision.LEFT, reason=NO_GRAD_LOGITS_READ,
                                          reason_key="no_grad_logits_read")
    logits.sites, logits.fate, logits.droppable = sites, fate, droppable  # all at once: a failure changes nothing


def _plan_walks(logits: LogitsPlan, options: Options, order: dict[Node, int], serve_reads: bool) -> list[WalkPlan]:
    """The op calls that rewrite ``logits.sites``, in their order: a walk per site, but for a loss
    without grad whose walk also serves the returned logits' reads (``serve_reads``: they are
    ``LAZY``; :func:`_serving_walk`) and a loss whose walk row statistics of the same values read
    instead of walking (:func:`_fold`; not under ``grads_in_forward``)."""
    walks = {plan.site.node: WalkPlan(plan, plan.replacement, plan.site.node) for plan in logits.sites}
    serving = _serving_walk(logits, options, strict=options.strict) if serve_reads else None
    if serving is not None:
        walks[serving.plan.site.node] = serving
    fold = None if options.grads_in_forward else _fold(logits, walks, order, strict=options.strict)
    if fold is not None:
        walks[fold.plan.site.node] = fold
        for plan in fold.folded:
            del walks[plan.site.node]
    return list(walks.values())


@tolerant("could not plan one walk for the loss and the returned logits' reads; the loss walks alone")
def _serving_walk(logits: LogitsPlan, options: Options) -> WalkPlan | None:
    """The walk of the first site without grad among ``logits.sites`` that can, returning the row
    statistics of the returned logits (:func:`one_walk_replacement`); None when none can."""
    dead = dead_after(plan.site for plan in logits.sites)
    for plan in logits.sites:
        if _requires_grad(plan.site.node):
            continue
        found = one_walk_replacement(plan.site, dead, options.tiles)
        if found is not None:
            replacement, head_rows = found
            return WalkPlan(plan, replacement, plan.site.node, head_rows=head_rows, serves_reads=True)
    return None


@tolerant("could not fold the row statistics into the loss's walk; each walks alone")
def _fold(logits: LogitsPlan, walks: dict[Node, WalkPlan], order: dict[Node, int]) -> WalkPlan | None:
    """The walk of the one loss site of ``logits`` (``walks[node]`` so far) that row statistics (a
    z-loss's logsumexp, an entropy) read, ``folded``: it walks every head row and returns them (its
    spelling's ``one_walk``), where they read the same values (the same casts and scale) with
    grad as the loss, and the loss's inputs exist before the first of them (``at``); None when
    none folds."""
    losses = [plan for plan in logits.sites if isinstance(plan.site.call, LossCall)]
    statistics = [plan for plan in logits.sites if plan.site.call.spelling.kind is SpellingKind.STATISTIC]
    if len(losses) != 1 or not statistics:
        return None
    (loss,) = losses
    site, walk = loss.site, walks[loss.site.node]
    replacement, head_rows = walk.replacement, walk.head_rows
    if not walk.serves_reads:
        spelling = site.call.spelling.one_walk
        replacement = spelling(site.call, site.projection) if spelling is not None else None
        if replacement is None:
            return None
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
        return None
    at = min((loss, *folded), key=lambda plan: order[plan.site.node]).site.node
    return dataclasses.replace(walk, replacement=replacement, head_rows=head_rows, folded=tuple(folded), at=at,
                               moved=tuple(moved))


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
