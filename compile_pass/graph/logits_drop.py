"""Opt-in: a training step does not compute the logits it returns but never reads.

    model = torch.compile(model, backend="chunkce", options={"returned_logits": "drop"})
    out = model(input_ids=ids, labels=labels)   # out.loss as usual
    out.logits                                  # DroppedLogits: shape / dtype / device only

HF causal LMs return ``logits`` beside ``loss``. Once the loss is rewritten, the
projection stays in the graph only for that output: ``[N, V]`` in the weight's
dtype in forward, held for as long as the caller holds the output (usually
across backward), and, because the output requires grad, a zero ``[N, V]``
gradient and two matmuls against it in backward.

With the option, such logits are replaced in the graph by a NaN scalar expanded
to their shape (no memory), and the backend's wrapper hands the caller a
:class:`DroppedLogits` in that slot. Only logits that (1) fed a loss the pass
rewrote in the same top-level graph, (2) are read by nothing in the graph but
the graph output (directly, or through dtype casts: accelerate's mixed-precision
wrapper ``.float()``s every output inside the traced forward; copies such as
OPT's ``.contiguous()``; the scale the pass absorbs, Cohere's and Granite's), and (3) require
grad (a training graph) are dropped. In a graph without grad (evaluation under
``no_grad``) such logits are lazy instead, as with the default option
(:mod:`compile_pass.graph.lazy_logits`): an evaluation loop reads them. Code that reads a dropped tensor's values fails with an error naming the
option; it never sees wrong numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.utils._pytree import tree_map

from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    Edit,
    create_node,
    example_value,
    size_hint,
    tensor_op_name,
)
from compile_pass.graph.scale import read_scale

DROPPED = "chunkce_dropped_logits"  # meta key on the stand-in node of the graph output

_aten = torch.ops.aten
# Ops that only change a tensor's metadata (view, dtype, device): they give another
# DroppedLogits. accelerate's mixed-precision wrapper calls .float() on every output,
# callers detach or move outputs: none of that reads a value.
METADATA_OPS = {
    _aten.detach.default, _aten.alias.default, _aten._to_copy.default, _aten.clone.default,
    _aten.view.default, _aten._unsafe_view.default, _aten.t.default, _aten.transpose.int,
    _aten.permute.default, _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.default, _aten.expand.default,
}


class DroppedLogits(torch.Tensor):
    """Stands in for logits a training step did not compute (``returned_logits="drop"``).

    Has the logits' shape, dtype and device and no storage. View, cast and copy
    ops give another ``DroppedLogits``; any op that would read values raises
    ``RuntimeError``.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> DroppedLogits:
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                   requires_grad=False)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DroppedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def tolist(self) -> Any:  # these read values without going through dispatch
        raise _not_computed("tolist")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise _not_computed("numpy")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _not_computed("__array__")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in METADATA_OPS:
            raise _not_computed(func)
        source = args[0]
        device = kwargs.pop("device", None) or source.device
        meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, DroppedLogits) else t, (args, kwargs))
        out = func(*meta[0], **meta[1])
        return DroppedLogits(out.shape, out.dtype, device)


def _not_computed(what: Any) -> RuntimeError:
    return RuntimeError(
        f"chunkce: {what} read logits that were not computed: this compiled step was built with "
        "options={'returned_logits': 'drop'}, which skips returned logits nothing in the graph reads. "
        "Compile with returned_logits='lazy' (the default: computed when read) or 'keep' to get the logits."
    )


def returned_chain(node: Node) -> list[Node] | None:
    """``[node, step, ..., returned]``: the projection and the steps of :func:`_is_step_of`
    (each read by nothing but the next) up to the value the graph returns; None when
    anything else reads them."""
    chain = [node]
    while True:
        users = list(chain[-1].users)
        if users and all(user.op == "output" for user in users):
            return chain
        if len(users) != 1 or not _is_step_of(users[0], chain[-1]):
            return None
        chain.append(users[0])


def _is_step_of(node: Node, source: Node) -> bool:
    """Whether ``node`` gives logits of ``source``'s shape and device, floating, from
    ``source`` by a dtype cast (accelerate's mixed-precision wrapper, ``convert_outputs_to_fp32``,
    ``.float()``s every output inside the traced forward; ``.type_as(other)`` reads only
    ``other``'s dtype), a copy (``.contiguous()``, OPT's head) or a scale the pass
    absorbs (Cohere's ``* logit_scale``, Granite's ``/ logits_scaling``:
    :func:`compile_pass.graph.scale.read_scale`)."""
    before, after = example_value(source), example_value(node)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and after.is_floating_point()
            and after.shape == before.shape and after.device == before.device):
        return False
    name = tensor_op_name(node)
    if name in CASTS or name in COPIES:
        return bool(node.args) and node.args[0] is source
    read = read_scale(node)
    return read is not None and read.scale is not None and read.scale.logits is source


def only_returned(node: Node) -> bool:
    """Whether ``node`` (a kept projection of a top-level graph) is logits read by nothing
    but the graph output, directly or through dtype casts, copies and an absorbed scale
    (:func:`returned_chain`), in a training graph or a graph without grad alike: what
    ``returned_logits="lazy"`` takes out of the graph."""
    chain = returned_chain(node) if node.users else None
    return chain is not None and isinstance(example_value(chain[-1]), torch.Tensor)


def droppable(node: Node) -> bool:
    """Whether ``node`` is :func:`only_returned` training logits (they require grad): what
    ``returned_logits="drop"`` drops. Logits of a graph without grad (evaluation) are not
    dropped: they are lazy (:mod:`compile_pass.graph.lazy_logits`)."""
    return only_returned(node) and example_value(returned_chain(node)[-1]).requires_grad


def drop_if_only_returned(projection: Projection, edit: Edit) -> int:
    """Replace a kept projection (and the casts up to the graph output) by a stand-in if
    it is :func:`droppable`, as part of the site's ``edit``; returns the bytes of logits
    no longer computed (0: left as is)."""
    return take_out(projection, edit, True) if droppable(projection.node) else 0


def take_out(projection: Projection, edit: Edit, mark: Any) -> int:
    """Replace an :func:`only_returned` projection and its :func:`returned_chain` by a stand-in
    (:func:`stand_in_for`) whose ``meta[DROPPED]`` is ``mark``, as part of ``edit``;
    returns the bytes of the values no longer computed."""
    chain = returned_chain(projection.node)
    stand_in = stand_in_for(projection, example_value(chain[-1]))
    stand_in.meta[DROPPED] = mark
    edit.replace_all_uses_with(chain[-1], stand_in)
    for dead in (*chain[::-1], *projection.inner[::-1]):
        if not dead.users:
            edit.erase(dead)
    return sum(size_hint(example_value(n).numel()) * example_value(n).element_size() for n in chain)


def stand_in_for(projection: Projection, returned: torch.Tensor) -> Node:
    """A node giving a NaN scalar expanded to ``returned``'s shape (sizes read from the
    hidden states, symbolic ones too) and dtype, inserted before the projection."""
    graph: Graph = projection.node.graph
    with graph.inserting_before(projection.node):
        nan = create_node(graph, "call_method", "new_full", (projection.hidden, (), float("nan")),
                          {"dtype": returned.dtype})
        sizes = [size if isinstance(size, int) else create_node(graph, "call_function", _aten.sym_size.int,
                                                                (projection.hidden, dim))
                 for dim, size in enumerate(returned.shape[:-1])]
        return create_node(graph, "call_method", "expand", (nan, *sizes, returned.shape[-1]))
