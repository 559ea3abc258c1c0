"""The returned-logits pass: logits that fed a rewritten loss and that only the graph output reads leave the graph.

    fused = rewrite_losses(gm.graph, options)                       # graph/driver.py: the losses
    plan = take_out_returned_logits(gm.graph, fused, options)       # this pass: keep / lazy / drop
    compiled = wrap_compiled(inner(gm), plan) if plan else inner(gm)  # compile_pass.lazy_logits.wrap

HF causal LMs return ``logits`` beside ``loss``. Once the loss is rewritten, the projection
stays in the graph only for that output: ``[N, V]`` in forward and, in a training graph, a
zero ``[N, V]`` gradient and two matmuls against it in backward. Logits of a top-level graph
that fed a rewritten loss (the driver hands over their projections) and that nothing reads
but the graph output, directly or through dtype casts (accelerate's mixed-precision wrapper
``.float()``s every output inside the traced forward), copies (OPT's ``.contiguous()``) and
the scale the pass absorbs (Cohere's, Granite's) -- :func:`only_returned` -- are replaced by a
stand-in, a NaN scalar expanded to their shape (no memory), marked ``meta[STAND_IN]`` with a
:class:`TakenOut`, as ``options.returned_logits`` says:

* ``"lazy"`` (the default), in training and no-grad graphs alike: the chain from the
  projection to the returned value is copied into a :class:`compile_pass.lazy_logits.Recipe`,
  and the graph returns, instead, the tensors it reads (hidden states ``[..., H]``, the head's
  weight and bias, a scale: :func:`add_outputs`). (An evaluation step that kept them would
  compute the ``[N, V]`` projection for them and the op would project every tile again.)
* ``"drop"``: training logits (they require grad) get the refusing recipe
  (:data:`compile_pass.lazy_logits.DROPPED`); no-grad logits are lazy, as an evaluation
  loop reads them.
* A tensor-parallel head's gathered logits (colwise_rep): lazy or dropped as above; the
  recipe takes the replicated hidden states' local tensor and makes it a DTensor again on the
  head's mesh (:func:`compile_pass.graph.tensor_parallel.recipe_hidden_states`), then runs the
  graph's DTensor nodes (the shard's projection, the gather, ``to_local``): a read is a
  collective every rank of the group must join. ``loss_parallel``'s ``Shard(-1)`` logits stay.
* ``"keep"``: nothing is taken out. The pre-grad pass runs no returned-logits pass (it
  cannot wrap the compiled graph) and passes ``"keep"`` to the driver.

The backend's wrapper (:func:`compile_pass.lazy_logits.wrap_compiled`) hands the caller a
:class:`compile_pass.lazy_logits.LazyLogits` (or ``DroppedLogits``) in each such slot. Each
projection is taken out all or nothing (:class:`compile_pass.graph.nodes.Edit`): a failure
leaves its logits computed (kept, exact), is logged at WARNING, and raises with ``strict``.
The driver asks :func:`taken_out_as` too: a no-grad site whose logits stay computed is left as
stock (the rewrite would only add a projection).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import Graph, GraphModule, Node

from compile_pass.graph import report, tensor_parallel
from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    Edit,
    create_node,
    example_value,
    is_tensor_node,
    size_hint,
    tensor_op_name,
)
from compile_pass.graph.scale import read_scale
from compile_pass.graph.tensor_parallel import local_value
from compile_pass.lazy_logits import DROPPED, Plan, Recipe, Refusing, Slot
from compile_pass.options import Options

if TYPE_CHECKING:
    from compile_pass.graph.driver import Fused

log = logging.getLogger(__name__)

STAND_IN = "chunkce_returned_logits"  # meta key of the stand-in node in the graph output: its TakenOut


@dataclass(frozen=True)
class TakenOut:
    """What a stand-in of the graph output carries (``node.meta[STAND_IN]``)."""

    recipe: Recipe | Refusing
    inputs: tuple[Node, ...]  # the recipe's inputs, nodes of the graph


def take_out_returned_logits(graph: Graph, fused: Fused, options: Options) -> Plan | None:
    """Take the returned logits of ``fused``'s kept projections out of ``graph`` (as
    ``options.returned_logits`` says), amend ``fused.report``'s records (``LOGITS_LAZY`` /
    ``LOGITS_DROPPED`` and the bytes, on the last site the logits fed), and append the
    recipes' inputs to the graph output (:func:`add_outputs`). Returns the plan for
    :func:`compile_pass.lazy_logits.wrap_compiled`, or None when nothing was taken out.

    Raises:
        Exception: ``options.strict`` and taking some logits out failed (the original error).
    """
    sites: dict[Node, list[int]] = {}  # projection -> the records of the sites it fed, in order
    projections: dict[Node, Projection] = {}
    for index, projection in fused.kept:
        sites.setdefault(projection.node, []).append(index)
        projections[projection.node] = projection
    records = fused.report.records
    for node, indices in sites.items():
        how = None
        try:
            with Edit(graph) as edit:
                how = taken_out_as(projections[node], options.returned_logits, in_subgraph=False)
                saved = take_out(projections[node], edit, how) if how is not None else 0
                graph.lint()
        except Exception:
            if options.strict:
                raise
            log.warning("chunkce: taking the returned logits of %s out of the graph failed; the step computes "
                        "them", node.format_node(), exc_info=True)
            continue
        if how is not None:
            for i in indices[:-1]:  # the projection is gone: no site's logits are kept
                records[i] = dataclasses.replace(records[i], reason="", fix="")
            last = records[indices[-1]]
            records[indices[-1]] = dataclasses.replace(
                last, reason=report.LOGITS_DROPPED if how == "drop" else report.LOGITS_LAZY, fix="",
                logits_bytes_avoided=last.logits_bytes_avoided + saved)
    return add_outputs(graph)


def taken_out_as(projection: Projection, mode: str | None, in_subgraph: bool) -> str | None:
    """How this pass takes out the logits of a kept ``projection`` under ``returned_logits=mode``:
    ``"lazy"``, ``"drop"``, or None (they stay computed: another reader, ``"keep"``, a
    higher-order op's body, inputs a recipe cannot take, the ``Shard(-1)`` DTensor logits of a
    ``loss_parallel`` head). The gathered logits of a vocabulary-sharded head (colwise_rep) are
    taken out too: their recipe is the graph's own DTensor nodes (the shard's projection, the
    gather, ``to_local``), so a read is a collective over the tensor-parallel group that every
    rank must join, as ``DTensor.full_tensor()`` is."""
    if in_subgraph or mode not in ("lazy", "drop") or not only_returned(projection.node):
        return None
    if projection.sharded is not None and projection.sharded.loss_parallel:  # Shard(-1) DTensor logits: kept
        return None
    (output,) = projection.node.graph.find_nodes(op="output")
    if not isinstance(output.args[0], (tuple, list)):
        return None
    chain = returned_chain(projection.node)
    if mode == "drop" and example_value(chain[-1]).requires_grad:
        return "drop"
    return "lazy" if _recipe_nodes(projection, chain) is not None else None


def only_returned(node: Node) -> bool:
    """Whether ``node`` (a kept projection) is logits read by nothing but the graph output,
    directly or through dtype casts, copies and an absorbed scale (:func:`returned_chain`)."""
    chain = returned_chain(node) if node.users else None
    return chain is not None and isinstance(example_value(chain[-1]), torch.Tensor)


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
    ``source`` by a dtype cast (``.type_as(other)`` reads only ``other``'s dtype), a copy
    or a scale the pass absorbs (:func:`compile_pass.graph.scale.read_scale`)."""
    before, after = example_value(source), example_value(node)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and after.is_floating_point()
            and after.shape == before.shape and after.device == before.device):
        return False
    name = tensor_op_name(node)
    if name in CASTS or name in COPIES:
        return bool(node.args) and node.args[0] is source
    read = read_scale(node)
    return read is not None and read.scale is not None and read.scale.logits is source


def take_out(projection: Projection, edit: Edit, how: str) -> int:
    """Replace the :func:`returned_chain` of ``projection`` by a stand-in carrying a
    :class:`TakenOut` (``how``: ``"lazy"`` or ``"drop"``), as part of ``edit``; returns the bytes
    of the values no longer computed."""
    chain = returned_chain(projection.node)
    taken = TakenOut(DROPPED, ()) if how == "drop" else _recipe(projection, chain)
    stand_in = _stand_in_for(projection, example_value(chain[-1]))
    stand_in.meta[STAND_IN] = taken
    edit.replace_all_uses_with(chain[-1], stand_in)
    for dead in (*chain[::-1], *projection.inner[::-1]):
        if not dead.users:
            edit.erase(dead)
    values = [local_value(example_value(n)) for n in chain] + tensor_parallel.logits_shards(projection)
    return sum(size_hint(v.numel()) * v.element_size() for v in values)


def _recipe_nodes(projection: Projection, chain: list[Node]) -> tuple[list[Node], list[Node]] | None:
    """The nodes a recipe runs (in graph order) and their inputs; None when an input is not
    a tensor or a number (a recipe cannot take it)."""
    order = {node: i for i, node in enumerate(projection.node.graph.nodes)}
    made = sorted({*projection.inner, *chain}, key=order.__getitem__)
    inputs = list(dict.fromkeys(arg for node in made for arg in node.all_input_nodes if arg not in made))
    if not all(isinstance(example_value(node), (torch.Tensor, torch.SymInt, torch.SymFloat, int, float))
               for node in inputs):
        return None
    return made, inputs


def _recipe(projection: Projection, chain: list[Node]) -> TakenOut:
    made, inputs = _recipe_nodes(projection, chain)
    rebuilt = None  # a tensor-parallel head's: the hidden states' local tensor, made a DTensor again in the recipe
    if projection.sharded is not None:
        rebuilt = tensor_parallel.recipe_hidden_states(projection, projection.node.graph)
        inputs = [rebuilt if node is projection.hidden else node for node in inputs]
    values = [example_value(node) for node in inputs]
    scalars = tuple(not isinstance(v, torch.Tensor) for v in values)
    projected = example_value(projection.node)
    operands = [example_value(a) for a in (projection.hidden, projection.weight) if is_tensor_node(a)]
    autocast_dtype = projected.dtype if any(v.dtype != projected.dtype for v in operands) else None
    roles = tuple("hidden states" if node is rebuilt else _role(node, projection) for node in inputs)
    module = _copy_nodes(projection.node.graph, made, inputs, scalars, chain[-1], projection, rebuilt)
    return TakenOut(Recipe(module, roles, scalars, autocast_dtype), tuple(inputs))


def _role(node: Node, projection: Projection) -> str:
    if node is projection.hidden:
        return "hidden states"
    if node is projection.weight:
        return "lm_head weight"
    if node is projection.bias:
        return "lm_head bias"
    return "scale"


def _copy_nodes(graph: Graph, made: list[Node], inputs: list[Node], scalars: tuple[bool, ...],
                returned: Node, projection: Projection, rebuilt: Node | None) -> GraphModule:
    """A GraphModule running ``made`` (in graph order) on placeholders for ``inputs``. A
    tensor-parallel head's gather (``redistribute(..., async_op=True)``) runs synchronously:
    the read hands out a plain tensor, not an ``AsyncCollectiveTensor``."""
    copy = Graph()
    env: dict[Node, Node] = {}
    root = graph.owning_module or torch.nn.Module()
    for i, (node, scalar) in enumerate(zip(inputs, scalars)):
        placeholder = copy.placeholder(f"input_{i}")
        env[node] = copy.call_method("item", (placeholder,)) if scalar else placeholder
        if node is rebuilt:
            env[projection.hidden], mesh = tensor_parallel.replicated_in(copy, placeholder, projection)
            root = torch.nn.Module()  # the recipe's only attribute: the mesh (its nodes call no module)
            setattr(root, tensor_parallel.MESH_ATTRIBUTE, mesh)
    for node in made:
        env[node] = copy.node_copy(node, env.__getitem__)
        env[node].meta = {}  # no fake values kept alive
        if tensor_op_name(node) == "redistribute" and env[node].kwargs.get("async_op"):
            env[node].kwargs = {**env[node].kwargs, "async_op": False}
    copy.output(env[returned])
    return GraphModule(root, copy, class_name="ChunkceLogitsRecipe")


def _stand_in_for(projection: Projection, returned: torch.Tensor) -> Node:
    """A node giving a NaN scalar expanded to ``returned``'s shape (sizes read from the
    hidden states, symbolic ones too) and dtype, inserted before the projection."""
    graph: Graph = projection.node.graph
    with graph.inserting_before(projection.node):
        nan = create_node(graph, "call_method", "new_full", (projection.hidden, (), float("nan")),
                          {"dtype": returned.dtype})
        sizes = [size if isinstance(size, int) else create_node(graph, "call_function", torch.ops.aten.sym_size.int,
                                                                (projection.hidden, dim))
                 for dim, size in enumerate(returned.shape[:-1])]
        return create_node(graph, "call_method", "expand", (nan, *sizes, returned.shape[-1]))


def add_outputs(graph: Graph) -> Plan | None:
    """Append every stand-in's recipe inputs to ``graph``'s (tuple) output, scalars as 0-d
    CPU tensors; the :class:`compile_pass.lazy_logits.Plan` of the slots, or None when the
    output holds no stand-in."""
    (output,) = graph.find_nodes(op="output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        return None
    slots, extras = [], []
    for position, value in enumerate(values):
        taken = value.meta.get(STAND_IN) if isinstance(value, Node) else None
        if taken is None:
            continue
        indices = []
        for node, scalar in zip(taken.inputs, taken.recipe.scalars):
            if scalar:
                with graph.inserting_before(output):
                    dtype = torch.float64 if isinstance(example_value(node), (float, torch.SymFloat)) else torch.int64
                    node = graph.call_function(torch.scalar_tensor, (node,), {"dtype": dtype, "device": "cpu"})
            indices.append(len(extras))
            extras.append(node)
        slots.append(Slot(position, taken.recipe, tuple(indices)))
    if not slots:
        return None
    if extras:
        output.args = (type(values)([*values, *extras]),)
    return Plan(len(values), tuple(slots))
