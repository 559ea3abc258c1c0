"""The op and a training step at the heads of four published models: one table in docs.

    python -m benchmarks.real_heads                  # every case (hours on 2 cores), then the table
    python -m benchmarks.real_heads --heads llama3.2-1b --tokens 4096 --providers chunkce floor-recompute
    python -m benchmarks.real_heads --parts model --heads smollm2-360m
    python -m benchmarks.real_heads --table-only     # the table again from the results file
    python -m benchmarks.real_heads --heads tiny --tokens 256 --results /tmp/r.jsonl --write /tmp/t.md

Heads (``benchmarks.real_models``): Llama-3.2-1B, Qwen3-0.6B, Gemma-3-1B, SmolLM2-360M,
at their published hidden size and vocabulary (``tiny``: ``cpu-tiny`` and ``cpu-micro``, a
check in seconds). Two parts, fp32 on CPU, every case in a fresh process:

* ``op``: forward + backward of each provider (``--providers``, ``benchmarks.impls``) at
  each ``--tokens``, run by ``bench_op`` (one call compiles, one is measured for peak and
  working set beyond the inputs' gradients, ``--reps`` more are timed);
* ``model``: a training step (forward, backward, AdamW) of the model at two decoder layers,
  1 x 4096 tokens, its tied head, each backend (``--backends``), run by ``bench_model``
  (peak above parameters + AdamW state, median of ``--steps`` steps, each step's loss).

Before a case starts, ``benchmarks.predict`` estimates its process's peak; a case over
``--mem-cap-gib`` is not run and its row says "out of memory: needs ~X GiB". Each case's
result is appended to ``--results`` (JSON lines) as it ends, with the versions and commit
it ran at; a run skips the cases already there (``--redo``: runs them again, the table takes
the last), so a run cut short goes on where it stopped. The markdown table is rebuilt from
that file into ``--write`` after every case.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable

import torch

from benchmarks import harness, isolate, predict
from benchmarks.bench_model import CONFIGS
from benchmarks.cases import SHAPES
from benchmarks.real_models import REAL_MODELS
from benchmarks.tables import fmt, markdown, num, ratio

MiB = harness.MiB
PROVIDERS = ("unfused-compiled", "torch-lce", "autochunk", "autochunk-forced", "chunkce", "floor-recompute")
BACKENDS = ("inductor", "chunkce")
BASELINE, OURS, FLOOR = "unfused-compiled", "chunkce", "floor-recompute"
# head -> (bench_op shape, bench_model config)
HEADS = {**{name: (name, f"{name}-2l") for name in REAL_MODELS}, "tiny": ("cpu-tiny", "cpu-micro")}
RESULTS = "benchmarks/results/real_heads_cpu.jsonl"
TABLE = "docs/tables/real_heads.md"


def _key(record: dict) -> tuple:
    return record["part"], record["head"], int(record["tokens"]), record["impl"]


def latest(records: Iterable[dict]) -> dict[tuple, dict]:
    """The last record of each case (part, head, tokens, provider or backend), in first-seen order."""
    out: dict[tuple, dict] = {}
    for r in records:
        out[_key(r)] = r
    return out


def _op_record(head: str, tokens: int, provider: str, rows: list[dict], status: str) -> dict:
    """bench_op's rows of one provider as one record: ms, peak, working set, or why none."""
    def value(metric: str) -> float | None:
        return next((num(r["p50"]) for r in rows if r["metric"] == metric), None)

    bad = next((r for r in rows if r["metric"] in ("failed", "skipped")), None)
    ms = value("time")
    record = {"part": "op", "head": head, "tokens": tokens, "impl": provider, "ms": ms, "peak_mib": value("peak"),
              "beyond_grads_mib": value("beyond_grads"), "rss_mib": value("rss_peak"),
              "note": next((r["note"] for r in rows if r.get("note")), "")}
    if bad is not None:
        return {**record, "status": bad["metric"], "note": bad["note"]}
    if ms is None or record["peak_mib"] is None:
        return {**record, "status": "failed", "note": f"child process ended ({status}) after {len(rows)} rows"}
    return {**record, "status": "measured"}


def run_op(head: str, tokens: int, provider: str, args: argparse.Namespace) -> dict:
    shape = SHAPES[HEADS[head][0]]
    need = predict.op_bytes(provider, tokens, shape.hidden_size, shape.vocab_size)
    if why := predict.too_big(need, args.mem_cap_gib):
        return {"part": "op", "head": head, "tokens": tokens, "impl": provider, "status": predict.OOM, "note": why}
    child = isolate.run(["-m", "benchmarks.bench_op", "--device", "cpu", "--shapes", HEADS[head][0],
                         "--tokens", str(tokens), "--dtype", "fp32", "--impls", provider, "--modes", "full",
                         "--runs", "memory", "speed", "--warmup", "0", "--reps", str(args.reps)],
                        timeout=args.run_timeout)
    return _op_record(head, tokens, provider, child.records, child.status)


def run_model(head: str, backend: str, args: argparse.Namespace) -> dict:
    name = HEADS[head][1]
    config = CONFIGS[name]
    base = {"part": "model", "head": head, "tokens": config.tokens, "impl": backend}
    if config.model:
        need = predict.step_bytes(REAL_MODELS[config.model], config.layers, config.tokens, backend)
        if why := predict.too_big(need, args.mem_cap_gib):
            return {**base, "status": predict.OOM, "note": why}
    child = isolate.run(["-m", "benchmarks.bench_model", "--device", "cpu", "--configs", name, "--backends", backend,
                         "--warmup", "1", "--steps", str(args.steps)], timeout=args.run_timeout)
    result = child.records[0] if child.records else {"note": f"child process ended ({child.status}) with no result"}
    if not result.get("losses"):
        return {**base, "status": "failed", "note": result.get("note", "")}
    return {**base, "status": "measured", "step_ms": result["step_ms_p50"], "peak_mib": result["peak_mib"],
            "static_mib": result["static_mib"], "losses": result["losses"],
            "sites_rewritten": result.get("sites_rewritten", ""), "note": ""}


# ---------------------------------------------------------------- the table


def _head_cell(head: str, part: str = "op") -> str:
    if part == "op":
        hidden, vocab = SHAPES[HEADS[head][0]].hidden_size, SHAPES[HEADS[head][0]].vocab_size
    else:
        hidden, vocab = CONFIGS[HEADS[head][1]].hidden_size, CONFIGS[HEADS[head][1]].vocab_size
    tied = f", {'tied' if REAL_MODELS[head].tied else 'untied'}" if head in REAL_MODELS else ""
    return f"{head} ({hidden} x {vocab}{tied})"


def op_table(records: list[dict]) -> str:
    """Per head and token count, each provider: seconds, x floor, x Inductor, peak, working set and
    its ratio to Inductor's, peak RSS; a row not measured says why."""
    cases = latest(r for r in records if r["part"] == "op")
    body = []
    for head, tokens in dict.fromkeys((k[1], k[2]) for k in cases):
        mine = {k[3]: r for k, r in cases.items() if k[1] == head and k[2] == tokens}
        base, floor = mine.get(BASELINE, {}), mine.get(FLOOR, {})
        for provider, r in mine.items():
            if r["status"] != "measured":
                body.append([_head_cell(head), tokens, f"`{provider}`", f"{r['status']}: {r['note']}", *[""] * 7])
                continue
            body.append([_head_cell(head), tokens, f"`{provider}`", fmt(r["ms"] / 1e3, ".1f"),
                         ratio(r["ms"], floor.get("ms")), ratio(r["ms"], base.get("ms")),
                         fmt(r["peak_mib"], ".0f"), fmt(r["beyond_grads_mib"], ".0f"),
                         ratio(r["beyond_grads_mib"], base.get("beyond_grads_mib"), ".3f"),
                         fmt(r["rss_mib"], ".0f"), r["note"]])
    return markdown(["head (H x V)", "tokens", "provider", "s", "x floor", "x Inductor", "peak MiB",
                     "beyond grads MiB", "x Inductor's", "peak RSS MiB", "note"], body)


def model_table(records: list[dict]) -> str:
    """Per head, each backend's training step: seconds, peak above parameters + AdamW, and the
    largest per-step loss gap to Inductor's."""
    cases = latest(r for r in records if r["part"] == "model")
    body = []
    for head, tokens in dict.fromkeys((k[1], k[2]) for k in cases):
        mine = {k[3]: r for k, r in cases.items() if k[1] == head and k[2] == tokens}
        base = mine.get("inductor", {})
        for backend, r in mine.items():
            if r["status"] != "measured":
                body.append([_head_cell(head, "model"), tokens, backend, f"{r['status']}: {r['note']}", *[""] * 6])
                continue
            gap = ""
            if base.get("losses") and backend != "inductor":
                gap = f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.1e}"
            body.append([_head_cell(head, "model"), tokens, backend, fmt(r["step_ms"] / 1e3, ".1f"),
                         ratio(r["step_ms"], base.get("step_ms")), fmt(r["peak_mib"], ".0f"),
                         ratio(r["peak_mib"], base.get("peak_mib")), fmt(r["static_mib"], ".0f"), gap,
                         r.get("sites_rewritten") or "-"])
    return markdown(["head (H x V)", "tokens", "backend", "step s (median)", "x Inductor",
                     "peak MiB above params + AdamW", "x Inductor", "params + AdamW MiB",
                     "max loss gap to Inductor", "sites rewritten"], body)


def document(records: list[dict], results: str = RESULTS) -> str:
    """The whole markdown page: where it comes from, then both tables."""
    sources = "; ".join(f"{name}: <{m.source}>" for name, m in REAL_MODELS.items())
    return "\n\n".join([
        "# The op and a training step at real heads (CPU, fp32)",
        f"Written by `python -m benchmarks.real_heads` from `{results}`: do not edit. "
        f"{harness.environment_line([r['env'] for r in records if r.get('env')])}. "
        f"Widths and vocabularies from the published configs ({sources}).",
        "## The op alone: forward + backward\n\n"
        "Seconds per call (a second call after the compiling one); `x floor`: over `floor-recompute` (chunkce's "
        "four matmuls at its own tiles); `x Inductor`: over `unfused-compiled`. Peak above the inputs; beyond "
        "grads: that peak less the inputs' own gradients.\n\n" + op_table(records),
        "## A training step: two decoder layers, 1 x 4096 tokens, AdamW\n\n" + model_table(records),
    ]) + "\n"


def write_document(records: list[dict], path: str, results: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(document(records, results))


# ---------------------------------------------------------------- the run


def cases(args: argparse.Namespace) -> list[tuple]:
    """Every (part, head, tokens, provider or backend) asked for, in run order."""
    out = []
    for head in args.heads:
        if "op" in args.parts:
            out += [("op", head, tokens, p) for tokens in args.tokens for p in args.providers]
        if "model" in args.parts:
            out += [("model", head, CONFIGS[HEADS[head][1]].tokens, b) for b in args.backends]
    return out


def pending(todo: list[tuple], records: list[dict], redo: bool) -> list[tuple]:
    """The cases of ``todo`` still to run: all with ``redo``, else those with no result yet (a case
    predicted out of memory is predicted again, under this run's cap)."""
    done = {k for k, r in latest(records).items() if r["status"] != predict.OOM}
    return list(todo) if redo else [c for c in todo if c not in done]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", nargs="+", choices=HEADS, default=list(REAL_MODELS))
    p.add_argument("--parts", nargs="+", choices=("op", "model"), default=["op", "model"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384], help="the op's token counts")
    p.add_argument("--providers", nargs="+", choices=predict.OP_WORKING_SET, default=list(PROVIDERS),
                   help="the op's (benchmarks.impls)")
    p.add_argument("--backends", nargs="+", choices=("eager", "inductor", "chunkce", "chunkce-gif"), default=list(BACKENDS),
                   help="the step's (bench_model)")
    p.add_argument("--reps", type=int, default=1, help="timed op calls after the measured one")
    p.add_argument("--steps", type=int, default=3, help="timed training steps")
    p.add_argument("--mem-cap-gib", type=float, default=14.0, help="do not start a case predicted above this")
    p.add_argument("--run-timeout", type=float, default=5400.0,
                   help="seconds per case's process (a case past it is a failed row, and the run goes on)")
    p.add_argument("--results", default=RESULTS, help="JSON lines, appended to")
    p.add_argument("--write", default=TABLE, help="the markdown table")
    p.add_argument("--redo", action="store_true", help="run the cases already in --results again")
    p.add_argument("--table-only", action="store_true", help="only write the table from --results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records = harness.read_jsonl(args.results)
    if not args.table_only:
        harness.print_environment(torch.device("cpu"))
        env = harness.recorded_environment()
        todo = pending(cases(args), records, args.redo)
        for number, (part, head, tokens, impl) in enumerate(todo, 1):
            print(f"[{number}/{len(todo)}] {part} {head} {tokens} {impl}", flush=True)
            record = run_op(head, tokens, impl, args) if part == "op" else run_model(head, impl, args)
            record = {**record, "env": env}
            print(f"  {record['status']}: " + (f"{record.get('ms') or record.get('step_ms'):.0f} ms, "
                                               f"peak {record['peak_mib']:.0f} MiB" if record["status"] == "measured"
                                               else record["note"]), flush=True)
            harness.append_jsonl(args.results, record)
            records.append(record)
            write_document(records, args.write, args.results)
    write_document(records, args.write, args.results)
    print(f"\n{document(records, args.results)}\nwrote {args.write}")
    ours_failed = [r for r in latest(records).values() if r["status"] == "failed" and r["impl"] in (OURS, FLOOR)]
    return 1 if ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
