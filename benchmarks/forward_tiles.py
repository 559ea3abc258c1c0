"""The op's forward under ``torch.no_grad()`` against stock Inductor, interleaved in one process.

    python -m benchmarks.forward_tiles --vocab 32000 --budgets 7 14 28 64 --threads 2
    python -m benchmarks.forward_tiles --vocab 128256 --budgets 7 --threads 1

What an evaluation step compiled with ``backend="chunkce"`` runs for the loss:
``linear_cross_entropy(hidden_states, weight, labels)`` (the projection tile by tile and
the per-tile kernel, no backward), against ``torch.compile`` of
``F.cross_entropy(F.linear(h, W).float(), y)`` (stock Inductor: one ``[N, V]`` matmul and
one fused log-softmax / nll kernel). Every tile budget (``chunk_bytes``, MiB) is its own
row; the calls alternate A/B/C... (the order reversed every other repeat), so a shared
machine's load falls on every row alike; the median of ``--reps`` is printed, with the
ratio to stock and every repeat's time. fp32 on CPU, ``N x H`` hidden states of std 1,
a weight of std 0.02, uniform labels (seed 0).

Measured on the project's 2-core CPU under other jobs' load: at 2
threads the op's time grows by about one scheduler time slice per tile (each tile is two
OpenMP parallel regions, the matmul's and the kernel's, and a region waits for its
second thread to be scheduled), so it is a function of the tile count, not of the
kernel's arithmetic; with ``--threads 1`` (no region waits for a thread) the op's forward
is below stock's. See ``docs/op.md``, "Forward without grad against stock".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from compile_pass.op import linear_cross_entropy
from compile_pass.op.tiling import MiB, resolve_tiles


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[7], help="tile budgets, MiB")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden_states = torch.randn(args.tokens, args.hidden)
    weight = torch.randn(args.vocab, args.hidden) * 0.02
    labels = torch.randint(0, args.vocab, (args.tokens,))
    stock = torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y))
    calls = {"stock (Inductor)": lambda: stock(hidden_states, weight, labels)}
    for budget in args.budgets:
        tiles = resolve_tiles(None, args.tokens, args.vocab, 4, "cpu", chunk_bytes=budget * MiB)
        count = -(-args.tokens // tiles.tokens) * -(-args.vocab // tiles.vocab_block)
        name = f"op {budget} MiB ({tiles.tokens} x {tiles.vocab_block}, {count} tiles)"
        calls[name] = (lambda b: lambda: linear_cross_entropy(hidden_states, weight, labels,
                                                              chunk_bytes=b * MiB))(budget)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():  # compile, then one warm call
            call()
            call()
        for rep in range(args.reps):
            for name in list(calls) if rep % 2 == 0 else list(calls)[::-1]:
                start = time.perf_counter()
                calls[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
    print(f"N {args.tokens}, H {args.hidden}, V {args.vocab}, fp32, CPU, {torch.get_num_threads()} threads, "
          f"median of {args.reps} interleaved")
    stock_ms = statistics.median(times["stock (Inductor)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:38s} {median:8.0f} ms  {median / stock_ms:5.2f}x  {[round(t) for t in values]}")


if __name__ == "__main__":
    main()
