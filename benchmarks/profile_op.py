"""Where the chunked op's time goes: torch.profiler over one forward + backward.

    python -m benchmarks.profile_op --device cpu --shape cpu-tiny --tokens 4096 --chunk-size 256
    python -m benchmarks.profile_op --shape llama3-8b --tokens 8192 --chunk-size auto 1024 4096

Per chunk size: the op's time split into matmuls (projection, its recompute in
backward, grad_hidden, grad_weight accumulation), the Inductor-compiled per-chunk
kernels, and the rest; the matmuls' achieved FLOP/s against 4 * 2*N*H*V FLOPs;
then the top operators. Inputs come from ``benchmarks.cases.setup``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.cases import DTYPES, SHAPES, Case, setup
from benchmarks.impls import IMPLS, dynamo_limits

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_")  # leaves: aten::matmul calls aten::mm


def _time(event, device: torch.device) -> float:
    """Microseconds of an aggregated event: on the device for accelerators, else on CPU."""
    if device.type == "cpu":
        return event.cpu_time_total
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def profile_case(case: Case, impl: str, top: int) -> None:
    inputs = setup(case)
    loss_fn = IMPLS[impl].build(inputs)

    def step():
        inputs.zero_grad()
        loss_fn().backward()

    wall = harness.time_region(lambda _: step(), None, case.device, warmup=2, reps=3).p50
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        harness.synchronize(case.device)
    events = prof.key_averages()
    matmul = [e for e in events if e.key in MATMULS]
    compiled = [e for e in events if e.key.startswith("Torch-Compiled Region")]
    matmul_us = sum(_time(e, case.device) for e in matmul)
    compiled_us = sum(_time(e, case.device) for e in compiled)
    shape = SHAPES[case.shape]
    flops = 4 * 2 * case.tokens * shape.hidden_size * shape.vocab_size
    print(f"\n{impl} {case.describe()}")
    print(f"  wall (p50 of 3): {wall:.1f} ms")
    print(f"  matmuls: {matmul_us / 1e3:.1f} ms in {sum(e.count for e in matmul)} calls "
          f"({', '.join(f'{e.key} x{e.count}' for e in matmul)}); "
          f"{flops / max(matmul_us * 1e-6, 1e-9) / 1e12:.3g} TFLOP/s on 4 x 2NHV = {flops / 1e12:.3g} TFLOP")
    print(f"  compiled per-chunk kernels: {compiled_us / 1e3:.1f} ms in {sum(e.count for e in compiled)} calls")
    sort = "self_cpu_time_total" if case.device.type == "cpu" else "self_device_time_total"
    try:
        print(events.table(sort_by=sort, row_limit=top, max_name_column_width=60))
    except (AttributeError, KeyError):  # older torch: cuda_time naming
        print(events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    p.add_argument("--shape", choices=SHAPES, default=None, help="default: llama3-8b (cpu: cpu-tiny)")
    p.add_argument("--tokens", type=int, default=None, help="default: 8192 (cpu: 4096)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 (cpu: fp32)")
    p.add_argument("--logits-dtype", choices=("same", "fp32"), default="same")
    p.add_argument("--chunk-size", nargs="+", default=["auto"], help="one profile each; 'auto' = the op's")
    p.add_argument("--impl", choices=IMPLS, default="chunkce")
    p.add_argument("--top", type=int, default=12, help="rows of the operator table")
    args = p.parse_args(argv)
    args.device = torch.device(args.device) if args.device else harness.default_device()
    cpu = args.device.type == "cpu"
    args.shape = args.shape or ("cpu-tiny" if cpu else "llama3-8b")
    args.tokens = args.tokens or (4096 if cpu else 8192)
    args.dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    args.chunk_size = [None if c == "auto" else int(c) for c in args.chunk_size]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.print_environment(args.device)
    logits_dtype = torch.float32 if args.logits_dtype == "fp32" else None
    with dynamo_limits():
        for chunk_size in args.chunk_size:
            case = Case(args.shape, args.tokens, args.dtype, logits_dtype, chunk_size, args.device)
            profile_case(case, args.impl, args.top)
            harness.release_memory(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
