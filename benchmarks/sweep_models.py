"""Every causal LM transformers registers, through the pass: the sweep of docs/models.md.

    python -m benchmarks.sweep_models                      # every architecture; print the table
    python -m benchmarks.sweep_models --only llama gpt2    # re-run a few, merged into the saved results
    python -m benchmarks.sweep_models --inductor-subset    # also Inductor vs Inductor on a few
    python -m benchmarks.sweep_models --write              # and rewrite the section of docs/models.md
    python -m benchmarks.sweep_models --only llama --rows out.json   # run, save nothing: the rows to a file

Each architecture of the installed transformers' causal-LM registry is built tiny
(``benchmarks.tiny_models``) and one training step,
``model(input_ids=..., labels=...).loss.backward()``, is run three ways from the same
weights: eagerly (must work, or the architecture is ``not_built``), compiled by stock
``aot_eager``, and compiled by ``backend="chunkce"`` with ``aot_eager`` inside
(``returned_logits="drop"``, so a rewritten graph holds no ``[N, V]`` node at all); one
outcome per architecture (``benchmarks.sweep_step``).

Architectures run in fresh processes (``benchmarks.isolate``), a few at a time
(:data:`PER_PROCESS`: one ``import transformers`` for them), ``--workers`` at once, with
a timeout for each stage of an architecture (build, eager, stock, chunkce); a process
that hangs or dies makes that architecture's row an ``error`` (stock's fault if it was
in stock's stage) and the rest of its batch goes on in a new one.
``CHUNKCE_EAGER_KERNELS=1`` for the aot_eager runs (the op's per-chunk math runs
eagerly: compiling it would dominate). Results are kept in
``benchmarks/results/sweep_models.json``; ``--only`` re-runs some and merges them in.
``--write`` checks the section it renders (its totals against its rows) before it
writes it, and the exit status is 1 for a bug row (``differs``, an error only
chunkce hits) or, with ``--write``, for an architecture not run yet.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import isolate
from benchmarks.sweep_step import OUTCOMES, run_architecture
from benchmarks.tables import markdown
from benchmarks.tiny_models import BATCH, SEQ, VOCAB_SIZE, causal_lm_architectures

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sweep_models.json"
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- sweep_models: begin -->", "<!-- sweep_models: end -->"

TIMEOUT_S = 180
PER_PROCESS = 8  # architectures one fresh process runs (one import of transformers for them)
INDUCTOR_SUBSET = ("llama", "gpt2", "qwen2_moe", "gemma2", "cohere")

# ---- processes ------------------------------------------------------------------------------------


def _child(model_types: list[str], inner: str, out: isolate.Reporter) -> None:
    """In a fresh process: each architecture's stages announced, its row reported."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers  # noqa: F401 - paid once per process

    import compile_pass  # noqa: F401

    for model_type in model_types:
        print(f"==== {model_type} ({inner})", flush=True)
        row = run_architecture(model_type, inner,
                               progress=lambda stage: out.stage({"model_type": model_type, "stage": stage}))
        out.record(row)


def run_all(model_types: list[str], inner: str, workers: int, timeout_s: float, log_path: str,
            echo=print, on_row=lambda row: None) -> dict[str, dict[str, Any]]:
    """Every model type through :func:`~benchmarks.sweep_step.run_architecture`, in fresh
    processes of up to :data:`PER_PROCESS` architectures, ``workers`` at once. A process that
    dies, or spends over ``timeout_s`` in one stage of an architecture, makes that row an
    ``error`` (stock's fault if it was in stock's stage); its batch goes on in a new process."""
    queue, rows, lock = list(model_types), {}, threading.Lock()
    registry = causal_lm_architectures()
    env = {"CHUNKCE_EAGER_KERNELS": "1"} if inner == "aot_eager" else {}

    def keep(row: dict[str, Any]) -> None:
        with lock:
            rows[row["model_type"]] = row
            on_row(row)
            echo(f"{row['model_type']:28s} {row['outcome']:11s} {row.get('reason_key') or ''} "
                 f"{row.get('detail', '')[:110]} ({row['seconds']} s)")

    def run_batch(batch: list[str]) -> None:
        while batch:
            started: dict[str, float] = {}

            def stage(value: dict[str, str]) -> None:
                started.setdefault(value["model_type"], time.perf_counter())

            child = isolate.run(["-m", "benchmarks.sweep_models", "--child", inner, *batch], env=env,
                                stage_timeout=timeout_s, log=log_path, on_record=keep, on_stage=stage)
            done = {row["model_type"] for row in child.records}
            batch = [m for m in batch if m not in done]
            if not batch:
                return
            where = child.stage or {"model_type": batch[0], "stage": "start"}
            failed = where["model_type"] if where["model_type"] in batch else batch[0]
            why = (f"timed out: over {timeout_s:.0f} s in stage '{where['stage']}'" if child.returncode is None
                   else f"worker died (exit code {child.returncode}) in stage '{where['stage']}'")
            keep({"model_type": failed, "inner": inner, "outcome": "error", "model_class": registry[failed],
                  "detail": why, "stock_fails": where["stage"].startswith("stock"),
                  "seconds": round(time.perf_counter() - started.get(failed, time.perf_counter()), 1)})
            batch.remove(failed)

    def worker() -> None:
        while True:
            with lock:
                batch, queue[:PER_PROCESS] = queue[:PER_PROCESS], []
            if not batch:
                return
            run_batch(batch)

    with ThreadPoolExecutor(max(1, min(workers, len(queue)))) as pool:
        for future in [pool.submit(worker) for _ in range(max(1, min(workers, len(queue))))]:
            future.result()
    return rows


# ---- results and the table ------------------------------------------------------------------------


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    """The saved results: ``{"meta": {...}, "aot_eager": {model_type: row}, "inductor": {...}}``."""
    if path.exists():
        return json.loads(path.read_text())
    return {"meta": {}, "aot_eager": {}, "inductor": {}}


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


PENDING = "pending"  # in the registry, not in the results yet (an interrupted sweep: --resume)


def with_pending(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``rows`` plus a ``pending`` row for every registered architecture that has none."""
    pending = {model_type: {"model_type": model_type, "model_class": model_class, "outcome": PENDING,
                            "detail": "not run yet: python -m benchmarks.sweep_models --resume"}
               for model_type, model_class in causal_lm_architectures().items() if model_type not in rows}
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


def render(results: dict[str, Any]) -> str:
    """The generated part of docs/models.md, from the saved results alone (no model is run)."""
    meta, rows = results["meta"], with_pending(results["aot_eager"])
    lines = [
        BEGIN,
        f"Generated by `python -m benchmarks.sweep_models --write` (torch {meta.get('torch')}, transformers "
        f"{meta.get('transformers')}; {meta.get('cpus')} CPU cores, {meta.get('workers')} worker(s); full sweep "
        f"wall time {_minutes(meta.get('wall_s'))}). Tiny configs: hidden 64, 4 heads of 16 / 2 kv heads, "
        f"1 layer (one per layer kind of hybrids), vocab {VOCAB_SIZE}, MoE 4 experts top 2, fp32, batch "
        f"{BATCH} x {SEQ} tokens; chunkce with `aot_eager` inside and `returned_logits=\"drop\"` vs stock "
        f"`aot_eager`, `CHUNKCE_EAGER_KERNELS=1`.",
        "",
        totals_line(rows),
        "",
        *_table(rows),
        "",
    ]
    inductor = results.get("inductor") or {}
    if inductor:
        lines += ["Inductor inside chunkce vs stock Inductor (`--inductor-subset`, the op's kernels compiled):", "",
                  *_table(inductor), ""]
    lines.append(END)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="re-run these; merge into the results")
    parser.add_argument("--inductor-subset", action="store_true",
                        help=f"also Inductor vs Inductor on {', '.join(INDUCTOR_SUBSET)} (or on --only's)")
    parser.add_argument("--skip-aot-eager", action="store_true", help="with --inductor-subset: only that")
    parser.add_argument("--resume", action="store_true",
                        help="skip the architectures an interrupted run already finished (its .partial.jsonl)")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: merge an interrupted run's finished rows into the results")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per stage of an architecture")
    parser.add_argument("--write", action="store_true", help=f"rewrite the generated part of {DOC.name}")
    parser.add_argument("--render", action="store_true", help="only regenerate the table from the results")
    parser.add_argument("--rows", metavar="PATH", default=None,
                        help="with --only: run those (aot_eager) and write their rows to PATH as JSON; "
                             "the saved results and the docs are left as they are")
    parser.add_argument("--child", nargs="+", metavar=("INNER", "MODEL_TYPE"), help=argparse.SUPPRESS)
    isolate.add_result_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[1:], args.child[0], isolate.Reporter(args.result_json))
        return 0

    import torch
    import transformers

    registry = causal_lm_architectures()
    unknown = sorted(set(args.only or ()) - set(registry))
    if unknown:
        parser.error(f"not causal-LM model types of transformers {transformers.__version__}: {unknown}")
    if args.rows:
        if not args.only:
            parser.error("--rows needs --only")
        log_path = f"{args.rows}.log"
        Path(log_path).write_text("")
        rows = run_all(args.only, "aot_eager", args.workers, args.timeout, log_path)
        Path(args.rows).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(rows)} rows to {args.rows} (worker output: {log_path})")
        return 0
    results = load_results()
    partial = RESULTS.with_suffix(".partial.jsonl")
    if args.collect and partial.exists():
        rows = map(json.loads, partial.read_text().splitlines())
        results["aot_eager"].update({row["model_type"]: row for row in rows})
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    elif not args.render:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        log_path = str(RESULTS.with_suffix(".log"))
        if not args.resume:
            Path(log_path).write_text("")
        print(f"worker output: {log_path}")
        if not args.skip_aot_eager:
            model_types = args.only or list(registry)
            started = time.perf_counter()
            done_before = {}
            if args.resume and partial.exists():  # rows an interrupted run finished
                done_before = {row["model_type"]: row for row in map(json.loads, partial.read_text().splitlines())}
                started -= sum(row["seconds"] for row in done_before.values()) / args.workers
                model_types = [m for m in model_types if m not in done_before]
            else:
                partial.write_text("")

            def keep(row: dict[str, Any]) -> None:  # a crash of this process loses nothing finished
                with partial.open("a") as f:
                    f.write(json.dumps(row) + "\n")

            rows = run_all(model_types, "aot_eager", args.workers, args.timeout, log_path, on_row=keep)
            results["aot_eager"].update({**done_before, **rows})
            results["meta"]["workers"] = args.workers
            if not args.only:
                results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
        if args.inductor_subset:
            subset = [m for m in (args.only or INDUCTOR_SUBSET)]
            results["inductor"].update(run_all(subset, "inductor", args.workers, args.timeout * 2, log_path))
        results["aot_eager"] = {k: v for k, v in sorted(results["aot_eager"].items()) if k in registry}
        results["meta"].update(torch=torch.__version__, transformers=transformers.__version__,
                               cpus=os.cpu_count())
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    text = render(results)
    problems = check_section(text)
    if args.write and not problems:
        doc = DOC.read_text()
        if BEGIN in doc:
            start, end = doc.index(BEGIN), doc.index(END) + len(END)
            DOC.write_text(doc[:start] + text + doc[end:])
        else:
            DOC.write_text(doc.rstrip("\n") + "\n\n## Every causal LM in transformers\n\n" + text + "\n")
    elif not args.write:
        print(text)
    for problem in problems:
        print(f"NOT WRITTEN: the rendered section is inconsistent: {problem}", file=sys.stderr)
    bad = [r for r in results["aot_eager"].values() if r["outcome"] == "differs"
           or (r["outcome"] == "error" and not r.get("stock_fails"))]
    for row in bad:
        print(f"BUG {row['model_type']}: {row['outcome']}: {_what(row)}", file=sys.stderr)
    pending = [t for t, r in with_pending(results["aot_eager"]).items() if r["outcome"] == PENDING]
    if args.write and pending:
        print(f"INCOMPLETE: {len(pending)} architecture(s) not run yet (--resume --write): {pending[:8]}",
              file=sys.stderr)
    return 1 if bad or problems or (args.write and pending) else 0


if __name__ == "__main__":
    sys.exit(main())
