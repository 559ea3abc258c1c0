"""The sweep's saved results and its tables, docs/tables/sweep_<family>.md (``benchmarks.sweep_models``).

    results = load_results()             # {"meta", "aot_eager", "inductor", "families": {family: rows}}
    text = render(results, "seq2seq")    # the family's table file, from the results alone
    problems = check_section(text)       # its totals line against its own rows

The causal-LM sweep's rows are ``results["aot_eager"]`` (and ``"inductor"``); every other
family's rows are ``results["families"][family]``; each family's file is :func:`table_path`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.sweep_step import OUTCOMES
from benchmarks.tables import markdown
from benchmarks.tiny_families import FAMILIES, architectures
from benchmarks.tiny_models import BATCH, SEQ, VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sweep_models.json"
TABLES = ROOT / "docs" / "tables"
PENDING = "pending"  # in the registry, not in the results yet (an interrupted sweep: --resume)
# What each family's batch is (benchmarks.tiny_families.batch_for).
INPUTS = {
    "seq2seq": "`input_ids` and `labels` (batch 2 x 16 each; the model shifts the labels into `decoder_input_ids`, "
               "given where the config has no start token); audio LMs also `input_features`",
    "masked_lm": "`input_ids` with every fourth token the mask token and `labels` -100 elsewhere (batch 2 x 16); "
                 "encoder-decoders as seq2seq",
    "image_text": "`pixel_values` (32 x 32 images in 8 x 8 patches, one per sample; Qwen-VL-style flattened patches "
                  "with `image_grid_thw` of 4 x 4) and the size / mask inputs the class takes, `input_ids` with "
                  "as many image tokens as the tower yields (-100 in `labels`) and 16 text tokens",
    "speech": "`input_features` (16 mel bins x 100 frames) or `input_values` (4000 samples), `input_ids` / "
              "`labels` of 16 tokens (audio tokens as for images)",
}


def table_path(family: str) -> Path:
    """The file ``--write`` writes ``family``'s table to."""
    return TABLES / f"sweep_{family}.md"


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    """The saved results (empty ones when there are none)."""
    results = json.loads(path.read_text()) if path.exists() else {"meta": {}, "aot_eager": {}, "inductor": {}}
    results.setdefault("families", {})
    return results


def rows_of(results: dict[str, Any], family: str) -> dict[str, dict[str, Any]]:
    """``family``'s saved rows (the causal sweep's: ``results["aot_eager"]``), by model type."""
    return results["aot_eager"] if family == "causal_lm" else results["families"].setdefault(family, {})


def _what(row: dict[str, Any]) -> str:
    """The row's explanation column: why, where, how much."""
    outcome = row["outcome"]
    if outcome == "rewritten":
        logits = {"dropped": "logits dropped", "kept": "logits KEPT (computed although returned_logits='drop')"}
        notes = [f"max abs diff {row['max_abs_diff']:.1e}", logits.get(row.get("logits"), "logits ?")]
        if row.get("note"):
            notes.append(row["note"])
        if row.get("other_logits_nodes"):
            notes.append(f"other [N, V] nodes left: {len(row['other_logits_nodes'])}")
        if row.get("sites", 1) > 1:
            notes.append(f"{row['sites']} sites")
        if row.get("graph_breaks"):
            notes.append(f"{len(row['graph_breaks'])} graph break(s) elsewhere")
        return "; ".join(notes)
    if outcome in ("refused", "graph_break"):
        text = row.get("reason", "")
        if row.get("rewritten_sites"):
            text += f" ({row['rewritten_sites']} other site(s) rewritten)"
        if outcome == "graph_break" and row.get("graph_breaks"):
            text += f"; Dynamo: {row['graph_breaks'][0]}"
        return text
    if outcome == "error":
        return ("stock compile fails too: " if row.get("stock_fails") else "ONLY CHUNKCE FAILS: ") + row["detail"]
    return row.get("detail", "")


def with_pending(rows: dict[str, dict[str, Any]], family: str = "causal_lm") -> dict[str, dict[str, Any]]:
    """``rows`` plus a ``pending`` row for every model type of ``family``'s registry that has none."""
    flag = "" if family == "causal_lm" else f" --family {family}"
    pending = {model_type: {"model_type": model_type, "model_class": model_class, "outcome": PENDING,
                            "detail": f"not run yet: python -m benchmarks.sweep_models{flag} --resume"}
               for model_type, model_class in architectures(family).items() if model_type not in rows}
    return {**rows, **pending}


def totals(rows: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Count of rows per outcome, and per refusal key (``refused:<key>``)."""
    counts: dict[str, int] = {outcome: 0 for outcome in (*OUTCOMES, PENDING)}
    for row in rows.values():
        counts[row["outcome"]] += 1
        if row["outcome"] == "refused":
            counts[f"refused:{row['reason_key']}"] = counts.get(f"refused:{row['reason_key']}", 0) + 1
    return counts


def totals_line(rows: dict[str, dict[str, Any]]) -> str:
    counts = totals(rows)
    built = len(rows) - counts["not_built"] - counts[PENDING]
    keys = ", ".join(f"`{k.split(':', 1)[1]}` {n}" for k, n in sorted(counts.items()) if k.startswith("refused:"))
    errors = [r for r in rows.values() if r["outcome"] == "error"]
    stock = sum(bool(r.get("stock_fails")) for r in errors)
    return (f"**Totals**: {len(rows)} architectures, {built} built; rewritten {counts['rewritten']}, "
            f"differs {counts['differs']}, refused {counts['refused']} ({keys or 'none'}), "
            f"graph break {counts['graph_break']}, no site {counts['no_site']}, error {counts['error']} "
            f"(stock compile fails too: {stock}, only chunkce: {len(errors) - stock}), "
            f"not built {counts['not_built']}" + (f", PENDING {counts[PENDING]} (not run yet)." if counts[PENDING]
                                                 else "."))


def _table(rows: dict[str, dict[str, Any]]) -> list[str]:
    body = [[model_type, f"`{row['model_class']}`", row["outcome"],
             f"`{row['reason_key']}`" if row.get("reason_key") else "-", _what(row)]
            for model_type, row in sorted(rows.items())]
    return markdown(["model type", "class", "outcome", "reason key", "what"], body, width=160).splitlines()


def _minutes(seconds: float | None) -> str:
    return f"{seconds / 60:.0f} min" if seconds else "not measured"


def render(results: dict[str, Any], family: str = "causal_lm") -> str:
    """``family``'s table file, from the saved results alone (no model is run)."""
    meta, rows = results["meta"], with_pending(rows_of(results, family), family)
    sizes = (f"Tiny configs: hidden 64, 4 heads of 16 / 2 kv heads, 1 layer (one per layer kind of hybrids), vocab "
             f"{VOCAB_SIZE}, MoE 4 experts top 2, fp32")
    if family == "causal_lm":
        command, wall, workers = "", meta.get("wall_s"), meta.get("workers")
        inputs = f"batch {BATCH} x {SEQ} tokens"
    else:
        command, wall = f" --family {family}", meta.get("family_wall_s", {}).get(family)
        workers = meta.get("family_workers", {}).get(family)
        inputs = f"towers as small; {INPUTS[family]}"
    versions = meta if family == "causal_lm" else meta.get("family_versions", {}).get(family, meta)
    title = "Every causal LM in transformers" if family == "causal_lm" else f"`{FAMILIES[family]}`"
    lines = [
        f"# The sweep: {title}",
        "",
        f"Generated by `python -m benchmarks.sweep_models{command} --write` (torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}; {versions.get('cpus')} CPU cores, {workers} worker(s); "
        f"full sweep wall time {_minutes(wall)}). {sizes}, {inputs}; chunkce with `aot_eager` inside and "
        f"`returned_logits=\"drop\"` vs stock `aot_eager`, `CHUNKCE_EAGER_KERNELS=1`.",
        "",
        totals_line(rows),
        "",
        *_table(rows),
        "",
    ]
    inductor = (results.get("inductor") or {}) if family == "causal_lm" else {}
    if inductor:
        lines += ["Inductor inside chunkce vs stock Inductor (`--inductor-subset`, the op's kernels compiled):", "",
                  *_table(inductor), ""]
    return "\n".join(lines)


TOTALS = re.compile(r"(rewritten|differs|refused|graph break|no site|error|not built) (\d+)")
ROW = re.compile(r"^\| (\S+) \| `(\w+)` \| (\w+) \| `?([\w,-]*)`? \| (.*) \|$", flags=re.MULTILINE)


def check_section(text: str) -> list[str]:
    """What is wrong with a rendered section: its totals line against its own first table
    (outcomes, built, pending, refusal keys). ``--write`` refuses to write a section with any."""
    table = text.split("Inductor inside chunkce", 1)[0]
    rows = {t: (outcome, "" if key in ("", "-") else key) for t, _, outcome, key, _ in ROW.findall(table)}
    (line,) = [line for line in text.splitlines() if line.startswith("**Totals**")] or [""]
    count = {o: sum(outcome == o for outcome, _ in rows.values()) for o in OUTCOMES}
    pending = sum(outcome == PENDING for outcome, _ in rows.values())
    keys: dict[str, int] = {}
    for outcome, key in rows.values():
        if outcome == "refused":
            keys[key] = keys.get(key, 0) + 1
    problems = []
    if {k.replace(" ", "_"): int(v) for k, v in TOTALS.findall(line)} != count:
        problems.append(f"totals {line!r} disagree with the rows' outcomes {count}")
    if f"{len(rows)} architectures, {len(rows) - count['not_built'] - pending} built" not in line:
        problems.append(f"totals {line!r}: not {len(rows)} architectures")
    if (f"PENDING {pending}" in line) != bool(pending):
        problems.append(f"totals {line!r}: {pending} pending rows")
    if {k: int(n) for k, n in re.findall(r"`([\w,-]+)` (\d+)", line)} != keys:
        problems.append(f"totals {line!r} disagree with the refusal keys {keys}")
    return problems


def write_table(text: str, family: str) -> Path:
    """Write ``text`` as ``family``'s table file; its path."""
    path = table_path(family)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
