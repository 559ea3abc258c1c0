"""Measured peak memory of a region of code, on any device.

    with PeakMemory("cpu") as mem:
        loss = step(batch)
    mem.peak_bytes        # most bytes live at once inside the block, above what was live on entry

    loss, peak = measure_peak_bytes(step, batch)      # the same, for one call

Every number is *measured* and in bytes. How:

- Accelerators (``cuda``, ``xpu``, ``npu``, ``mps``, ...): the caching
  allocator's own counters, through ``torch.accelerator`` when the device is the
  current accelerator, else through the device's torch module
  (``getattr(torch, device.type)``). Peak = ``max_memory_allocated`` after the
  region minus ``memory_allocated`` on entry (allocated, not reserved, bytes).
- CPU: torch keeps no allocator statistics, so the region runs under
  ``torch.profiler`` with ``profile_memory=True``. c10's CPU allocator then
  reports every allocation and free (signed size, time stamp); the running sum in
  time order is the live-bytes curve and its maximum is the peak. This sees every
  tensor torch allocates on CPU, eager or from Inductor-generated code (its buffers
  come from ``empty_strided``), but not memory libraries take with their own
  ``malloc`` (oneDNN scratch, BLAS workspaces, Python objects). Limitation: a
  tensor allocated while no profiler was running and freed inside the region is
  not subtracted (the allocator never learnt its size; torch warns once), so free
  such tensors before entering (e.g. ``optimizer.zero_grad(set_to_none=True)``
  outside the region): the result is then exact, otherwise an upper bound.

  Kineto (the profiler's backend) writes ``USDT: ... profiler_start`` and
  ``... profiler_stop`` to the process's stderr on every start and stop, at its
  highest log severity, above ERROR: the only ``KINETO_LOG_LEVEL`` that hides
  them also hides Kineto's errors, for the whole process, and only when set
  before Kineto's first use. So those two lines alone are dropped from what the
  profiler's start and stop write to file descriptor 2; every other line is
  passed on. With ``KINETO_LOG_LEVEL`` set, nothing is filtered (the user chose
  what Kineto prints).
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
    """Context manager: the peak bytes allocated inside the block, above the entry level.

    Args:
        device: the device whose memory is measured (``"cpu"``, ``"cuda:0"``, ...).

    Attributes (set on exit):
        peak_bytes: most bytes live at once inside the block minus bytes live on
            entry (int, >= 0).
        end_bytes: bytes live on exit minus bytes live on entry (may be negative
            on accelerators; on CPU, frees of pre-existing tensors are not seen).

    On CPU the block runs under ``torch.profiler``, so no other profiler may be
    active and the block runs somewhat slower; do not time it.
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
# "USDT:2026-12-01 13:51:50 29720:29720 SyncActivityProfilerHandler.cpp:52] profiler_start"
_KINETO_USDT_LINE = re.compile(rb"^USDT:[^\n]*\] profiler_(?:start|stop)\r?(?:\n|\Z)", re.MULTILINE)


@contextlib.contextmanager
def _without_kineto_usdt_lines() -> Iterator[None]:
    """Drop Kineto's ``profiler_start`` / ``profiler_stop`` lines from fd 2 inside the block.

    Kineto writes them with ``std::cerr`` on the calling thread, so fd 2 is pointed
    at a temporary file for the block (the profiler's start or stop, milliseconds)
    and what landed there, less those lines, is written to the real fd 2 after it.
    """
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
    """Call ``fn(*args, **kwargs)`` and measure its peak memory.

    Args:
        fn: the code to measure.
        device: whose memory; default the device of the first tensor in ``args``,
            else CPU.

    Returns:
        ``(result, peak_bytes)``: what ``fn`` returned, and the most bytes live at
        once during the call above the bytes live before it (see :class:`PeakMemory`).
    """
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    with PeakMemory(device) as mem:
        result = fn(*args, **kwargs)
    return result, mem.peak_bytes
