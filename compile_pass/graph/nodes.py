"""Reading nodes of a torch-level FX graph (op names, fake values, sizes) and writing them (Edit).

Reading and writing nodes of a torch-level FX graph: op names, fake values
(``meta["example_value"]``), sizes; nodes created or traced in with their ``example_value``;
an :class:`Edit` makes a site's changes all or nothing.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg
from torch.fx.proxy import GraphAppendingTracer, Proxy

import compile_pass.torch_internals as internals

log = logging.getLogger(__name__)

_TORCH_FUNCTIONS = {
    getattr(torch, name): name
    for name in ("reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "clone", "narrow",
                 "select", "transpose", "swapaxes", "swapdims", "permute", "t", "movedim")
}
# Tensor methods on the logits that only cast them (to another floating dtype, same shape and
# device: checked where read) or copy them; the matcher passes them, the logits drop looks through them.
CASTS = {"float", "half", "bfloat16", "double", "to", "type", "type_as"}
COPIES = {"contiguous", "clone"}
# Ops that only change shape (row-major, vocab dim kept last); ops that select or reorder token dims.
RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
TRANSPOSES = {"transpose", "swapaxes", "swapdims"}
TOKEN_INDEXES = {"getitem", "narrow", "select", "permute", *TRANSPOSES}
CALLS = ("call_function", "call_method")  # the node ops that call a function or a tensor method
# The functions a graph calls for these (each spelling of it)
MULTIPLY = (operator.mul, torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply)
SOFTMAX = (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax)
LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, torch.special.log_softmax, torch.Tensor.log_softmax)
# Metadata an inserted node inherits from the node it replaces (source line, module path).
_INHERITED_META = ("stack_trace", "nn_module_stack")


def op_name(node: Node) -> str:
    """Short name of what a node does: ``view``, ``mul``, ``tanh``, ``.T``, ``placeholder``."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        if node.target is builtins.getattr:
            return f".{node.args[1]}"
        return _TORCH_FUNCTIONS.get(node.target) or getattr(node.target, "__name__", str(node.target))
    if node.op == "call_module":
        return f"module {node.target}"
    return node.op


def tensor_op_name(node: Node) -> str | None:
    """The method name of a tensor op that the matcher may look through, else None."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return "getitem"
    if node.target is builtins.getattr and node.args[1] in ("T", "mT"):
        return f".{node.args[1]}"
    if node.target in _TORCH_FUNCTIONS:
        return _TORCH_FUNCTIONS[node.target]
    name = getattr(node.target, "__name__", None)
    if name and getattr(torch.Tensor, name, None) is node.target:
        return name
    return internals.dtensor_prim(node.target)  # torch 2.11's DTensor.to_local / redistribute


def function_of(node: Node) -> Any:
    """The torch function a call_function / call_method node runs (a method as
    ``torch.Tensor.<name>``); None for other nodes."""
    if node.op == "call_method":
        return getattr(torch.Tensor, str(node.target), None)
    return node.target if node.op == "call_function" else None


def example_value(arg: Any) -> Any:
    """The fake value Dynamo recorded for a node; a non-node argument as it is."""
    return arg.meta.get("example_value") if isinstance(arg, Node) else arg


def is_tensor_node(arg: Any) -> bool:
    return isinstance(example_value(arg), torch.Tensor)


def same_size(a: Any, b: Any) -> bool:
    """Whether two possibly symbolic sizes are known equal (adds no guard)."""
    return statically_known_true(a == b)


def size_hint(size: Any) -> int:
    """An int for a possibly symbolic size: its hint (adds no guard)."""
    if isinstance(size, torch.SymInt):
        node = size.node
        if node.hint is not None:
            return int(node.hint)
        return int(node.shape_env.size_hint(node.expr, allow_none=True) or 0)
    return int(size)


def dims_arg(args: list[Any]) -> list[Any]:
    """The dims of ``permute(*dims)`` / ``permute(dims)``, as a list."""
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else list(args)


def module_attr(graph: Graph, target: str) -> Any:
    """The attribute a ``get_attr`` / ``call_module`` target names on the graph's module, or None."""
    value = graph.owning_module
    for part in str(target).split("."):
        value = getattr(value, part, None)
    return value


def create_node(graph: Graph, kind: str, target: Any, args: tuple, kwargs: Mapping[str, Any] | None = None,
                meta: Mapping[str, Any] | None = None) -> Node:
    """Insert a node at the graph's insertion point, with its ``example_value``.

    Args:
        kind: ``"call_function"`` or ``"call_method"``.
        meta: metadata to copy onto the node (e.g. the replaced node's ``stack_trace``).
    """
    node = graph.create_node(kind, target, args, dict(kwargs or {}))
    _fill_meta(node, meta or {})
    return node


def trace_into(graph: Graph, fn: Callable[..., Any], *args: Any, meta: Mapping[str, Any] | None = None,
               **kwargs: Any) -> Node:
    """Call ``fn`` with an FX ``Proxy`` for every node among ``args`` / ``kwargs`` (dataclass
    fields and tuples' items included): its tensor ops become nodes of ``graph`` at the insertion point, each with
    its ``example_value``. ``fn`` must read no tensor value or metadata. Returns the result's node
    (a tuple of them for a tuple result).
    """
    tracer = _MetaTracer(graph, meta or {})

    def wrap(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{field.name: wrap(getattr(value, field.name))
                                                 for field in dataclasses.fields(value) if field.init})
        if isinstance(value, tuple):  # a NamedTuple of nodes too
            return type(value)(*map(wrap, value)) if hasattr(value, "_fields") else tuple(map(wrap, value))
        return Proxy(value, tracer) if isinstance(value, Node) else value

    result = fn(*map(wrap, args), **{name: wrap(value) for name, value in kwargs.items()})
    return tuple(part.node for part in result) if isinstance(result, tuple) else result.node


class _MetaTracer(GraphAppendingTracer):
    """Appends to an existing graph; every node it creates gets its metadata."""

    def __init__(self, graph: Graph, meta: Mapping[str, Any]) -> None:
        super().__init__(graph)
        self._meta = meta

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> Node:  # noqa: ANN001
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        _fill_meta(node, self._meta)
        return node


def _fill_meta(node: Node, meta: Mapping[str, Any]) -> None:
    node.meta.update({key: meta[key] for key in _INHERITED_META if key in meta})
    args, kwargs = map_arg((node.args, node.kwargs), example_value)
    # The inputs' own fake mode (the tracing context may hold another one).
    fake_mode = next((leaf.fake_mode for leaf in internals.tree_leaves((args, kwargs))
                      if isinstance(leaf, internals.fake_tensor.get())), None)
    try:
        with fake_mode or contextlib.nullcontext(), _saved_tensors_hooks_off():
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - metadata only: the graph is right without it
        log.debug("chunkce: no example_value for %s", node.format_node(), exc_info=True)
        return
    node.meta["example_value"] = value



def _saved_tensors_hooks_off() -> contextlib.AbstractContextManager[None]:
    """Autograd's saved-tensor hooks off while computing an ``example_value``, as Dynamo does (a
    checkpoint region would otherwise count what the fake ops save)."""
    return internals.saved_tensors_hooks_off()


class Edit:
    """The changes to one graph for one site, all kept or all undone.

        with Edit(graph) as edit:     # an exception inside undoes every change, then propagates
            new = create_node(...)
            edit.replace_all_uses_with(old, new)
            edit.erase(old)           # disconnected now, removed when the block succeeds
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._before: set[Node] = set()
        self._replaced: list[tuple[Node, Node, list[Node]]] = []
        self._erased: list[tuple[Node, tuple, dict]] = []
        self._moved: list[tuple[Node, Node]] = []  # (node, the node it came after)

    def __enter__(self) -> Edit:
        self._before = set(self.graph.nodes)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            for node, _, _ in self._erased:
                self.graph.erase_node(node)
        else:
            self._undo()

    def replace_all_uses_with(self, old: Node, new: Node) -> None:
        """``old.replace_all_uses_with(new)``, remembered."""
        users = list(old.users)
        old.replace_all_uses_with(new)
        self._replaced.append((old, new, users))

    def move_before(self, node: Node, at: Node) -> None:
        """``at.prepend(node)``: ``node`` moved to just before ``at``, remembered."""
        self._moved.append((node, node.prev))
        at.prepend(node)

    def erase(self, node: Node) -> None:
        """Disconnect ``node`` (it must have no users) and erase it when the edit is kept."""
        if node.users:
            raise RuntimeError(f"chunkce: cannot erase {node.format_node()}: it still has users")
        self._erased.append((node, node.args, node.kwargs))
        node.args, node.kwargs = (), {}

    def _undo(self) -> None:
        for node, args, kwargs in reversed(self._erased):
            node.args, node.kwargs = args, kwargs
        for old, new, users in reversed(self._replaced):
            for user in users:
                user.replace_input_with(new, old)
        added = [node for node in self.graph.nodes if node not in self._before]
        for node in reversed(added):  # users before what they use: only added nodes use added nodes now
            self.graph.erase_node(node)
        for node, before in reversed(self._moved):
            before.append(node)
