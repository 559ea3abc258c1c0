"""Op-level benchmark: linear + cross-entropy, unfused vs chunkce vs peers, side by side.

    python -m benchmarks.bench_op --device cpu --shapes cpu-tiny --tokens 1024 4096
    python -m benchmarks.bench_op --shapes llama3-8b qwen2.5-7b --tokens 8192 16384 \
        --modes full --csv op.csv                                   # on a GPU: bf16

For each shape (H, V from ``SHAPES``), token count N and implementation
(``benchmarks.impls``), three separate runs, Liger-style:

* ``speed``  - ms per call (p20 / p50 / p80 over ``--reps`` after ``--warmup``), for
  each mode: ``forward`` (with autograd recording), ``backward`` (the forward
  excluded), ``full`` (forward + backward);
* ``memory`` - peak bytes of one call above the inputs (and, for ``forward``, the
  bytes still held for backward), measured by ``compile_pass.memory``;
* ``error``  - max abs difference of the loss and both gradients from an fp64
  reference (F.linear + F.cross_entropy in fp64, chunked over tokens).

Inputs are made once per (shape, N) by :func:`setup` and shared by every implementation.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.impls import IGNORE_INDEX, IMPLS, Impl, OpInputs

MiB = harness.MiB


@dataclass(frozen=True)
class Shape:
    hidden_size: int  # H
    vocab_size: int  # V


SHAPES = {
    "llama3-8b": Shape(4096, 128256),
    "qwen2.5-7b": Shape(3584, 152064),
    "gemma-2b-like": Shape(2048, 256000),
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

    def describe(self) -> dict:
        shape = SHAPES[self.shape]
        return {"shape": self.shape, "tokens": self.tokens, "hidden": shape.hidden_size,
                "vocab": shape.vocab_size, "dtype": str(self.dtype).removeprefix("torch."),
                "logits_dtype": str(self.logits_dtype or self.dtype).removeprefix("torch."),
                "chunk_size": self.chunk_size or "auto", "device": self.device.type}


def setup(case: Case) -> OpInputs:
    """The one setup factory: hidden states, lm_head weight and targets of ``case``."""
    shape = SHAPES[case.shape]
    gen = torch.Generator(case.device).manual_seed(case.seed)
    n, h, v = case.tokens, shape.hidden_size, shape.vocab_size
    hidden = torch.randn(n, h, device=case.device, dtype=case.dtype, generator=gen)  # [N, H]
    weight = torch.randn(v, h, device=case.device, dtype=case.dtype, generator=gen) * h**-0.5  # [V, H]
    target = torch.randint(0, v, (n,), device=case.device, generator=gen)  # [N]
    ignored = torch.rand(n, device=case.device, generator=gen) < case.ignored
    target = target.masked_fill(ignored, IGNORE_INDEX)
    return OpInputs(hidden=hidden.requires_grad_(), weight=torch.nn.Parameter(weight),
                    target=target, logits_dtype=case.logits_dtype, chunk_size=case.chunk_size)


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


def bench_memory(case: Case, inputs: OpInputs, loss_fn, mode: str) -> list[dict]:
    peak, retained = harness.memory_region(_run(mode, loss_fn), _prepare(mode, inputs, loss_fn),
                                           case.device)
    rows = [{"metric": "peak", "unit": "MiB", "p50": peak / MiB}]
    if mode == "forward":  # what the forward leaves for backward (the loss's graph)
        rows.append({"metric": "retained", "unit": "MiB", "p50": retained / MiB})
    return rows


def bench_error(case: Case, inputs: OpInputs, loss_fn, truth) -> list[dict]:
    inputs.zero_grad()
    loss = loss_fn()
    loss.backward()
    rows = []
    for metric, ours, exact in (("loss_err", loss, truth[0]), ("grad_hidden_err", inputs.hidden.grad, truth[1]),
                                ("grad_weight_err", inputs.weight.grad, truth[2])):
        err = (ours.detach().double() - exact).abs().max().item()
        rows.append({"metric": metric, "unit": "abs", "p50": err,
                     "relative": err / max(exact.abs().max().item(), 1e-30)})
    inputs.zero_grad()
    return rows


def run_case(case: Case, impls: list[Impl], args: argparse.Namespace) -> list[dict]:
    inputs = setup(case)
    truth = reference(inputs) if "error" in args.runs else None
    rows = []
    for impl in impls:
        base = {**case.describe(), "impl": impl.name}
        problem = impl.problem(case.device, inputs)
        if not problem:
            try:
                loss_fn = impl.build(inputs)
            except Exception as e:  # noqa: BLE001 - a peer that imports but cannot be set up
                problem = f"set-up failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if problem:
            print(f"  skip {impl.name}: {problem}", flush=True)
            rows.append({**base, "run": "-", "mode": "-", "metric": "skipped", "note": problem})
            continue
        note = impl.note(inputs)
        jobs = [(run, mode) for run in args.runs for mode in (("full",) if run == "error" else args.modes)]
        for run, mode in jobs:
            try:
                if run == "speed":
                    out = bench_speed(case, inputs, loss_fn, mode, args.warmup, args.reps)
                elif run == "memory":
                    out = bench_memory(case, inputs, loss_fn, mode)
                else:
                    out = bench_error(case, inputs, loss_fn, truth)
            except Exception as e:  # noqa: BLE001 - an OOM or a broken peer must not end the sweep
                print(f"  {impl.name} {run} {mode}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                      flush=True)
                if args.verbose:
                    traceback.print_exc()
                out = [{"metric": "failed", "note": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}]
            for r in out:
                rows.append({**base, "run": run, "mode": mode, **r, "note": r.get("note", note)})
            inputs.zero_grad()
            harness.release_memory(case.device)
        print(f"  done {impl.name}", flush=True)
        del loss_fn
        harness.release_memory(case.device)
    return rows


COLUMNS = ("run", "metric", "unit", "impl", "mode", "shape", "tokens", "hidden", "vocab", "dtype",
           "logits_dtype", "chunk_size", "device", "p20", "p50", "p80", "relative", "note")


def report(rows: list[dict], baseline: str = "unfused-eager") -> None:
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

    tables = [("speed", "time", "speed: ms per call, median (x = vs unfused-eager)", ".1f"),
              ("memory", "peak", "memory: peak MiB above the inputs (x = vs unfused-eager)", ".1f"),
              ("memory", "retained", "memory: MiB a forward keeps for backward", ".1f"),
              ("error", "loss_err", "error vs fp64: |loss - exact|", ".2e"),
              ("error", "grad_hidden_err", "error vs fp64: max |grad_hidden - exact|", ".2e"),
              ("error", "grad_weight_err", "error vs fp64: max |grad_weight - exact|", ".2e")]
    for run, metric, title, fmt in tables:
        selected = [r for r in rows if r["run"] == run and r["metric"] in (metric, "failed")]
        if not any(r["metric"] == metric for r in selected):
            continue
        header, body = harness.pivot(selected, keys, "impl", ratio_cell(fmt),
                                     baseline=baseline if run != "error" else None)
        print(f"\n{title}\n{harness.format_table(header, body)}")
    skipped = {r["impl"]: r["note"] for r in rows if r["metric"] == "skipped"}
    notes = {r["impl"]: r["note"] for r in rows if r.get("note") and r["metric"] not in ("skipped", "failed")}
    for name, note in {**notes, **skipped}.items():
        print(f"note: {name}: {note}")


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
                   help="tokens per chunk, one case each ('auto': each impl's own choice)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first; default 3 (cpu 1)")
    p.add_argument("--reps", type=int, default=None, help="timed calls; default 10 (cpu 3)")
    p.add_argument("--csv", default=None, help="write the rows here")
    p.add_argument("--append", action="store_true", help="append to --csv instead of overwriting")
    p.add_argument("--verbose", action="store_true", help="tracebacks of failed measurements")
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
