"""A compiled kernel's graph called directly: its guards checked, no Dynamo frame or wrappers per call.

:class:`KernelGraphs` is a kernel's ``torch.compile`` backend: Inductor's, as ``torch.compile(options=...)``
builds it, noting each graph it compiles and where the graph's inputs come from (Dynamo's sources:
an argument, its attribute, a tensor's size or stride). After a call through ``torch.compile``,
:meth:`KernelGraphs.resolve` pairs the code object's one compiled entry with its graph:
:class:`GraphCall` checks the entry's guards (the same check Dynamo runs) and calls the graph on
the inputs read the way Dynamo's bytecode reads them. A kernel returns None and writes only its
tensor arguments (its effects are the graph's), so nothing after the graph is left to run.
Why and what it saves: docs/op.md, "Per-chunk kernels"."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import compile_pass.torch_internals as internals

log = logging.getLogger(__name__)

_PARTS = ("inductor_wrapper", "local_source", "attr_source", "tensor_property_source", "tensor_property",
          "as_tensor_fullprec", "cache_entry_list", "guard_manager")


@functools.cache
def available() -> str | None:
    """None where this torch has every name a direct call needs, else why not (logged once): the
    kernels then run through ``torch.compile`` alone."""
    try:
        for name in _PARTS:
            entry = getattr(internals, name)
            if isinstance(entry, internals.Private):
                entry.get()
            elif not entry.declared():
                raise internals.TorchInternalMissing(f"chunkce: this torch's {entry.owner} has no {entry.name}")
    except internals.TorchInternalMissing as exc:
        log.info("chunkce: the per-chunk kernels run through torch.compile's call path: %s", exc)
        return str(exc)
    return None


class GraphCall:
    """One compiled graph of a kernel, called directly: ``call(args)`` runs it and returns True where
    its guards hold for ``args``, else returns False having run nothing. ``calls`` counts its runs."""

    def __init__(self, names: tuple[str, ...], guards: Any, reads: Callable, compiled: Callable):
        self._names, self._check, self._reads, self._compiled = names, guards.check, reads, compiled
        self.calls = 0

    def __call__(self, args) -> bool:
        if len(args) != len(self._names) or not self._check(dict(zip(self._names, args))):
            return False
        self._compiled(*self._reads(*args))
        self.calls += 1
        return True


class KernelGraphs:
    """The backend of one kernel's ``torch.compile``: Inductor's with ``options``, noting each graph
    it compiles; :attr:`call` its :class:`GraphCall` once :meth:`resolve` found one, :attr:`refused`
    why not."""

    compiler_name = "inductor"

    def __init__(self, fn: Callable, options: dict):
        self._fn = fn
        self._inductor = internals.inductor_wrapper.get()(None, options, True)
        self._graphs: dict[int, tuple] = {}  # id(Inductor's graph): (it, the callable returned, reads or why not)
        self.call: GraphCall | None = None
        self.refused: str | None = None

    def __call__(self, gm, example_inputs):
        compiled = self._inductor(gm, example_inputs)
        inner = inspect.unwrap(compiled)
        self._graphs[id(inner)] = (inner, compiled, _reads(gm, self._fn))
        return compiled

    def get_compiler_config(self) -> dict:
        return self._inductor.get_compiler_config()

    def reset(self) -> None:
        self._inductor.reset()

    def resolve(self, result: Any) -> None:
        """After a call through ``torch.compile`` that returned ``result``: the direct call of the graph
        it compiled, or why there is none (decided once, logged at debug level)."""
        if self.call is None and self.refused is None:
            call = self._resolve(result)
            if isinstance(call, GraphCall):
                self.call = call
                internals.counters.get()["chunkce"]["kernel_graph_calls"] += 1
            else:
                self.refused = call
                internals.counters.get()["chunkce"]["kernel_graph_calls_refused"] += 1
                log.debug("chunkce: %s runs through torch.compile at each call: %s", self._fn.__code__.co_name, call)

    def _resolve(self, result: Any) -> GraphCall | str:
        if result is not None:
            return "it returns a value (a direct call runs its graph only)"
        entries = internals.cache_entry_list(self._fn.__code__)
        if len(entries) != 1:
            return f"{len(entries)} compiled entries (a direct call holds one)"
        entry = entries[0]
        compiled = self._graph_of(entry)
        if compiled is None:
            return "its compiled entry calls no graph this backend compiled"
        compiled, reads = compiled
        if isinstance(reads, str):
            return reads
        code = self._fn.__code__
        names = code.co_varnames[:code.co_argcount]
        return GraphCall(names, internals.guard_manager.read(entry).root, reads, compiled)

    def _graph_of(self, entry) -> tuple[Callable, Callable | str] | None:
        """The graph ``entry``'s code calls: a global of the kernel's module, which Dynamo wraps (both
        wrappers end at the compiled graph ``inspect.unwrap`` reaches)."""
        for name in entry.code.co_names:
            obj = self._fn.__globals__.get(name)
            if callable(obj) and id(inner := inspect.unwrap(obj)) in self._graphs:
                graph = self._graphs[id(inner)]
                return graph[1:] if graph[0] is inner else None
        return None


def _reads(gm, fn: Callable) -> Callable | str:
    """A function of ``fn``'s arguments that returns the graph's inputs, each read as Dynamo's
    bytecode reads it (its source); why not where a source is of another kind."""
    code = fn.__code__
    if code.co_flags & (0x04 | 0x08) or code.co_kwonlyargcount:  # *args, **kwargs
        return "its arguments are not all positional"
    expressions = []
    for node in gm.graph.find_nodes(op="placeholder"):
        graph_arg = node.meta.get("grapharg")
        expression = _expression(getattr(graph_arg, "source", None))
        if expression is None:
            return f"graph input {node.name} comes from {getattr(graph_arg, 'source', None)!r}"
        expressions.append(f"as_tensor({expression})" if graph_arg.pass_arg_as_tensor else expression)
    text = f"lambda {', '.join(code.co_varnames[:code.co_argcount])}: ({''.join(e + ', ' for e in expressions)})"
    return eval(text, {"as_tensor": internals.as_tensor_fullprec.get()})  # noqa: S307 - text built from names checked above


def _expression(source) -> str | None:
    """``source`` (an argument, an attribute of one, a tensor's size, stride or storage offset) as a
    Python expression over the kernel's argument names; None for any other kind."""
    kind = type(source)
    if kind is internals.local_source.get():
        plain = not (source.is_derefed_cell_contents or source.is_varargs or source.is_varkw)
        return source.local_name if plain and source.local_name.isidentifier() else None
    if kind is internals.attr_source.get():
        base = _expression(source.base)
        return f"{base}.{source.member}" if base and source.member.isidentifier() else None
    if kind is internals.tensor_property_source.get():
        base, prop = _expression(source.base), internals.tensor_property.get()
        calls = {prop.SIZE: f"size({source.idx})", prop.STRIDE: f"stride({source.idx})",
                 prop.STORAGE_OFFSET: "storage_offset()"}
        return f"{base}.{calls[source.prop]}" if base and source.prop in calls else None
    return None
