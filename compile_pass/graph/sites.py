"""Find cross-entropy sites in a torch-level FX graph and see back to their projection.

Works on the graph TorchDynamo captures (and on Inductor's pre-grad graph, which
is the same IR): torch-level ops, tensor metadata in ``node.meta["example_value"]``.
From the cross-entropy input the walk goes back through ops that only reshape,
copy, cast or index the token dims of the logits, as Dynamo emits them:

    .float() .view(-1, V) .contiguous() .to(dtype)   call_method
    logits[..., :-1, :]         call_function operator.getitem(x, (Ellipsis, slice, slice))
    logits.transpose(1, 2)      call_method transpose (class dim moved to 1 for the loss)

until it reaches a projection (:mod:`compile_pass.graph.forms`). The matcher only
states facts (what each node on the path is); the guard decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.fx import Graph, Node

from compile_pass.graph.forms import (
    CROSS_ENTROPY_FUNCTIONS,
    CrossEntropyCall,
    Projection,
    as_projection,
    read_cross_entropy,
)
from compile_pass.graph.nodes import dims_arg, example_value, is_tensor_node, module_attr, same_size, tensor_op_name

# Ops on the logits that only change shape (row-major, vocab dim kept last), copy,
# or cast: the hidden states need nothing for them but a final flatten.
_RESHAPE = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_COPY = {"contiguous", "clone"}
_CAST = {"float", "half", "bfloat16", "double", "to", "type", "type_as"}
# Ops that select or reorder token dims: replayed on the hidden states.
_TOKEN_INDEX = {"getitem", "narrow", "select", "transpose", "swapaxes", "swapdims", "permute"}


class Step(NamedTuple):
    """One node between projection and loss, and how it treats the logits."""

    node: Node
    kind: str  # reshape | copy | cast | index


@dataclass
class Site:
    """One cross-entropy call and what lies between it and its projection.

    ``steps`` run forward, from the projection's output to the cross-entropy input.
    When the walk could not reach a projection, ``stop`` is the node it stopped at
    and ``stop_kind`` says why (the guard words it).
    """

    node: Node
    call: CrossEntropyCall | None
    projection: Projection | None = None
    steps: list[Step] = field(default_factory=list)
    class_dim_moved: Node | None = None  # transpose taking [B, T, V] to [B, V, T] right before the loss
    stop: Node | None = None
    # opaque | graph_input | subgraph_input | vocab_dim | advanced_index | symbolic_reshape
    # | class_dim_1 | unbatched | call_module | unreadable | internal_error
    stop_kind: str | None = None
    error: str | None = None  # what went wrong reading the site (internal_error)
    hidden_plan: list[tuple[str, Any]] = field(default_factory=list)  # ("reshape", shape) | ("replay", node)


def _index_keeps_vocab_dim(index: Any, ndim: int) -> str | None:
    """None when ``x[index]`` leaves the last dim whole; else ``vocab_dim`` / ``advanced_index``."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if isinstance(item, (list, bool, torch.Tensor)) or (isinstance(item, Node) and is_tensor_node(item)):
            return "advanced_index"
    if any(item is Ellipsis for item in items):
        after = items[[i for i, item in enumerate(items) if item is Ellipsis][0] + 1:]
        consuming = [item for item in after if item is not None]
        if not consuming:
            return None
    else:
        consuming = [item for item in items if item is not None]
        if len(consuming) < ndim:
            return None
    last = consuming[-1]
    full = isinstance(last, slice) and last.start in (None, 0) and last.stop is None and last.step in (None, 1)
    return None if full else "vocab_dim"


def _classify(node: Node) -> str | None:
    """How a node between projection and loss treats the logits: reshape / copy /
    cast / index, or a stop kind (``opaque``, ``vocab_dim``, ``advanced_index``)."""
    name = tensor_op_name(node)
    if name is None or not node.args or not is_tensor_node(node.args[0]) or not is_tensor_node(node):
        return "opaque"
    before, after = example_value(node.args[0]), example_value(node)
    ndim = before.dim()
    if ndim == 0 or after.dim() == 0 or not same_size(after.shape[-1], before.shape[-1]):
        return "vocab_dim" if name in _RESHAPE | _TOKEN_INDEX else "opaque"
    if name in _CAST:
        same = after.shape == before.shape and after.device == before.device
        return "cast" if same and after.is_floating_point() else "opaque"
    if after.dtype != before.dtype:
        return "opaque"
    if name in _COPY:
        return "copy" if after.shape == before.shape else "opaque"
    if name in _RESHAPE:
        return "reshape"
    if name == "getitem":
        return _index_keeps_vocab_dim(node.args[1], ndim) or "index"
    if name in ("narrow", "select"):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return "index" if isinstance(dim, int) and dim % ndim != ndim - 1 else "vocab_dim"
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = node.args[1:]
        ok = len(dims) == 2 and all(isinstance(d, int) and d % ndim != ndim - 1 for d in dims)
        return "index" if ok else "vocab_dim"
    if name == "permute":
        dims = dims_arg(node.args[1:])
        return "index" if dims and isinstance(dims[-1], int) and dims[-1] % ndim == ndim - 1 else "vocab_dim"
    return "opaque"


def _moves_class_dim_to_1(node: Any) -> bool:
    """``[B, T, V] -> [B, V, T]``: transpose(1, 2) / permute(0, 2, 1) / movedim(-1, 1)."""
    if not isinstance(node, Node) or not is_tensor_node(node) or example_value(node).dim() != 3:
        return False
    name, args = tensor_op_name(node), list(node.args[1:])
    if name in ("transpose", "swapaxes", "swapdims"):
        return len(args) == 2 and all(isinstance(d, int) for d in args) and {d % 3 for d in args} == {1, 2}
    if name == "permute":
        dims = dims_arg(args)
        return all(isinstance(d, int) for d in dims) and [d % 3 for d in dims] == [0, 2, 1]
    if name == "movedim":
        return len(args) == 2 and all(isinstance(d, int) for d in args) and (args[0] % 3, args[1] % 3) == (2, 1)
    return False


def _plan_hidden(site: Site) -> None:
    """Replay token-dim indexing on the hidden states; fills ``hidden_plan`` or stops the site.

    Reshapes of the token dims are deferred (row-major order is kept, and the op
    flattens at the end); one followed by token-dim indexing is made concrete from
    the leading shape of the logits at that point.
    """
    pending = False
    for node, kind in site.steps:
        if kind == "reshape":
            pending = pending or example_value(node).shape != example_value(node.args[0]).shape
        elif kind == "index":
            if pending and not _append_reshape(site, example_value(node.args[0]), node):
                return
            pending = False
            site.hidden_plan.append(("replay", node))
    if site.class_dim_moved is not None and pending:
        _append_reshape(site, example_value(site.class_dim_moved.args[0]), site.class_dim_moved)


def _append_reshape(site: Site, logits: torch.Tensor, at: Node) -> bool:
    """Plan ``hidden.reshape(*leading, H)`` for the logits' leading shape; one symbolic
    size becomes -1, more than one (or a symbolic H) stops the site."""
    leading = tuple(logits.shape[:-1])
    symbolic = [i for i, size in enumerate(leading) if not isinstance(size, int)]
    hidden_size = example_value(site.projection.hidden).shape[-1]
    if len(symbolic) > 1 or not isinstance(hidden_size, int):
        site.stop, site.stop_kind = at, "symbolic_reshape"
        return False
    site.hidden_plan.append(("reshape", tuple(-1 if i in symbolic else size for i, size in enumerate(leading))))
    return True


def match_site(node: Node, call: CrossEntropyCall) -> Site:
    """Walk back from a cross-entropy call's input to its projection."""
    site = Site(node, call)
    current = call.input
    if not is_tensor_node(current):
        site.stop, site.stop_kind = (current if isinstance(current, Node) else None), "unreadable"
        return site
    ndim = example_value(current).dim()
    if ndim == 1:
        site.stop, site.stop_kind = current, "unbatched"
        return site
    if ndim >= 3:
        if not _moves_class_dim_to_1(current):
            site.stop, site.stop_kind = current, "class_dim_1"
            return site
        site.class_dim_moved, current = current, current.args[0]
    steps: list[Step] = []
    while True:
        site.projection = as_projection(current)
        if site.projection is not None:
            break
        if not isinstance(current, Node):
            site.stop, site.stop_kind = None, "unreadable"
            return site
        kind = "graph_input" if current.op == "placeholder" else _classify(current)
        if kind not in ("reshape", "copy", "cast", "index"):
            site.stop, site.stop_kind = current, kind
            break
        steps.append(Step(current, kind))
        current = current.args[0]
    site.steps = steps[::-1]
    if site.projection is not None:
        if example_value(site.projection.hidden).dim() < 2:
            site.stop, site.stop_kind, site.projection = site.projection.node, "unbatched", None
        else:
            _plan_hidden(site)
    return site


def find_sites(graph: Graph, in_subgraph: bool = False) -> list[Site]:
    """Every cross-entropy call in ``graph``, in graph order, matched back to its projection.

    ``in_subgraph``: ``graph`` is a higher-order op's body, whose inputs come from the
    enclosing graph (a loss on such an input is ``subgraph_input``, not a graph break).
    """
    sites = []
    for node in graph.nodes:
        if node.op == "call_module":
            if isinstance(module_attr(graph, node.target), torch.nn.CrossEntropyLoss):
                sites.append(Site(node, None, stop=node, stop_kind="call_module"))
            continue
        if node.op != "call_function" or node.target not in CROSS_ENTROPY_FUNCTIONS:
            continue
        try:
            site = match_site(node, read_cross_entropy(node))
            if in_subgraph and site.stop_kind == "graph_input":
                site.stop_kind = "subgraph_input"
            sites.append(site)
        except Exception as exc:  # noqa: BLE001 - a graph we cannot read never fails the compile
            sites.append(Site(node, None, stop=node, stop_kind="internal_error", error=f"{type(exc).__name__}: {exc}"))
    return sites


def logits_dtypes(site: Site) -> list[torch.dtype]:
    """The dtypes the logits pass through: the projection's, each cast's, and the
    dtype the loss is computed in (the cross-entropy output's: fp32 under autocast).
    Consecutive repeats are dropped."""
    chain = [example_value(site.projection.node).dtype]
    chain += [example_value(step.node).dtype for step in site.steps if step.kind == "cast"]
    chain.append(example_value(site.node).dtype)
    return [dtype for i, dtype in enumerate(chain) if i == 0 or dtype != chain[i - 1]]
