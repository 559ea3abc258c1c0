"""A shared machine, made on purpose: competing busy processes around a benchmark's timed steps.

    with busy.competing(1, "matmul"):      # one other job's process, running until the block ends
        stats = harness.time_region(...)

``matmul`` (the default kind): a torch process pinned to one thread (``torch.set_num_threads(1)``,
``OMP_NUM_THREADS=1``) multiplying two ``[512, 512]`` fp32 matrices in a loop. It models another
user's numeric job: always runnable, so the kernel time-slices it against our threads on one
core, and it shares that core's caches and the memory bandwidth, as a training or data job
does. ``python``: a pure-Python spin loop, the same scheduling pressure with no cache or memory
traffic (a lower bound of the effect). Each process is started, waited for until it runs its
loop (it prints one line), and killed when the block ends; a process of ours is never left behind.

``bench_model --busy N`` times its steps once idle and once with ``N`` of them running, and prints
both ratios to Inductor in one table (:func:`busy_table`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

from benchmarks.tables import fmt, markdown, num, ratio

LOOPS = {
    "matmul": ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nb = torch.randn(512, 512)\n"
               "print('running', flush=True)\nwhile True:\n    torch.mm(a, b)\n"),
    "python": "print('running', flush=True)\nwhile True:\n    pass\n",
}
KINDS = tuple(LOOPS)


@contextlib.contextmanager
def competing(count: int, kind: str = "matmul") -> Iterator[list[subprocess.Popen]]:
    """``count`` busy processes of ``kind`` (:data:`LOOPS`) running while the block runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    processes: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            process = subprocess.Popen([sys.executable, "-c", LOOPS[kind]], env=env, stdout=subprocess.PIPE,
                                       text=True, start_new_session=True)
            processes.append(process)
            process.stdout.readline()  # its loop has started
        yield processes
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            process.stdout.close()


def busy_table(rows: list[dict]) -> str:
    """Each run's median step idle and with the busy processes, and both as ratios to Inductor's
    in the same run (``bench_model``'s rows with ``busy_step_ms_p50``)."""
    base = {(r["config"], r.get("step", "train")): r for r in rows
            if r["backend"] == "inductor" and num(r.get("busy_step_ms_p50"))}
    body = []
    for r in rows:
        if not num(r.get("busy_step_ms_p50")):
            continue
        b = base.get((r["config"], r.get("step", "train")))
        idle = ratio(r["step_ms_p50"], b["step_ms_p50"]) if b else "-"
        busy = ratio(r["busy_step_ms_p50"], b["busy_step_ms_p50"]) if b else "-"
        body.append([r["config"], r.get("step", "train"), r["backend"], fmt(r["step_ms_p50"], ".0f"), idle,
                     fmt(r["busy_step_ms_p50"], ".0f"), busy, r.get("busy", "")])
    return markdown(["config", "step", "backend", "idle step ms (p50)", "idle vs inductor",
                     "busy step ms (p50)", "busy vs inductor", "busy processes"], body)
