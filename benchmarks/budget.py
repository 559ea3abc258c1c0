"""A fixed memory budget: the most tokens a training step fits under a cap, per backend, and their speed.

    python -m benchmarks.budget                      # Llama-3.2-1B's widths, two layers: Inductor, chunkce
    python -m benchmarks.budget --backends inductor-ckpt chunkce-ckpt --steps 0 --max-tokens 16384 \
        --granularity 1024 --mem-cap-gib 20               # both with activation checkpointing, memory only
    python -m benchmarks.budget --model tiny --headroom-gib 0.006 --granularity 128 --max-tokens 512 \
        --results /tmp/budget.jsonl --write /tmp/budget.md --plot /tmp/budget.png   # a check, minutes
    python -m benchmarks.budget --table-only         # table and plot again from the results

The model (``--model``): Llama-3.2-1B's published widths, vocabulary and tied head
(``benchmarks.real_models``) at ``--layers`` decoder layers, fp32, batch 1 (``tiny``:
``bench_model``'s ``cpu-micro`` at those layers). The cap is the model's parameters and AdamW's two states
plus ``--headroom-gib``. A backend ending in ``-ckpt`` checkpoints every decoder layer's activations
(transformers' ``activation_checkpointing_enable``, non-reentrant), as a user short of memory does.
Not in the table: under ``torch.compile`` of the loss, transformers' checkpointing does not lower
Inductor's peak on torch 2.13 (CPU; ``python -m benchmarks.checkpoint_peaks``), and chunkce-ckpt's
16384-token step at Llama-3.2-1B's widths measured 11804 MiB in all, as without checkpointing.
A trial is one token count in a fresh process: a first step
(compiling, making AdamW's state), then one step (forward, backward, AdamW) whose peak
above the parameters and state is measured (``compile_pass.memory``; gradients freed before
it); it fits when parameters + state + that peak is at most the cap.

Per backend, for a real model, two trials (``--calibrate``) also measure a forward + backward
without the optimizer; the search starts where the straight line through those two
meets the cap (else where ``benchmarks.predict`` expects the last fit), tries the grid point
next to the start, then doubles or halves, then bisects to one granularity between a measured
fit and a measured misfit. A trial predicted above ``--mem-cap-gib`` (the machine's share) is
not run and counts as a misfit. A trial that fits times ``--steps`` more steps in its process
(tokens/s); the largest fit's timing is the table's. Every trial is appended to ``--results``
(JSON lines) as it ends and reused by later runs
(``--redo``: measured again); the table (``--write``) and the plot (``--plot``: the trials'
memory against the cap, the largest step, tokens/s) are rebuilt from that file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable

import torch

from benchmarks import bench_model, harness, isolate, predict
from benchmarks.real_models import REAL_MODELS
from benchmarks.tables import fmt, markdown

MiB = harness.MiB
GiB = 2**30
RESULTS = "benchmarks/results/budget_cpu.jsonl"
TABLE = "docs/tables/budget_cpu.md"
PLOT = "docs/img/budget_cpu.png"
MODELS = ("llama3.2-1b", "tiny")
BACKENDS = ("inductor", "chunkce", "inductor-ckpt", "chunkce-ckpt")
CKPT = "-ckpt"


def config(model: str, layers: int, tokens: int) -> bench_model.ModelConfig:
    """The step's config at ``tokens`` tokens (batch 1)."""
    if model == "tiny":
        return dataclasses.replace(bench_model.CONFIGS["cpu-micro"], layers=layers, batch=1, seq_len=tokens)
    return bench_model.real_config(model, layers=layers, batch=1, seq_len=tokens)


def static_mib(model: str, layers: int) -> float:
    """Parameters + AdamW's two states (exp_avg, exp_avg_sq), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config(model, layers, 64).transformers_config())
    return 3 * sum(p.numel() * p.element_size() for p in built.parameters()) / MiB


def largest_fit(fits: Callable[[int], bool], start: int, granularity: int, max_tokens: int) -> int:
    """The largest multiple of ``granularity`` up to ``max_tokens`` for which ``fits`` (taken to be
    monotone: true below some size, false above) is true, 0 when none; ``fits`` is called on
    ``start`` (rounded down to the grid) first, then on its neighbour one grid point up (after a
    fit) or down (after a misfit), which settles a good start in two trials, then doubling or
    halving, then bisecting."""
    def grid(tokens: int) -> int:
        return max(granularity, min(max_tokens // granularity * granularity, tokens // granularity * granularity))

    probe = grid(start)
    low, high = 0, None  # the largest known fit (0: none), the smallest known misfit
    if fits(probe):
        low = probe
        if (neighbour := grid(low + granularity)) > low:
            low, high = (neighbour, None) if fits(neighbour) else (low, neighbour)
        while high is None and low < grid(max_tokens):
            probe = grid(2 * low)
            low, high = (probe, None) if fits(probe) else (low, probe)
        if high is None:
            return low
    else:
        high = probe
        if (neighbour := grid(high - granularity)) < high:
            low, high = (neighbour, high) if fits(neighbour) else (0, neighbour)
        while low == 0 and high > granularity:
            probe = grid(high // 2)
            low, high = (probe, high) if fits(probe) else (0, probe)
        if low == 0:
            return 0
    while high - low > granularity:
        probe = grid((low + high) // 2)
        low, high = (probe, high) if fits(probe) else (low, probe)
    return low


def line_start(points: list[tuple[int, float]], cap_mib: float, granularity: int, max_tokens: int) -> int | None:
    """The largest multiple of ``granularity`` (up to ``max_tokens``) at which the straight line
    through two measured ``(tokens, MiB in all)`` points stays within ``cap_mib``; None when the
    line does not rise (no token count is bounded by it). A forward + backward's memory is
    parameters and state, the gradients, and saved activations linear in the tokens, once the
    activations set its peak: at Llama-3.2-1B's widths, two layers, the peak at 1024 and 2048
    tokens is the gradients' (6906 and 6946 MiB measured), and a line through them starts at
    41472. What is not linear shows as a misfit at the start, and the search walks down from it."""
    (t1, m1), (t2, m2) = sorted(points)
    slope = (m2 - m1) / (t2 - t1)
    if slope <= 0:
        return None
    tokens = int(t2 + (cap_mib - m2) / slope)
    return max(granularity, min(max_tokens, tokens) // granularity * granularity)


# ---------------------------------------------------------------- one trial, in its own process


def trial(args: argparse.Namespace) -> dict:
    """Child: one step's memory at ``--trial`` tokens (with ``--fwd-bwd``, a forward + backward's
    too, without the optimizer); then, if the step fits ``--cap-mib``, ``--timed-steps`` timed
    steps (so the largest fit's speed needs no process of its own)."""
    device = torch.device("cpu")
    step_config = config(args.model, args.layers, args.trial)
    settings = argparse.Namespace(device=device, seed=0, lr=1e-4, compile="loss", chunk_size=None)
    model, ids, optimizer, loss_fn = bench_model.setup_step(step_config, args.backend.removesuffix(CKPT), settings)
    if args.backend.endswith(CKPT):
        if enable := getattr(model, "activation_checkpointing_enable", None):  # transformers >= 5.2x
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(_=None) -> None:
        loss_fn(ids).backward()
        optimizer.step()

    step()  # compiles, and makes AdamW's state
    static = bench_model.static_bytes(model, optimizer)
    peak, _ = bench_model.peak_of(optimizer, device, step)
    record = {"static_mib": static / MiB, "peak_mib": peak / MiB, "total_mib": (static + peak) / MiB,
              "sites_rewritten": torch._dynamo.utils.counters["chunkce"]["sites_rewritten"]}
    if args.fwd_bwd:
        peak_fwd_bwd, _ = bench_model.peak_of(optimizer, device, lambda: loss_fn(ids).backward())
        record["fwd_bwd_mib"] = (static + peak_fwd_bwd) / MiB
    if args.timed_steps and (args.cap_mib is None or record["total_mib"] <= args.cap_mib):
        stats = harness.time_region(step, lambda: optimizer.zero_grad(set_to_none=True), device, warmup=0,
                                    reps=args.timed_steps)
        record.update(step_ms=stats.p50, tokens_per_s=args.trial / (stats.p50 / 1e3))
    return record


# ---------------------------------------------------------------- the search


class Search:
    """The trials of one model: cached in the results file, run in fresh processes, predicted first."""

    def __init__(self, args: argparse.Namespace, records: list[dict]) -> None:
        self.args, self.records = args, records
        self.env = harness.recorded_environment()

    def _found(self, kind: str, backend: str, tokens: int, fwd_bwd: bool) -> dict | None:
        if self.args.redo:
            return None
        return next((r for r in reversed(self.records) if r["kind"] == kind and r["model"] == self.args.model
                     and r["layers"] == self.args.layers and r["backend"] == backend and r["tokens"] == tokens
                     and r["status"] != predict.OOM and (not fwd_bwd or "fwd_bwd_mib" in r)), None)

    def _append(self, record: dict) -> dict:
        harness.append_jsonl(self.args.results, record)
        self.records.append(record)
        return record

    def measure(self, kind: str, backend: str, tokens: int, cap_mib: float | None = None,
                fwd_bwd: bool = False) -> dict:
        """A trial (``kind`` "trial"; timed too when it fits ``cap_mib``, and with ``fwd_bwd`` the
        memory of a forward + backward besides) or a timing ("speed") at ``tokens``: from the file,
        or run now."""
        if (found := self._found(kind, backend, tokens, fwd_bwd)) is not None:
            return found
        base = {"kind": kind, "model": self.args.model, "layers": self.args.layers, "backend": backend,
                "tokens": tokens, "env": self.env}
        if self.args.model in REAL_MODELS:
            need = predict.step_bytes(REAL_MODELS[self.args.model], self.args.layers, tokens, backend.removesuffix(CKPT))
            if why := predict.too_big(need, self.args.mem_cap_gib):
                print(f"    {backend} {tokens} tokens: {why}", flush=True)
                return self._append({**base, "status": predict.OOM, "note": why})
        print(f"    {backend} {tokens} tokens: {kind} ...", flush=True)
        timed = self.args.steps if kind == "speed" or cap_mib is not None else 0
        child = isolate.run(["-m", "benchmarks.budget", "--model", self.args.model, "--layers", str(self.args.layers),
                             "--backend", backend, "--trial", str(tokens), "--timed-steps", str(timed),
                             *(["--cap-mib", str(cap_mib)] if cap_mib is not None else []),
                             *(["--fwd-bwd"] if fwd_bwd else [])],
                            timeout=self.args.run_timeout)
        if not child.records:
            return self._append({**base, "status": "failed", "note": f"child process ended ({child.status})"})
        record = self._append({**base, "status": "measured", **child.records[0]})
        print(f"    {backend} {tokens} tokens: {record['total_mib']:.0f} MiB in all", flush=True)
        return record

    def fits(self, backend: str, tokens: int, cap_mib: float) -> bool:
        record = self.measure("trial", backend, tokens, cap_mib=cap_mib)
        return record["status"] == "measured" and record["total_mib"] <= cap_mib

    def start(self, backend: str, cap_mib: float) -> int:
        """Where the search starts: for a real model, where the line through two small trials'
        forward + backward memory (``--calibrate``; :func:`line_start`) meets the cap, else the
        largest grid point :mod:`benchmarks.predict` expects to fit; the grid's first for the
        tiny model."""
        if self.args.model not in REAL_MODELS:
            return self.args.granularity
        points = [self.measure("trial", backend, tokens, fwd_bwd=True) for tokens in self.args.calibrate]
        if all(r["status"] == "measured" for r in points) and len(points) == 2:
            measured = line_start([(r["tokens"], r["fwd_bwd_mib"]) for r in points], cap_mib,
                                  self.args.granularity, self.args.max_tokens)
            if measured is not None:
                return measured
        model, tokens = REAL_MODELS[self.args.model], self.args.granularity
        while (tokens < self.args.max_tokens and predict.step_bytes(
                model, self.args.layers, tokens + self.args.granularity, backend.removesuffix(CKPT))
               - predict.PROCESS <= cap_mib * MiB):
            tokens += self.args.granularity
        return tokens


def cap_of(args: argparse.Namespace) -> tuple[float, float]:
    """(parameters + AdamW state, the cap) in MiB."""
    static = static_mib(args.model, args.layers)
    return static, static + args.headroom_gib * GiB / MiB


def summary(records: list[dict], model: str, layers: int, cap: float) -> list[dict]:
    """Per backend: its largest measured fit under ``cap``, that step's timing if measured, and
    ``at_least`` where no larger trial was run or predicted (the search stopped at --max-tokens)."""
    mine = [r for r in records if r["model"] == model and r["layers"] == layers and r["status"] == "measured"]
    out = []
    for backend in dict.fromkeys(r["backend"] for r in mine):
        fit = [r["tokens"] for r in mine if r["backend"] == backend and r["kind"] == "trial" and r["total_mib"] <= cap]
        best = max(fit, default=0)
        speed = next((r for r in reversed(mine) if r["backend"] == backend and r["tokens"] == best
                      and "tokens_per_s" in r), {})
        misfit = any(r["model"] == model and r["layers"] == layers and r["backend"] == backend
                     and r["kind"] == "trial" and r["tokens"] > best for r in records)  # measured or predicted
        out.append({"backend": backend, "tokens": best, "tokens_per_s": speed.get("tokens_per_s"),
                    "step_ms": speed.get("step_ms"), "at_least": bool(best) and not misfit})
    return out


def document(records: list[dict], args: argparse.Namespace, static: float, cap: float) -> str:
    mine = [r for r in records if r["model"] == args.model and r["layers"] == args.layers]
    trials = sorted((r for r in mine if r["kind"] == "trial"), key=lambda r: (r["backend"], r["tokens"]))
    rows = summary(records, args.model, args.layers, cap)
    inductor = {r["backend"]: r["tokens"] for r in rows if r["backend"].removesuffix(CKPT) == "inductor"}

    def times(r: dict) -> str:  # over Inductor's fit, checkpointed alike
        base = inductor.get("inductor" + CKPT * r["backend"].endswith(CKPT), 0)
        return f"{'>= ' * r['at_least']}{r['tokens'] / base:.2f}x" if base else ""

    best = markdown(["backend", "largest step, tokens", "x Inductor's", "step s", "tokens/s"],
                    [[r["backend"], f">= {r['tokens']}" if r["at_least"] else r["tokens"], times(r),
                      fmt(r["step_ms"] / 1e3 if r["step_ms"] else None, ".1f"),
                      fmt(r["tokens_per_s"], ".0f")] for r in rows])
    tried = markdown(["backend", "tokens", "MiB in all", "fits", "note"],
                     [[r["backend"], r["tokens"], fmt(r.get("total_mib"), ".0f"),
                       str(r["status"] == "measured" and r["total_mib"] <= cap), r.get("note", "")] for r in trials])
    return "\n\n".join([
        f"# A training step under a memory cap: {args.model}, {args.layers} layers (CPU, fp32)",
        f"Written by `python -m benchmarks.budget` from `{args.results}`: do not edit. "
        f"{harness.environment_line([r['env'] for r in mine if r.get('env')])}. Cap {cap:.0f} MiB: parameters + AdamW state ({static:.0f} MiB) + "
        f"{args.headroom_gib:g} GiB; batch 1; >= where no larger trial was run (the search's --max-tokens). "
        f"`-ckpt`: every decoder "
        f"layer's activations checkpointed (transformers' `activation_checkpointing_enable`, non-reentrant); "
        f"x Inductor's is over Inductor's fit checkpointed alike.",
        best, "Every trial (parameters + AdamW state + the step's measured peak):", tried]) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="llama3.2-1b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["inductor", "chunkce"],
                   help="-ckpt: with activation checkpointing on every decoder layer")
    p.add_argument("--headroom-gib", type=float, default=4.0, help="the cap above parameters + AdamW state")
    p.add_argument("--granularity", type=int, default=512, help="tokens are multiples of this")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--calibrate", type=int, nargs=2, default=[4096, 8192],
                   help="a real model's two trials whose line starts the search: sizes where the saved "
                        "activations, not the gradients, set a forward + backward's peak")
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps at each backend's largest fit (0: none; a later run times them)")
    p.add_argument("--mem-cap-gib", type=float, default=14.0, help="do not start a trial predicted above this")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per trial's process")
    p.add_argument("--results", default=RESULTS, help="JSON lines, appended to")
    p.add_argument("--write", default=TABLE, help="the markdown table")
    p.add_argument("--plot", default=PLOT, help="the PNG")
    p.add_argument("--redo", action="store_true", help="measure again what --results holds")
    p.add_argument("--table-only", action="store_true", help="only the table and plot from --results")
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # parent -> child
    p.add_argument("--trial", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cap-mib", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fwd-bwd", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timed-steps", type=int, default=0, help=argparse.SUPPRESS)
    isolate.add_result_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.result_json:
        isolate.Reporter(args.result_json).record(trial(args))
        return 0
    static, cap = cap_of(args)
    records = harness.read_jsonl(args.results)
    if not args.table_only:
        harness.print_environment(torch.device("cpu"))
        print(f"cap {cap:.0f} MiB: parameters + AdamW state {static:.0f} MiB + {args.headroom_gib:g} GiB", flush=True)
        search = Search(args, records)
        for backend in args.backends:
            print(f"  {backend}:", flush=True)
            best = largest_fit(lambda tokens: search.fits(backend, tokens, cap), search.start(backend, cap),
                               args.granularity, args.max_tokens)
            timed = {r["backend"]: r["tokens_per_s"] for r in summary(search.records, args.model, args.layers, cap)}
            if best and args.steps and not timed.get(backend):
                search.measure("speed", backend, best)
            print(f"  {backend}: {best} tokens fit", flush=True)
        records = search.records
    text = document(records, args, static, cap)
    os.makedirs(os.path.dirname(args.write) or ".", exist_ok=True)
    with open(args.write, "w") as f:
        f.write(text)
    print(f"\n{text}\nwrote {args.write}")
    if args.plot:
        from benchmarks.plots import plot_budget

        trials = [r for r in records if r["model"] == args.model and r["layers"] == args.layers
                  and r["kind"] == "trial" and r["status"] == "measured"]
        plot_budget(trials, summary(records, args.model, args.layers, cap), cap, args.plot,
                    title=f"{args.model} widths, {args.layers} layers, fp32, CPU: cap {cap / 1024:.1f} GiB")
        print(f"wrote {args.plot}")
    return 0 if all(r["tokens"] for r in summary(records, args.model, args.layers, cap)) else 1


if __name__ == "__main__":
    sys.exit(main())
