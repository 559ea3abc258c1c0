"""What the benchmarks measure with and record: time, peak memory, environment, CSV.

    stats = time_region(run, prepare, device, warmup=3, reps=10)   # ms: p20 / p50 / p80
    peak, retained = memory_region(run, prepare, device)          # bytes, measured
    rss = rss_region(run, prepare)                                # bytes of resident memory, Linux
    write_csv(rows, "out.csv")                                    # tables: benchmarks.tables
    append_jsonl("r.jsonl", record); read_jsonl("r.jsonl")        # resumable results

``prepare`` runs before each timed or measured call and is never counted (it zeroes
gradients, or runs the forward whose backward is measured); ``run`` gets what it
returned. Memory comes from :class:`compile_pass.memory.PeakMemory`: allocator
statistics on accelerators, profiler allocation events on CPU; :func:`rss_region`
adds the process's peak resident set (Linux), which also sees what libraries
allocate outside torch.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_pass.memory import PeakMemory

MiB = 2**20

# Kineto (under the CPU memory measurement) prints two lines per profiler start/stop;
# read when the profiler first starts, so setting it at import is early enough.
os.environ.setdefault("KINETO_LOG_LEVEL", "99")


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: the first paragraph of ``doc`` as its description, and ``--device``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    return parser


def default_device() -> torch.device:
    """The current accelerator when there is one, else CPU."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return torch.device(acc.current_accelerator().type)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def release_memory(device: torch.device) -> None:
    """Collect garbage and hand cached blocks back, so one implementation's cache never
    pads the next one's footprint (the numbers are allocated bytes either way)."""
    gc.collect()
    if device.type != "cpu":
        synchronize(device)
        getattr(torch, device.type).empty_cache()


@dataclass(frozen=True)
class Stats:
    """Quantiles of repeated measurements (Liger's y_20 / y_50 / y_80)."""

    p20: float
    p50: float
    p80: float

    @staticmethod
    def of(samples: Sequence[float]) -> Stats:
        if len(samples) == 1:
            return Stats(samples[0], samples[0], samples[0])
        q = statistics.quantiles(samples, n=10, method="inclusive")  # deciles
        return Stats(q[1], statistics.median(samples), q[7])


def time_region(run: Callable[[Any], Any], prepare: Callable[[], Any] | None,
                device: torch.device, *, warmup: int, reps: int) -> Stats:
    """Milliseconds per ``run(prepare())``, ``prepare`` excluded; ``warmup`` untimed calls first.

    CUDA: events around each call; elsewhere the wall clock between two device
    synchronizations.
    """
    prepare = prepare or (lambda: None)
    for _ in range(warmup):
        run(prepare())
    synchronize(device)
    samples = []
    for _ in range(reps):
        state = prepare()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(state)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run(state)
            synchronize(device)
            samples.append((time.perf_counter() - t0) * 1e3)
        del state
    return Stats.of(samples)


def memory_region(run: Callable[[Any], Any], prepare: Callable[[], Any] | None,
                  device: torch.device, *, warmup: int = 1) -> tuple[int, int]:
    """``(peak, retained)`` bytes of one ``run(prepare())`` after ``warmup`` unmeasured calls.

    peak: most bytes live at once during the call above the level before it (the
    inputs and whatever ``prepare`` made). retained: bytes still live when it
    returned, what it returned included (for a forward: what autograd saved).
    """
    prepare = prepare or (lambda: None)
    for _ in range(warmup):
        run(prepare())
    release_memory(device)
    state = prepare()
    with PeakMemory(device) as mem:
        result = run(state)
    del result, state
    return mem.peak_bytes, mem.end_bytes


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def rss_region(run: Callable[[Any], Any], prepare: Callable[[], Any] | None) -> int | None:
    """Peak resident-set bytes of one ``run(prepare())`` above the resident set before it.

    Linux only (None elsewhere): glibc's free heap is handed back (``malloc_trim``),
    the kernel's high-water mark reset (``/proc/self/clear_refs`` = 5), then
    ``VmHWM`` after the call minus ``VmRSS`` before it. Unlike the allocator-level
    peak this sees memory taken outside torch (oneDNN / BLAS scratch, compiled
    code's own buffers); memory freed earlier but kept by the allocator's caches and
    reused inside the call is not counted, so run it in a fresh process after the
    warm-up calls. Only meaningful on CPU: device memory is not resident memory.
    """
    prepare = prepare or (lambda: None)
    state = prepare()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    except OSError:
        return None
    result = run(state)
    peak = _status_kib("VmHWM")
    del result, state
    return max(0, peak - before) * 1024


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception:  # noqa: BLE001 - absent or broken: either way not usable
        return "-"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, str]:
    """Hardware and versions, for the log and the docs."""
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cpu_threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger_kernel"),
        "cut_cross_entropy": _version("cut_cross_entropy"),
    }
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                       capture_output=True, text=True, timeout=5).stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "-"
    return env


def print_environment(device: torch.device) -> None:
    print("  ".join(f"{k}={v}" for k, v in environment(device).items()), flush=True)


def write_csv(rows: Sequence[dict[str, Any]], path: str, *, append: bool = False) -> None:
    """Rows (dicts with the same keys) to ``path``; the header only when the file is new."""
    if not rows:
        return
    fields = list(rows[0])
    new = not (append and os.path.exists(path) and os.path.getsize(path) > 0)
    with open(path, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)


RECORDED = ("device", "cpu_threads", "torch", "transformers", "commit")  # what a result record keeps


def recorded_environment() -> dict[str, str]:
    """The part of :func:`environment` a CPU result keeps beside its numbers."""
    env = environment(torch.device("cpu"))
    return {k: env[k] for k in RECORDED}


def environment_line(envs: Sequence[dict[str, str]]) -> str:
    """``"torch 2.13.0+cpu, transformers 5.24.0, <cpu> (2 threads), commit abc1234"`` of the
    results' environments (each field's distinct values, comma-separated)."""
    def values(key: str) -> str:
        return ", ".join(dict.fromkeys(str(e[key]) for e in envs if key in e)) or "-"

    return (f"torch {values('torch')}, transformers {values('transformers')}, {values('device')} "
            f"({values('cpu_threads')} threads), commit {values('commit')}")


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file, in the order written (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_jsonl(path: str, record: dict) -> None:
    """One record appended to ``path`` (its folder made), flushed as it is written."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
