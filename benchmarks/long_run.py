"""The example's model trained for hundreds of steps by chunkce, Inductor and eager, side by side.

    python -m benchmarks.long_run --dtype fp32 --steps 500 --out benchmarks/results/long_run_fp32.json
    python -m benchmarks.long_run --dtype bf16 --minutes 30 --hidden-size 128 \
        --out benchmarks/results/long_run_bf16.json        # as many steps as fit, at least --min-steps
    python -m benchmarks.long_run --report benchmarks/results/long_run_fp32.json \
        benchmarks/results/long_run_bf16.json               # the plot and the docs table from the files

The model is ``examples/train_compiled.py``'s (Llama, 2 layers, hidden 256, vocabulary 32000,
8 x 256 tokens a step, AdamW at lr 1e-3) on its corpus (:mod:`benchmarks.training_text`). The
three backends (``torch.compile(model, backend="chunkce")``, ``torch.compile(model)``, and the
model uncompiled) start from the same weights and take the same batches, one step each in turn,
so a time budget (``--minutes``) stops all three after the same step. Every ``--eval-every``
steps and after the last, each evaluates the held-out text (``model.eval()``, ``no_grad``,
through the same compiled model) and its perplexity is recorded.

Two correct implementations drift apart as their rounding differs, so the measure is chunkce's
largest loss gap to Inductor against eager's largest gap to Inductor over the same steps (the
noise floor), and the same for perplexity. A largest gap is one step's, so the report also gives
the ratio of the median gaps over all steps. The JSON (per-step losses, perplexities, seconds,
chunkce's counters) is rewritten after every evaluation, so a stopped run keeps what it did.
``--report`` prints the gaps, writes ``docs/tables/long_run_cpu.md`` and plots
``docs/img/long_run_cpu.png`` (:func:`benchmarks.plots.plot_long_run`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.training_text import load_text

BACKENDS = ("chunkce", "inductor", "eager")
REFERENCE = "inductor"
TABLE = Path("docs/tables/long_run_cpu.md")
PLOT = Path("docs/img/long_run_cpu.png")


@dataclass(frozen=True)
class Setup:
    """The example's defaults (``examples/train_compiled.py``)."""

    dtype: str = "fp32"
    hidden_size: int = 256
    intermediate_size: int = 688
    layers: int = 2
    heads: int = 4
    vocab_size: int = 32000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    seed: int = 0
    steps: int = 500
    minutes: float | None = None   # stop after the step that passes this budget (all backends)
    min_steps: int = 100           # ... but not before this step
    eval_every: int = 50
    eval_batches: int = 4          # held-out batches of batch_size x seq_len tokens


class Trainer:
    """One backend's model, optimizer and compiled forward."""

    def __init__(self, backend: str, setup: Setup, config: LlamaConfig, init_state: dict) -> None:
        self.backend, self.setup = backend, setup
        self.model = LlamaForCausalLM(config)
        self.model.load_state_dict(init_state)
        self.model.train()
        if backend == "eager":
            self.forward = self.model
        else:   # "inductor": torch.compile's default
            self.forward = torch.compile(self.model, **({} if backend == "inductor" else {"backend": backend}))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=setup.lr)
        self.seconds = 0.0

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.setup.dtype == "bf16" else contextlib.nullcontext()

    def step(self, ids: torch.Tensor) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.forward(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        value = loss.item()
        self.seconds += time.perf_counter() - start
        return value

    def perplexity(self, batches: list[torch.Tensor]) -> float:
        """exp of the mean next-token loss over ``batches`` (each the same size)."""
        self.model.eval()
        with torch.no_grad(), self._autocast():
            losses = [self.forward(input_ids=ids, labels=ids).loss.item() for ids in batches]
        self.model.train()
        return math.exp(sum(losses) / len(losses))


def run(setup: Setup, out: Path) -> dict:
    """Train every backend in turn step by step; write ``out`` after each evaluation; return the record."""
    text = load_text(setup.vocab_size)
    batches = text.train_batches(setup.steps, setup.batch_size, setup.seq_len, setup.seed)
    held_out = text.held_out_batches(setup.eval_batches, setup.batch_size, setup.seq_len)
    config = LlamaConfig(vocab_size=setup.vocab_size, hidden_size=setup.hidden_size,
                         intermediate_size=setup.intermediate_size, num_hidden_layers=setup.layers,
                         num_attention_heads=setup.heads, num_key_value_heads=setup.heads,
                         max_position_embeddings=max(setup.seq_len, 512), use_cache=False,
                         tie_word_embeddings=False, dtype=torch.float32)
    torch.manual_seed(setup.seed)
    init_state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    torch._dynamo.reset()
    counters.clear()
    trainers = [Trainer(backend, setup, config, init_state) for backend in BACKENDS]
    record = {"setup": asdict(setup), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "backends": list(BACKENDS), "losses": {b: [] for b in BACKENDS}, "eval_steps": [],
              "perplexity": {b: [] for b in BACKENDS}}
    print(f"long run: {setup}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    start = time.perf_counter()

    def evaluate(step: int) -> None:
        record["eval_steps"].append(step)
        for trainer in trainers:
            record["perplexity"][trainer.backend].append(trainer.perplexity(held_out))
        record.update(seconds={t.backend: t.seconds for t in trainers}, counters=dict(counters["chunkce"]),
                      wall_s=time.perf_counter() - start)
        out.write_text(json.dumps(record, indent=1))
        ppl = "  ".join(f"{b} {record['perplexity'][b][-1]:.3f}" for b in BACKENDS)
        print(f"step {step:>4}  held-out perplexity: {ppl}", flush=True)

    evaluate(0)
    for i, ids in enumerate(batches, 1):
        for trainer in trainers:
            record["losses"][trainer.backend].append(trainer.step(ids))
        if i % 10 == 0:
            losses = "  ".join(f"{b} {record['losses'][b][-1]:.6f}" for b in BACKENDS)
            print(f"step {i:>4}  loss: {losses}  ({time.perf_counter() - start:.0f} s)", flush=True)
        over_budget = setup.minutes is not None and time.perf_counter() - start > 60 * setup.minutes
        if i % setup.eval_every == 0 or i == len(batches) or (over_budget and i >= setup.min_steps):
            evaluate(i)
        if over_budget and i >= setup.min_steps:
            break
    return record


@dataclass(frozen=True)
class Gaps:
    """Largest gaps to the reference (Inductor) over one run's steps and evaluations."""

    dtype: str
    steps: int
    loss: dict[str, float]         # backend -> max over steps of |loss - reference's|
    perplexity: dict[str, float]   # backend -> max over evaluations of |ppl - reference's|
    median: dict[str, float]       # backend -> median over steps of |loss - reference's| (the max is one step's)

    @classmethod
    def of(cls, record: dict) -> Gaps:
        losses, ppl = record["losses"], record["perplexity"]
        steps = min(len(v) for v in losses.values())
        evals = min(len(v) for v in ppl.values())

        def gaps(series: dict, n: int, backend: str) -> list[float]:
            return [abs(a - b) for a, b in zip(series[backend][:n], series[REFERENCE][:n])]

        others = [b for b in record["backends"] if b != REFERENCE]
        return cls(record["setup"]["dtype"], steps, {b: max(gaps(losses, steps, b)) for b in others},
                   {b: max(gaps(ppl, evals, b)) for b in others},
                   {b: statistics.median(gaps(losses, steps, b)) for b in others})

    def ratio(self, which: str) -> float:
        gaps = getattr(self, which)
        if gaps["eager"] == 0:
            return 0.0 if gaps["chunkce"] == 0 else math.inf
        return gaps["chunkce"] / gaps["eager"]


def table(records: list[dict]) -> str:
    """The markdown table of each run's gaps (chunkce's and eager's, to Inductor) and their ratio."""
    lines = ["| dtype | model | steps | loss gap: chunkce | loss gap: eager | ratio | perplexity gap: chunkce "
             "| perplexity gap: eager | ratio | median loss gap: ratio | final loss (Inductor) | final perplexity (Inductor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        gaps, s = Gaps.of(record), record["setup"]
        lines.append(
            f"| {gaps.dtype} | hidden {s['hidden_size']}, {s['layers']} layers, {s['batch_size']} x {s['seq_len']} "
            f"| {gaps.steps} | {gaps.loss['chunkce']:.2e} | {gaps.loss['eager']:.2e} | {gaps.ratio('loss'):.2f} "
            f"| {gaps.perplexity['chunkce']:.2e} | {gaps.perplexity['eager']:.2e} | {gaps.ratio('perplexity'):.2f} "
            f"| {gaps.ratio('median'):.2f} | {record['losses'][REFERENCE][gaps.steps - 1]:.4f} | {record['perplexity'][REFERENCE][-1]:.2f} |")
    versions = ", ".join(sorted({f"torch {r['torch']}, {r['threads']} threads" for r in records}))
    return f"Largest gap to Inductor over the same steps ({versions}; CPU):\n\n" + "\n".join(lines) + "\n"


def report(paths: list[Path]) -> int:
    """Print the gaps of each run, write the docs table and the plot; 1 when a ratio passes 1.5."""
    from benchmarks.plots import plot_long_run
    records = [json.loads(path.read_text()) for path in paths]
    text = table(records)
    print(text)
    TABLE.write_text(text)
    plot_long_run(records, str(PLOT))
    print(f"wrote {TABLE} and {PLOT}")
    worst = max(max(Gaps.of(r).ratio("loss"), Gaps.of(r).ratio("perplexity")) for r in records)
    return 1 if worst > 1.5 else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=Setup.steps, help="at most this many steps")
    p.add_argument("--minutes", type=float, default=None, help="stop after the step that passes this budget")
    p.add_argument("--min-steps", type=int, default=Setup.min_steps)
    p.add_argument("--hidden-size", type=int, default=Setup.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: the example's 688 x hidden / 256")
    p.add_argument("--eval-every", type=int, default=Setup.eval_every)
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/long_run_<dtype>.json")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="runs' JSON files: table and plot only")
    args = p.parse_args(argv)
    if args.report:
        return report(args.report)
    intermediate = args.intermediate_size or Setup.intermediate_size * args.hidden_size // Setup.hidden_size
    setup = Setup(dtype=args.dtype, hidden_size=args.hidden_size, intermediate_size=intermediate,
                  steps=args.steps, minutes=args.minutes, min_steps=min(args.min_steps, args.steps),
                  eval_every=args.eval_every)
    out = args.out or Path(f"benchmarks/results/long_run_{args.dtype}.json")
    record = run(setup, out)
    gaps = Gaps.of(record)
    print(f"largest loss gap to inductor over {gaps.steps} steps: chunkce {gaps.loss['chunkce']:.3e}, "
          f"eager {gaps.loss['eager']:.3e} (ratio {gaps.ratio('loss'):.2f}); perplexity: chunkce "
          f"{gaps.perplexity['chunkce']:.3e}, eager {gaps.perplexity['eager']:.3e} "
          f"(ratio {gaps.ratio('perplexity'):.2f}); chunkce counters {record['counters']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
