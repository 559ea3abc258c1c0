"""Measured peak memory of a region of code, in bytes, on any device (how: docs/api.md).

    with PeakMemory("cpu") as mem:
        loss = step(batch)
    mem.peak_bytes        # most bytes live at once inside the block, above what was live on entry

    loss, peak = measure_peak_bytes(step, batch)      # the same, for one call
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["PeakMemory", "measure_peak_bytes"]


def _device_module(device: torch.device) -> Any:
    """The module with allocator stats for ``device``: ``torch.accelerator`` or ``torch.<type>``."""
    acc = getattr(torch, "accelerator", None)
    if (acc is not None and hasattr(acc, "reset_peak_memory_stats")
            and acc.is_available() and acc.current_accelerator().type == device.type):
        return acc
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "max_memory_allocated"):
        raise NotImplementedError(
            f"chunkce.memory: expected a device with allocator statistics, got {device}; "
            "torch has no memory_allocated / max_memory_allocated for it")
    return module


def _index(device: torch.device, module: Any) -> int:
    if device.index is not None:
        return device.index
    return module.current_device_index() if hasattr(module, "current_device_index") else module.current_device()


class PeakMemory:
    """Context manager: the peak bytes allocated inside the block on ``device``, above the entry
    level. Sets ``peak_bytes`` (int, >= 0) and ``end_bytes`` (live on exit minus on entry) on exit.
    On CPU the block runs under ``torch.profiler``: no other profiler may be active.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self.end_bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cpu":
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _without_kineto_usdt_lines():
                self._prof.__enter__()
        else:
            self._module = _device_module(self.device)
            self._idx = _index(self.device, self._module)
            self._module.synchronize(self._idx)
            self._start = self._module.memory_allocated(self._idx)
            self._module.reset_peak_memory_stats(self._idx)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cpu":
            with _without_kineto_usdt_lines():
                self._prof.__exit__(*exc)
            self.peak_bytes, self.end_bytes = _cpu_peak(self._prof)
            del self._prof
        else:
            self._module.synchronize(self._idx)
            self.peak_bytes = max(0, self._module.max_memory_allocated(self._idx) - self._start)
            self.end_bytes = self._module.memory_allocated(self._idx) - self._start


# What Kineto's USDT_EMIT_START_TRACE / USDT_EMIT_STOP_TRACE print, e.g.
# "USDT:2026-12-01 13:51:50 29720:29720 SyncActivityProfilerHandler.cpp:52] profiler_start", and what a
# CUDA build's Kineto prints at the stop on a machine with no GPU, e.g.
# "ERROR:2026-12-06 05:47:36 11111:11111 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35"
_KINETO_USDT_LINE = re.compile(rb"^(?:USDT:[^\n]*\] profiler_(?:start|stop)|ERROR:[^\n]*DeviceProperties\.cpp:\d+\] "
                               rb"gpuGetDeviceCount failed with code \d+)\r?(?:\n|\Z)", re.MULTILINE)


@contextlib.contextmanager
def _without_kineto_usdt_lines() -> Iterator[None]:
    """Drop Kineto's ``profiler_start`` / ``profiler_stop`` (and no-GPU) lines from fd 2 inside the block
    (fd 2 points at a temporary file, copied back less those lines)."""
    if os.environ.get("KINETO_LOG_LEVEL"):
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):   # no fd 2, or sys.stderr closed / None
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = memoryview(_KINETO_USDT_LINE.sub(b"", captured.read()))
            while kept:
                kept = kept[os.write(2, kept):]


def _cpu_peak(prof: profile) -> tuple[int, int]:
    """(peak, end) of the running sum of CPU allocator events, in time order, in bytes."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()      # + on allocation, - on free
        peak = max(peak, live)
    return peak, live


def measure_peak_bytes(fn: Callable[..., Any], *args: Any,
                       device: str | torch.device | None = None, **kwargs: Any) -> tuple[Any, int]:
    """``(result, peak_bytes)`` of ``fn(*args, **kwargs)``, measured on ``device`` (default: the
    first tensor argument's, else CPU); see :class:`PeakMemory`."""
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    with PeakMemory(device) as mem:
        result = fn(*args, **kwargs)
    return result, mem.peak_bytes
