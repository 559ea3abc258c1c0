"""Every causal LM transformers registers, through the pass: the tables docs/models.md links.

    python -m benchmarks.sweep_models                      # every architecture; print the table
    python -m benchmarks.sweep_models --only llama gpt2    # re-run a few, merged into the saved results
    python -m benchmarks.sweep_models --family seq2seq masked_lm   # other registries (tiny_families.FAMILIES)
    python -m benchmarks.sweep_models --inductor-subset    # also Inductor vs Inductor on a few
    python -m benchmarks.sweep_models --write              # and write docs/tables/sweep_<family>.md
    python -m benchmarks.sweep_models --only llama --rows out.json   # run, save nothing: the rows to a file

Each architecture of the installed transformers' causal-LM registry (or, with ``--family``,
of its seq2seq, masked-LM, image-text-to-text or speech-seq2seq registry) is built tiny
(``benchmarks.tiny_families``) and one training step,
``model(**batch).loss.backward()``, is run three ways from the same
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
``benchmarks/results/sweep_models.json`` (``benchmarks.sweep_table``, which renders the
sections); ``--only`` re-runs some and merges them in.
``--write`` checks the section it renders (its totals against its rows) before it
writes it, and the exit status is 1 for a bug row (``differs``, an error only
chunkce hits) or, with ``--write``, for an architecture not run yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import isolate
from benchmarks.sweep_step import run_architecture
from benchmarks.sweep_table import (
    PENDING,
    RESULTS,
    ROOT,
    _what,
    check_section,
    load_results,
    render,
    rows_of,
    with_pending,
    write_table,
)
from benchmarks.tiny_families import FAMILIES, architectures

TIMEOUT_S = 180
PER_PROCESS = 8  # architectures one fresh process runs (one import of transformers for them)
INDUCTOR_SUBSET = ("llama", "gpt2", "qwen2_moe", "gemma2", "cohere")

# ---- processes ------------------------------------------------------------------------------------


def _child(family: str, model_types: list[str], inner: str, out: isolate.Reporter) -> None:
    """In a fresh process: each architecture's stages announced, its row reported."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers  # noqa: F401 - paid once per process

    import compile_pass  # noqa: F401

    for model_type in model_types:
        print(f"==== {family} {model_type} ({inner})", flush=True)
        row = run_architecture(model_type, inner, family=family,
                               progress=lambda stage: out.stage({"model_type": model_type, "stage": stage}))
        out.record(row)


def run_all(model_types: list[str], inner: str, workers: int, timeout_s: float, log_path: str,
            echo=print, on_row=lambda row: None, family: str = "causal_lm") -> dict[str, dict[str, Any]]:
    """Every model type of ``family`` through :func:`~benchmarks.sweep_step.run_architecture`, in fresh
    processes of up to :data:`PER_PROCESS` architectures, ``workers`` at once. A process that
    dies, or spends over ``timeout_s`` in one stage of an architecture, makes that row an
    ``error`` (stock's fault if it was in stock's stage); its batch goes on in a new process."""
    queue, rows, lock = list(model_types), {}, threading.Lock()
    registry = architectures(family)
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

            child = isolate.run(["-m", "benchmarks.sweep_models", "--child", inner, family, *batch], env=env,
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
                  **({} if family == "causal_lm" else {"family": family}),
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


def _sweep(args: argparse.Namespace, results: dict[str, Any], family: str, log_path: str) -> None:
    """Run ``family``'s model types (``--only``'s of them, or the rest of an interrupted run)
    into ``results``, each finished row also appended to the family's ``.partial.jsonl``."""
    registry, rows_before = architectures(family), rows_of(results, family)
    partial = _partial(family)
    if not args.skip_aot_eager:
        model_types = [m for m in args.only if m in registry] if args.only else list(registry)
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

        rows = run_all(model_types, "aot_eager", args.workers, args.timeout, log_path, on_row=keep, family=family)
        rows_before.update({**done_before, **rows})
        if family == "causal_lm":
            results["meta"]["workers"] = args.workers
        else:
            results["meta"].setdefault("family_workers", {})[family] = args.workers
        if not args.only:
            wall = round(time.perf_counter() - started, 1)
            if family == "causal_lm":
                results["meta"]["wall_s"] = wall
            else:
                results["meta"].setdefault("family_wall_s", {})[family] = wall
    if args.inductor_subset and family == "causal_lm":
        subset = [m for m in (args.only or INDUCTOR_SUBSET)]
        results["inductor"].update(run_all(subset, "inductor", args.workers, args.timeout * 2, log_path))
    kept = {k: v for k, v in sorted(rows_before.items()) if k in registry}
    rows_before.clear()
    rows_before.update(kept)


def _partial(family: str) -> Path:
    """Where a run of ``family`` appends each finished row."""
    return RESULTS.with_suffix(".partial.jsonl" if family == "causal_lm" else f".{family}.partial.jsonl")


def _merged(results: dict[str, Any], family: str) -> dict[str, Any]:
    """The saved results as they are now, with ``family``'s rows and meta from ``results``: a sweep
    of another family running at the same time keeps what it saved."""
    saved = load_results()
    if family == "causal_lm":
        saved["aot_eager"], saved["inductor"] = results["aot_eager"], results["inductor"]
        saved["meta"].update({k: v for k, v in results["meta"].items() if not k.startswith("family_")})
    else:
        saved["families"][family] = rows_of(results, family)
        for key in ("family_versions", "family_workers", "family_wall_s"):
            if family in results["meta"].get(key, {}):
                saved["meta"].setdefault(key, {})[family] = results["meta"][key][family]
    return saved


def _report(results: dict[str, Any], family: str, write: bool) -> bool:
    """Print or write ``family``'s section; False when it is inconsistent, has a bug row, or
    (``write``) a model type not run yet."""
    text = render(results, family)
    problems = check_section(text)
    if write and not problems:
        write_table(text, family)
    elif not write:
        print(text)
    for problem in problems:
        print(f"NOT WRITTEN: the rendered section ({family}) is inconsistent: {problem}", file=sys.stderr)
    rows = rows_of(results, family)
    bad = [r for r in rows.values() if r["outcome"] == "differs" or (r["outcome"] == "error" and not r.get("stock_fails"))]
    for row in bad:
        print(f"BUG {family} {row['model_type']}: {row['outcome']}: {_what(row)}", file=sys.stderr)
    pending = [t for t, r in with_pending(rows, family).items() if r["outcome"] == PENDING]
    if write and pending:
        print(f"INCOMPLETE: {len(pending)} {family} architecture(s) not run yet (--resume --write): {pending[:8]}",
              file=sys.stderr)
    return not (bad or problems or (write and pending))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", choices=list(FAMILIES), default=["causal_lm"],
                        help="the registries to sweep (default: causal_lm)")
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
    parser.add_argument("--write", action="store_true", help="write each family's table to docs/tables/sweep_<family>.md")
    parser.add_argument("--render", action="store_true", help="only regenerate the table from the results")
    parser.add_argument("--rows", metavar="PATH", default=None,
                        help="with --only: run those (aot_eager) and write their rows to PATH as JSON; "
                             "the saved results and the docs are left as they are")
    parser.add_argument("--child", nargs="+", metavar=("INNER", "FAMILY"), help=argparse.SUPPRESS)
    isolate.add_result_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[1], args.child[2:], args.child[0], isolate.Reporter(args.result_json))
        return 0

    import torch
    import transformers

    registered = set().union(*(architectures(family) for family in args.family))
    unknown = sorted(set(args.only or ()) - registered)
    if unknown:
        parser.error(f"not model types of {args.family} in transformers {transformers.__version__}: {unknown}")
    if args.rows:
        if not args.only or len(args.family) != 1:
            parser.error("--rows needs --only and one --family")
        log_path = f"{args.rows}.log"
        Path(log_path).write_text("")
        rows = run_all(args.only, "aot_eager", args.workers, args.timeout, log_path, family=args.family[0])
        Path(args.rows).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(rows)} rows to {args.rows} (worker output: {log_path})")
        return 0
    results = load_results()
    if args.collect:
        for family in args.family:
            if _partial(family).exists():
                rows = map(json.loads, _partial(family).read_text().splitlines())
                rows_of(results, family).update({row["model_type"]: row for row in rows})
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    elif not args.render:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        log_path = str(RESULTS.with_suffix(".log"))
        if not args.resume:
            Path(log_path).write_text("")
        print(f"worker output: {log_path}")
        for family in args.family:
            _sweep(args, results, family, log_path)
            versions = dict(torch=torch.__version__, transformers=transformers.__version__, cpus=os.cpu_count())
            if family == "causal_lm":
                results["meta"].update(versions)
            else:
                results["meta"].setdefault("family_versions", {})[family] = versions
            results = _merged(results, family)
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    ok = [_report(results, family, args.write) for family in args.family]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
