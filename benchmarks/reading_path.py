"""The modules a reader opens following one training step through chunkce, in the order they run.

    python -m benchmarks.reading_path            # the counts, then each phase's modules in order
    python -m benchmarks.reading_path --calls    # every step of the path: module and function

One step of a small Llama (``bench_model``'s ``cpu-micro``): ``torch.compile(model,
backend="chunkce")``, a forward with labels (Dynamo captures the graph and calls the backend,
which runs the pass), a backward, then a read of ``out.logits`` (``argmax``). Every Python call
into a module of ``compile_pass`` is recorded (``sys.setprofile`` on every thread). A reader reads each function
once, when the step first reaches it: the path is the functions in order of their first call,
and consecutive functions of one module are one visit. A **return** is a visit to a module
already left (the path came back to it after another). Printed for the whole step and for the pass alone (the calls below
``chunkce_backend``: find, plan, apply, report). This is a measure of how the code reads, not a
speed: it runs in seconds, and what Inductor and Dynamo do in between is not counted.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

PACKAGE = Path(__import__("compile_pass").__file__).resolve().parent


def _module_of(filename: str) -> str | None:
    """``compile_pass/graph/plan.py`` -> ``graph/plan.py``; None outside the package."""
    try:
        return Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None


@contextmanager
def recorded_calls(calls: list[tuple[str, str, bool]]) -> Iterator[None]:
    """Append ``(module, function, in the pass)`` for each call into the package while the block runs."""
    depth = [0]  # calls of chunkce_backend open on the main thread
    resolved: dict[str, str | None] = {}

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        filename = frame.f_code.co_filename
        if filename not in resolved:
            resolved[filename] = _module_of(filename)
        module = resolved[filename]
        if module is None:
            return
        is_backend = frame.f_code.co_name == "chunkce_backend" and module == "backend.py"
        if event == "call":
            calls.append((module, frame.f_code.co_name, depth[0] > 0 or is_backend))
            depth[0] += is_backend
        elif is_backend:
            depth[0] -= 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def visits(calls: list[tuple[str, str]]) -> list[str]:
    """The modules of the functions in order of first call, consecutive ones of a module one visit."""
    modules = [module for module, _ in dict.fromkeys(calls)]
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def counts(calls: list[tuple[str, str]]) -> tuple[int, int, list[str]]:
    """``(modules opened, returns to a module already left, first-opening order)`` of ``(module,
    function)`` calls."""
    path = visits(calls)
    order = list(dict.fromkeys(path))
    return len(order), len(path) - len(order), order


def one_step() -> list[tuple[str, str, bool]]:
    """The calls of one training step of a small Llama through ``backend="chunkce"``, then a read."""
    from benchmarks.bench_model import CONFIGS, build

    torch._dynamo.reset()
    model, ids = build(CONFIGS["cpu-micro"], torch.device("cpu"), seed=0)
    calls: list[tuple[str, str, bool]] = []
    with recorded_calls(calls):
        compiled = torch.compile(model, backend="chunkce")
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        out.logits.argmax(-1)
    return calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", action="store_true", help="print the path: each function at its first call")
    args = p.parse_args(argv)
    calls = one_step()
    package_modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    for title, selected in (("one training step and a read of out.logits", calls),
                            ("the pass (below chunkce_backend)", [c for c in calls if c[2]])):
        opened, returns, order = counts([(module, function) for module, function, _ in selected])
        print(f"{title}: {opened} of {len(package_modules)} modules opened, {returns} returns to a module "
              f"already left")
        print("  " + ", ".join(order))
    if args.calls:
        for module, function, in_pass in dict.fromkeys(calls):
            print(f"{'pass ' if in_pass else '     '}{module}:{function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
