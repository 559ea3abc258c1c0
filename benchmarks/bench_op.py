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
Inputs are made by :func:`setup` (the same seed in every process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.impls import IGNORE_INDEX, IMPLS, Impl, OpInputs

MiB = harness.MiB
WEIGHT_STD = 0.02  # lm_head init (Hugging Face's initializer_range), see setup()


@dataclass(frozen=True)
class Shape:
    hidden_size: int  # H
    vocab_size: int  # V


SHAPES = {
    "llama3-8b": Shape(4096, 128256),
    "qwen2.5-7b": Shape(3584, 152064),
    "gemma-2b-like": Shape(2048, 256000),
    "h2048-v128k": Shape(2048, 128256),
    "h1024-v32k": Shape(1024, 32768),
    "h256-v128k": Shape(256, 128256),
    "h128-v128k": Shape(128, 128256),
    "h256-v32k": Shape(256, 32768),
    "small": Shape(1024, 32000),
    "cpu-tiny": Shape(128, 8192),  # fp32 on 2 CPU cores in seconds
}
MODES = ("forward", "backward", "full")
RUNS = ("speed", "memory", "error")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    shape: str
    tokens: int  # N
    dtype: torch.dtype
    logits_dtype: torch.dtype | None
    chunk_size: int | None
    device: torch.device
    ignored: float = 0.05  # fraction of targets set to IGNORE_INDEX (padding, prompts)
    seed: int = 0
    dynamic: bool | None = False  # the compiled providers' torch.compile(dynamic=...)

    def describe(self) -> dict:
        shape = SHAPES[self.shape]
        return {"shape": self.shape, "tokens": self.tokens, "hidden": shape.hidden_size,
                "vocab": shape.vocab_size, "dtype": str(self.dtype).removeprefix("torch."),
                "logits_dtype": str(self.logits_dtype or self.dtype).removeprefix("torch."),
                "chunk_size": self.chunk_size or "auto", "device": self.device.type}


def setup(case: Case) -> OpInputs:
    """The one setup factory: hidden states, lm_head weight and targets of ``case``.

    Realistic scales: hidden states ~ N(0, 1) (what a final RMSNorm hands the head)
    and weight ~ N(0, 0.02^2), so the logits have std 0.02 sqrt(H) (0.64 at H 1024).
    With an unscaled ``randn`` weight the logits' std is sqrt(H) (32 at H 1024), most
    softmax probabilities and so most entries of the logits' gradient are denormal
    floats, and on x86 CPUs every provider's backward matmuls then run ~10x slower:
    an artefact of the benchmark, not a property of any provider.
    """
    shape = SHAPES[case.shape]
    gen = torch.Generator(case.device).manual_seed(case.seed)
    n, h, v = case.tokens, shape.hidden_size, shape.vocab_size
    hidden = torch.randn(n, h, device=case.device, dtype=case.dtype, generator=gen)  # [N, H]
    weight = torch.randn(v, h, device=case.device, dtype=case.dtype, generator=gen) * WEIGHT_STD  # [V, H]
    target = torch.randint(0, v, (n,), device=case.device, generator=gen)  # [N]
    ignored = torch.rand(n, device=case.device, generator=gen) < case.ignored
    target = target.masked_fill(ignored, IGNORE_INDEX)
    return OpInputs(hidden=hidden.requires_grad_(), weight=torch.nn.Parameter(weight),
                    target=target, logits_dtype=case.logits_dtype, chunk_size=case.chunk_size,
                    dynamic=case.dynamic)


def reference(inputs: OpInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 loss, grad of hidden, grad of weight: torch's unfused ops, a few hundred MiB at a time."""
    hidden = inputs.hidden.detach()
    weight = inputs.weight.detach().double().requires_grad_()  # [V, H]
    target = inputs.target
    count = (target != IGNORE_INDEX).sum().double()
    step = max(1, 2**29 // (weight.shape[0] * 8))  # tokens whose fp64 logits take 512 MiB
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grad_hidden = torch.empty_like(hidden, dtype=torch.float64)  # [N, H]
    for start in range(0, hidden.shape[0], step):
        chunk = hidden[start:start + step].double().requires_grad_()  # [n, H]
        part = F.cross_entropy(F.linear(chunk, weight), target[start:start + step],
                               ignore_index=IGNORE_INDEX, reduction="sum") / count
        part.backward()
        grad_hidden[start:start + step] = chunk.grad
        loss += part.detach()
    return loss, grad_hidden, weight.grad


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


def run_impl(case: Case, inputs: OpInputs, impl: Impl, args: argparse.Namespace, truth) -> list[dict]:
    """Every requested run of one provider on one case, in this process; rows as dicts."""
    base = {**case.describe(), "impl": impl.name}
    problem = impl.problem(case.device, inputs)
    if not problem:
        try:
            loss_fn = impl.build(inputs)
        except Exception as e:  # noqa: BLE001 - a peer that imports but cannot be set up
            problem = f"set-up failed: {_message(e)}"
    if problem:
        print(f"  skip {impl.name}: {problem}", flush=True)
        return [{**base, "run": "-", "mode": "-", "metric": "skipped", "note": problem}]
    note = impl.note(inputs)
    rows, warmed = [], False
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
            rows.append({**base, "run": run, "mode": mode, **r, "note": r.get("note", note)})
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
    for impl in impls:
        rows += run_impl(case, inputs, impl, args, truth)
        harness.release_memory(case.device)
    return rows


def _child_args(case: Case, impl: str, args: argparse.Namespace, result: str, truth: str | None) -> list[str]:
    return ["--device", str(case.device), "--shapes", case.shape, "--tokens", str(case.tokens),
            "--dtype", next(k for k, v in DTYPES.items() if v == case.dtype),
            "--logits-dtype", "fp32" if case.logits_dtype is not None else "same",
            "--chunk-size", str(case.chunk_size or "auto"), "--impls", impl,
            "--modes", *args.modes, "--runs", *args.runs, "--warmup", str(args.warmup),
            "--reps", str(args.reps), "--result-json", result,
            *(["--reference-file", truth] if truth else []), *(["--verbose"] if args.verbose else [])]


def _run_case_isolated(case: Case, impls: list[Impl], args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        truth_path = None
        if "error" in args.runs:
            truth_path = os.path.join(tmp, "reference.pt")
            torch.save(reference(setup(case)), truth_path)
            harness.release_memory(case.device)
        for impl in impls:
            result = os.path.join(tmp, f"{impl.name}.json")
            cmd = [sys.executable, "-m", "benchmarks.bench_op",
                   *_child_args(case, impl.name, args, result, truth_path)]
            try:
                proc = subprocess.run(cmd, timeout=args.run_timeout)
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                returncode = f"timeout after {args.run_timeout} s"
            if os.path.exists(result):
                with open(result) as f:
                    rows += json.load(f)
            else:  # killed (out of memory) or timed out: say so, never drop it silently
                rows.append({**case.describe(), "impl": impl.name, "run": "-", "mode": "-",
                             "metric": "failed", "note": f"child process ended ({returncode}) with no result"})
    return rows


COLUMNS = ("run", "metric", "unit", "impl", "mode", "shape", "tokens", "hidden", "vocab", "dtype",
           "logits_dtype", "chunk_size", "device", "p20", "p50", "p80", "relative", "note")


def _value(rows: list[dict], impl: str, run: str, metric: str, mode: str = "full") -> float | None:
    for r in rows:
        if r["impl"] == impl and r["run"] == run and r["metric"] == metric and r["mode"] == mode:
            return r["p50"]
    return None


def _ratio(value: float | None, base: float | None, fmt: str = ".2f") -> str:
    if value is None or not base:
        return ""
    return f"{value / base:{fmt}}x"


def summary(rows: list[dict], compiled: str = "unfused-compiled", floor: str = "floor-recompute") -> tuple[list, list]:
    """One line per provider of one case, ``full`` mode: time, memory, error, with ratios."""
    header = ["provider", "ms", "x compiled", "x floor", "peak MiB", "beyond grads MiB", "x compiled",
              "peak RSS MiB", "loss err", "grad_hidden err", "grad_weight err", "note"]
    body = []
    t_base, t_floor = _value(rows, compiled, "speed", "time"), _value(rows, floor, "speed", "time")
    w_base = _value(rows, compiled, "memory", "beyond_grads")
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        bad = [r for r in mine if r["metric"] in ("skipped", "failed")]
        if bad and not any(r["metric"] == "time" for r in mine):
            body.append([impl, bad[0]["metric"], *[""] * 9, bad[0]["note"]])
            continue
        t, peak = _value(rows, impl, "speed", "time"), _value(rows, impl, "memory", "peak")
        beyond, rss = _value(rows, impl, "memory", "beyond_grads"), _value(rows, impl, "memory", "rss_peak")
        errors = [next((v for v in (_value(rows, impl, run, m) for run in ("memory", "error")) if v is not None),
                       None) for m in ("loss_err", "grad_hidden_err", "grad_weight_err")]
        note = next((r["note"] for r in mine if r.get("note")), "")
        body.append([impl, f"{t:.1f}" if t is not None else "", _ratio(t, t_base), _ratio(t, t_floor),
                     f"{peak:.1f}" if peak is not None else "", f"{beyond:.1f}" if beyond is not None else "",
                     _ratio(beyond, w_base, ".3f"), f"{rss:.1f}" if rss is not None else "",
                     *(f"{e:.2e}" if e is not None else "-" for e in errors), note])
    return header, body


def report(rows: list[dict], baseline: str = "unfused-compiled") -> None:
    keys = ("shape", "tokens", "chunk_size", "mode")

    def ratio_cell(fmt):
        def cell(row, base):
            if row["metric"] in ("failed", "skipped"):
                return row["metric"]
            text = format(row["p50"], fmt)
            if base is not None and base.get("p50") and row is not base:
                text += f" ({row['p50'] / base['p50']:.2f}x)"
            return text
        return cell

    modes = {r["mode"] for r in rows if r["run"] == "speed"}
    if modes - {"full"}:  # per mode, when modes other than full were run
        tables = [("speed", "time", f"speed: ms per call, median (x = vs {baseline})", ".1f"),
                  ("memory", "peak", f"memory: peak MiB above the inputs (x = vs {baseline})", ".1f"),
                  ("memory", "retained", "memory: MiB a forward keeps for backward", ".1f")]
        for run, metric, title, fmt in tables:
            selected = [r for r in rows if r["run"] == run and r["metric"] in (metric, "failed")]
            if not any(r["metric"] == metric for r in selected):
                continue
            header, body = harness.pivot(selected, keys, "impl", ratio_cell(fmt), baseline=baseline)
            print(f"\n{title}\n{harness.format_table(header, body)}")
    for key in dict.fromkeys((r["shape"], r["tokens"], r["chunk_size"]) for r in rows):
        case_rows = [r for r in rows if (r["shape"], r["tokens"], r["chunk_size"]) == key]
        header, body = summary(case_rows)
        print(f"\nfull forward + backward, {key[0]} N={key[1]} chunk={key[2]} "
              f"(x compiled: vs unfused-compiled; x floor: vs floor-recompute)")
        print(harness.format_table(header, body))
    failed = [(r["impl"], r["run"], r["note"]) for r in rows if r["metric"] == "failed"]
    for impl, run, note in dict.fromkeys(failed):
        print(f"failed: {impl} {run}: {note}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
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
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # child -> parent
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
    """One (case, provider) for an ``--isolate`` parent: rows to ``--result-json``."""
    logits_dtype = torch.float32 if args.logits_dtype == "fp32" else None
    case = Case(args.shapes[0], args.tokens[0], args.dtype, logits_dtype, args.chunk_size[0], args.device)
    inputs = setup(case)
    truth = None
    if "error" in args.runs:
        truth = (lambda: torch.load(args.reference_file)) if args.reference_file else reference(inputs)
    rows = [{c: r.get(c, "") for c in COLUMNS} for r in run_impl(case, inputs, IMPLS[args.impls[0]], args, truth)]
    with open(args.result_json, "w") as f:
        json.dump(rows, f)
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
                case_rows = [{c: r.get(c, "") for c in COLUMNS} for r in run_case(case, impls, args)]
                report(case_rows)  # per case, so a run cut short still shows what it measured
                if args.csv:  # likewise on disk
                    harness.write_csv(case_rows, args.csv, append=args.append or bool(rows))
                rows += case_rows
                harness.release_memory(args.device)
    if args.csv:
        print(f"\nwrote {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
