"""compile_pass.memory measures what was really allocated, to the byte where torch knows."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from compile_pass.memory import PeakMemory, measure_peak_bytes

MiB = 2**20
# CPU: the profiler sees every c10 allocation, so the only slack is small bookkeeping
# tensors torch itself may allocate; accelerators round blocks up to 512 B.
TOL = 64 * 1024


def _devices():
    devices = ["cpu"]
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        devices.append(pytest.param(acc.current_accelerator().type, marks=pytest.mark.gpu))
    return devices


@pytest.mark.parametrize("device", _devices())
def test_three_live_blocks_then_freed(device):
    def fn():
        blocks = [torch.empty(4 * MiB, device=device) for _ in range(3)]   # 3 x 16 MiB fp32
        del blocks
        return torch.empty(1 * MiB, device=device)                         # 4 MiB, survives

    out, peak = measure_peak_bytes(fn, device=device)
    assert abs(peak - 48 * MiB) <= TOL, peak
    with PeakMemory(device) as mem:
        small = torch.empty(MiB // 4, device=device)                       # 1 MiB
    assert abs(mem.peak_bytes - 1 * MiB) <= TOL, mem.peak_bytes
    assert abs(mem.end_bytes - 1 * MiB) <= TOL, mem.end_bytes
    with PeakMemory(device) as mem:    # freeing 4 MiB first lowers the level: 1 MiB fits under it
        del out
        small2 = torch.empty(MiB // 4, device=device)
    assert mem.peak_bytes <= TOL, mem.peak_bytes
    assert abs(mem.end_bytes + 3 * MiB) <= TOL, mem.end_bytes
    del small, small2


@pytest.mark.parametrize("device", _devices())
def test_logits_are_counted(device):
    N, H, V = 256, 32, 4000
    hidden = torch.randn(N, H, device=device)
    weight = torch.randn(V, H, device=device)
    labels = torch.randint(0, V, (N,), device=device)

    def loss_fn(hidden, weight, labels):
        return F.cross_entropy(F.linear(hidden, weight), labels)   # logits [N, V] fp32

    loss_fn(hidden, weight, labels)             # first call: BLAS workspaces (32 MiB on CUDA) stay cached
    loss, peak = measure_peak_bytes(loss_fn, hidden, weight, labels)
    assert peak >= N * V * 4
    assert peak <= 3 * N * V * 4 + TOL          # logits + log-softmax, and nothing unseen
    torch.testing.assert_close(loss, loss_fn(hidden, weight, labels))


@pytest.mark.slow
def test_inductor_buffers_are_counted():
    """Buffers allocated by Inductor-generated code go through c10's allocator too."""
    torch._dynamo.reset()
    N, H, V = 256, 32, 4000
    hidden, weight = torch.randn(N, H), torch.randn(V, H)

    @torch.compile(backend="inductor")
    def lse_sum(hidden, weight):
        return torch.logsumexp(hidden @ weight.T, dim=-1).sum()   # mm output [N, V] must exist

    lse_sum(hidden, weight)                                       # compile outside the region
    _, peak = measure_peak_bytes(lse_sum, hidden, weight)
    assert N * V * 4 <= peak <= N * V * 4 + TOL
    torch._dynamo.reset()


def test_backward_is_counted():
    """Autograd's saved tensors and gradients are seen (CPU backward runs on this thread)."""
    N, V = 512, 2048
    logits = torch.randn(N, V, requires_grad=True)
    labels = torch.randint(0, V, (N,))

    def step():
        F.cross_entropy(logits, labels).backward()

    _, peak = measure_peak_bytes(step)
    assert peak >= 2 * N * V * 4                  # saved log-softmax + logits.grad
    assert logits.grad is not None


def test_region_that_allocates_nothing():
    keep = torch.randn(MiB)
    with PeakMemory("cpu") as mem:
        keep.mul_(2)                              # in place: no allocation
    assert mem.peak_bytes <= TOL and abs(mem.end_bytes) <= TOL


def test_unsupported_device_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="chunkce.memory"):
        with PeakMemory("meta"):
            pass


@pytest.mark.slow
def test_cpu_measurement_prints_no_profiler_lines():
    """Kineto's profiler_start / profiler_stop lines are dropped; other stderr output is kept.

    A fresh process: Kineto reads its log level once, when the profiler first starts.
    """
    code = (
        "import os, sys, torch\n"
        "from compile_pass.memory import PeakMemory, measure_peak_bytes\n"
        "measure_peak_bytes(lambda: torch.empty(1000))\n"
        "with PeakMemory('cpu'):\n"
        "    print('python line', file=sys.stderr, flush=True)\n"
        "    os.write(2, b'fd line\\n')\n"
        "print('done', flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert "profiler_start" not in proc.stderr and "profiler_stop" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == ["python line", "fd line"], proc.stderr


def test_kineto_lines_are_dropped_and_others_kept(capfd, monkeypatch):
    """What Kineto prints at the profiler's start and stop (a CUDA build on a machine without a GPU
    adds its gpuGetDeviceCount line) is dropped from fd 2; a line that merely mentions them is kept.
    (The filter is off where ``KINETO_LOG_LEVEL`` is set: benchmarks.harness sets it at import, and a
    test importing a benchmark shares this worker's environment.)"""
    from compile_pass.memory import _without_kineto_usdt_lines

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)

    with _without_kineto_usdt_lines():
        os.write(2, b"USDT:2026-12-01 13:51:50 29720:29720 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                    b"ERROR:2026-12-06 05:47:36 11111:11111 DeviceProperties.cpp:56] gpuGetDeviceCount failed "
                    b"with code 35\nkept: gpuGetDeviceCount failed\n"
                    b"USDT:2026-12-01 13:51:50 29720:29720 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "kept: gpuGetDeviceCount failed\n"
