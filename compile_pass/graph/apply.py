"""Apply: carry out a graph's plans, each site in one all-or-nothing edit, then its logits' fate.

    records = apply_plans(plans, logits, options, take_out=True)
    returned = take_out_returned(plan_returned(graph, options), options)   # a graph with no site

Each ``REWRITE`` plan is one :class:`compile_pass.graph.nodes.Edit` (the rewrite, then a lint):
a failure undoes it and the site is refused as ``internal_error``. Then the logits planned
``LAZY`` / ``DROPPED`` are taken out (``take_out``), each projection in an edit of its own: a
failure leaves them computed (``LOGITS_KEPT``). The records are the plans' with what was done.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from compile_pass.graph import guard
from compile_pass.graph.logits_fate import Fate
from compile_pass.graph.nodes import Edit, example_value, size_hint
from compile_pass.graph.plan import Action, LogitsPlan, SitePlan
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
from compile_pass.graph.returned_logits import take_out as take_out_logits
from compile_pass.graph.rewrite import rewrite_site
from compile_pass.graph.stages import attempt, reached
from compile_pass.options import Options


def apply_plans(plans: list[SitePlan], logits: list[LogitsPlan], options: Options, take_out: bool) -> list[SiteRecord]:
    """The records of ``plans`` once carried out; ``take_out``: the caller wraps the compiled graph
    (:func:`compile_pass.graph.returned_logits.add_outputs`), so returned logits may leave it."""
    for plan in plans:
        if plan.action is Action.REWRITE:
            plan.record = attempt(options.strict, partial(_rewrite, plan, options), partial(_failed, plan),
                                  "rewriting %s failed; left it unfused", plan.site.node.format_node())
    for group in logits:
        done = [plan for plan in group.sites if plan.record.decision is Decision.REWRITTEN]
        # a failed rewrite's loss still reads the logits
        fate, droppable = (group.fate, group.droppable) if len(done) == len(group.sites) else (Fate.KEPT, False)
        saved = None
        statistics = next((plan.statistics for plan in done if plan.statistics), ())
        if fate in (Fate.LAZY, Fate.DROPPED) and take_out:
            saved = attempt(options.strict, partial(_take_out, group, fate, options, statistics), lambda exc: None,
                            "taking the returned logits of %s out of the graph failed; the step computes them",
                            group.projection.node.format_node())
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
        saved = attempt(options.strict, partial(_take_out, group, Fate.LAZY, options), lambda exc: None,
                        "taking the returned logits of %s out of the graph failed; the step computes them",
                        node.format_node())
        if saved is not None:
            records.append(ReturnedRecord(source, module, vocab, saved))
    return records


def _rewrite(plan: SitePlan, options: Options) -> SiteRecord:
    graph = plan.site.node.graph
    with Edit(graph) as edit:
        reached("rewrite", plan.site)
        done = rewrite_site(plan.site, plan.replacement, edit, options)
        graph.lint()
    plan.statistics = done.statistics
    return dataclasses.replace(plan.record, logits_bytes_avoided=done.logits_bytes_avoided, tiles=done.tiles)


def _failed(plan: SitePlan, exc: Exception) -> SiteRecord:
    reason = guard.internal_error(f"{type(exc).__name__}: {exc}")
    return dataclasses.replace(plan.record, decision=Decision.REFUSED, reason=str(reason), reason_key=reason.key,
                               fix=reason.fix, tiles=None)


def _take_out(group: LogitsPlan, fate: Fate, options: Options, statistics: tuple = ()) -> int:
    graph = group.projection.node.graph
    with Edit(graph) as edit:
        reached("take_out", group.projection)
        saved = take_out_logits(group.projection, edit, fate,
                                tiles=(options.chunk_size, options.chunk_bytes), statistics=statistics)
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
