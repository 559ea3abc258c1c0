"""Accuracy of the loss and gradients over a sweep of logit magnitudes, against fp64: the table.

    python -m benchmarks.precision_sweep            # the table of docs/op.md's numerics section
    python -m benchmarks.precision_sweep --grads-in-forward
    python -m benchmarks.precision_sweep --tiles           # 128-column tiles: online log-sum-exp
    python -m benchmarks.precision_sweep --many-blocks     # V 151936 in 8-token chunks

Run from the repository root. The cases and the errors are the tests' precision oracle
(``benchmarks/precision_oracle.py``: fp32 torch and fp32 chunkce, each against the same
computation in fp64 on the same inputs); ``tests/op/test_op_precision.py`` asserts the ratio
on them. Each cell is a relative error ``||x - ref|| / ||ref||``; the last column gives
chunkce's error over torch's (1.0: as accurate as torch).
"""

from __future__ import annotations

import argparse

from benchmarks.precision_oracle import (
    BLOCK,
    CASES,
    CHUNK,
    H,
    MANY_BLOCKS,
    MANY_BLOCKS_SPREAD,
    N,
    QUANTITIES,
    V,
    case_errors,
    many_blocks_errors,
)


def sweep(grads_in_forward: bool = False, tiles: bool = False) -> list[tuple[str, list[float], list[float]]]:
    """Per case: (name, torch's errors, chunkce's errors), in ``QUANTITIES`` order."""
    return [(name, *case_errors(spread, offset, divisor, grads_in_forward, tiles))
            for name, spread, offset, divisor in CASES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grads-in-forward", action="store_true", help="chunkce's grads_in_forward op")
    parser.add_argument("--tiles", action="store_true", help=f"tiles of {BLOCK} vocabulary columns")
    parser.add_argument("--many-blocks", action="store_true", help="the MANY_BLOCKS cases (V 151936)")
    args = parser.parse_args()
    if args.many_blocks:
        rows = [(name, *many_blocks_errors(*case)) for name, *case in MANY_BLOCKS]
        print(f"fp32, logit spread {MANY_BLOCKS_SPREAD}, N H V 33 16 151936, relative error against fp64")
    else:
        rows = sweep(args.grads_in_forward, args.tiles)
        print(f"fp32, N={N} H={H} V={V}, chunk_size={CHUNK}, "
              f"{f'{BLOCK}-column tiles' if args.tiles else 'whole rows'}, relative error against fp64 "
              f"(torch | chunkce{', grads_in_forward' if args.grads_in_forward else ''})")
    header = " | ".join(f"{q} torch | {q} chunkce" for q in QUANTITIES)
    print(f"| case | {header} | chunkce / torch (loss, dh, dW, db) |")
    print("|---" * (2 + 2 * len(QUANTITIES)) + "|")
    for name, theirs, ours in rows:
        cells = " | ".join(f"{t:.1e} | {o:.1e}" for t, o in zip(theirs, ours))
        ratios = ", ".join(f"{o / t:.1f}" if t > 0 else "-" for t, o in zip(theirs, ours))
        print(f"| {name} | {cells} | {ratios} |")


if __name__ == "__main__":
    main()
