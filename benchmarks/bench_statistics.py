"""Row-statistics benchmark: ``compile_pass.linear_statistics`` against torch's unfused spelling,
forward + backward of ``selected`` (the taken token's logit) + ``lse`` + ``entropy``.

    python -m benchmarks.bench_statistics                       # N 1024, H 256, V 32000, fp32
    python -m benchmarks.bench_statistics --tokens 4096 --vocab 128256 --reps 5
    python -m benchmarks.bench_statistics --graph --tokens 2048  # an RL head compiled: Inductor and chunkce

Both read the same inputs (hidden states ``randn``, weight std 0.02): the unfused one
``F.linear`` then ``gather`` / ``logsumexp`` / ``-(softmax * log_softmax).sum(-1)``, eagerly; the op
with its default tiles. Prints ms (p20 / p50 / p80 of ``--reps`` after ``--warmup``) and the peak
bytes of one call above its inputs (``harness.memory_region``), and the ratios op / unfused.
``--graph``: the same step written as an RL policy head writes it inside a compiled function
(per-token log-probs gathered from ``log_softmax`` and an entropy bonus of the same log-probs,
:func:`rl_head`), compiled by Inductor and by chunkce in one process, and the walks chunkce's step
ran (the pass folds the gather and the entropy into one statistics walk).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.walks import counted_walks
from compile_pass import linear_statistics

MiB = harness.MiB


def unfused(hidden, weight, indices):
    logits = F.linear(hidden, weight)  # [N, V]
    log_probs = logits.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logits.gather(-1, indices).squeeze(-1), logits.logsumexp(-1), entropy


def fused(hidden, weight, indices):
    outputs = linear_statistics(hidden, weight, indices=indices)
    return outputs.selected.squeeze(-1), outputs.lse, outputs.entropy


def rl_head(hidden, weight, labels):
    """A policy-gradient head as RL code writes it: per-token log-probs of ``labels`` and an entropy bonus."""
    log_probs = F.linear(hidden, weight).float().log_softmax(-1)  # [N, V]
    token = log_probs.gather(-1, labels).squeeze(-1)  # [N]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [N]
    return -token.mean() - 0.01 * entropy.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--graph", action="store_true", help="rl_head compiled by Inductor and by chunkce")
    args = parser.parse_args()
    device = harness.default_device()
    harness.print_environment(device)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device).requires_grad_()
    indices = torch.randint(0, args.vocab, (args.tokens, 1), generator=gen).to(device)

    def prepare():
        hidden.grad = weight.grad = None

    if args.graph:
        _graph(args, hidden, weight, indices, device, prepare)
        return
    results = {}
    for name, fn in (("unfused", unfused), ("linear_statistics", fused)):
        def step(_, fn=fn):
            selected, lse, entropy = fn(hidden, weight, indices)
            (selected - lse + 0.01 * entropy).sum().backward()

        stats = harness.time_region(step, prepare, device, warmup=args.warmup, reps=args.reps)
        peak, _ = harness.memory_region(step, prepare, device, warmup=0)
        results[name] = (stats, peak)
        print(f"{name:>18}: {stats.p20:8.1f} / {stats.p50:8.1f} / {stats.p80:8.1f} ms   peak {peak / MiB:8.1f} MiB")
    (ours, ours_peak), (theirs, theirs_peak) = results["linear_statistics"], results["unfused"]
    print(f"op / unfused: time {ours.p50 / theirs.p50:.2f}x, peak {ours_peak / theirs_peak:.3f}x "
          f"(N {args.tokens}, H {args.hidden}, V {args.vocab}, {hidden.dtype}, forward + backward)")


def _graph(args, hidden, weight, indices, device, prepare) -> None:
    """:func:`rl_head`'s training step compiled by Inductor and by chunkce: ms, peak, chunkce's walks."""
    results, walks = {}, counted_walks()
    for backend in ("inductor", "chunkce"):
        compiled = torch.compile(rl_head, backend=backend, fullgraph=True)

        def step(_, compiled=compiled):
            compiled(hidden, weight, indices).backward()

        step(None)  # compiles
        walks.clear()
        stats = harness.time_region(step, prepare, device, warmup=args.warmup, reps=args.reps)
        steps = args.warmup + args.reps
        ran = ", ".join(f"{name} {count / steps:g}" for name, count in sorted(walks.items())) or "none"
        peak, _ = harness.memory_region(step, prepare, device, warmup=0)
        results[backend] = (stats, peak)
        print(f"{backend:>9}: {stats.p20:8.1f} / {stats.p50:8.1f} / {stats.p80:8.1f} ms   peak {peak / MiB:8.1f} MiB"
              f"   walks a step: {ran}")
    (ours, ours_peak), (theirs, theirs_peak) = results["chunkce"], results["inductor"]
    print(f"chunkce / Inductor: time {ours.p50 / theirs.p50:.2f}x, peak {ours_peak / theirs_peak:.3f}x "
          f"(N {args.tokens}, H {args.hidden}, V {args.vocab}, {hidden.dtype}, training step)")


if __name__ == "__main__":
    main()
