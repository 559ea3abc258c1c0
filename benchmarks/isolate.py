"""The one way a benchmark runs a piece of itself in a fresh Python process, and hears back.

    parent:  run = isolate.run(["-m", "benchmarks.bench_op", *args], timeout=600)
             run.records   # what the child reported, in order; run.ok, run.status
    child:   out = isolate.Reporter(args.result_json)   # the hidden --result-json PATH
             out.stage({"model_type": "llama", "stage": "build"}); out.record(row)

A fresh interpreter per provider, backend or architecture means no compile cache,
allocator state, resident memory or monkeypatch of one colours the next. The child
appends JSON lines to the file the parent named (``--result-json PATH``, added to
its command line by :func:`run`), so whatever it reported before it was killed
(out of memory, a timeout) still comes back. The parent can bound the whole run
(``timeout``) and each stage the child announces (``stage_timeout``), and is told
of each record as it arrives (``on_record``). The child runs in its own session;
on a timeout, an error or Ctrl-C in the parent, its whole process group is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT_FLAG = "--result-json"


def add_result_argument(parser: argparse.ArgumentParser) -> None:
    """The hidden ``--result-json PATH`` a child gets from :func:`run` (None: not a child)."""
    parser.add_argument(RESULT_FLAG, default=None, help=argparse.SUPPRESS)


class Reporter:
    """Child side: appends ``["stage", value]`` / ``["record", value]`` lines to ``path``.

    Each line is flushed as written, so a child killed later loses nothing it reported.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, kind: str, value: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps([kind, value]) + "\n")

    def stage(self, value: Any) -> None:
        """Announce a stage (the parent's ``stage_timeout`` restarts; ``ChildRun.stage``)."""
        self._write("stage", value)

    def record(self, value: Any) -> None:
        """One result (a JSON-serialisable value)."""
        self._write("record", value)


@dataclass
class ChildRun:
    """What a child did: its records, the last stage it announced, how it ended."""

    records: list[Any] = field(default_factory=list)
    stage: Any = None  # the last stage value announced, None if none
    returncode: int | None = None  # None: killed by the parent (timeout)
    status: str = ""  # "rc=0", "rc=-9", "timed out: over 60 s in stage ..."
    seconds: float = 0.0
    output_tail: str = ""  # the last 4000 characters of its output, when it went to a log

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class _Lines:
    """Reads the result file's complete lines as they are appended."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0

    def new(self) -> list[tuple[str, Any]]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete)
        return [tuple(json.loads(line)) for line in complete.splitlines() if line.strip()]


def _tee(stream, log_path: str) -> None:
    with open(log_path, "a") as log:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()


def run(args: Sequence[str], *, results: bool = True, timeout: float | None = None,
        stage_timeout: float | None = None, env: dict[str, str] | None = None, log: str | None = None,
        tee: bool = False, on_record: Callable[[Any], None] | None = None,
        on_stage: Callable[[Any], None] | None = None, poll_s: float = 0.5) -> ChildRun:
    """Run ``python *args`` (e.g. ``["-m", "benchmarks.scaling", ...]``) in a fresh interpreter.

    results: append ``--result-json PATH`` (a temporary file) and collect what the
        child reports there through :class:`Reporter`.
    timeout: seconds for the whole run; stage_timeout: seconds since the last stage
        the child announced (or its start). Either kills the child's process group.
    env: variables set on top of this process's; the repository root always leads
        ``PYTHONPATH``, so ``-m benchmarks...`` resolves from any directory.
    log: append the child's stdout and stderr to this file (else they are this
        process's); tee: with ``log``, also echo them here.
    on_record, on_stage: called with each record / stage as it arrives (from this thread).

    Returns a :class:`ChildRun`; never raises for the child's failure (``ok``, ``status``).
    """
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), child_env.get("PYTHONPATH"))))
    out = ChildRun()
    with tempfile.TemporaryDirectory(prefix="chunkce_child_") as tmp:
        result_path = os.path.join(tmp, "result.jsonl")
        argv = [sys.executable, *args, *([RESULT_FLAG, result_path] if results else [])]
        log_file = open(log, "a") if log and not tee else None  # noqa: SIM115 - closed below
        stdout = subprocess.PIPE if tee else log_file
        start = since = time.perf_counter()
        proc = subprocess.Popen(argv, env=child_env, stdout=stdout, stderr=subprocess.STDOUT if log else None,
                                text=True, start_new_session=True)
        reader = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True) if tee else None
        if reader:
            reader.start()
        lines = _Lines(result_path)

        def collect() -> None:
            nonlocal since
            for kind, value in lines.new():
                if kind == "stage":
                    out.stage, since = value, time.perf_counter()
                    if on_stage:
                        on_stage(value)
                else:
                    out.records.append(value)
                    if on_record:
                        on_record(value)

        try:
            while proc.poll() is None:
                try:
                    proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    pass
                collect()
                now = time.perf_counter()
                if timeout is not None and now - start > timeout:
                    out.status = f"timed out after {timeout:.0f} s"
                elif stage_timeout is not None and now - since > stage_timeout:
                    out.status = f"timed out: over {stage_timeout:.0f} s in stage {out.stage!r}"
                if out.status:
                    break
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            if reader:
                reader.join(timeout=5)
            if log_file:
                log_file.close()
        collect()
        out.seconds = time.perf_counter() - start
        if not out.status:
            out.returncode = proc.returncode
            out.status = f"rc={proc.returncode}"
    if log:
        with open(log, errors="replace") as f:
            f.seek(max(0, os.path.getsize(log) - 4000))
            out.output_tail = f.read()
    return out
