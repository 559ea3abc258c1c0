"""Find cross-entropy sites in a torch-level FX graph and see back to their projection.

Works on the graph TorchDynamo captures (and on Inductor's pre-grad graph, which
is the same IR): torch-level ops, tensor metadata in ``node.meta["example_value"]``.
From the cross-entropy input the walk goes back through ops that only reshape,
copy, cast or index the token dims of the logits, as Dynamo emits them:

    .float() .view(-1, V) .contiguous() .to(dtype)   call_method
    logits[..., :-1, :]         call_function operator.getitem(x, (Ellipsis, slice, slice))
    logits.transpose(1, 2)      call_method transpose (class dim moved to 1 for the loss)

and through one scaling of the logits by a constant, which the op reproduces (its
``logit_scale``; read by :mod:`compile_pass.graph.projection`),

until it reaches a projection (:mod:`compile_pass.graph.projection`). The matcher only
states facts (what each node on the path is, and where and why the walk stopped: a
kind of :data:`compile_pass.graph.refusals.STOPS`); the guard decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.fx import Node

from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    RESHAPES,
    TOKEN_INDEXES,
    TRANSPOSES,
    dims_arg,
    example_value,
    is_tensor_node,
    same_size,
    tensor_op_name,
)
from compile_pass.graph.projection import Projection, ScaleRead, as_projection, read_scale
from compile_pass.graph.refusals import Refusal
from compile_pass.graph.spellings.call import Call, StepKind
from compile_pass.graph.stages import reached
from compile_pass.graph.tensor_parallel import read_sharded
from compile_pass.op.checks import is_last_dim
from compile_pass.op.kernels import HeadScale

# RESHAPES, COPIES, CASTS: the hidden states need nothing for them but a final flatten;
# TOKEN_INDEXES (select or reorder token dims): replayed on the hidden states.


class Step(NamedTuple):
    """One node between projection and loss, and how it treats the logits."""

    node: Node
    kind: StepKind


class Reshape(NamedTuple):
    """A step of a site's hidden-states plan: ``hidden.reshape(*shape, H)``."""

    shape: tuple[int, ...]


class Replay(NamedTuple):
    """A step of a site's hidden-states plan: ``node``'s token-dim indexing replayed on them."""

    node: Node


@dataclass
class Site:
    """One cross-entropy call and what lies between it and its projection.

    ``steps`` run forward, from the projection's output to the cross-entropy input.
    When the walk could not reach a projection, ``stop`` is the node it stopped at
    and ``stop_kind`` says why (the guard words it).
    """

    node: Node
    call: Call | None
    projection: Projection | None = None
    steps: list[Step] = field(default_factory=list)
    class_dim_moved: Node | None = None  # transpose taking [B, T, V] to [B, V, T] right before the loss
    stop: Node | None = None
    stop_kind: Refusal | None = None  # one of refusals.STOPS
    error: str | None = None  # what went wrong reading the site (INTERNAL_ERROR)
    stop_detail: str | None = None  # what of a scaling the op cannot take (the SCALE_* kinds)
    hidden_plan: list[Reshape | Replay] = field(default_factory=list)
    scale: HeadScale[Node] | None = None  # the logits' scaling, read at ``scale_node``
    scale_node: Node | None = None  # the multiply / divide, also among ``steps`` (kind SCALE)

    def erasable(self) -> list[Node]:
        """The nodes a rewrite of this site erases where nothing else reads them, loss side first."""
        moved = [self.class_dim_moved] if self.class_dim_moved is not None else []
        return [*moved, *self.call.inner, *(step.node for step in self.steps[::-1]), self.projection.node,
                *self.projection.inner[::-1]]


def _index_keeps_vocab_dim(index: Any, ndim: int) -> Refusal | None:
    """None when ``x[index]`` leaves the last dim whole; else ``VOCAB_DIM`` / ``ADVANCED_INDEX``."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if isinstance(item, (list, bool, torch.Tensor)) or (isinstance(item, Node) and is_tensor_node(item)):
            return Refusal.ADVANCED_INDEX
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
    return None if full else Refusal.VOCAB_DIM


def _classify(node: Node) -> StepKind | Refusal:
    """How a node between projection and loss treats the logits: reshape / copy /
    cast / index, or a stop kind (``OPAQUE``, ``VOCAB_DIM``, ``ADVANCED_INDEX``)."""
    name = tensor_op_name(node)
    if name is None or not node.args or not is_tensor_node(node.args[0]) or not is_tensor_node(node):
        return Refusal.OPAQUE
    before, after = example_value(node.args[0]), example_value(node)
    ndim = before.dim()
    if ndim == 0 or after.dim() == 0 or not same_size(after.shape[-1], before.shape[-1]):
        return Refusal.VOCAB_DIM if name in RESHAPES | TOKEN_INDEXES else Refusal.OPAQUE
    if name in CASTS:
        same = after.shape == before.shape and after.device == before.device
        return StepKind.CAST if same and after.is_floating_point() else Refusal.OPAQUE
    if after.dtype != before.dtype:
        return Refusal.OPAQUE
    if name in COPIES:
        return StepKind.COPY if after.shape == before.shape else Refusal.OPAQUE
    if name in RESHAPES:
        return StepKind.RESHAPE
    if name == "getitem":
        return _index_keeps_vocab_dim(node.args[1], ndim) or StepKind.INDEX
    if name in ("narrow", "select"):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return StepKind.INDEX if isinstance(dim, int) and not is_last_dim(dim, ndim) else Refusal.VOCAB_DIM
    if name in TRANSPOSES:
        dims = node.args[1:]
        ok = len(dims) == 2 and all(isinstance(d, int) and not is_last_dim(d, ndim) for d in dims)
        return StepKind.INDEX if ok else Refusal.VOCAB_DIM
    if name == "permute":
        dims = dims_arg(node.args[1:])
        return StepKind.INDEX if dims and is_last_dim(dims[-1], ndim) else Refusal.VOCAB_DIM
    return Refusal.OPAQUE


def _moves_class_dim_to_1(node: Any) -> bool:
    """``[B, T, V] -> [B, V, T]``: transpose(1, 2) / permute(0, 2, 1) / movedim(-1, 1)."""
    if not isinstance(node, Node) or not is_tensor_node(node) or example_value(node).dim() != 3:
        return False
    name, args = tensor_op_name(node), list(node.args[1:])
    if name in TRANSPOSES:
        return len(args) == 2 and all(isinstance(d, int) for d in args) and {d % 3 for d in args} == {1, 2}
    if name == "permute":
        dims = dims_arg(args)
        return all(isinstance(d, int) for d in dims) and [d % 3 for d in dims] == [0, 2, 1]
    if name == "movedim":
        return len(args) == 2 and all(isinstance(d, int) for d in args) and (args[0] % 3, args[1] % 3) == (2, 1)
    return False


class Stop(NamedTuple):
    """Where the walk stopped short of a projection, and why."""

    node: Node | None
    kind: Refusal  # one of refusals.STOPS
    detail: str | None = None


def match_site(node: Node, call: Call, in_subgraph: bool = False) -> Site:
    """Walk back from a cross-entropy call's input to its projection: the site with its
    steps, scaling and plan for the hidden states, or the :class:`Stop` that ended the walk.

    ``in_subgraph``: the graph is a higher-order op's body (logits that are its input
    stop the walk as ``SUBGRAPH_INPUT``, not ``GRAPH_INPUT``).
    """
    site = Site(node, call)
    stop = _class_dim(site) or _walk(site, in_subgraph) or _plan_hidden(site)
    if stop is not None:
        site.stop, site.stop_kind, site.stop_detail = stop
    return site


def _class_dim(site: Site) -> Stop | None:
    """A readable loss input; ``[B, V, T]`` logits are a transpose of ``[B, T, V]`` ones (``class_dim_moved``)."""
    loss_input = site.call.input
    if not is_tensor_node(loss_input):
        return Stop(loss_input if isinstance(loss_input, Node) else None, Refusal.UNREADABLE)
    # ndim 1: unbatched logits [V] (a 0-d target), the hidden states are unsqueezed
    if example_value(loss_input).dim() >= 3 and site.call.class_dim == 1:
        if not _moves_class_dim_to_1(loss_input):
            return Stop(loss_input, Refusal.CLASS_DIM_1)
        site.class_dim_moved = loss_input
    return None


def _walk(site: Site, in_subgraph: bool) -> Stop | None:
    """From the loss input back to the projection, one node a step; fills ``projection``,
    ``steps`` (forward order) and ``scale``, or returns where it stopped."""
    current = site.call.input if site.class_dim_moved is None else site.class_dim_moved.args[0]
    steps: list[Step] = []
    log_softmax_ahead = StepKind.LOG_SOFTMAX in site.call.passes.values()  # a spelling's, not yet passed
    projection, stop = _projection_at(current)
    while stop is None and projection is None:
        step, stop = _step(site, current, in_subgraph, log_softmax_ahead)
        if step is not None:
            steps.append(step)
            log_softmax_ahead = log_softmax_ahead and step.kind is not StepKind.LOG_SOFTMAX
            current = read_scale(current).logits if step.kind is StepKind.SCALE else current.args[0]
            projection, stop = _projection_at(current)
    site.projection, site.steps = projection, steps[::-1]
    return stop


def _projection_at(node: Any) -> tuple[Projection | None, Stop | None]:
    """The projection whose logits ``node`` is (a vocabulary-sharded head's gathered or
    ``Shard(-1)`` logits too: :mod:`compile_pass.graph.tensor_parallel`), or a stop there."""
    sharded = read_sharded(node)
    if sharded is None:
        return as_projection(node), None
    projection, why = sharded
    return projection, None if why is None else Stop(node, Refusal.TENSOR_PARALLEL, why)


def _step(site: Site, node: Any, in_subgraph: bool, log_softmax_ahead: bool) -> tuple[Step | None, Stop | None]:
    """What the walk does at ``node``, which is no projection: passes it, or stops there."""
    if not isinstance(node, Node):
        return None, Stop(None, Refusal.UNREADABLE)
    reached("walk", node)
    passes = site.call.passes
    read = None if node in passes else read_scale(node)
    if read is not None:
        return _scale_step(site, node, read, log_softmax_ahead)
    if node.op == "placeholder":
        return None, Stop(node, Refusal.SUBGRAPH_INPUT if in_subgraph else Refusal.GRAPH_INPUT)
    kind = passes.get(node) or _classify(node)
    return (Step(node, kind), None) if isinstance(kind, StepKind) else (None, Stop(node, kind))


def _scale_step(site: Site, node: Node, read: ScaleRead, log_softmax_ahead: bool) -> tuple[Step | None, Stop | None]:
    """The walk at a multiply / divide: the site's one scaling of the logits, or a stop
    (``log_softmax_ahead``: the node scales a spelling's log-probabilities)."""
    if read.scale is None:
        return None, Stop(node, read.stop_kind, read.detail)
    if site.scale is not None:
        return None, Stop(node, Refusal.SCALE_TWICE)
    if log_softmax_ahead:
        return None, Stop(node, Refusal.SCALE_OPERAND, "a scaling of the log-probabilities, after the log_softmax")
    site.scale, site.scale_node = read.scale, node
    return Step(node, StepKind.SCALE), None


def _plan_hidden(site: Site) -> Stop | None:
    """Replay token-dim indexing on the hidden states: fills ``hidden_plan``, or returns
    why it cannot (``SYMBOLIC_RESHAPE``).

    Reshapes of the token dims are deferred (row-major order is kept, and the op
    flattens at the end); one followed by token-dim indexing is made concrete from
    the leading shape of the logits at that point.
    """
    pending, stop = False, None
    for node, kind in site.steps:
        if kind is StepKind.RESHAPE:
            pending = pending or example_value(node).shape != example_value(node.args[0]).shape
        elif kind is StepKind.INDEX:
            stop = stop or (_append_reshape(site, example_value(node.args[0]), node) if pending else None)
            pending = False
            site.hidden_plan.append(Replay(node))
    if site.class_dim_moved is not None and pending:
        stop = stop or _append_reshape(site, example_value(site.class_dim_moved.args[0]), site.class_dim_moved)
    return stop


def _append_reshape(site: Site, logits: torch.Tensor, at: Node) -> Stop | None:
    """Plan ``hidden.reshape(*leading, H)`` for the logits' leading shape; one symbolic
    size becomes -1, more than one (or a symbolic H) stops the site at ``at``."""
    leading = tuple(logits.shape[:-1])
    symbolic = [i for i, size in enumerate(leading) if not isinstance(size, int)]
    hidden_size = example_value(site.projection.hidden).shape[-1]
    if len(symbolic) > 1 or not isinstance(hidden_size, int):
        return Stop(at, Refusal.SYMBOLIC_RESHAPE)
    site.hidden_plan.append(Reshape(tuple(-1 if i in symbolic else size for i, size in enumerate(leading))))
    return None
