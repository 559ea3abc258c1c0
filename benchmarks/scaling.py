"""Scaling: each provider's memory and time as the number of tokens (or the vocabulary) grows, on one plot.

    python -m benchmarks.scaling --device cpu --shape h256-v128k --tokens 1024 2048 4096 8192 16384 \
        --csv benchmarks/results/scaling_cpu.csv --plot docs/img/scaling_cpu.png
    python -m benchmarks.scaling --device cpu --hidden 64 --tokens 2048 --vocab 32768 65536 131072 262144 \
        --csv benchmarks/results/vocab_cpu.csv --plot docs/img/vocab_cpu.png   # against V instead

With ``--vocab``, the walk is over those vocabularies at ``--hidden`` and the one ``--tokens``
(shapes ``h{H}-v{V}``), and everything below that says N reads V.

One fresh process per provider (``benchmarks.impls``) walks the token counts in
ascending order on inputs from ``benchmarks.cases.setup``. At each N: one forward + backward
under ``compile_pass.memory.PeakMemory`` (the compiled providers compile at their
first call, here; the allocator-level peak above the inputs, so the compiler's own
Python objects do not count). That call's wall time is the time, unless it
compiled a graph (Dynamo's ``unique_graphs`` counter moved) or ``--reps`` > 0: then
the median of ``max(reps, 1)`` further calls is. (The profiler records only the
few allocations a call makes; its cost on a call of seconds is noise.) Reported: peak MiB above
the inputs, the working set beyond the inputs' own gradients (peak minus the
``[N, H]`` + ``[V, H]`` gradient bytes), and ms.

A size is skipped, with the reason in its row, when the last measured point
predicts (linearly in N) a peak beyond ``--mem-cap-gib`` or a call longer than
``--max-call-s``: a provider whose memory grows with N stops before it would
exhaust the machine, and the table says where and why. Compiled providers use
``dynamic=None`` (one recompile, at the second size); the auto-chunker is always
compiled static (it refuses dynamic shapes), so it compiles at every size.

One of our providers (``Impl.ours``) is never skipped for being unable to run, and
a size it fails at is listed as ``BROKEN`` and makes the exit status 1 (a size
skipped for the predicted memory or time is not a failure).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from benchmarks import harness, isolate
from benchmarks.cases import DTYPES, SHAPES, Case, Shape, setup
from benchmarks.impls import IMPLS, dynamo_limits, exit_status
from benchmarks.tables import fmt, markdown

MiB = harness.MiB
COLUMNS = ("impl", "shape", "tokens", "hidden", "vocab", "dtype", "chunk_size", "device", "metric",
           "peak_mib", "beyond_grads_mib", "grads_mib", "ms", "note")


def _full(inputs, loss_fn) -> None:
    inputs.zero_grad()
    loss_fn().backward()


def measure(case: Case, impl_name: str, reps: int) -> dict:
    """One provider at one size, in this process: peak, working set, ms."""
    impl = IMPLS[impl_name]
    inputs = setup(case)
    row = {**case.describe(), "impl": impl_name, "grads_mib": inputs.grad_bytes / MiB}
    problem = impl.why_not(case.device, inputs)
    if problem:
        return {**row, "metric": "skipped", "note": problem}
    loss_fn = impl.build(inputs)
    inputs.zero_grad()
    harness.release_memory(case.device)
    stats = torch._dynamo.utils.counters["stats"]
    graphs = stats["unique_graphs"]
    start = time.perf_counter()
    with harness.PeakMemory(case.device) as mem:
        loss_fn().backward()
        harness.synchronize(case.device)
    ms = (time.perf_counter() - start) * 1e3
    compiled = stats["unique_graphs"] != graphs
    if reps or compiled:  # a call that compiled is not a timing
        ms = harness.time_region(lambda _: _full(inputs, loss_fn), None, case.device, warmup=0,
                                 reps=max(reps, 1)).p50
    return {**row, "metric": "measured", "peak_mib": mem.peak_bytes / MiB,
            "beyond_grads_mib": (mem.peak_bytes - inputs.grad_bytes) / MiB, "ms": ms,
            "note": "; ".join(filter(None, (impl.note(inputs), "timed apart" if reps or compiled else "")))}


def _input_bytes(case: Case) -> int:
    shape = SHAPES[case.shape]
    return (case.tokens * shape.hidden_size + shape.vocab_size * shape.hidden_size) * case.dtype.itemsize


def walk(impl_name: str, args: argparse.Namespace, out: isolate.Reporter) -> None:
    """Child: every token count for one provider; each size's row reported when measured."""
    last = None  # the last measured row
    failed = None  # the first row after which larger sizes cannot run
    logits_dtype = torch.float32 if args.logits_dtype == "fp32" else None
    axis = args.axis
    for shape, tokens, size in args.points:
        case = Case(shape, tokens, args.dtype, logits_dtype, args.chunk_size, args.device, dynamic=None)
        why = None
        if failed is not None:
            why = f"not run: {axis}={failed[axis]} failed"
        elif last is not None:
            grow = size / int(last[axis])
            peak = last["peak_mib"] * MiB * grow + _input_bytes(case)
            seconds = last["ms"] / 1e3 * grow
            if peak > args.mem_cap_gib * 2**30:
                why = (f"predicted peak {peak / 2**30:.1f} GiB (from {last['peak_mib']:.0f} MiB at {axis}="
                       f"{last[axis]}, linear in {axis}) is above --mem-cap-gib {args.mem_cap_gib}")
            elif seconds > args.max_call_s:
                why = (f"predicted {seconds:.0f} s a call (from {axis}={last[axis]}) is above "
                       f"--max-call-s {args.max_call_s}")
        if why:
            row = {**case.describe(), "impl": impl_name, "metric": "skipped", "note": why}
        else:
            print(f"  {impl_name} {axis}={size} ...", flush=True)
            try:
                row = measure(case, impl_name, args.reps)
            except Exception as e:  # noqa: BLE001 - an OOM or a refused rewrite is a result too
                if args.verbose:
                    traceback.print_exc()
                row = {**case.describe(), "impl": impl_name, "metric": "failed",
                       "note": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            harness.release_memory(args.device)
        print(f"  {impl_name} {axis}={size}: {row['metric']} "
              + (f"peak {row['peak_mib']:.0f} MiB, {row['ms']:.0f} ms" if row["metric"] == "measured"
                 else row.get("note", "")), flush=True)
        out.record({c: row.get(c, "") for c in COLUMNS})
        if row["metric"] == "measured":
            last = row
        elif (row["metric"] == "failed" and "memory" in row["note"].lower()) or (
                row["metric"] == "skipped" and last is None):
            failed = failed or row  # out of memory, or cannot run here: larger sizes neither


def run_all(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for name in args.impls:
        child = isolate.run(["-m", "benchmarks.scaling", "--child", name, *args.passthrough],
                            timeout=args.run_timeout)
        got = child.records
        done = {int(r[args.axis]) for r in got}
        for shape, tokens, size in args.points:  # sizes a killed child never reported: say so
            if size not in done:
                got.append({c: "" for c in COLUMNS} | {"impl": name, "shape": shape, "tokens": tokens,
                                                     "vocab": SHAPES[shape].vocab_size, "metric": "failed",
                                                     "note": f"child process ended ({child.status}) before this size"})
        print(f"  {name}: {child.seconds:.0f} s", flush=True)
        rows += sorted(got, key=lambda r: int(r[args.axis]))
        if args.csv:
            harness.write_csv(rows, args.csv)
    return rows


def tables(rows: list[dict], axis: str = "tokens") -> str:
    """Markdown: per provider (rows) and token count (columns; vocabulary with ``axis="vocab"``)
    the working set, the peak and the seconds per call, then a line for every size skipped or
    failed, with why."""
    tokens = sorted({int(r[axis]) for r in rows})
    out = []
    for title, key, scale, spec in (("MiB beyond the inputs' gradients (allocator peak)", "beyond_grads_mib", 1, ".0f"),
                                    ("MiB above the inputs (allocator peak)", "peak_mib", 1, ".0f"),
                                    ("seconds per forward + backward", "ms", 1e3, ".1f")):
        body = []
        for impl in dict.fromkeys(r["impl"] for r in rows):
            cells = []
            for n in tokens:
                r = next((r for r in rows if r["impl"] == impl and int(r[axis]) == n), None)
                measured = r is not None and r["metric"] == "measured"
                cells.append(fmt(float(r[key]) / scale, spec) if measured else (r["metric"] if r else ""))
            body.append([f"`{impl}`", *cells])
        out.append(f"{title}:\n\n" + markdown(["provider", *map(str, tokens)], body))
    notes = [f"- `{r['impl']}` at {'N' if axis == 'tokens' else 'V'} = {r[axis]}: {r['metric']}, {r['note']}" for r in rows
             if r["metric"] in ("skipped", "failed")]
    return "\n\n".join(out + (["\n".join(notes)] if notes else []))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    p.add_argument("--shape", choices=SHAPES, default=None, help="default: h256-v128k (cpu), llama3-8b")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="default 1024 .. 16384 on cpu, 4096 .. 65536 on an accelerator")
    p.add_argument("--vocab", nargs="+", type=int, default=None,
                   help="walk these vocabularies at --hidden and the one --tokens instead")
    p.add_argument("--hidden", type=int, default=64, help="H of the --vocab walk")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: fp32 on cpu, bf16")
    p.add_argument("--logits-dtype", choices=("same", "fp32"), default="same")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--chunk-size", type=int, default=None, help="default: each provider's own choice")
    p.add_argument("--reps", type=int, default=0,
                   help="timed calls per size after the measured one; 0: time the measured call "
                        "unless it compiled")
    p.add_argument("--mem-cap-gib", type=float, default=18.0,
                   help="skip a size whose predicted peak is above this")
    p.add_argument("--max-call-s", type=float, default=120.0, help="skip a size predicted to take longer")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per provider's process")
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None, help="PNG path (matplotlib)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    isolate.add_result_argument(p)
    args = p.parse_args(argv)
    args.passthrough = list(argv if argv is not None else sys.argv[1:])
    args.device = torch.device(args.device) if args.device else harness.default_device()
    cpu = args.device.type == "cpu"
    args.shape = args.shape or ("h256-v128k" if cpu else "llama3-8b")
    args.tokens = args.tokens or ([1024, 2048, 4096, 8192, 16384] if cpu else [4096, 8192, 16384, 32768, 65536])
    args.dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    if args.vocab:  # (shape, tokens, the walked size) per point
        for v in args.vocab:
            SHAPES.setdefault(f"h{args.hidden}-v{v}", Shape(args.hidden, v))
        args.axis = "vocab"
        args.points = [(f"h{args.hidden}-v{v}", args.tokens[0], v) for v in sorted(args.vocab)]
    else:
        args.axis = "tokens"
        args.points = [(args.shape, n, n) for n in sorted(args.tokens)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        with dynamo_limits():
            walk(args.child, args, isolate.Reporter(args.result_json))
        return 0
    harness.print_environment(args.device)
    rows = run_all(args)
    print("\n" + tables(rows, args.axis))
    if args.csv:
        print(f"\nwrote {len(rows)} rows to {args.csv}")
    if args.plot:
        from benchmarks.plots import plot_scaling
        dtype = str(args.dtype).removeprefix("torch.")
        if args.axis == "vocab":
            title = f"N {args.tokens[0]}, H {args.hidden}, {args.device.type}, {dtype}"
        else:
            shape = SHAPES[args.shape]
            title = f"{args.shape} ({shape.hidden_size} x {shape.vocab_size}), {args.device.type}, {dtype}"
        plot_scaling(rows, args.plot, title=title, axis=args.axis)
        print(f"wrote {args.plot}")
    return exit_status(rows, lambda r: f"{r['impl']} {args.axis}={r[args.axis]}: {r['note']}")


if __name__ == "__main__":
    sys.exit(main())
