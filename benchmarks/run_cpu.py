"""Every CPU result in docs/benchmarks.md, from one command.

    python -m benchmarks.run_cpu            # ~20 min on 2 quiet cores; CSVs, PNGs, tables
    python -m benchmarks.run_cpu --quick    # tiny shapes, ~5 min: checks every stage works

Stages, each its own process (``bench_op``, ``scaling``, ``bench_model``), each
provider or backend in a fresh process below that:

1. ``op``      every provider at one shape, forward + backward (``bench_op --isolate``)
2. ``model``   Llama training step, Inductor vs chunkce: step time and peak
3. ``cap``     the largest batch whose step fits a memory cap, per backend, and its plot
4. ``example`` ``examples/train_compiled.py`` with its defaults (the README's results
   table), its output kept in ``<out>/example_cpu.txt``
5. ``scaling`` every provider from 1k to 16k tokens at a 128k vocabulary, and its plot
   (last: its ``--max-call-s`` keeps the whole run inside its time)

Writes ``<out>/op_cpu.csv``, ``scaling_cpu.csv``, ``model_cpu.csv``,
``model_cap_cpu.csv``, ``cpu_tables.md`` (the markdown tables the docs quote) and
the plots into ``<img>``; default ``benchmarks/results`` and ``docs/img``
(``--quick``: a temporary directory, so a check never overwrites the documented run).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time

# Stage settings: (full run, --quick).
OP_CASE = {"full": ["--shapes", "h1024-v32k", "--tokens", "2048", "--warmup", "1", "--reps", "3"],
           "quick": ["--shapes", "cpu-tiny", "--tokens", "1024", "--warmup", "1", "--reps", "1"]}
SCALING = {"full": ["--shape", "h128-v128k", "--tokens", "1024", "2048", "4096", "8192", "16384",
                    "--max-call-s", "12"],
           "quick": ["--shape", "cpu-tiny", "--tokens", "256", "512", "1024"]}
MODEL = {"full": ["--configs", "cpu-small", "--steps", "3"],
         "quick": ["--configs", "cpu-micro", "--steps", "1", "--warmup", "1"]}
CAP = {"full": ["--configs", "cpu-small", "--cap-mib", "768"],
       "quick": ["--configs", "cpu-micro", "--cap-mib", "40"]}
CPU_IMPLS = ["unfused-eager", "unfused-compiled", "autochunk", "autochunk-forced", "torch-lce",
             "torch-lce-compiled", "chunkce", "chunkce-compiled", "chunkce-gif", "floor-recompute", "floor-unfused"]
STAGES = ("op", "model", "cap", "example", "scaling")


def _stage(name: str, cmd: list[str], timeout: float | None, log: str | None = None) -> str:
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        if log:  # keep the output as well as showing it
            with open(log, "w") as f:
                proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
                for line in proc.stdout:
                    sys.stdout.write(line)
                    f.write(line)
                code = proc.wait(timeout=timeout)
        else:
            code = subprocess.run([sys.executable, "-m", *cmd], timeout=timeout).returncode
        status = f"rc={code}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f} s"
    took = time.perf_counter() - start
    print(f"=== {name}: {status}, {took:.0f} s", flush=True)
    return f"{name}: {status}, {took:.0f} s"


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _num(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def op_markdown(rows: list[dict]) -> str:
    """The op table: one row per provider, full mode, ratios against compiled unfused and the floor."""
    def get(impl: str, run: str, metric: str) -> float | None:
        return next((_num(r["p50"]) for r in rows if r["impl"] == impl and r["run"] == run
                     and r["metric"] == metric and r["mode"] == "full"), None)

    t_base, t_floor = get("unfused-compiled", "speed", "time"), get("floor-recompute", "speed", "time")
    w_base = get("unfused-compiled", "memory", "beyond_grads")
    body = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        bad = next((r for r in rows if r["impl"] == impl and r["metric"] in ("skipped", "failed")), None)
        t = get(impl, "speed", "time")
        if bad and t is None:
            body.append([f"`{impl}`", f"{bad['metric']}: {bad['note']}", *[""] * 8])
            continue
        peak, beyond, rss = (get(impl, "memory", m) for m in ("peak", "beyond_grads", "rss_peak"))
        errs = [get(impl, "memory", m) for m in ("loss_err", "grad_hidden_err", "grad_weight_err")]
        body.append([
            f"`{impl}`", f"{t:.0f}" if t is not None else "",
            f"{t / t_base:.2f}x" if t and t_base else "", f"{t / t_floor:.2f}x" if t and t_floor else "",
            f"{peak:.0f}" if peak is not None else "", f"{beyond:.0f}" if beyond is not None else "",
            f"{beyond / w_base:.3f}x" if beyond is not None and w_base else "",
            f"{rss:.0f}" if rss is not None else "",
            " / ".join(f"{e:.1e}" for e in errs) if all(e is not None for e in errs) else "-",
            next((r["note"] for r in rows if r["impl"] == impl and r.get("note")), ""),
        ])
    header = ["provider", "ms", "x compiled", "x floor", "peak MiB", "beyond grads MiB", "x compiled",
              "peak RSS MiB", "error vs fp64: loss / grad_hidden / grad_weight", "note"]
    return _md(header, body)


def scaling_markdown(rows: list[dict]) -> str:
    tokens = sorted({int(r["tokens"]) for r in rows})
    out = []
    for title, key in (("MiB beyond the inputs' gradients (allocator peak)", "beyond_grads_mib"),
                       ("seconds per forward + backward", "ms")):
        body = []
        for impl in dict.fromkeys(r["impl"] for r in rows):
            cells = []
            for n in tokens:
                r = next((r for r in rows if r["impl"] == impl and int(r["tokens"]) == n), None)
                if r is None:
                    cells.append("")
                elif r["metric"] == "measured":
                    v = float(r[key])
                    cells.append(f"{v / 1e3:.1f}" if key == "ms" else f"{v:.0f}")
                else:
                    cells.append(r["metric"])
            body.append([f"`{impl}`", *cells])
        out.append(f"{title}:\n\n" + _md(["provider", *map(str, tokens)], body))
    notes = [f"- `{r['impl']}` at N = {r['tokens']}: {r['metric']}, {r['note']}" for r in rows
             if r["metric"] in ("skipped", "failed")]
    return "\n\n".join(out + (["\n".join(notes)] if notes else []))


def model_markdown(rows: list[dict]) -> str:
    base = next((r for r in rows if r["backend"] == "inductor" and _num(r["peak_mib"])), None)
    body = []
    for r in rows:
        if not _num(r["peak_mib"]):
            body.append([r["backend"], f"failed: {r['note']}", *[""] * 7])
            continue
        ratio = lambda key: f" ({float(r[key]) / float(base[key]):.2f}x)" if base and r is not base else ""  # noqa: E731
        body.append([r["backend"], f"{float(r['step_ms_p50']):.0f}{ratio('step_ms_p50')}",
                     f"{float(r['tokens_per_s']):.0f}", f"{float(r['peak_mib']):.1f}{ratio('peak_mib')}",
                     f"{float(r['peak_fwd_bwd_mib']):.1f}", f"{float(r['static_mib']):.1f}",
                     f"{float(r['warmup_s']):.0f}", r["sites_rewritten"] or "-",
                     f"{float(r['max_loss_diff_vs_inductor']):.1e}" if r.get("max_loss_diff_vs_inductor") else "-"])
    return _md(["backend", "step ms (p50)", "tokens/s", "step peak MiB (above params + AdamW)",
                "fwd + bwd peak MiB", "params + AdamW MiB", "warm-up s", "sites rewritten",
                "max loss diff vs inductor"], body)


def cap_markdown(rows: list[dict]) -> str:
    body = [[r["backend"], r["batch"], r["tokens"], f"{float(r['total_mib']):.0f}", r["fits"]] for r in rows]
    best = {}
    for r in rows:
        if r["fits"] == "True":
            best[r["backend"]] = max(best.get(r["backend"], 0), int(r["tokens"]))
    summary = ", ".join(f"{b}: {t} tokens" for b, t in best.items())
    return _md(["backend", "batch", "tokens", "MiB in all", "fits"], body) + f"\n\nLargest step that fits: {summary}."


def write_tables(out: str) -> str:
    parts = []
    for title, name, fn in (("Op", "op_cpu.csv", op_markdown), ("Model", "model_cpu.csv", model_markdown),
                            ("Memory cap", "model_cap_cpu.csv", cap_markdown),
                            ("Scaling", "scaling_cpu.csv", scaling_markdown)):
        rows = _read(os.path.join(out, name))
        parts.append(f"## {title} ({name})\n\n" + (fn(rows) if rows else "(no rows)"))
    path = os.path.join(out, "cpu_tables.md")
    with open(path, "w") as f:
        f.write("\n\n".join(parts) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes: a check that every stage runs")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--out", default=None, help="CSVs and tables; default benchmarks/results (quick: a temp dir)")
    p.add_argument("--img", default=None, help="PNGs; default docs/img (quick: the --out dir)")
    p.add_argument("--chunk-size", type=int, default=None, help="chunkce's chunk_size; default its own choice")
    args = p.parse_args(argv)
    mode = "quick" if args.quick else "full"
    out = args.out or (tempfile.mkdtemp(prefix="chunkce_bench_") if args.quick else "benchmarks/results")
    img = args.img or (out if args.quick else "docs/img")
    os.makedirs(out, exist_ok=True)
    os.makedirs(img, exist_ok=True)
    chunk = ["--chunk-size", str(args.chunk_size)] if args.chunk_size else []
    commands = {
        "op": ["benchmarks.bench_op", "--device", "cpu", *OP_CASE[mode], "--modes", "full", "--isolate",
               "--impls", *CPU_IMPLS, *chunk, "--csv", os.path.join(out, "op_cpu.csv")],
        "model": ["benchmarks.bench_model", "--device", "cpu", *MODEL[mode], "--backends", "inductor", "chunkce",
                  "--isolate", *chunk, "--csv", os.path.join(out, "model_cpu.csv")],
        "cap": ["benchmarks.bench_model", "--device", "cpu", *CAP[mode], "--backends", "inductor", "chunkce",
                "--isolate", *chunk, "--csv", os.path.join(out, "model_cap_cpu.csv"),
                "--plot", os.path.join(img, "model_cap_cpu.png")],
        "scaling": ["benchmarks.scaling", "--device", "cpu", *SCALING[mode], "--impls", *CPU_IMPLS, *chunk,
                    "--csv", os.path.join(out, "scaling_cpu.csv"), "--plot", os.path.join(img, "scaling_cpu.png")],
    }
    example = ["examples/train_compiled.py", "--device", "cpu",
               *(["--steps", "3", "--warmup", "1", "--batch-size", "2", "--seq-len", "64", "--max-bytes", "200000"]
                 if args.quick else [])]
    start = time.perf_counter()
    done = [_stage(name, example, None, os.path.join(out, "example_cpu.txt")) if name == "example"
            else _stage(name, commands[name], None) for name in args.stages]
    print(f"\nwrote {write_tables(out)}; PNGs in {img}")
    print("\n".join(done) + f"\nall stages: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
