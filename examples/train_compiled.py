"""Train a small Llama on real text with torch.compile, stock Inductor vs chunkce, side by side.

    python examples/train_compiled.py                       # both backends, stdlib sources
    python examples/train_compiled.py --backend chunkce --text my.txt --steps 50

Both runs use the same seed, initial weights and batches, so their per-step losses
must agree; the script exits 1 when they do not (beyond --tol). Peak memory of one
training step (forward + backward + optimizer) is measured with compile_pass.memory
after warm-up; tokens/s is timed over the steps after it. No network is used: the
tokenizer is trained on the corpus and cached under ~/.cache/chunkce.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch
import torch._dynamo
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from compile_pass.memory import PeakMemory
from corpus import encode, load_docs, load_tokenizer, sample_batches   # examples/corpus.py

BACKENDS = ("inductor", "chunkce")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    p.add_argument("--steps", type=int, default=12, help="training steps per backend")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured one (compile)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the stdlib's *.py files)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size bound")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--compile", choices=("loss", "model"), default="loss",
                   help="compile a loss function (logits are dead, so never materialized) or the "
                        "model itself (its output keeps the logits alive)")
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    p.add_argument("--tol", type=float, default=1e-3, help="max abs per-step loss difference")
    args = p.parse_args(argv)
    if args.steps < args.warmup + 2:
        p.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2}")
    return args


@dataclass
class Run:
    """One backend's training run; bytes, seconds and tokens/s are measured, not estimated."""

    backend: str
    losses: list[float] = field(default_factory=list)
    warmup_s: float = 0.0        # the first --warmup steps, compile included
    peak_bytes: int = 0          # one step after warm-up, above the level before it
    tokens_per_s: float = 0.0    # steps after the measured one
    counters: dict = field(default_factory=dict)


def backend_problem(name: str) -> str | None:
    """Why torch.compile cannot use backend ``name`` here, or None when it can."""
    try:
        torch._dynamo.lookup_backend(name)
    except Exception as e:  # the entry point exists before its module does
        return f"{type(e).__name__}: {e}"
    return None


def train(backend: str, config: LlamaConfig, init_state: dict, batches: list[torch.Tensor],
          args: argparse.Namespace, device: torch.device) -> Run:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = LlamaForCausalLM(config).to(device)
    model.load_state_dict(init_state)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.compile == "model":
        compiled = torch.compile(model, backend=backend)
        def loss_fn(ids): return compiled(input_ids=ids, labels=ids).loss
    else:
        # HF shifts labels inside the model; loss = CE(lm_head(h)[:, :-1].float(), ids[:, 1:])
        loss_fn = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend=backend)

    def step(ids: torch.Tensor) -> float:
        loss = loss_fn(ids)
        loss.backward()
        optimizer.step()
        return loss.item()     # syncs the device, so the timing is honest; no tensor escapes

    run, timed_s, timed_tokens = Run(backend), 0.0, 0
    bar = tqdm(batches, desc=f"{backend:>8}", unit="step", dynamic_ncols=True)
    for i, ids in enumerate(bar):
        ids = ids.to(device)
        optimizer.zero_grad(set_to_none=True)   # outside the measured region: frees last grads
        start = time.perf_counter()
        if i == args.warmup:
            with PeakMemory(device) as mem:
                run.losses.append(step(ids))
            run.peak_bytes = mem.peak_bytes
        else:
            run.losses.append(step(ids))
        elapsed = time.perf_counter() - start
        if i < args.warmup:
            run.warmup_s += elapsed
        elif i > args.warmup:
            timed_s, timed_tokens = timed_s + elapsed, timed_tokens + ids.numel()
        bar.set_postfix(loss=f"{run.losses[-1]:.4f}")
    run.tokens_per_s = timed_tokens / timed_s
    run.counters = dict(torch._dynamo.utils.counters["chunkce"])   # sites found / rewritten / refused
    return run


def report(runs: list[Run], args: argparse.Namespace, tokens_per_step: int) -> int:
    """Print per-step losses and the summary table; return the exit code."""
    mib = 2**20
    print("\nper-step loss")
    print(f"{'step':>5}" + "".join(f"{r.backend:>14}" for r in runs) + ("   |diff|" if len(runs) == 2 else ""))
    for i in range(args.steps):
        row = f"{i:>5}" + "".join(f"{r.losses[i]:>14.6f}" for r in runs)
        if len(runs) == 2:
            row += f"   {abs(runs[0].losses[i] - runs[1].losses[i]):.2e}"
        print(row)

    logits_mib = tokens_per_step * args.vocab_size * 4 / mib
    print(f"\nsummary ({tokens_per_step} tokens/step, vocab {args.vocab_size}: "
          f"one fp32 logits buffer = {logits_mib:.1f} MiB)")
    print(f"{'':<32}" + "".join(f"{r.backend:>14}" for r in runs))
    print(f"{'warm-up s (compile included)':<32}" + "".join(f"{r.warmup_s:>14.1f}" for r in runs))
    print(f"{'peak step memory MiB':<32}" + "".join(f"{r.peak_bytes / mib:>14.1f}" for r in runs))
    print(f"{'tokens/s':<32}" + "".join(f"{r.tokens_per_s:>14.0f}" for r in runs))
    print(f"{'final loss':<32}" + "".join(f"{r.losses[-1]:>14.6f}" for r in runs))
    for r in runs:
        if r.counters:
            print(f"{r.backend} counters: {r.counters}")
    if len(runs) != 2:
        return 0
    base, ours = runs
    print(f"peak memory {ours.backend}/{base.backend}: {ours.peak_bytes / base.peak_bytes:.2f}x "
          f"({(base.peak_bytes - ours.peak_bytes) / mib:+.1f} MiB saved)")
    diff = max(abs(a - b) for a, b in zip(base.losses, ours.losses))
    ok = diff <= args.tol
    print(f"max |loss diff| over {args.steps} steps: {diff:.2e} (tolerance {args.tol:.0e}): "
          f"{'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    acc = getattr(torch, "accelerator", None)
    device = torch.device(args.device or (acc.current_accelerator() if acc and acc.is_available() else "cpu"))
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    for name in backends:
        if problem := backend_problem(name):
            print(f"error: backend {name!r} is not usable: {problem}", file=sys.stderr)
            return 2

    docs = load_docs(args.text, args.max_bytes)
    tokenizer = load_tokenizer(docs, args.vocab_size)
    ids = encode(tokenizer, docs)
    batches = sample_batches(ids, args.steps, args.batch_size, args.seq_len, args.seed)
    print(f"corpus: {args.text or 'python stdlib *.py'}, {sum(map(len, docs)) / 1e6:.1f} M chars, "
          f"{ids.numel() / 1e6:.2f} M tokens, tokenizer vocab {tokenizer.get_vocab_size()}")

    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=max(args.seq_len, 512), use_cache=False,
                         tie_word_embeddings=False, dtype=torch.float32)
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    n_params = sum(v.numel() for v in init_state.values())
    print(f"model: Llama, {args.layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
          f"{n_params / 1e6:.1f} M params, fp32, {device}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; compiling the {args.compile}")

    runs = [train(name, config, init_state, batches, args, device) for name in backends]
    return report(runs, args, args.batch_size * args.seq_len)


if __name__ == "__main__":
    sys.exit(main())
