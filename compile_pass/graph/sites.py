"""Find cross-entropy sites in a torch-level FX graph and see back to their projection.

Works on the graph TorchDynamo captures (and on Inductor's pre-grad graph, which
is the same IR): torch-level ops, tensor metadata in ``node.meta["example_value"]``.
From the cross-entropy input the walk goes back through ops that only reshape,
copy, cast or index the token dims of the logits, as Dynamo emits them:

    .float() .view(-1, V) .contiguous() .to(dtype)   call_method
    logits[..., :-1, :]         call_function operator.getitem(x, (Ellipsis, slice, slice))
    logits.transpose(1, 2)      call_method transpose (class dim moved to 1 for the loss)

and through one scaling of the logits by a constant (:func:`read_scale`), which the op
reproduces (its ``logit_scale``):

    logits * s, s * logits      call_function operator.mul / torch.mul, call_method mul
    logits / s                  call_function operator.truediv / torch.div / torch.true_divide,
                                call_method div / true_divide

with ``s`` a Python number (a constant of the graph), a 0-d tensor node (an input,
buffer or parameter) that does not require grad, or the ``.item()`` of one (a float
argument Dynamo made dynamic),

until it reaches a projection (:mod:`compile_pass.graph.forms`). The matcher only
states facts (what each node on the path is); the guard decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numbers
import operator

import torch
from torch.fx import Graph, Node

from compile_pass.graph.forms import CrossEntropyCall, Projection, as_projection
from compile_pass.graph.nodes import dims_arg, example_value, is_tensor_node, module_attr, same_size, tensor_op_name
from compile_pass.graph.spellings import read_loss

# Ops on the logits that only change shape (row-major, vocab dim kept last), copy,
# or cast: the hidden states need nothing for them but a final flatten.
_RESHAPE = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_COPY = {"contiguous", "clone"}
_CAST = {"float", "half", "bfloat16", "double", "to", "type", "type_as"}
# Ops that select or reorder token dims: replayed on the hidden states.
_TOKEN_INDEX = {"getitem", "narrow", "select", "transpose", "swapaxes", "swapdims", "permute"}
# A scaling of the logits by a constant, out of place: absorbed into the op.
_MULTIPLY = (operator.mul, torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply)
_DIVIDE = (operator.truediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div,
           torch.Tensor.divide, torch.Tensor.true_divide)
# ... in place: refused (stop kind ``in_place_scale``).
_SCALE_IN_PLACE = (operator.imul, operator.itruediv, torch.Tensor.mul_, torch.Tensor.multiply_,
                   torch.Tensor.div_, torch.Tensor.divide_, torch.Tensor.true_divide_)


class Step(NamedTuple):
    """One node between projection and loss, and how it treats the logits."""

    node: Node
    # reshape | copy | cast | index | scale | log_softmax | neg (the last two: CrossEntropyCall.passes)
    kind: str


@dataclass(frozen=True)
class Scale:
    """``logits * value`` (``logits / value`` when ``divides``) between projection and loss."""

    node: Node  # the mul / div; its dtype (the logits', no promotion) is the dtype it scales in
    logits: Node  # its logits operand
    value: Any  # a Python int / float, or the node of a 0-d tensor that does not require grad
    divides: bool
    item: Node | None = None  # the `value.item()` the graph scaled by (a float input Dynamo made dynamic)

    @property
    def dtype(self) -> torch.dtype:
        return example_value(self.node).dtype


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
    # | class_dim_1 | call_module | unreadable | internal_error
    # | scale_operand | scale_requires_grad | scale_twice | in_place_scale
    stop_kind: str | None = None
    error: str | None = None  # what went wrong reading the site (internal_error)
    stop_detail: str | None = None  # what of a scaling the op cannot take (the scale_* kinds)
    hidden_plan: list[tuple[str, Any]] = field(default_factory=list)  # ("reshape", shape) | ("replay", node)
    scale: Scale | None = None  # the logits' scaling, also among ``steps`` (kind "scale")


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


def _function(node: Node) -> Any:
    """The torch function a call_function / call_method node runs (a method as ``torch.Tensor.<name>``)."""
    if node.op == "call_method":
        return getattr(torch.Tensor, str(node.target), None)
    return node.target if node.op == "call_function" else None


class ScaleRead(NamedTuple):
    """What :func:`read_scale` found: a :class:`Scale`, or a stop kind and what stops it."""

    scale: Scale | None
    stop_kind: str | None = None
    detail: str | None = None


def read_scale(node: Node) -> ScaleRead | None:
    """The scaling a multiply / divide node applies to the logits; None when ``node`` is
    no multiply or divide.

    Absorbed: ``logits * s``, ``s * logits`` and ``logits / s`` for ``s`` a Python int or
    float, or a 0-d real tensor node that does not require grad, the result in the
    logits' own dtype (a 0-d tensor or a number does not promote a dimensioned tensor
    of its category: ``bf16 * fp32 0-d -> bf16``). Anything else is read as a stop:
    ``in_place_scale`` (``mul_``, ``*=``, ``out=``), ``scale_requires_grad`` (the scale
    would need its own gradient), ``scale_operand`` (every other multiplier or divisor:
    a tensor with dims, a symbolic number, ``s / logits``, a rounding mode, a promotion).
    """
    function = _function(node)
    if function in _SCALE_IN_PLACE or (function in _MULTIPLY + _DIVIDE and "out" in node.kwargs):
        return ScaleRead(None, "in_place_scale")
    if function not in _MULTIPLY + _DIVIDE:
        return None
    divides = function in _DIVIDE
    kwargs = dict(node.kwargs)
    rounding_mode = kwargs.pop("rounding_mode", None)
    operands = [*node.args, *(kwargs.pop(name) for name in ("input", "other") if name in kwargs)]
    if kwargs or len(operands) != 2 or not is_tensor_node(node):
        return ScaleRead(None, "scale_operand", "arguments chunkce cannot read")
    if rounding_mode is not None:
        return ScaleRead(None, "scale_operand", f"a division with rounding_mode={rounding_mode!r}")
    output = example_value(node)
    candidates = [i for i, arg in enumerate(operands) if is_tensor_node(arg)
                  and example_value(arg).dim() >= 1 and example_value(arg).shape == output.shape]
    if len(candidates) != 1:
        return ScaleRead(None, "scale_operand", "a product or quotient of two [..., V] tensors")
    position = candidates[0]
    if divides and position == 1:
        return ScaleRead(None, "scale_operand", "the logits are the divisor: `s / logits`")
    logits, value = operands[position], operands[1 - position]
    item = _item_of_0d_tensor(value)
    value = value if item is None else item.args[0]
    problem = _scale_problem(value, example_value(logits), output)
    if problem is not None:
        return ScaleRead(None, *problem)
    return ScaleRead(Scale(node, logits, value, divides, item))


def _item_of_0d_tensor(value: Any) -> Node | None:
    """``value`` when it is ``t.item()`` of a 0-d tensor node ``t``, else None.

    A Python float argument of the compiled function that Dynamo made dynamic (a new
    value on a later call) enters the graph as a 0-d fp64 tensor and is read back with
    ``.item()``. Scaling by that number rounds as scaling by the tensor does (a
    0-d tensor does not promote the logits either; both are converted to the
    logits' computation dtype), so the op takes the tensor."""
    if not (isinstance(value, Node) and value.op == "call_method" and value.target == "item"
            and len(value.args) == 1 and not value.kwargs and is_tensor_node(value.args[0])):
        return None
    return value if example_value(value.args[0]).dim() == 0 else None


def _scale_problem(value: Any, logits: torch.Tensor, output: torch.Tensor) -> tuple[str, str] | None:
    """Why the op cannot take ``value`` as the scale of ``logits`` (giving ``output``):
    ``(stop kind, detail)``, or None."""
    if isinstance(value, Node):
        fake = example_value(value)
        if isinstance(fake, (torch.SymInt, torch.SymFloat)):
            return "scale_operand", (f"the symbolic number `{value.name}`: a Python number Dynamo made "
                                     "dynamic; pass it as a 0-d tensor")
        if not isinstance(fake, torch.Tensor):
            return "scale_operand", f"`{value.name}`, which is not a tensor or a number"
        if fake.dim() != 0:
            return "scale_operand", (f"a multiplier of shape {tuple(fake.shape)}, broadcast over the "
                                     "logits, not a 0-d tensor")
        if fake.is_complex() or fake.dtype == torch.bool:
            return "scale_operand", f"a 0-d tensor of dtype {fake.dtype}"
        if fake.requires_grad:
            return "scale_requires_grad", f"`{value.name}`"
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "scale_operand", f"the constant {value!r}, not a real number"
    if output.dtype != logits.dtype or not output.is_floating_point():
        return "scale_operand", f"a scale that changes the logits' dtype ({logits.dtype} -> {output.dtype})"
    return None


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
    ndim = example_value(current).dim()  # 1: unbatched logits [V] (a 0-d target), the hidden states unsqueezed
    if ndim >= 3 and call.class_dim == 1:
        if not _moves_class_dim_to_1(current):
            site.stop, site.stop_kind = current, "class_dim_1"
            return site
        site.class_dim_moved, current = current, current.args[0]
    steps: list[Step] = []
    log_softmax_ahead = "log_softmax" in call.passes.values()  # a spelling's, not yet passed
    while True:
        site.projection = as_projection(current)
        if site.projection is not None:
            break
        if not isinstance(current, Node):
            site.stop, site.stop_kind = None, "unreadable"
            return site
        scale = None if current in call.passes else read_scale(current)
        if scale is not None:
            if scale.scale is None:
                site.stop, site.stop_kind, site.stop_detail = current, scale.stop_kind, scale.detail
                break
            if site.scale is not None:
                site.stop, site.stop_kind = current, "scale_twice"
                break
            if log_softmax_ahead:
                site.stop, site.stop_kind = current, "scale_operand"
                site.stop_detail = "a scaling of the log-probabilities, after the log_softmax"
                break
            site.scale = scale.scale
            steps.append(Step(current, "scale"))
            current = scale.scale.logits
            continue
        kind = call.passes.get(current) or ("graph_input" if current.op == "placeholder" else _classify(current))
        log_softmax_ahead = log_softmax_ahead and kind != "log_softmax"
        if kind not in ("reshape", "copy", "cast", "index", "log_softmax", "neg"):
            site.stop, site.stop_kind = current, kind
            break
        steps.append(Step(current, kind))
        current = current.args[0]
    site.steps = steps[::-1]
    if site.projection is not None:
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
        try:
            call = read_loss(node)  # F.cross_entropy, or an older spelling (spellings.py)
            if call is None:
                continue
            site = match_site(node, call)
            if in_subgraph and site.stop_kind == "graph_input":
                site.stop_kind = "subgraph_input"
            sites.append(site)
        except Exception as exc:  # noqa: BLE001 - a graph we cannot read never fails the compile
            sites.append(Site(node, None, stop=node, stop_kind="internal_error", error=f"{type(exc).__name__}: {exc}"))
    return sites


def logits_dtypes(site: Site) -> list[torch.dtype]:
    """The dtypes the logits pass through: the projection's, each cast's, the scaling's,
    and the dtype the loss is computed in (the cross-entropy output's: fp32 under
    autocast). Consecutive repeats are dropped."""
    chain = [example_value(site.projection.node).dtype]
    chain += [example_value(step.node).dtype for step in site.steps if step.kind in ("cast", "scale")]
    chain.append(example_value(site.node).dtype)
    return _dedupe(chain)


def cast_chains(site: Site) -> list[list[torch.dtype]]:
    """The dtype chains between the points where the op rounds the logits: one chain,
    :func:`logits_dtypes`, without a scaling; with one, projection -> the scaling's dtype
    and the scaling's dtype -> the loss's (the op rounds to each chain's last dtype)."""
    if site.scale is None:
        return [logits_dtypes(site)]
    chains: list[list[torch.dtype]] = [[example_value(site.projection.node).dtype]]
    for step in site.steps:
        if step.kind == "cast":
            chains[-1].append(example_value(step.node).dtype)
        elif step.kind == "scale":
            chains[-1].append(site.scale.dtype)
            chains.append([site.scale.dtype])
    chains[-1].append(example_value(site.node).dtype)
    return [_dedupe(chain) for chain in chains]


def _dedupe(chain: list[torch.dtype]) -> list[torch.dtype]:
    """``chain`` without consecutive repeats."""
    return [dtype for i, dtype in enumerate(chain) if i == 0 or dtype != chain[i - 1]]
