"""The op's units of work per tile, and its time against the tile budget (the working set).

    python -m benchmarks.tile_kernels count                 # kernels per tile, per walk (N 2048, H 256, V 32000)
    python -m benchmarks.tile_kernels curve                 # fwd + bwd time and working set against the budget
    python -m benchmarks.tile_kernels curve --shapes example-32k --reps 3
    python -m benchmarks.tile_kernels memory                # working set at the default tiles, 32k to 262k vocab
    python -m benchmarks.tile_kernels argmax                # a tile's row maximum and argmax, two spellings
    python -m benchmarks.tile_kernels calls                 # us a compiled tile kernel's call costs, above its work

``count`` runs each walk of the op once under ``torch.profiler`` (after two warm-up calls) and
divides what ran by the tiles the walk took (the per-tile kernel's runs, from
``kernel_runner.hooked_runs``). The walks: the loss's forward and backward
(``linear_cross_entropy``) and the row statistics' forward and backward (``linear_statistics``:
``lse`` and ``entropy``). Counted, per tile:

* ``matmul``: ``aten::mm`` / ``addmm`` / ``addmm_`` / ``bmm`` / ``baddbmm`` calls;
* ``inductor``: Inductor's compiled kernels, by their profiler records (CPU: Inductor's
  ``cpp.enable_kernel_profile`` record of each ``cpp_fused_*`` function; CUDA: the device kernels);
* ``other``: every other aten op that does work and calls no aten op itself (a fill, a copy, an
  add); views, ``empty`` and ``detach`` are not work;
* ``parallel``: on CPU, the parallel regions and barriers a tile waits at: one per matmul and per
  other op, plus each Inductor kernel's ``#pragma omp for`` / ``omp single`` loops (each ends at a
  barrier of its ``omp parallel`` region), read from the kernel's generated C++; none on walk
  threads (``CHUNKCE_WALK_THREADS`` above 1: a tile's ops run on its one thread), where a walk
  waits once, at its parts' join (``waits / walk``). On CUDA, ``launches``: the device kernels
  of every kind.

``curve`` times one forward + backward of ``linear_cross_entropy`` (median of ``--reps``, the
points interleaved round by round so a drift of the machine moves each alike) at each tile budget
(``--budgets-mib``) and token floor (``--floors``), the tile chosen by ``tiling.choose_tiles`` as the
op chooses it, and the working set of each point: the peak above the inputs of one call
(``compile_pass.memory``, exact) minus the two gradients (``[N, H]`` + ``[V, H]``). One process
per shape. ``memory`` prints that working set at the default tiles for ``--vocabs``. ``argmax``
times the statistics kernels' row maximum and argmax of one default tile (``[512, 1792]`` fp32, one
intra-op thread, as a walk thread runs it), each compiled by Inductor: ``kernels._maximum`` (the
first column holding the maximum, a float minimum) against the same with ``torch.argmax``.
``calls`` measures what one call of a compiled tile kernel costs as the op calls it: the
``chunk_forward`` call of a real op call on a tiny tile (``--call-shape``, one walk thread) is
captured, compiled, then replayed ``--calls`` times through ``kernel_runner.run`` (the op's path:
the graph called directly, ``kernel_runner.GraphCall``), through ``run``'s path before direct calls
(its config patch, then ``torch.compile``), through the direct call alone (Dynamo's guard check, the
graph's inputs, Inductor's own call) and the same through AOTAutograd's wrapper, through the compiled
function itself (Dynamo's and AOTAutograd's wrappers, without ``run``'s hooks and config patch), and
eagerly (``CHUNKCE_EAGER_KERNELS=1``'s path); then the direct call's parts, each alone. The kernel's
own work is the profiler's records of its generated code (CPU: ``cpp.enable_kernel_profile``'s record
around each ``cpp_fused_*`` function; CUDA: the device kernels' time), and a call's cost is the time
per call less that work. On CPU one intra-op thread (a walk thread's). The minimum and the median of
``--rounds`` rounds, each path interleaved (the minimum: the least disturbed by other processes).
Inputs: hidden states ``randn``, weight std 0.02, fp32, 5 % of targets ignored.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import compile_pass
from benchmarks import harness, isolate
from compile_pass.memory import PeakMemory
from compile_pass.op import kernel_runner, tiling

MiB = harness.MiB
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"})
NOT_WORK = frozenset(f"aten::{name}" for name in (  # no kernel: metadata, allocation, a dtype rule
    "empty", "empty_strided", "empty_like", "new_empty", "as_strided", "view", "_reshape_alias", "reshape",
    "alias", "detach", "detach_", "resolve_conj", "resolve_neg", "lift_fresh", "_unsafe_view", "set_",
    "slice", "select", "narrow", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "flatten",
    "contiguous", "to", "_to_copy", "promote_types", "result_type",
    "item", "_local_scalar_dense",  # a host read of a value already computed
))
TILE_KERNELS = frozenset({"chunk_forward", "chunk_backward", "statistics_forward", "maximum_forward",
                          "statistics_backward"})
WALKS = ("loss forward", "loss backward", "statistics forward", "statistics backward")
SHAPES = {  # tokens, hidden, vocab
    "example-32k": (2048, 256, 32000),
    "example-128k": (2048, 256, 128256),
    "large": (4096, 1024, 32768),
}


def _inputs(tokens: int, hidden: int, vocab: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(device).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[torch.rand(tokens, generator=gen) < 0.05] = -100
    return hidden_states, weight, target.to(device)


# ---- count ---------------------------------------------------------------------------------


def _walks(hidden_states, weight, target):
    """``{walk: (prepare, run)}``: ``run(prepare())`` is the walk alone."""
    indices = target.clamp(min=0).unsqueeze(1)

    def loss():
        return compile_pass.linear_cross_entropy(hidden_states, weight, target)

    def stats():
        out = compile_pass.linear_statistics(hidden_states, weight, indices=indices)
        return out.lse.sum() + 0.01 * out.entropy.sum()

    return {
        "loss forward": (lambda: None, lambda _: loss()),
        "loss backward": (loss, lambda value: value.backward()),
        "statistics forward": (lambda: None, lambda _: stats()),
        "statistics backward": (stats, lambda value: value.backward()),
    }


_OMP_LOOP = re.compile(r"#pragma omp (for|single)\b")


@functools.cache
def _omp_loops(kernel_record: str) -> int:
    """The ``omp for`` / ``omp single`` loops (each one barrier) in the generated C++ of the Inductor
    kernel whose profiler record is ``kernel_record`` (``graph_K_cpp_fused_...``); 1 if not found."""
    from torch._inductor.codecache import PyCodeCache

    name = re.sub(r"^graph_\d+_", "", kernel_record)
    for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        source = getattr(module, "__file__", None)
        text = Path(source).read_text() if source else ""
        start = text.find(f"{name} = async_compile.cpp")
        if start >= 0:
            end = text.find("\'\'\')", start)
            return max(1, len(_OMP_LOOP.findall(text[start:end])))
    return 1


@dataclass
class Count:
    """One walk's units of work (the module docstring's columns), summed over its tiles."""

    tiles: int
    matmul: int = 0
    inductor: int = 0
    other: int = 0
    parallel: int = 0  # CPU: regions and barriers; CUDA: device kernels (launches)
    others: collections.Counter = field(default_factory=collections.Counter)


def _work(event) -> bool:
    return event.name.startswith("aten::") and event.name not in NOT_WORK


def _leaves(events):
    """The aten ops that do work and call no aten op that does (the work each does is its own)."""
    def has_work(event) -> bool:
        return _work(event) or any(has_work(child) for child in event.cpu_children)

    for event in events:
        if _work(event) and not any(has_work(child) for child in event.cpu_children):
            yield event


def count_walk(prepare, run, device: torch.device) -> Count:
    """What ``run(prepare())`` ran (only ``run`` profiled), and the tiles it walked."""
    tiles = collections.Counter()

    def hook(fn_name, _variant):
        if fn_name in TILE_KERNELS:
            tiles[fn_name] += 1

    state = prepare()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with kernel_runner.hooked_runs(hook), profile(activities=activities) as prof:
        run(state)
        harness.synchronize(device)
    count = Count(tiles=sum(tiles.values()))
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    for event in events:
        if device.type == "cpu" and "cpp_fused" in event.name:  # Inductor's record around a C++ kernel
            count.inductor += 1
            count.parallel += _omp_loops(event.name)
        elif device.type != "cpu" and event.device_type == cuda and event.name.startswith("triton_"):
            count.inductor += 1  # a Triton kernel, on the device
    for event in _leaves(events):
        if event.name in MATMULS:
            count.matmul += 1
        elif event.name not in NOT_WORK:
            count.other += 1
            count.others[event.name] += 1
    if device.type == "cpu" and tiling.walk_threads("cpu") > 1:
        count.parallel = 0  # each tile on one walk thread: its ops and kernel run on one thread
    elif device.type == "cpu":
        count.parallel += count.matmul + count.other
    else:
        count.parallel = sum(1 for e in events if e.device_type == cuda)
    return count


def run_count(args) -> None:
    tokens, hidden, vocab = args.tokens, args.hidden, args.vocab
    tensors = _inputs(tokens, hidden, vocab, args.device)
    tile = tiling.resolve_tiles(None, tokens, vocab, 4, args.device.type)
    walk_threads = tiling.walk_threads(args.device.type)
    print(f"N {tokens}, H {hidden}, V {vocab}, fp32, {args.device}: tile {tile.tokens} x {tile.vocab_block}, "
          f"{torch.get_num_threads()} threads, {walk_threads} walk threads (CHUNKCE_WALK_THREADS)")
    parallel = "launches" if args.device.type == "cuda" else "regions+barriers"
    print(f"| walk | tiles | matmuls / tile | Inductor kernels / tile | other aten ops / tile | "
          f"{parallel} / tile | waits / walk | other aten ops (whole walk) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    torch._inductor.config.cpp.enable_kernel_profile = True  # a record per compiled C++ kernel
    for walk, (prepare, run) in _walks(*tensors).items():
        for _ in range(2):  # compile, and warm, under a profiler as counted: the walk then runs on this
            with profile():  # thread, whose Inductor config (enable_kernel_profile) its kernels compile with
                run(prepare())
        tensors[0].grad = tensors[1].grad = None
        count = count_walk(prepare, run, args.device)
        tensors[0].grad = tensors[1].grad = None
        per = max(count.tiles, 1)
        others = ", ".join(f"{name[6:]} x{n}" for name, n in count.others.most_common())
        waits = 1 if args.device.type == "cpu" and walk_threads > 1 else count.parallel  # the parts' join
        print(f"| {walk} | {count.tiles} | {count.matmul / per:.2f} | {count.inductor / per:.2f} | "
              f"{count.other / per:.2f} | {count.parallel / per:.2f} | {waits} | {others} |", flush=True)


# ---- curve and memory ---------------------------------------------------------------------


def _step(tensors, chunk_size: int | None, chunk_bytes: int | None):
    """One forward + backward of the loss at the given tiles (None: the op's default)."""
    hidden_states, weight, target = tensors

    def step():
        hidden_states.grad = weight.grad = None
        compile_pass.linear_cross_entropy(hidden_states, weight, target, chunk_size=chunk_size,
                                          chunk_bytes=chunk_bytes).backward()
    return step


def working_set(step, tensors) -> int:
    """Peak bytes of one ``step()`` above its inputs, less the two gradients it must hold (an earlier
    step's gradients are dropped before the measured block: freed inside it, they would count
    against the peak)."""
    hidden_states, weight, _ = tensors
    hidden_states.grad = weight.grad = None
    with PeakMemory(hidden_states.device) as mem:
        step()
    return mem.peak_bytes - (hidden_states.numel() + weight.numel()) * hidden_states.element_size()


def curve_points(args) -> None:
    """One shape's points, reported to the parent through ``--result-json`` (:func:`run_curve`)."""
    tokens, hidden, vocab = SHAPES[args.shapes[0]]
    tensors = _inputs(tokens, hidden, vocab, args.device)
    points = []
    for floor in args.floors:
        for mib in args.budgets_mib:
            budget = int(mib * MiB)
            tile = tiling.choose_tiles(tokens, vocab, 4, chunk_bytes=budget, min_tokens=floor)
            points.append(({"floor": floor, "budget_mib": mib, "tokens": tile.tokens,
                            "vocab_block": tile.vocab_block}, _step(tensors, tile.tokens, budget), []))
    points[0][1]()  # compiles the kernels (dynamic shapes: no tile size compiles again)
    for point, step, _ in points:  # one call each measured for memory, which also warms its tile
        point["working_set_mib"] = working_set(step, tensors) / MiB
    for _ in range(args.reps):
        for _, step, times in points:
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    reporter = isolate.Reporter(args.result_json)
    for point, _, times in points:
        reporter.record(point | {"ms": statistics.median(times)})


def _default_point(shape_tokens: int, vocab: int) -> tuple[int, int]:
    tile = tiling.resolve_tiles(None, shape_tokens, vocab, 4, "cpu")
    return tile.tokens, tile.vocab_block


def run_curve(args) -> None:
    print(f"default: CPU budget {tiling.DEFAULT_CHUNK_BYTES / MiB:g} MiB, token floor "
          f"{tiling.MIN_FULL_SPEED_TOKENS_CPU} (compile_pass/op/tiling.py); median of {args.reps}, "
          f"one process per shape, fwd + bwd of linear_cross_entropy, fp32")
    print("| shape (N x H x V) | floor | budget MiB | tile | ms | vs default | working set MiB |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for shape in args.shapes:
        child = isolate.run(["-m", "benchmarks.tile_kernels", "curve-points", "--shapes", shape,
                             "--budgets-mib", *map(str, args.budgets_mib), "--floors", *map(str, args.floors),
                             "--reps", str(args.reps), "--device", str(args.device)], timeout=args.timeout)
        points = child.records
        if not child.ok:
            print(f"| {shape}: {child.status} |")
        tokens, hidden, vocab = SHAPES[shape]
        default = _default_point(tokens, vocab)
        base = next((p["ms"] for p in points if (p["tokens"], p["vocab_block"]) == default), None)
        for p in points:
            ratio = f"{p['ms'] / base:.2f}x" if base else "-"
            print(f"| {tokens} x {hidden} x {vocab} | {p['floor']} | {p['budget_mib']:g} | "
                  f"{p['tokens']} x {p['vocab_block']} | {p['ms']:.1f} | {ratio} | {p['working_set_mib']:.1f} |",
                  flush=True)


def run_memory(args) -> None:
    print(f"working set of one fwd + bwd at the default tiles (peak above the inputs less the gradients), "
          f"N {args.tokens}, H {args.hidden}, fp32")
    print("| V | tile | working set MiB |")
    print("|---:|---|---:|")
    for vocab in args.vocabs:
        tensors = _inputs(args.tokens, args.hidden, vocab, args.device)
        tile = tiling.resolve_tiles(None, args.tokens, vocab, 4, args.device.type)
        step = _step(tensors, None, None)
        step()
        print(f"| {vocab} | {tile.tokens} x {tile.vocab_block} | {working_set(step, tensors) / MiB:.1f} |",
              flush=True)


def run_argmax(args) -> None:
    from compile_pass.op import kernels

    def with_torch_argmax(z, row_max, argmax):
        new_max = torch.maximum(z, row_max.unsqueeze(1)).amax(dim=-1)
        larger = (new_max > row_max) | (torch.isnan(new_max) & ~torch.isnan(row_max))
        return new_max, torch.where(larger, torch.argmax(z, dim=-1), argmax)

    def ours(z, row_max, argmax):
        return kernels._maximum(z, row_max, argmax, 0)

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(512, 1792, generator=gen) * 2
    row_max, argmax = torch.randn(512, generator=gen), torch.zeros(512, dtype=torch.int64)
    spellings = {name: torch.compile(fn, dynamic=True, options={"cpp.threads": 1})
                 for name, fn in (("torch.argmax", with_torch_argmax), ("kernels._maximum", ours))}
    times: dict[str, list[float]] = {name: [] for name in spellings}
    for kernel in spellings.values():
        kernel(z, row_max, argmax)
    for _ in range(50):  # interleaved round by round
        for name, kernel in spellings.items():
            start = time.perf_counter()
            kernel(z, row_max, argmax)
            times[name].append(time.perf_counter() - start)
    print("| row maximum and argmax of a [512, 1792] fp32 tile | ms (p50) |\n| --- | --- |")
    for name, measured in times.items():
        print(f"| {name} | {statistics.median(measured) * 1e3:.2f} |")


# ---- calls --------------------------------------------------------------------------------


def _captured_call(tokens: int, hidden: int, vocab: int, device: torch.device) -> tuple:
    """``(fn_name, variant, args)`` of the first ``chunk_forward`` call a real op call makes (one walk
    thread, default tiles), after two calls that compile it."""
    captured = []
    real_run = kernel_runner.run

    def capture(fn_name, variant, eager, *args):
        if fn_name == "chunk_forward" and not captured:
            captured.append((fn_name, variant, args))
        return real_run(fn_name, variant, eager, *args)

    hidden_states, weight, target = _inputs(tokens, hidden, vocab, device)
    kernel_runner.run = capture
    try:
        for _ in range(2):
            captured.clear()
            compile_pass.linear_cross_entropy(hidden_states.detach(), weight.detach(), target)
    finally:
        kernel_runner.run = real_run
    return captured[0]


def _kernel_work_us(call, device: torch.device, calls: int) -> float:
    """The kernel's own work per call (us): its profiler records, as the module docstring says."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        harness.synchronize(device)
    if device.type == "cuda":
        cuda = torch.autograd.DeviceType.CUDA
        total = sum(e.device_time for e in prof.events() if e.device_type == cuda)
    else:
        total = sum(e.cpu_time for e in prof.events() if "cpp_fused" in e.name)
    return total / calls


def _timed(paths: dict, rounds: int, calls: int, device: torch.device) -> dict[str, list[float]]:
    """us a call of each of ``paths``, ``rounds`` rounds of ``calls`` calls, the paths interleaved round by round."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for call in paths.values():
        call()
    for _ in range(rounds):
        for name, call in paths.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            harness.synchronize(device)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def run_calls(args) -> None:
    import os

    os.environ["CHUNKCE_WALK_THREADS"] = "1"  # the op's kernels on this thread, as on an accelerator
    if args.device.type == "cpu":
        torch.set_num_threads(1)  # a tiny tile: no parallel region to wait at (a walk thread's one thread)
    torch._inductor.config.cpp.enable_kernel_profile = True  # a record around each compiled C++ kernel
    tokens, hidden, vocab = args.call_shape
    fn_name, variant, kernel_args = _captured_call(tokens, hidden, vocab, args.device)
    below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
    compiled = kernel_runner.compiled(fn_name, variant)

    direct = kernel_runner.graph_call(fn_name, variant)
    if direct is None:
        print(f"no direct call of {fn_name}'s graph on this torch (kernel_runner.direct_calls_unavailable): its paths are left out")
    elif direct.inductor is None:
        print(f"{fn_name}'s direct call goes through AOTAutograd's wrapper (kernel_runner's debug log says why)")

    def through_run():
        kernel_runner.run(fn_name, variant, False, *kernel_args)

    def run_through_compile():  # run's path before direct calls: the config patch, Dynamo, AOTAutograd
        with kernel_runner._shape_settings(), kernel_runner.dynamo_stats_kept():
            kernel_runner._through_compile(compiled, kernel_args)

    def compiled_function():
        compiled(*kernel_runner._symbolic(list(kernel_args)))

    def eager():
        kernel_runner.run(fn_name, variant, True, *kernel_args)

    paths = {"kernel_runner.run (the op's path: the graph called directly)": through_run,
             "kernel_runner.run's path through torch.compile (config patch, Dynamo, AOTAutograd)": run_through_compile,
             "the compiled function (Dynamo + AOTAutograd wrappers)": compiled_function,
             "eager (CHUNKCE_EAGER_KERNELS=1)": eager}
    parts = {}
    if direct is not None:
        through_aot = kernel_runner.GraphCall(direct.names, direct.check, direct.reads, direct.compiled, None)
        inputs, named = direct.reads(*kernel_args), dict(zip(direct.names, kernel_args))

        paths |= {"the graph's direct call (guards, inputs, Inductor's call)": lambda: direct(kernel_args),
                  "the graph's direct call through AOTAutograd's wrapper": lambda: through_aot(kernel_args)}
        parts = {"Dynamo's guard check (its arguments by name, checked)":
                 lambda: direct.check(dict(zip(direct.names, kernel_args))),
                 "the guard check alone": lambda: direct.check(named),
                 "the graph's inputs read": lambda: direct.reads(*kernel_args),
                 "AOTAutograd's wrapper + Inductor's call (with the work)": lambda: direct.compiled(*inputs),
                 "the arguments detached, token dim unbacked (kernel_runner._symbolic)":
                 lambda: kernel_runner._symbolic(kernel_args)}
        if direct.inductor is not None:
            parts["Inductor's call (with the work)"] = lambda: direct.inductor(list(inputs))
    with below_autograd(), torch.no_grad():  # as run() calls a kernel (its guards hold the grad mode)
        times = _timed(paths, args.rounds, args.calls, args.device)
        parts = _timed(parts, args.rounds, args.calls, args.device)
    work = _kernel_work_us(through_run, args.device, args.calls)
    print(f"{fn_name} on a [{tokens}, {vocab}] fp32 tile (H {hidden}), variant {variant}; {args.calls} calls "
          f"a round, {args.rounds} rounds (min and median); the kernel's own work {work:.1f} us a call")
    print("| path | us a call, min | median | us a call above the kernel's work (min) |\n|---|---:|---:|---:|")
    for name, measured in times.items():
        above = f"{min(measured) - work:.1f}" if "eager" not in name else "-"
        print(f"| {name} | {min(measured):.1f} | {statistics.median(measured):.1f} | {above} |")
    if parts:
        print("\nthe direct call's parts, each alone:\n| part | us a call, min | median |\n|---|---:|---:|")
        for name, measured in parts.items():
            print(f"| {name} | {min(measured):.1f} | {statistics.median(measured):.1f} |")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("mode", choices=("count", "curve", "memory", "argmax", "calls", "curve-points"))
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    p.add_argument("--tokens", type=int, default=2048, help="count, memory")
    p.add_argument("--hidden", type=int, default=256, help="count, memory")
    p.add_argument("--vocab", type=int, default=32000, help="count")
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256, 262144], help="memory")
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=["example-32k", "example-128k"],
                   help="curve; large: about 11 min more on 2 idle cores")
    p.add_argument("--budgets-mib", type=float, nargs="+", default=[2, 4, 7, 16, 32], help="curve")
    p.add_argument("--floors", type=int, nargs="+", default=[256, 512, 1024], help="curve")
    p.add_argument("--reps", type=int, default=3, help="curve: timed rounds (after one call per point "
                   "measured for memory)")
    p.add_argument("--timeout", type=float, default=900, help="curve: seconds per shape's process")
    p.add_argument("--call-shape", type=int, nargs=3, default=[64, 16, 256], metavar=("N", "H", "V"),
                   help="calls: the op call whose tile is replayed (one tile at the default budget)")
    p.add_argument("--calls", type=int, default=300, help="calls: calls a round")
    p.add_argument("--rounds", type=int, default=5, help="calls: rounds")
    isolate.add_result_argument(p)
    args = p.parse_args(argv)
    args.device = torch.device(args.device) if args.device else harness.default_device()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode != "curve-points":
        harness.print_environment(args.device)
    modes = {"count": run_count, "curve": run_curve, "memory": run_memory, "argmax": run_argmax,
             "calls": run_calls, "curve-points": curve_points}
    modes[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
