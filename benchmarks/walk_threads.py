"""The op on its walk threads against the one-thread walk, interleaved in one process.

    python -m benchmarks.walk_threads                                  # N 2048, H 256, V 32000, 7 rounds
    python -m benchmarks.walk_threads --vocab 128256 --busy 1          # with one competing busy process

Each round times, for each walk (``CHUNKCE_WALK_THREADS`` unset: the default split; ``1``: one walk
thread), the loss's forward + backward (``linear_cross_entropy``), the loss without grad and the
row statistics without grad (``linear_statistics`` with one gathered column); the two walks
alternate call by call, so a drift of the machine moves them alike (docs/op.md, "Walk threads").
Prints each median and the split's ratio to the one thread's. Inputs: hidden states ``randn``,
weight std 0.02, fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

import compile_pass
from benchmarks import busy, harness

WALKS = {"split": None, "one thread": "1"}  # CHUNKCE_WALK_THREADS


def _timed(fn, walk_threads: str | None) -> float:
    os.environ.pop("CHUNKCE_WALK_THREADS", None)
    if walk_threads is not None:
        os.environ["CHUNKCE_WALK_THREADS"] = walk_threads
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--busy", type=int, default=0, help="competing busy processes (benchmarks/busy.py)")
    args = p.parse_args(argv)
    harness.print_environment(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen)

    def train():
        hidden.grad = weight.grad = None
        compile_pass.linear_cross_entropy(hidden, weight, target).backward()

    def loss_no_grad():
        with torch.no_grad():
            compile_pass.linear_cross_entropy(hidden, weight, target)

    def statistics_no_grad():
        with torch.no_grad():
            compile_pass.linear_statistics(hidden, weight, None, target[:, None])

    steps = {"loss forward + backward": train, "loss, no grad": loss_no_grad,
             "row statistics, no grad": statistics_no_grad}
    times = {(step, walk): [] for step in steps for walk in WALKS}
    with busy.competing(args.busy) if args.busy else contextlib.nullcontext():
        for fn in steps.values():  # compile both walks' kernels, and warm
            for walk_threads in WALKS.values():
                for _ in range(2):
                    _timed(fn, walk_threads)
        for _ in range(args.rounds):
            for step, fn in steps.items():
                for walk, walk_threads in WALKS.items():
                    times[step, walk].append(_timed(fn, walk_threads))
    os.environ.pop("CHUNKCE_WALK_THREADS", None)
    print(f"N {args.tokens} x H {args.hidden} x V {args.vocab} fp32, {torch.get_num_threads()} threads, "
          f"{args.busy} busy processes; median of {args.rounds} interleaved rounds")
    print("| step | split ms | one thread ms | split / one thread |")
    print("| --- | ---: | ---: | ---: |")
    for step in steps:
        split, one = (statistics.median(times[step, walk]) for walk in WALKS)
        print(f"| {step} | {split:.0f} | {one:.0f} | {split / one:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
