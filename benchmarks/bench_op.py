"""Op-level benchmark: linear + cross-entropy, every provider side by side, forward + backward.

    python -m benchmarks.bench_op --device cpu --shapes cpu-tiny --tokens 1024 4096
    python -m benchmarks.bench_op --device cpu --shapes h1024-v32k --tokens 4096 --modes full --isolate
    python -m benchmarks.bench_op --shapes llama3-8b qwen2.5-7b --tokens 8192 16384 \
        --modes full --csv op.csv                                   # on a GPU: bf16

For each shape (H, V from ``SHAPES``), token count N and provider
(``benchmarks.impls``), separate runs, Liger-style:

* ``speed``  - ms per call (p20 / p50 / p80 over ``--reps`` after ``--warmup``), for
  each mode: ``forward`` (with autograd recording), ``backward`` (the forward
  excluded), ``full`` (forward + backward);
* ``memory`` - peak bytes of one call above the inputs (and, for ``forward``, the
  bytes still held for backward), measured by ``compile_pass.memory``; for ``full``
  also the working set beyond the inputs' own gradients (peak minus the
  ``[N, H]`` + ``[V, H]`` gradient bytes, which every provider must allocate) and,
  on CPU (Linux), the peak resident set of the same call above the resident set
  before it (``harness.rss_region``: meaningful in a fresh process, ``--isolate``);
* ``error``  - max abs difference of the loss and both gradients from an fp64
  reference (F.linear + F.cross_entropy in fp64, chunked over tokens); taken from
  the ``memory`` run's ``full`` call when there is one (one call fewer).

``--isolate`` runs every (case, provider) in a fresh interpreter, so no provider's
compile caches, allocator state or resident memory colour the next one's numbers;
the fp64 reference is computed once per case by the parent and handed over in a file.
Inputs are made by :func:`benchmarks.cases.setup` (the same seed in every process).
The printed tables are markdown (``benchmarks.op_report``, whose ``op_table`` is also
the docs' table). A failure of one of our providers (``Impl.ours``) is listed as
``BROKEN`` and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import torch

from benchmarks import harness, isolate
from benchmarks.cases import DTYPES, SHAPES, Case, reference, setup
from benchmarks.impls import IMPLS, Impl, OpInputs, dynamo_limits, exit_status
from benchmarks.op_report import report

MiB = harness.MiB
MODES = ("forward", "backward", "full")
RUNS = ("speed", "memory", "error")


def _prepare(mode: str, inputs: OpInputs, loss_fn):
    def prepare():
        inputs.zero_grad()
        return loss_fn() if mode == "backward" else None
    return prepare


def _run(mode: str, loss_fn):
    if mode == "forward":
        return lambda state: loss_fn()
    if mode == "backward":
        return lambda loss: loss.backward()
    return lambda state: loss_fn().backward()


def bench_speed(case: Case, inputs: OpInputs, loss_fn, mode: str, warmup: int, reps: int) -> list[dict]:
    stats = harness.time_region(_run(mode, loss_fn), _prepare(mode, inputs, loss_fn), case.device,
                                warmup=warmup, reps=reps)
    return [{"metric": "time", "unit": "ms", "p20": stats.p20, "p50": stats.p50, "p80": stats.p80}]


def bench_memory(case: Case, inputs: OpInputs, loss_fn, mode: str, warmup: int) -> list[dict]:
    peak, retained = harness.memory_region(_run(mode, loss_fn), _prepare(mode, inputs, loss_fn),
                                           case.device, warmup=warmup)
    rows = [{"metric": "peak", "unit": "MiB", "p50": peak / MiB}]
    if mode == "forward":  # what the forward leaves for backward (the loss's graph)
        rows.append({"metric": "retained", "unit": "MiB", "p50": retained / MiB})
    if mode == "full":  # every provider allocates the two gradients; the rest is its working set
        rows.append({"metric": "beyond_grads", "unit": "MiB", "p50": (peak - inputs.grad_bytes) / MiB})
    return rows


def bench_full_call(case: Case, inputs: OpInputs, loss_fn, truth) -> list[dict]:
    """One forward + backward measured three ways at once (each run costs a call of seconds on CPU).

    The allocator-level peak above the inputs (``compile_pass.memory``) and, from
    it, the working set beyond the inputs' gradients; on CPU (Linux) the peak
    resident set of the same call (``harness.rss_region``, which then also holds the
    profiler's own event buffers, well under 1 MiB here); with ``truth`` the
    errors of that call's loss and gradients against fp64.
    """
    held: dict = {}

    def run(_):
        with harness.PeakMemory(case.device) as mem:
            loss = loss_fn()
            loss.backward()
        held["mem"], held["loss"] = mem, loss.detach()

    inputs.zero_grad()
    harness.release_memory(case.device)
    rss = harness.rss_region(run, None) if case.device.type == "cpu" else run(None)
    peak = held["mem"].peak_bytes
    rows = [{"metric": "peak", "unit": "MiB", "p50": peak / MiB},
            {"metric": "beyond_grads", "unit": "MiB", "p50": (peak - inputs.grad_bytes) / MiB}]
    if rss is not None:
        rows.append({"metric": "rss_peak", "unit": "MiB", "p50": rss / MiB})
    if truth is not None:
        rows += _errors(held["loss"], inputs, truth() if callable(truth) else truth)
    return rows


def bench_error(case: Case, inputs: OpInputs, loss_fn, truth) -> list[dict]:
    inputs.zero_grad()
    loss = loss_fn()
    loss.backward()
    rows = _errors(loss, inputs, truth)
    inputs.zero_grad()
    return rows


def _errors(loss: torch.Tensor, inputs: OpInputs, truth) -> list[dict]:
    rows = []
    for metric, ours, exact in (("loss_err", loss, truth[0]), ("grad_hidden_err", inputs.hidden.grad, truth[1]),
                                ("grad_weight_err", inputs.weight.grad, truth[2])):
        err = (ours.detach().double() - exact).abs().max().item()
        rows.append({"metric": metric, "unit": "abs", "p50": err,
                     "relative": err / max(exact.abs().max().item(), 1e-30)})
    return rows


def _message(e: BaseException) -> str:
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def run_impl(case: Case, inputs: OpInputs, impl: Impl, args: argparse.Namespace, truth,
             emit=lambda row: None) -> list[dict]:
    """Every requested run of one provider on one case, in this process; rows as dicts.

    A provider of others that cannot run here is one ``skipped`` row; ours are never
    skipped: a set-up that raises is a ``failed`` row. ``emit`` gets each row as made.
    """
    base = {**case.describe(), "impl": impl.name}
    rows: list[dict] = []

    def add(row: dict) -> None:
        row = {c: row.get(c, "") for c in COLUMNS}
        rows.append(row)
        emit(row)

    problem = impl.why_not(case.device, inputs)
    if not problem:
        try:
            loss_fn = impl.build(inputs)
            note = impl.note(inputs)
        except Exception as e:  # noqa: BLE001 - a peer that imports but cannot be set up
            if args.verbose:
                traceback.print_exc()
            if impl.ours:  # something of ours is missing or broken: a failure, never a skip
                print(f"  {impl.name}: set-up failed: {_message(e)}", flush=True)
                add({**base, "run": "-", "mode": "-", "metric": "failed", "note": f"set-up failed: {_message(e)}"})
                return rows
            problem = f"set-up failed: {_message(e)}"
    if problem:
        print(f"  skip {impl.name}: {problem}", flush=True)
        add({**base, "run": "-", "mode": "-", "metric": "skipped", "note": problem})
        return rows
    warmed = False
    jobs = [(run, mode) for run in args.runs for mode in (("full",) if run == "error" else args.modes)]
    full_call = "memory" in args.runs and "full" in args.modes  # measures the errors too
    truth = truth if impl.computes_loss else None  # a floor computes no loss
    for run, mode in jobs:
        if run == "error" and (truth is None or full_call):
            continue
        try:
            if run == "speed":
                out = bench_speed(case, inputs, loss_fn, mode, 0 if warmed else args.warmup, args.reps)
            elif run == "memory" and mode == "full":
                if not warmed:  # compile first: the resident set must not count the compiler
                    _run("full", loss_fn)(_prepare("full", inputs, loss_fn)())
                out = bench_full_call(case, inputs, loss_fn, truth if "error" in args.runs else None)
            elif run == "memory":
                out = bench_memory(case, inputs, loss_fn, mode, 0 if warmed else 1)
            else:
                out = bench_error(case, inputs, loss_fn, truth() if callable(truth) else truth)
            warmed = True
        except Exception as e:  # noqa: BLE001 - an OOM or a broken peer must not end the sweep
            print(f"  {impl.name} {run} {mode}: {_message(e)}", flush=True)
            if args.verbose:
                traceback.print_exc()
            out = [{"metric": "failed", "note": _message(e)}]
        for r in out:
            add({**base, "run": run, "mode": mode, **r, "note": r.get("note", note)})
        inputs.zero_grad()
        harness.release_memory(case.device)
        if out[0]["metric"] == "failed":
            break  # the next runs would fail the same way (and compile again first)
    print(f"  done {impl.name}", flush=True)
    return rows


def run_case(case: Case, impls: list[Impl], args: argparse.Namespace) -> list[dict]:
    """Every provider on one case: in this process, or each in a fresh one (``--isolate``)."""
    if args.isolate:
        return _run_case_isolated(case, impls, args)
    inputs = setup(case)
    truth = reference(inputs) if "error" in args.runs else None
    rows = []
    with dynamo_limits():
        for impl in impls:
            rows += run_impl(case, inputs, impl, args, truth)
            harness.release_memory(case.device)
    return rows


def _child_args(case: Case, impl: str, args: argparse.Namespace, truth: str | None) -> list[str]:
    return ["-m", "benchmarks.bench_op", "--device", str(case.device), "--shapes", case.shape,
            "--tokens", str(case.tokens), "--dtype", next(k for k, v in DTYPES.items() if v == case.dtype),
            "--logits-dtype", "fp32" if case.logits_dtype is not None else "same",
            "--chunk-size", str(case.chunk_size or "auto"), "--impls", impl,
            "--modes", *args.modes, "--runs", *args.runs, "--warmup", str(args.warmup),
            "--reps", str(args.reps), *(["--reference-file", truth] if truth else []),
            *(["--verbose"] if args.verbose else [])]


def _run_case_isolated(case: Case, impls: list[Impl], args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        truth_path = None
        if "error" in args.runs:
            truth_path = os.path.join(tmp, "reference.pt")
            torch.save(reference(setup(case)), truth_path)
            harness.release_memory(case.device)
        for impl in impls:
            child = isolate.run(_child_args(case, impl.name, args, truth_path), timeout=args.run_timeout)
            rows += child.records
            if not child.ok:  # killed (out of memory), timed out or crashed: say so, never drop it silently
                rows.append({c: "" for c in COLUMNS} | {**case.describe(), "impl": impl.name, "run": "-",
                                                        "mode": "-", "metric": "failed",
                                                        "note": f"child process ended ({child.status}) "
                                                                f"after {len(child.records)} rows"})
    return rows


COLUMNS = ("run", "metric", "unit", "impl", "mode", "shape", "tokens", "hidden", "vocab", "dtype",
           "logits_dtype", "chunk_size", "device", "p20", "p50", "p80", "relative", "note")




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.argument_parser(__doc__)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=None,
                   help="default: llama3-8b on an accelerator, cpu-tiny on cpu")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="N values; default 8192 16384 on an accelerator, 1024 4096 on cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on an accelerator, fp32 on cpu")
    p.add_argument("--logits-dtype", choices=("same", "fp32"), default="same",
                   help="fp32: upcast the logits before the loss (HF's logits.float())")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--chunk-size", nargs="+", default=["auto"],
                   help="tokens per chunk, one case each ('auto': each provider's own choice)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first; default 3 (cpu 1)")
    p.add_argument("--reps", type=int, default=None, help="timed calls; default 10 (cpu 3)")
    p.add_argument("--isolate", action="store_true", help="a fresh process per (case, provider)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per isolated provider")
    p.add_argument("--csv", default=None, help="write the rows here")
    p.add_argument("--append", action="store_true", help="append to --csv instead of overwriting")
    p.add_argument("--verbose", action="store_true", help="tracebacks of failed measurements")
    isolate.add_result_argument(p)  # child -> parent
    p.add_argument("--reference-file", default=None, help=argparse.SUPPRESS)  # parent -> child
    args = p.parse_args(argv)
    args.device = torch.device(args.device) if args.device else harness.default_device()
    cpu = args.device.type == "cpu"
    args.shapes = args.shapes or (["cpu-tiny"] if cpu else ["llama3-8b"])
    args.tokens = args.tokens or ([1024, 4096] if cpu else [8192, 16384])
    args.dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.reps = args.reps if args.reps is not None else (3 if cpu else 10)
    try:
        args.chunk_size = [None if c == "auto" else int(c) for c in args.chunk_size]
    except ValueError:
        p.error(f"--chunk-size takes positive ints or 'auto', got {args.chunk_size}")
    if args.result_json:
        args.isolate = False  # the child runs its one provider here
    return args


def _child_main(args: argparse.Namespace) -> int:
    """One (case, provider) for an ``--isolate`` parent: each row reported as it is made."""
    logits_dtype = torch.float32 if args.logits_dtype == "fp32" else None
    case = Case(args.shapes[0], args.tokens[0], args.dtype, logits_dtype, args.chunk_size[0], args.device)
    inputs = setup(case)
    truth = None
    if "error" in args.runs:
        truth = (lambda: torch.load(args.reference_file)) if args.reference_file else reference(inputs)
    with dynamo_limits():
        run_impl(case, inputs, IMPLS[args.impls[0]], args, truth, emit=isolate.Reporter(args.result_json).record)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.result_json:
        return _child_main(args)
    harness.print_environment(args.device)
    logits_dtype = torch.float32 if args.logits_dtype == "fp32" else None
    impls = [IMPLS[name] for name in args.impls]
    rows = []
    for shape in args.shapes:
        for tokens in args.tokens:
            for chunk_size in args.chunk_size:
                case = Case(shape, tokens, args.dtype, logits_dtype, chunk_size, args.device)
                print(f"case {case.describe()}", flush=True)
                case_rows = run_case(case, impls, args)
                report(case_rows)  # per case, so a run cut short still shows what it measured
                if args.csv:  # likewise on disk
                    harness.write_csv(case_rows, args.csv, append=args.append or bool(rows))
                rows += case_rows
                harness.release_memory(args.device)
    if args.csv:
        print(f"\nwrote {len(rows)} rows to {args.csv}")
    return exit_status(rows, lambda r: f"{r['impl']} {r['run']} {r['mode']}: {r['note']}")


if __name__ == "__main__":
    sys.exit(main())
