"""The report: a record per site, the table, and how a report is logged, counted and kept.

The report: what the pass did at each site (the records and their table), and how a report is
published (logged, counted, kept).

One :class:`SiteRecord` per site; a :class:`PassReport` per graph, with a :class:`ReturnedRecord`
per returned logits taken out of a graph with no site and an :class:`UnmatchedRecord` per
projection to the vocabulary of a training graph that has no site (:mod:`compile_pass.graph.find`).

:func:`publish`: every report the backend or the pre-grad pass publishes is logged through
``logging.getLogger("compile_pass.graph.report")``, counted in
``torch._dynamo.utils.counters["chunkce"]``, and kept (:func:`last_report`). A rewritten site is
logged at INFO. A refused site whose rewrite would have saved memory (``SiteRecord.warns``: its
logits are a vocabulary's), and a projection to the vocabulary with no site, at WARNING with the
reason and the fix, once per process for each (source line, reason key); a repeat (a graph
compiled again: a new sequence length, DDP's pieces) at DEBUG. A refused site with a few classes
(a classifier's score layer) and a site left as stock (``Decision.LEFT``) at INFO. A soft-capped
head says that it is refused by design. :func:`compile_pass.explain` does not publish.

Counter keys: ``sites_found``, ``sites_rewritten``, ``sites_refused``, ``sites_left``,
``refused_<reason key>`` (e.g. ``refused_soft_cap``), ``logits_kept`` (rewritten sites whose
logits other users still need), ``logits_lazy`` (returned logits computed only when read, the
default ``returned_logits="lazy"``, of a loss's graph or of a forward without labels),
``logits_dropped`` (returned logits not computed, ``returned_logits="drop"``),
``logits_bytes_avoided``, ``unmatched_projections`` and ``statistics_folded`` (rewritten row
statistics read from the walk of a loss of the same logits: no op node of their own).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from torch.fx import Graph, Node

import compile_pass.torch_internals as internals
from compile_pass.graph import find
from compile_pass.graph.refusals import Reason, Refusal, fix_for
from compile_pass.graph.returned_logits import Fate
from compile_pass.graph.stages import reached, tolerant
from compile_pass.op.tiling import Tiles

log = logging.getLogger(__name__)



class Decision(StrEnum):
    """What the pass did at a site (its value is what the report's table shows)."""

    REWRITTEN = "rewritten"
    REFUSED = "refused"
    LEFT = "left as stock"  # a site the pass could rewrite but does not: the rewrite would only cost (not a refusal)


NO_GRAD_LOGITS_READ = (
    "not rewritten: this graph computes no gradient and still computes the [N, V] logits for another reader; "
    "without grad Inductor fuses the fp32 upcast and the log-softmax into reductions over them, so the rewrite "
    "would save no memory and add a second projection (measured in docs/models.md); exact as stock"
)
LOGITS_KEPT = "logits still materialized for other users"
LOGITS_DROPPED = "returned logits not computed (returned_logits='drop')"
LOGITS_LAZY = "returned logits computed only when read (returned_logits='lazy')"
DROP_LOGITS_FIX = (
    "fix: the only other user is the graph output (e.g. HF's outputs.logits): the chunkce backend's default, "
    "options={'returned_logits': 'lazy'}, computes them only if something reads them"
)


@dataclass(frozen=True)
class SiteRecord:
    """The pass's decision at one cross-entropy call."""

    source: str  # "file.py:12 in forward: loss = F.cross_entropy(...)"
    module: str  # module path of the projection, e.g. "lm_head"; "" when unknown
    decision: Decision
    reason: str  # why refused or left; for a rewritten site, notes (e.g. LOGITS_KEPT) or ""
    reason_key: str = ""
    # a rewritten site's [n, Vb] tiles: what the op's own rule (op.tiling.resolve_tiles) gives
    # for the site's sizes (their hints where symbolic), options and environment at compile time
    tiles: Tiles | None = None
    logits_bytes_avoided: int = 0
    fix: str = ""  # how to make a refused site rewritable (never empty then), or a kept logits droppable
    # how the loss is spelled: "cross_entropy", "nll_loss" (of a log_softmax), "gather" (of a
    # log_softmax: the per-token log-probabilities); "" when unknown
    spelling: str = ""
    # a refused site: whether a rewrite would have saved memory (logged at WARNING, else at INFO)
    warns: bool = True
    # what became of the logits, on the record that says so (``reason``): every rewritten site of
    # logits kept, the last rewritten site of logits taken out; None on the others
    fate: Fate | None = None
    folded: bool = False  # a row statistic read from a loss's walk (graph/plan.py, WalkPlan.folded): no op of its own

    def __post_init__(self) -> None:
        if self.decision is Decision.REFUSED and not self.fix:  # every refusal says what to do about it
            object.__setattr__(self, "fix", fix_for(self.reason_key))

    @property
    def chunk_size(self) -> int | None:
        """Tokens a tile (the ``n`` of :attr:`tiles`) of a rewritten site; None otherwise."""
        return None if self.tiles is None else self.tiles.tokens


def failed(where: str, reason: Reason) -> SiteRecord:
    """The record of a site (``where``: its node's name, or ``"(whole graph)"``) the pass
    failed on (``reason``: ``internal_error``)."""
    return SiteRecord(where, "", Decision.REFUSED, str(reason), reason.key, fix=reason.fix)


SOFT_CAP_BY_DESIGN = ("refused by design: the op has no soft cap, so a soft-capped head's logits stay as stock "
                      "compile computes them (exact; nothing to fix)")
NO_SITE_FIX = (
    "fix: compute the loss inside the compiled region (compile the function that computes the loss too, or pass "
    "labels= to the model so that it computes it); the pass finds F.cross_entropy, nll_loss(log_softmax(...)) "
    "and -log_softmax(...).gather(...) only; if the graph breaks before the loss, the loss's graph is reported on "
    "its own (graph_break); compile_pass.explain(model, ...) lists what the pass sees"
)


@dataclass(frozen=True)
class UnmatchedRecord:
    """A projection to the vocabulary in a training graph with no cross-entropy site
    (:mod:`compile_pass.graph.find`): its logits, and their gradient, are computed in full."""

    source: str  # of the projection: "modeling_llama.py:512 in forward: logits = self.lm_head(...)"
    module: str  # "lm_head"; "" when unknown
    vocab: int  # V, the projection's last dim
    use: str  # what reads the logits: "returned by the graph", "normalised by `log_softmax`"
    fix: str = NO_SITE_FIX

    def __str__(self) -> str:
        module = f" (module {self.module})" if self.module else ""
        return (f"{self.source}{module} projects to a vocabulary of {self.vocab} in a training graph with no "
                f"cross-entropy loss (the logits are {self.use}): its [N, {self.vocab}] logits and their gradient "
                "are computed in full")


def unmatched(graph: Graph) -> list[UnmatchedRecord]:
    """The records of ``graph``'s projections to the vocabulary but a decode step's
    (:func:`compile_pass.graph.find.unmatched_projections`; the caller checks that the graph has no
    site and is a top-level graph).
    Never raises: a graph it cannot read gives ``[]`` (logged at DEBUG)."""
    try:
        return [UnmatchedRecord(source_of(found.projection.node), module_of(found.projection.node), found.vocab,
                                found.use)
                for found in find.unmatched_projections(graph) if not find.decode_sized(found.projection)]
    except Exception:  # noqa: BLE001 - a diagnostic never fails the compile
        log.debug("chunkce: could not look for logits without a loss", exc_info=True)
        return []


@dataclass(frozen=True)
class ReturnedRecord:
    """Returned logits of a graph with no cross-entropy site, taken out: computed only when read
    (a forward without labels; :func:`compile_pass.graph.plan.plan_returned`)."""

    source: str  # of the projection
    module: str
    vocab: int
    logits_bytes_avoided: int

    def __str__(self) -> str:
        module = f" (module {self.module})" if self.module else ""
        return (f"{self.source}{module}: the returned [N, {self.vocab}] logits are computed only when read "
                f"({format_bytes(self.logits_bytes_avoided)} not computed in the step)")


@dataclass
class PassReport:
    """Every site of one graph (or, from :func:`compile_pass.explain`, of every graph)."""

    records: list[SiteRecord] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)  # reasons Dynamo gave, when explain saw any
    unmatched: list[UnmatchedRecord] = field(default_factory=list)  # logits of a graph with no site
    returned: list[ReturnedRecord] = field(default_factory=list)  # lazy logits of a graph with no site

    @property
    def rewritten(self) -> list[SiteRecord]:
        return [r for r in self.records if r.decision is Decision.REWRITTEN]

    @property
    def refused(self) -> list[SiteRecord]:
        return [r for r in self.records if r.decision is Decision.REFUSED]

    def __str__(self) -> str:
        kinds = Counter(kind_of(r.spelling) for r in self.records)
        sites = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        sites = f"{sites} site(s)" if len(kinds) < 2 else f"{len(self.records)} sites ({sites})"
        header = f"chunkce: {sites}, {len(self.rewritten)} rewritten, {len(self.refused)} refused"
        left = [r for r in self.records if r.decision is Decision.LEFT]
        header += f", {len(left)} left as stock" if left else ""
        columns = ("#", "decision", "spelling", "source", "module", "tiles", "logits avoided", "reason")
        rows = [(str(i), r.decision, r.spelling or "-", _shorten(r.source, _SOURCE_WIDTH), r.module or "-",
                 tiles_text(r.tiles), format_bytes(r.logits_bytes_avoided), r.reason or "-")
                for i, r in enumerate(self.records, 1)]
        widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(columns)]
        lines = [header, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
        for record, row in zip(self.records, rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
            if record.fix:
                lines.append(" " * (widths[0] + 2) + record.fix)
        for record in self.unmatched:
            lines += [f"no cross-entropy site: {record}", "  " + record.fix]
        lines += [f"lazy logits: {record}" for record in self.returned]
        for reason in self.graph_breaks:
            lines.append(f"graph break: {reason}")
        return "\n".join(lines)


_SOURCE_WIDTH = 72
_KINDS = {"cross_entropy": "cross-entropy", "nll_loss": "cross-entropy"}  # nll_loss of a log_softmax


def kind_of(spelling: str) -> str:
    """What a site with ``spelling`` (:attr:`SiteRecord.spelling`) computes, in words: ``cross-entropy``
    (``F.cross_entropy``, ``nll_loss`` of a ``log_softmax``), ``gather``, ``entropy``, ``logsumexp``,
    ``row-sum``; ``unknown`` where the pass could not read it."""
    return _KINDS.get(spelling, spelling.replace("_", "-") or "unknown")


def tiles_text(tiles: Tiles | None) -> str:
    return "-" if tiles is None else f"{tiles.tokens} x {tiles.vocab_block}"  # n tokens x Vb columns


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_bytes(n: int) -> str:
    if not n:
        return "0"
    unit = "B"
    for larger in ("KiB", "MiB", "GiB"):
        if n < 1024:
            break
        n, unit = n / 1024, larger
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def source_of(node: Node) -> str:
    """``file.py:12 in forward: <code>`` from the node's stack trace (its innermost frame)."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, line in enumerate(trace) if line.lstrip().startswith("File ")]
    if not frames:
        return node.name
    i = frames[-1]
    match = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', trace[i])
    code = trace[i + 1].strip() if i + 1 < len(trace) else ""
    if match is None:
        return trace[i].strip()
    path, line, function = match.groups()
    return f"{path.rsplit('/', 1)[-1]}:{line} in {function}: {code}"


def module_of(node: Node | None) -> str:
    """Module path of the innermost module that made ``node`` (``lm_head``), or ""."""
    stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
    if not stack:
        return ""
    path, module_type = list(stack.values())[-1][:2]
    path = re.sub(r"^[LG]\[[^\]]*\](\[[^\]]*\])*\.?", "", str(path))  # L['self'], L['args'][0], G['model']
    path = re.sub(r"(__dict__\['_modules'\]\[|_modules\[)'([^']*)'\]", r"\2", path)  # PEFT's wrappers: __dict__
    return path or getattr(module_type, "__name__", str(module_type))  # the root module: its class


log = logging.getLogger(__name__)

_latest: PassReport | None = None
_warned: set[tuple[str, str]] = set()  # (source, reason key) of every warning this process logged


def publish(report: PassReport, strict: bool = False) -> None:
    """Log each record (the module docstring says at which level), count it, and keep the
    report for :func:`last_report` if it has any site; a failure is logged, not raised, unless
    ``strict`` (:func:`compile_pass.graph.stages.tolerant`)."""
    _publish(report, strict=strict)


def forget_warnings() -> None:
    """Forget which (source, reason key) pairs were warned of: the next of each warns again."""
    _warned.clear()


@tolerant("could not report the pass's decisions; the graph is rewritten")
def _publish(report: PassReport) -> None:
    global _latest
    reached("report", report)
    if report.records:
        _latest = report
    stats = internals.counters.get()["chunkce"]
    for record in report.records:
        stats["sites_found"] += 1
        if record.decision is Decision.REWRITTEN:
            stats["sites_rewritten"] += 1
            stats["logits_bytes_avoided"] += record.logits_bytes_avoided
            stats["logits_kept"] += record.fate is Fate.KEPT
            stats["logits_dropped"] += record.fate is Fate.DROPPED
            stats["logits_lazy"] += record.fate is Fate.LAZY
            stats["statistics_folded"] += record.folded
            log.info("chunkce: rewrote %s (%s, module %s, tiles %s, logits bytes avoided %s)%s",
                     record.source, kind_of(record.spelling), record.module or "?", tiles_text(record.tiles),
                     record.logits_bytes_avoided, f"; {record.reason}" if record.reason else "")
        elif record.decision is Decision.LEFT:  # nothing is lost: no warning
            stats["sites_left"] += 1
            log.info("chunkce: left %s as stock compiles it: %s", record.source, record.reason)
        else:
            stats["sites_refused"] += 1
            stats[f"refused_{record.reason_key}"] += 1
            module = f" (module {record.module})" if record.module else ""
            advice = SOFT_CAP_BY_DESIGN if record.reason_key == Refusal.SOFT_CAP.key else record.fix
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
    return _latest
