"""How a pass report is published: log records, counters, the last report.

Every :class:`compile_pass.graph.report.PassReport` the backend or the pre-grad pass
publishes is logged through ``logging.getLogger("compile_pass.graph.publish")``, counted in
``torch._dynamo.utils.counters["chunkce"]``, and kept: :func:`last_report`.

Logged: a rewritten site at INFO. A refused site whose rewrite would have saved memory
(``SiteRecord.warns``: its logits are a vocabulary's, :func:`compile_pass.graph.no_site.
is_vocabulary`), and a projection to the vocabulary with no site, at WARNING with the
reason and the fix, once per process for each (source line, reason key): a graph
compiled again (a new sequence length, DDP's pieces, a restart of Dynamo's analysis)
does not repeat it; a repeat is logged at DEBUG. A refused site with a few classes (a
classifier's score layer: nothing to save) is logged at INFO, and stays in the report.
A soft-capped head (``soft_cap``) says that it is refused by design.
:func:`compile_pass.explain` does not publish: it returns the full report, and logs no site.

A site left as stock (``LEFT``: the rewrite would only cost, e.g. a graph without grad
that still reads the logits) is logged at INFO with its reason, never warned.

Counter keys: ``sites_found``, ``sites_rewritten``, ``sites_refused``, ``sites_left``,
``refused_<reason key>`` (e.g. ``refused_soft_cap``), ``logits_kept`` (rewritten
sites whose logits other users still need), ``logits_lazy`` (returned logits
computed only when read, the default ``returned_logits="lazy"``, of a loss's graph or of a
forward without labels), ``logits_dropped``
(returned logits not computed, ``returned_logits="drop"``), ``logits_bytes_avoided`` and
``unmatched_projections`` (projections to the vocabulary of training graphs with no site).
"""

from __future__ import annotations

import logging
from functools import partial

import compile_pass.torch_internals as internals
from compile_pass.graph.report import (
    LEFT,
    LOGITS_DROPPED,
    LOGITS_KEPT,
    LOGITS_LAZY,
    REWRITTEN,
    SOFT_CAP_BY_DESIGN,
    PassReport,
    tiles_text,
)
from compile_pass.graph.stages import attempt, reached

log = logging.getLogger(__name__)

_last: PassReport | None = None
_warned: set[tuple[str, str]] = set()  # (source, reason key) of every warning this process logged


def publish(report: PassReport, strict: bool = False) -> None:
    """Log each record (the module docstring says at which level), count it, and keep the
    report for :func:`last_report` if it has any site; a failure is logged, not raised, unless
    ``strict`` (:func:`compile_pass.graph.stages.attempt`)."""
    attempt(strict, partial(_publish, report), lambda exc: None,
            "could not report the pass's decisions; the graph is rewritten")


def forget_warnings() -> None:
    """Forget which (source, reason key) pairs were warned of: the next of each warns again."""
    _warned.clear()


def _publish(report: PassReport) -> None:
    global _last
    reached("report", report)
    if report.records:
        _last = report
    stats = internals.counters.get()["chunkce"]
    for record in report.records:
        stats["sites_found"] += 1
        if record.decision == REWRITTEN:
            stats["sites_rewritten"] += 1
            stats["logits_bytes_avoided"] += record.logits_bytes_avoided
            stats["logits_kept"] += record.reason == LOGITS_KEPT
            stats["logits_dropped"] += record.reason == LOGITS_DROPPED
            stats["logits_lazy"] += record.reason == LOGITS_LAZY
            log.info("chunkce: rewrote %s (%s, module %s, tiles %s, logits bytes avoided %s)%s",
                     record.source, record.form or "loss", record.module or "?", tiles_text(record.tiles),
                     record.logits_bytes_avoided, f"; {record.reason}" if record.reason else "")
        elif record.decision == LEFT:  # nothing is lost: no warning
            stats["sites_left"] += 1
            log.info("chunkce: left %s as stock compiles it: %s", record.source, record.reason)
        else:
            stats["sites_refused"] += 1
            stats[f"refused_{record.reason_key}"] += 1
            module = f" (module {record.module})" if record.module else ""
            advice = SOFT_CAP_BY_DESIGN if record.reason_key == "soft_cap" else record.fix
            level = _once(record.source, record.reason_key) if record.warns else logging.INFO
            log.log(level, "chunkce: left %s unfused%s: %s; %s",
                    record.source, module, record.reason, advice)
    for returned in report.returned:
        stats["logits_lazy"] += 1
        stats["logits_bytes_avoided"] += returned.logits_bytes_avoided
        log.info("chunkce: %s", returned)
    for unmatched_record in report.unmatched:
        stats["unmatched_projections"] += 1
        log.log(_once(unmatched_record.source, "unmatched"), "chunkce: %s; %s", unmatched_record,
                unmatched_record.fix)


def _once(source: str, reason_key: str) -> int:
    """WARNING the first time this process reports ``(source, reason_key)``, DEBUG after."""
    if (source, reason_key) in _warned:
        return logging.DEBUG
    _warned.add((source, reason_key))
    return logging.WARNING


def last_report() -> PassReport | None:
    """The report of the pass's latest run in this process that found a cross-entropy site."""
    return _last
