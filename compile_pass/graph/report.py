"""What the pass did at each cross-entropy site: log records, counters, a table.

One :class:`SiteRecord` per site; a :class:`PassReport` per graph. Every report is
logged through ``logging.getLogger("compile_pass.graph.report")`` (rewritten sites at
INFO, refused ones at DEBUG, as Inductor's passes do), counted in
``torch._dynamo.utils.counters["chunkce"]``, and kept: :func:`last_report`.

Counter keys: ``sites_found``, ``sites_rewritten``, ``sites_refused``,
``refused_<reason key>`` (e.g. ``refused_soft_cap``), ``logits_kept`` (rewritten
sites whose logits other users still need), ``logits_dropped`` (returned logits
not computed, ``drop_unused_logits``) and ``logits_bytes_avoided``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from torch._dynamo.utils import counters
from torch.fx import Node

log = logging.getLogger(__name__)

REWRITTEN, REFUSED = "rewritten", "refused"
LOGITS_KEPT = "logits still materialized for other users"
LOGITS_DROPPED = "returned logits not computed (drop_unused_logits)"
DROP_LOGITS_FIX = (
    "fix: the only other user is the graph output (e.g. HF's outputs.logits); a training step that never "
    "reads it can skip it: options={'drop_unused_logits': True}"
)
GRAPH_BREAK_FIX = (
    "fix: remove the graph break between the lm_head and the loss (a print, .item(), "
    "data-dependent Python control flow, or an unsupported call; `torch._dynamo.explain(model)(...)` "
    "names it), or compute the loss inside the compiled region; under DDP's graph split or FSDP2 the reason "
    "names the cause and its fix (docs/distributed.md)"
)

# How to make a site refused with a reason key rewritable, or that there is no way and the site
# stays unfused (exact, as stock compile): every refused record carries one (SiteRecord.fix).
_FIXES = {
    "graph_break": GRAPH_BREAK_FIX,
    "subgraph_input": "fix: compute the lm_head inside the same checkpoint region (higher-order op body) as the "
                      "loss, or the loss outside it",
    "call_module": "fix: call F.cross_entropy, or let Dynamo inline nn.CrossEntropyLoss (do not register it as "
                   "a leaf module)",
    "loss_spelling": "fix: write the loss as F.cross_entropy(logits.view(-1, V), labels.view(-1), ...) or as "
                     "the reason says",
    "target": "fix: pass int64 class indices computed in the compiled region, shaped like the logits without "
              "their class dim",
    "probability_target": "fix: none for soft targets (the op takes class indices); the site stays unfused, "
                          "exact",
    "argument": "fix: pass reduction, ignore_index and label_smoothing as Python constants, class weights as a "
                "tensor of the compiled region",
    "class_weight": "fix: pass class weights as a plain floating tensor (float16, bfloat16, float32 or float64)",
    "class_dim_1": "fix: compute the [B, T, V] logits, then move the class dim for the loss with "
                   ".transpose(1, 2), or flatten to [B * T, V]",
    "vocab_dim": "fix: slice or select token dims only; keep the vocabulary dim whole from the lm_head to the "
                 "loss",
    "advanced_index": "fix: select the tokens on the hidden states before the lm_head (h[mask]), or with "
                      "slices on the logits",
    "symbolic_reshape": "fix: flatten the logits with .view(-1, V) before indexing their tokens, or mark one "
                        "token dim dynamic",
    "unreadable": "fix: compute the loss's input from the lm_head's output inside the compiled region",
    "no_projection": "fix: compute the logits with nn.Linear / F.linear / a matmul by a [V, H] (or [H, V]) "
                     "weight inside the compiled region",
    "producer": "fix: project with a plain nn.Linear / F.linear / matmul by a 2-D weight",
    "weight_dtype": "fix: none for quantized heads (the op takes float16, bfloat16, float32 or float64 "
                    "weights); the site stays unfused, exact",
    "subclass": "fix: none for tensor-subclass heads (quantized, float8, DTensor); keep the head a plain "
                "tensor (e.g. FSDP2: the head in the root group) or the site stays unfused, exact",
    "lossy_cast": "fix: cast the logits once, to the dtype the loss needs (a narrowing cast on the way is not "
                  "reproduced)",
    "mode_switch": "fix: keep grad mode and autocast unchanged from the lm_head to the loss",
    "mutation": "fix: compute the logits out of place (logits = logits * s, not logits *= s)",
    "soft_cap": "fix: none for soft-capped heads (tanh); the site stays unfused, exact",
    "scale_operand": "fix: scale by one Python number or 0-d tensor, before the log_softmax: logits * s or "
                     "logits / s",
    "scale_requires_grad": "fix: detach the scale (logits * s.detach()) or freeze it (s.requires_grad_(False))",
    "scale_twice": "fix: fold the scalings into one constant, e.g. logits * (a / b)",
    "internal_error": "fix: none on your side (the site stays unfused, exact); please report it, with the "
                      "graph (TORCH_LOGS=graph_code)",
}
_OP_FIX = ("fix: compute only shape, dtype or one scaling between the lm_head and the loss; anything else "
           "there stays unfused, exact")


def fix_for(reason_key: str) -> str:
    """What to do about a site refused with ``reason_key``, or that nothing can be done;
    never empty (``op_<name>``: an op between projection and loss)."""
    if reason_key.startswith("op_"):
        return _OP_FIX
    return _FIXES.get(reason_key, "fix: write the loss as F.cross_entropy(lm_head(h).view(-1, V), labels.view(-1)) "
                                  "inside the compiled region (docs/design.md, The guard)")


@dataclass(frozen=True)
class SiteRecord:
    """The pass's decision at one cross-entropy call."""

    source: str  # "file.py:12 in forward: loss = F.cross_entropy(...)"
    module: str  # module path of the projection, e.g. "lm_head"; "" when unknown
    decision: str  # REWRITTEN or REFUSED
    reason: str  # why refused; for a rewritten site, notes (e.g. LOGITS_KEPT) or ""
    reason_key: str = ""
    chunk_size: int | str | None = None  # tokens per chunk: given, the automatic choice, or "auto"
    logits_bytes_avoided: int = 0
    fix: str = ""  # how to make a refused site rewritable (or a kept logits droppable), where known
    # how the loss is spelled: "cross_entropy", "nll_loss" (of a log_softmax), "gather" (of a
    # log_softmax: the per-token log-probabilities); "" when unknown
    form: str = ""

    def __post_init__(self) -> None:
        if self.decision == REFUSED and not self.fix:  # every refusal says what to do about it
            object.__setattr__(self, "fix", fix_for(self.reason_key))


@dataclass
class PassReport:
    """Every site of one graph (or, from :func:`compile_pass.explain`, of every graph)."""

    records: list[SiteRecord] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)  # reasons Dynamo gave, when explain saw any

    @property
    def rewritten(self) -> list[SiteRecord]:
        return [r for r in self.records if r.decision == REWRITTEN]

    @property
    def refused(self) -> list[SiteRecord]:
        return [r for r in self.records if r.decision == REFUSED]

    def __str__(self) -> str:
        header = (f"chunkce: {len(self.records)} cross-entropy site(s), {len(self.rewritten)} rewritten, "
                  f"{len(self.refused)} refused")
        columns = ("#", "decision", "loss", "source", "module", "chunk", "logits avoided", "reason")
        rows = [(str(i), r.decision, r.form or "-", _shorten(r.source, _SOURCE_WIDTH), r.module or "-",
                 str(r.chunk_size or "-"), format_bytes(r.logits_bytes_avoided), r.reason or "-")
                for i, r in enumerate(self.records, 1)]
        widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(columns)]
        lines = [header, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
        for record, row in zip(self.records, rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
            if record.fix:
                lines.append(" " * (widths[0] + 2) + record.fix)
        for reason in self.graph_breaks:
            lines.append(f"graph break: {reason}")
        return "\n".join(lines)


_SOURCE_WIDTH = 72


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_bytes(n: int) -> str:
    if not n:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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


_last: PassReport | None = None


def publish(report: PassReport) -> None:
    """Log each record, count it, and keep the report for :func:`last_report` if it has any."""
    global _last
    if report.records:
        _last = report
    stats = counters["chunkce"]
    for record in report.records:
        stats["sites_found"] += 1
        if record.decision == REWRITTEN:
            stats["sites_rewritten"] += 1
            stats["logits_bytes_avoided"] += record.logits_bytes_avoided
            stats["logits_kept"] += record.reason == LOGITS_KEPT
            stats["logits_dropped"] += record.reason == LOGITS_DROPPED
            log.info("chunkce: rewrote %s (%s, module %s, chunk size %s, logits bytes avoided %s)%s",
                     record.source, record.form or "loss", record.module or "?", record.chunk_size,
                     record.logits_bytes_avoided, f"; {record.reason}" if record.reason else "")
        else:
            stats["sites_refused"] += 1
            stats[f"refused_{record.reason_key}"] += 1
            level = logging.WARNING if record.reason_key == "internal_error" else logging.DEBUG
            log.log(level, "chunkce: left %s unfused: %s", record.source, record.reason)


def last_report() -> PassReport | None:
    """The report of the pass's latest run in this process that found a cross-entropy site."""
    return _last
