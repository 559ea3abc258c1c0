"""The two tiers: ``-m "not slow"`` (a minute or two) and the rest. A pytest plugin
(``conftest.pytest_plugins``); nothing here is marked by hand.

A test is **slow** when it does one of these (read from the test at collection):

* spawns a process: its code reaches ``subprocess``, ``multiprocessing`` or
  ``torch.multiprocessing`` (a fresh interpreter, ``torchrun``, spawned ranks);
* builds a Hugging Face model: its code reaches ``transformers``, ``trl``, ``peft``,
  ``accelerate`` or ``datasets``;
* compiles with Inductor: its code or its parameters hold the string ``"inductor"``
  (a backend, an inner backend);
* runs a hypothesis search (``@given``), or torch's own exhaustive checks of an op
  (``torch.library.opcheck``, ``torch.autograd.gradcheck`` / ``gradgradcheck``).

"Its code" is the test function, the fixtures it uses and every function or class
of the tests' own modules (and benchmarks') they name, followed transitively (a helper in
``rewrite_proof.py`` or ``distributed_cases.py`` counts). The rule can only over-mark
(a helper named but not called); what it cannot see statically, a fast test checks
at run time: one that compiles a graph with Inductor (``torch.compile`` without a
backend, say) or starts a process fails with the reason (:func:`_tier_check`), so
the rule cannot fall behind the tests. Not counted: the op's own per-chunk kernels,
which Inductor compiles once per variant and process (``compile_pass.op.kernels.run``),
whoever calls the op.
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
import multiprocessing.process
import subprocess
import sys
import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FOLLOWED = (TESTS, TESTS.parent / "benchmarks")  # whose code is read; not the package's (it names Inductor)
SPAWNS = ("subprocess", "multiprocessing", "torch.multiprocessing")
HUGGING_FACE = ("transformers", "trl", "peft", "accelerate", "datasets")
INDUCTOR = "inductor"
OP_CHECKS = ("opcheck", "gradcheck", "gradgradcheck")  # torch.library's and torch.autograd's


def _under(name: str | None, roots: tuple[str, ...]) -> bool:
    return bool(name) and any(name == root or name.startswith(root + ".") for root in roots)


def _ours(obj) -> bool:
    """A function or class defined in tests/ (a test module, conftest, a helper) or benchmarks/."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    return file is not None and any(Path(file).resolve().is_relative_to(root) for root in FOLLOWED)


class _Reach:
    """What a test's code reaches: module names it uses, strings it holds."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.strings: set[str] = set()
        self.names: set[str] = set()  # globals and attributes its code names
        self._seen: dict[int, object] = {}  # by id, the object kept so that no id is reused

    def value(self, obj) -> None:
        """A parameter value or a name a piece of code uses."""
        if id(obj) in self._seen:
            return
        self._seen[id(obj)] = obj
        if isinstance(obj, str):
            self.strings.add(obj)
        elif isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
        elif isinstance(obj, (tuple, list, set, frozenset)):
            for item in obj:
                self.value(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                self.value(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for item in vars(obj).values():
                self.value(item)
        elif callable(obj):
            try:
                function = inspect.unwrap(getattr(obj, "__func__", obj))
                self.modules.add(getattr(function, "__module__", None) or "")
            except Exception:  # noqa: BLE001 - an object that will not say (an op namespace)
                return
            if isinstance(function, type):
                if _ours(function):
                    for member in vars(function).values():
                        self.value(member)
            elif isinstance(function, types.FunctionType) and _ours(function):
                self.code(function.__code__, function.__globals__)
                self.value(function.__defaults__ or ())
                self.value(list((function.__kwdefaults__ or {}).values()))
        elif isinstance(obj, (staticmethod, classmethod, property)):
            self.value(obj.__func__ if not isinstance(obj, property) else obj.fget)

    def code(self, code: types.CodeType, namespace: dict) -> None:
        self.names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, namespace)
            else:
                self.value(const)
        for instruction in dis.get_instructions(code):
            if instruction.opname == "IMPORT_NAME":
                self.modules.add(instruction.argval)
            elif instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and instruction.argval in namespace:
                named = namespace[instruction.argval]  # a function, class or module; not a table of cases
                if isinstance(named, (types.FunctionType, type, types.ModuleType)):
                    self.value(named)


def slow_reasons(item: pytest.Item) -> list[str]:
    """Why ``item`` is slow (empty: it is fast), from what its code does."""
    reach = _Reach()
    reach.value(item.obj)
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        for fixture in defs:
            if name != "_tier_check":  # the check itself names what it checks
                reach.value(fixture.func)
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        reach.value(list(callspec.params.values()))
    reasons = []
    if any(_under(name, SPAWNS) for name in reach.modules):
        reasons.append("spawns a process")
    if any(_under(name, HUGGING_FACE) for name in reach.modules):
        reasons.append("builds a Hugging Face model")
    if INDUCTOR in reach.strings:
        reasons.append("compiles with Inductor")
    if getattr(item.obj, "is_hypothesis_test", False):
        reasons.append("runs a hypothesis search")
    if reach.names & set(OP_CHECKS):
        reasons.append("runs torch's op checks")
    return reasons


def pytest_collection_modifyitems(config, items):
    for item in items:
        reasons = slow_reasons(item)
        if reasons:
            item.add_marker(pytest.mark.slow(reason="; ".join(reasons)))


# --- the run-time check of the fast tier -----------------------------------------------------------


class _Slow(Exception):
    pass


@pytest.fixture(autouse=True)
def _tier_check(request, monkeypatch):
    """A test the rule left fast may not compile a graph with Inductor (the op's per-chunk
    kernels aside) nor start a process."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    done: list[str] = []

    def refuse(what: str):
        done.append(what)
        raise _Slow(f"{request.node.nodeid} {what} but conftest's tier rule left it fast (tests/tiers.py): "
                    f"name {INDUCTOR!r} in its code, or reach subprocess / multiprocessing from it")

    from torch._inductor import compile_fx

    from compile_pass.op import kernels

    def caller_file(skip: tuple[str, ...]) -> str:
        """The file of the nearest caller of the checked function outside the modules ``skip`` names."""
        frame = sys._getframe(4)  # past caller_file, spawned_by_a_test and check
        while frame is not None and any(part in frame.f_code.co_filename for part in skip):
            frame = frame.f_back
        return frame.f_code.co_filename if frame is not None else ""

    def in_kernels() -> bool:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not kernels.run.__code__:
            frame = frame.f_back
        return frame is not None

    def guarded(owner, name: str, what: str, slow_when):
        real = getattr(owner, name)

        def check(*args, **kwargs):
            if slow_when():
                refuse(what)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, check)

    def spawned_by_a_test() -> bool:
        return Path(caller_file(("subprocess.py", "multiprocessing"))).resolve().parent == TESTS

    guarded(compile_fx, "compile_fx", "compiles a graph with Inductor", lambda: not in_kernels())
    guarded(subprocess.Popen, "__init__", "starts a process", spawned_by_a_test)
    guarded(multiprocessing.process.BaseProcess, "start", "starts a process", spawned_by_a_test)
    yield
    assert not done, done[0]  # also when the test caught the exception
