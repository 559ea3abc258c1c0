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
``model_cap_cpu.csv`` and its plot, ``cpu_tables.md`` (the markdown tables the docs
quote), and the scaling plot into ``<img>``; default ``benchmarks/results`` and ``docs/img``
(``--quick``: a temporary directory, so a check never overwrites the documented run).
The tables are each benchmark's own markdown tables (``op_report.op_table``,
``bench_model.step_table`` / ``cap_table``, ``scaling.tables``) read back from the
CSVs. A stage that fails (exit status non-zero) makes the exit status 1.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time

from benchmarks import bench_model, isolate, op_report, scaling

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


def _stage(name: str, cmd: list[str], log: str | None = None) -> tuple[str, bool]:
    """One stage in its own process (its output shown, and kept in ``log`` when given)."""
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    child = isolate.run(cmd, results=False, log=log, tee=bool(log))
    print(f"=== {name}: {child.status}, {child.seconds:.0f} s", flush=True)
    return f"{name}: {child.status}, {child.seconds:.0f} s", child.ok


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_tables(out: str) -> str:
    parts = []
    for title, name, fn in (("Op", "op_cpu.csv", op_report.op_table), ("Model", "model_cpu.csv", bench_model.step_table),
                            ("Memory cap", "model_cap_cpu.csv", bench_model.cap_table),
                            ("Scaling", "scaling_cpu.csv", scaling.tables)):
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
        "op": ["-m", "benchmarks.bench_op", "--device", "cpu", *OP_CASE[mode], "--modes", "full", "--isolate",
               "--impls", *CPU_IMPLS, *chunk, "--csv", os.path.join(out, "op_cpu.csv")],
        "model": ["-m", "benchmarks.bench_model", "--device", "cpu", *MODEL[mode], "--backends", "inductor", "chunkce",
                  "--isolate", *chunk, "--csv", os.path.join(out, "model_cpu.csv")],
        "cap": ["-m", "benchmarks.bench_model", "--device", "cpu", *CAP[mode], "--backends", "inductor", "chunkce",
                "--isolate", *chunk, "--csv", os.path.join(out, "model_cap_cpu.csv"),
                "--plot", os.path.join(out, "model_cap_cpu.png")],
        "scaling": ["-m", "benchmarks.scaling", "--device", "cpu", *SCALING[mode], "--impls", *CPU_IMPLS, *chunk,
                    "--csv", os.path.join(out, "scaling_cpu.csv"), "--plot", os.path.join(img, "scaling_cpu.png")],
    }
    example = ["examples/train_compiled.py", "--device", "cpu",
               *(["--steps", "3", "--warmup", "1", "--batch-size", "2", "--seq-len", "64", "--max-bytes", "200000"]
                 if args.quick else [])]
    start = time.perf_counter()
    log = os.path.join(out, "example_cpu.txt")
    if "example" in args.stages and os.path.exists(log):
        os.remove(log)  # the log is appended to: this run's output only
    done = [_stage(name, example, log) if name == "example" else _stage(name, commands[name])
            for name in args.stages]
    print(f"\nwrote {write_tables(out)}; PNGs in {img}")
    print("\n".join(line for line, _ in done) + f"\nall stages: {time.perf_counter() - start:.0f} s")
    failed = [line for line, ok in done if not ok]
    for line in failed:
        print(f"FAILED stage {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
