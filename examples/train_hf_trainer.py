"""Hugging Face's Trainer with chunkce: compile the model before handing it to the Trainer.

    model.compile(backend="chunkce")
    Trainer(model=model, args=TrainingArguments(...), ...).train()

    python examples/train_hf_trainer.py                               # chunkce vs stock Inductor
    python examples/train_hf_trainer.py --runs chunkce chunkce-keep-logits inductor

Each run trains the same config-built Llama from the same initial weights on the same
batches (the standard library's sources, tokenized offline; gradient accumulation over
micro-batches with different numbers of valid labels), then runs the Trainer's
evaluation loop with an accuracy metric built from its logits. Per-step losses must agree
across runs (exit 1 beyond --tol). The peak memory of one training micro-step (forward +
backward) after warm-up is measured with compile_pass.memory. The table's times say what they
cover (COLUMNS): the first optimizer step and the evaluation include compiling, the later steps
do not. Runs: ``chunkce`` (no
options: the logits training steps return are lazy, never computed since the Trainer
never reads them), ``chunkce-keep-logits`` (``returned_logits="keep"``: the projection
stays for the returned logits), ``inductor`` (stock). See docs/trainers.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch._dynamo
from corpus import encode, load_docs, load_tokenizer  # examples/corpus.py
from datasets import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from compile_pass.memory import PeakMemory

RUNS = {  # name -> (backend, options)
    "chunkce": ("chunkce", None),
    "chunkce-keep-logits": ("chunkce", {"returned_logits": "keep"}),
    "inductor": ("inductor", None),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=["chunkce", "inductor"])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the stdlib's *.py files)")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size bound")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=None,
                   help="tokens per chunk of the chunkce runs (default: the op's automatic size)")
    p.add_argument("--tol", type=float, default=1e-3, help="max abs per-step loss difference")
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first compiles; a later one is measured)")
    return args


def padded_rows(ids: torch.Tensor, count: int, seq_len: int, seed: int) -> Dataset:
    """``count`` windows of the token stream, each with a random number of real tokens (the
    rest padding with label -100): micro-batches hold different numbers of valid labels, so
    the Trainer's ``num_items_in_batch`` matters. A fixed length: one graph per mode."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (count,), generator=gen)
    real = torch.randint(seq_len // 4, seq_len + 1, (count,), generator=gen)
    rows = []
    for start, length in zip(starts.tolist(), real.tolist()):
        input_ids = ids[start:start + seq_len]                       # [T]
        keep = torch.arange(seq_len) < length
        rows.append({"input_ids": input_ids.tolist(),
                     "attention_mask": keep.long().tolist(),
                     "labels": input_ids.masked_fill(~keep, -100).tolist()})
    return Dataset.from_list(rows)


def accuracy(prediction) -> dict[str, float]:
    """Next-token accuracy over the valid labels, from the evaluation loop's logits."""
    logits, labels = prediction.predictions, prediction.label_ids   # [n, T, V], [n, T]
    valid = labels[:, 1:] != -100
    return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:])[valid].mean())}


class MeasuredTrainer(Trainer):
    """The stock Trainer; one training micro-step after the first optimizer step runs under PeakMemory."""

    measure_at = 0      # the micro-step to measure (set by the caller)
    peak_bytes = 0
    _micro_steps = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step`` (forward + backward), measured once."""
        self._micro_steps += 1
        if self._micro_steps - 1 != self.measure_at:
            return super().training_step(model, inputs, num_items_in_batch)
        with PeakMemory(self.args.device) as mem:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.peak_bytes = mem.peak_bytes
        return loss


class StepTimes(TrainerCallback):
    """The wall-clock time at the start of training and at the end of each optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.times = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


@dataclass
class Result:
    """One run: per-step losses, evaluation metrics, measured peak bytes, seconds (see COLUMNS)."""

    name: str
    losses: list[float] = field(default_factory=list)
    eval_loss: float = 0.0
    eval_accuracy: float = 0.0
    peak_bytes: int = 0
    train_seconds: float = 0.0
    first_step_seconds: float = 0.0
    later_step_seconds: float = 0.0
    eval_seconds: float = 0.0
    counters: dict = field(default_factory=dict)


COLUMNS = """\
  peak MiB     memory of one training micro-step (forward + backward) above what was held before it,
               measured after the first optimizer step
  eval loss    the Trainer's evaluate() loss; eval acc: next-token accuracy from its logits
  train s      Trainer.train(), wall clock, compiling included
  1st step s   the first optimizer step: compiles the training graph (most of the time)
  step s       each later optimizer step, mean: no compiling, the steady-state cost
  eval s       Trainer.evaluate(), wall clock: compiles the evaluation graph, then runs it
  losses       the training loss of each optimizer step"""


def run(name: str, base: LlamaForCausalLM, train: Dataset, evaluation: Dataset, args: argparse.Namespace,
        output_dir: str) -> Result:
    """Train a copy of ``base`` with the Trainer, compiled as ``RUNS[name]`` says, then evaluate it."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = copy.deepcopy(base)
    backend, options = RUNS[name]
    if backend == "chunkce" and args.chunk_size is not None:
        options = {**(options or {}), "chunk_size": args.chunk_size}
    model.compile(backend=backend, options=options)   # before the Trainer: accelerate leaves it as it is
    training_args = TrainingArguments(
        output_dir=os.path.join(output_dir, name), use_cpu=not torch.accelerator.is_available(),
        report_to="none", disable_tqdm=True, save_strategy="no", seed=args.seed, learning_rate=args.lr,
        max_steps=args.steps, gradient_accumulation_steps=args.accumulation, logging_steps=1,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size)
    trainer = MeasuredTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                              compute_metrics=accuracy)
    trainer.remove_callback(PrinterCallback)   # the per-step log lines; the summary table says it all
    trainer.measure_at = args.accumulation   # the first micro-step of the second optimizer step
    steps = StepTimes()
    trainer.add_callback(steps)
    trainer.train()
    evaluated = time.perf_counter()
    metrics = trainer.evaluate()
    times = steps.times
    result = Result(name, peak_bytes=trainer.peak_bytes, train_seconds=evaluated - times[0],
                    first_step_seconds=times[1] - times[0],
                    later_step_seconds=(times[-1] - times[1]) / max(len(times) - 2, 1),
                    eval_seconds=time.perf_counter() - evaluated,
                    counters=dict(torch._dynamo.utils.counters["chunkce"]))
    result.losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h][:args.steps]
    result.eval_loss, result.eval_accuracy = metrics["eval_loss"], metrics["eval_accuracy"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    docs = load_docs(args.text, args.max_bytes)
    tokenizer = load_tokenizer(docs, args.vocab_size)
    ids = encode(tokenizer, docs)
    rows = args.steps * args.accumulation * args.batch_size
    train = padded_rows(ids, rows, args.seq_len, args.seed)
    evaluation = padded_rows(ids, args.eval_rows, args.seq_len, args.seed + 1)
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
                         intermediate_size=2 * args.hidden_size, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    torch.manual_seed(args.seed)
    base = LlamaForCausalLM(config)
    tokens = args.batch_size * args.seq_len
    print(f"Llama: {args.layers} layer(s), hidden {args.hidden_size}, vocab {config.vocab_size}; "
          f"{args.steps} steps x {args.accumulation} micro-batches of {args.batch_size} x {args.seq_len}; "
          f"logits of one micro-batch: {tokens * config.vocab_size * 4 / 2**20:.1f} MiB (fp32)")

    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, base, train, evaluation, args, args.output_dir or tmp) for name in args.runs]

    print(f"\n{'run':<20} {'peak MiB':>9} {'eval loss':>10} {'eval acc':>9} {'train s':>8} {'1st step s':>11} "
          f"{'step s':>7} {'eval s':>7}  losses")
    for r in results:
        losses = " ".join(f"{loss:.4f}" for loss in r.losses)
        print(f"{r.name:<20} {r.peak_bytes / 2**20:>9.1f} {r.eval_loss:>10.4f} {r.eval_accuracy:>9.4f} "
              f"{r.train_seconds:>8.1f} {r.first_step_seconds:>11.1f} {r.later_step_seconds:>7.2f} "
              f"{r.eval_seconds:>7.1f}  {losses}")
    print(COLUMNS)
    for r in results:
        if r.counters:
            print(f"{r.name}: counters {r.counters}")
    reference = results[0]
    worst = max((float(np.max(np.abs(np.subtract(r.losses, reference.losses)))) for r in results[1:]), default=0.0)
    print(f"max per-step loss difference vs {reference.name}: {worst:.2e} (tol {args.tol:g})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
