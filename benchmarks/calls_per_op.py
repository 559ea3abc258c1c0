"""Calls per op, counted with no GPU: the op planned for a device description, at the GPU anchors.

    python -m benchmarks.calls_per_op                          # H200, the three anchors, the op's rule
    python -m benchmarks.calls_per_op --device h100 --budgets-mib 64 128 --call-us 150 10 5

For each anchor shape (N x H x V, bf16) the op's tiles are those ``tiling.choose_tiles`` picks
with a device's defaults (``tiling.default_chunk_bytes`` / ``tiling.min_full_speed_tokens`` of
``"cuda"``, or ``--budgets-mib`` / ``--min-tokens`` to try another rule), on one walk thread (an
accelerator's). The walks are counted as the op runs them (no tensor is made):

* forward (``loops.forward_walk``): every token chunk over every vocabulary block, per tile one
  projection matmul and one ``chunk_forward`` kernel call;
* backward (``loops.backward_walk`` over ``tiling.plan_backward``'s blocks, which a half-precision
  weight caps at ``V / VOCAB_BLOCKS`` when there is more than one token chunk): per tile the
  projection, one ``chunk_backward`` call, the hidden-state product (one matmul, or one per
  ``REDUCTION_COLUMNS`` columns for a full-precision head) and the weight-gradient product;
* grads-in-forward (``grads_in_forward.chunked_grads_in_forward``): whole rows, per token chunk
  the projection, ``chunk_forward`` and ``chunk_backward``, the two gradient products; its
  backward calls no kernel (it scales the saved gradients).

The host's cost of the walk is estimated as ``calls x call_us + matmuls x launch_us`` and set
against QuACK's forward + backward (17.33 ms at 4096 x 4096 x 128256 bf16 on an H200, Liger's
docstring; the other anchors scaled by their FLOPs ``N * H * V``). It is an upper bound: CUDA runs
the host ahead of the device, so host time hides behind the matmuls unless a tile's host work
outlasts its device work. The device description's SM count gives the projection's tail: its
``[n, Vb]`` output in 128 x 256 blocks over the SMs (waves, and the last wave's fill).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from compile_pass.op import loops
from compile_pass.op.tiling import (
    Tiles,
    accumulate_dtype,
    choose_tiles,
    default_chunk_bytes,
    min_full_speed_tokens,
    plan_backward,
    spans,
)

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class Device:
    """What the dry run needs of a device: its name, memory and SM count (no device is opened)."""

    name: str
    memory_bytes: int
    sms: int
    device_type: str = "cuda"


DEVICES = {
    "h100": Device("NVIDIA H100 80GB HBM3 (SXM)", 80 * GiB, 132),
    "h200": Device("NVIDIA H200 (141 GB HBM3e)", 141 * 10**9, 132),
}
ANCHORS = ((4096, 4096, 128256), (8192, 4096, 128256), (16384, 2048, 248320))  # N, H, V, bf16
QUACK_MS = 17.33  # QuACK's forward + backward, 4096 x 4096 x 128256 bf16, H200 (Liger's sm90 docstring)
QUACK_SHAPE = ANCHORS[0]
CALL_US = (85.0, 20.0, 10.0, 5.0)  # a compiled-kernel call on CPU before and after Inductor's own call (busy), targets
LAUNCH_US = 5.0  # an eager aten matmul's host cost (dispatcher + cuBLAS launch)
BLOCK = (128, 256)  # a Hopper GEMM's output block, tokens x columns


@dataclass(frozen=True)
class WalkCount:
    """Per-tile kernel calls and matmuls of one walk, and the tiles it took."""

    tiles: int
    calls: int
    matmuls: int


@dataclass(frozen=True)
class OpCount:
    """The op's walks at one shape and rule."""

    tiles: Tiles  # the forward's (and the recompute backward's before its cap)
    backward_block: int  # the backward's vocabulary block
    forward: WalkCount
    backward: WalkCount
    gif_tiles: Tiles  # the grads-in-forward op's whole rows
    gif_forward: WalkCount
    gif_backward: WalkCount

    @property
    def calls(self) -> int:
        return self.forward.calls + self.backward.calls

    @property
    def matmuls(self) -> int:
        return self.forward.matmuls + self.backward.matmuls

    @property
    def gif_calls(self) -> int:
        return self.gif_forward.calls + self.gif_backward.calls

    @property
    def gif_matmuls(self) -> int:
        return self.gif_forward.matmuls + self.gif_backward.matmuls


def _hidden_products(grad_hidden_dtype: torch.dtype, logits_dtype: torch.dtype, columns: int) -> int:
    """Matmuls of one tile's ``grad_hidden (+)= grad_logits [n, Vb] @ weight [Vb, H]``
    (``loops._add_vocabulary_products``): pieces of ``REDUCTION_COLUMNS`` for a full-precision head."""
    full_precision = grad_hidden_dtype == logits_dtype and accumulate_dtype(logits_dtype) == logits_dtype
    return len(spans(columns, loops.REDUCTION_COLUMNS)) if full_precision else 1


def count_op(num_tokens: int, vocab_size: int, dtype: torch.dtype, tiles: Tiles, gif_tiles: Tiles) -> OpCount:
    """The walks' kernel calls and matmuls for ``hidden [N, H]`` and ``weight [V, H]`` of ``dtype``
    (no bias, every gradient wanted, one walk thread) at the given tiles, as the walks run them."""
    chunks, blocks = spans(num_tokens, tiles.tokens), spans(vocab_size, tiles.vocab_block)
    forward = WalkCount(len(chunks) * len(blocks), len(chunks) * len(blocks), len(chunks) * len(blocks))
    walk = plan_backward(num_tokens, vocab_size, tiles, dtype, dtype, [True, True, False], False)
    matmuls = 0
    for start, end in walk.vocab_blocks:
        matmuls += len(walk.token_chunks) * (2 + _hidden_products(walk.grad_hidden_dtype, dtype, end - start))
    backward_tiles = len(walk.token_chunks) * len(walk.vocab_blocks)
    backward = WalkCount(backward_tiles, backward_tiles, matmuls)
    gif_chunks = spans(num_tokens, gif_tiles.tokens)
    per_chunk = 3 + _hidden_products(dtype, dtype, vocab_size) - 1  # projection, hidden product(s), weight
    gif_forward = WalkCount(len(gif_chunks), 2 * len(gif_chunks), per_chunk * len(gif_chunks))
    return OpCount(tiles, walk.vocab_blocks[0][1] if walk.vocab_blocks else 0, forward, backward,
                   gif_tiles, gif_forward, WalkCount(0, 0, 0))


def plan(num_tokens: int, vocab_size: int, dtype: torch.dtype, device: Device,
         chunk_bytes: int | None = None, min_tokens: int | None = None) -> OpCount:
    """The op's tiles and counts for a device description: the device's defaults (what the op would
    choose there), or the given budget and token floor."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    # a budget to try stands in for the default (not chunk_bytes=: that would change the whole-row rule)
    rule = {"min_tokens": min_full_speed_tokens(device.device_type) if min_tokens is None else min_tokens,
            "default_chunk_bytes": default_chunk_bytes(device.device_type) if chunk_bytes is None else chunk_bytes}
    tiles = choose_tiles(num_tokens, vocab_size, itemsize, **rule)
    gif_tiles = choose_tiles(num_tokens, vocab_size, itemsize, whole_rows=True, **rule)
    return count_op(num_tokens, vocab_size, dtype, tiles, gif_tiles)


def quack_ms(num_tokens: int, hidden: int, vocab: int) -> float:
    """QuACK's time scaled by FLOPs from its measured anchor."""
    return QUACK_MS * (num_tokens * hidden * vocab) / math.prod(QUACK_SHAPE)


def overhead_share(calls: int, matmuls: int, call_us: float, launch_us: float, reference_ms: float) -> float:
    """The host's walk cost as a share of ``reference_ms``."""
    return (calls * call_us + matmuls * launch_us) / 1e3 / reference_ms


def waves(tiles: Tiles, sms: int) -> tuple[float, float]:
    """The projection's output blocks over the SMs: waves, and the fill of the last wave."""
    blocks = math.ceil(tiles.tokens / BLOCK[0]) * math.ceil(tiles.vocab_block / BLOCK[1])
    full = math.ceil(blocks / sms)
    return blocks / sms, blocks / (full * sms)


def report(device: Device, budgets: list[int | None], min_tokens: int | None, call_us: list[float],
           launch_us: float) -> list[float]:
    """Prints the tables; returns the largest share at each of ``call_us``."""
    print(f"device: {device.name}, {device.memory_bytes / GiB:.1f} GiB, {device.sms} SMs; anchors bf16; "
          f"QuACK {QUACK_MS} ms at {' x '.join(map(str, QUACK_SHAPE))}, scaled by N*H*V; "
          f"matmul launch {launch_us:g} us")
    worst = [0.0] * len(call_us)
    for budget in budgets:
        floor = min_full_speed_tokens(device.device_type) if min_tokens is None else min_tokens
        shown = default_chunk_bytes(device.device_type) if budget is None else budget
        print(f"\nrule: budget {shown / MiB:g} MiB, token floor {floor}"
              f"{' (the op default)' if budget is None and min_tokens is None else ''}")
        shares = " | ".join(f"{us:g} us" for us in call_us)
        print(f"| N x H x V | mode | tile | bwd block | fwd calls / matmuls | bwd calls / matmuls | "
              f"waves (last fill) | QuACK ms | overhead at {shares} |")
        print("|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(call_us))
        for n, h, v in ANCHORS:
            count = plan(n, v, torch.bfloat16, device, budget, min_tokens)
            reference = quack_ms(n, h, v)
            rows = (("default", count.tiles, count.backward_block, count.forward, count.backward),
                    ("grads_in_forward", count.gif_tiles, "-", count.gif_forward, count.gif_backward))
            for mode, tiles, block, fwd, bwd in rows:
                share = [overhead_share(fwd.calls + bwd.calls, fwd.matmuls + bwd.matmuls, us, launch_us, reference)
                         for us in call_us]
                worst = [max(w, s) for w, s in zip(worst, share, strict=True)]
                wave, fill = waves(tiles, device.sms)
                print(f"| {n} x {h} x {v} | {mode} | {tiles.tokens} x {tiles.vocab_block} | {block} | "
                      f"{fwd.calls} / {fwd.matmuls} | {bwd.calls} / {bwd.matmuls} | {wave:.1f} ({fill:.0%}) | "
                      f"{reference:.2f} | " + " | ".join(f"{s:.1%}" for s in share) + " |")
    return worst


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=DEVICES, default="h200")
    p.add_argument("--budgets-mib", type=float, nargs="+", default=None,
                   help="tile budgets to try (default: the op's accelerator default)")
    p.add_argument("--min-tokens", type=int, default=None, help="token floor (default: the op's)")
    p.add_argument("--call-us", type=float, nargs="+", default=list(CALL_US),
                   help="host cost of one compiled-kernel call, us; the last is the target")
    p.add_argument("--launch-us", type=float, default=LAUNCH_US, help="host cost of one matmul launch, us")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    budgets = [None] if args.budgets_mib is None else [int(b * MiB) for b in args.budgets_mib]
    worst = report(DEVICES[args.device], budgets, args.min_tokens, args.call_us, args.launch_us)
    print("\nlargest overhead share, by the cost of a call: "
          + ", ".join(f"{us:g} us {share:.1%}" for us, share in zip(args.call_us, worst, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
