"""Returned logits taken out of the graph: their fate, a stand-in in their slot, a recipe to make them.

Returned logits taken out of the graph: what becomes of a projection's logits (:class:`Fate`),
the chain of casts, copies and a scale from the projection to the graph output that only it
reads (:func:`returned_chain`), and a stand-in in the output slot (a NaN scalar expanded to
their shape) with a recipe to compute them on read (``LAZY``: the graph's chain, the graph
returning the tensors it reads instead) or the refusing one (``DROPPED_RECIPE``).

    saved = take_out(projection, edit, Fate.LAZY)   # inside the edit of the logits (graph/apply.py)
    outputs = add_outputs(graph)                  # the recipes' inputs (and row statistics) appended
    compiled = wrap_compiled(inner(gm), outputs)  # compile_pass.lazy_logits.wrap (the backend)

The recipe's head as the row-statistics op takes it (:func:`head_of`: a
:class:`compile_pass.lazy_logits.head.Head`), so that reads of the lazy logits that need only row
statistics go through the op (:mod:`compile_pass.lazy_logits.reads`); None when the op cannot
round as the chain does (casts before or after the scale that are not one rounding) or an
operand is not among the recipe's inputs: reads then compute the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch
from torch.fx import Graph, GraphModule, Node

from compile_pass.graph import tensor_parallel
from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    Edit,
    create_node,
    example_value,
    size_hint,
    tensor_op_name,
)
from compile_pass.graph.projection import Projection, read_scale
from compile_pass.graph.tensor_parallel import local_value
from compile_pass.lazy_logits import DROPPED_RECIPE, DroppedRecipe, LazyOutputs, Recipe, Slot
from compile_pass.lazy_logits.head import Head
from compile_pass.op.checks import holds


class Fate(Enum):
    """What becomes of a projection's logits (the module docstring says when each)."""

    GONE = "gone"
    KEPT = "kept"
    LAZY = "lazy"
    DROPPED = "dropped"


STAND_IN = "chunkce_returned_logits"  # meta key of the stand-in node in the graph output: its TakenOut


@dataclass(frozen=True)
class TakenOut:
    """What a stand-in of the graph output carries (``node.meta[STAND_IN]``)."""

    recipe: Recipe | DroppedRecipe
    inputs: tuple[Node, ...]  # the recipe's inputs, nodes of the graph
    statistics: tuple[Node, ...] = ()  # lse, entropy, max, argmax, row_sum [N] of the head's rows, computed in the step


def take_out(projection: Projection, edit: Edit, fate: Fate,
             tiles: tuple[int | None, int | None] = (None, None), statistics: tuple[Node, ...] = ()) -> int:
    """Replace the :func:`returned_chain` of ``projection`` by a stand-in carrying a
    :class:`TakenOut` (``fate``: ``LAZY`` or ``DROPPED``), as part of ``edit``; returns the bytes
    of the values no longer computed. ``tiles``: the options' ``(chunk_size, chunk_bytes)``, which
    the lazy logits' fused reads take; ``statistics``: nodes of the row statistics of the recipe's
    head (:func:`returned_head`) the graph computes, handed to the lazy logits."""
    chain = returned_chain(projection.node)
    taken = TakenOut(DROPPED_RECIPE, ()) if fate is Fate.DROPPED else _recipe(projection, chain, tiles)
    if statistics and isinstance(taken.recipe, Recipe) and taken.recipe.head is not None:
        taken = replace(taken, statistics=statistics)
    stand_in = _stand_in_for(projection, example_value(chain[-1]))
    stand_in.meta[STAND_IN] = taken
    edit.replace_all_uses_with(chain[-1], stand_in)
    for dead in (*chain[::-1], *projection.inner[::-1]):
        if not dead.users:
            edit.erase(dead)
    values = [local_value(example_value(n)) for n in chain] + tensor_parallel.logits_shards(projection)
    return sum(size_hint(v.numel()) * v.element_size() for v in values)


def _recipe(projection: Projection, chain: list[Node], tiles: tuple[int | None, int | None]) -> TakenOut:
    made, inputs = recipe_nodes(projection, chain)
    rebuilt = None  # a tensor-parallel head's: the hidden states' local tensor, made a DTensor again in the recipe
    if projection.sharded is not None:
        rebuilt = tensor_parallel.recipe_hidden_states(projection, projection.node.graph)
        inputs = [rebuilt if node is projection.hidden else node for node in inputs]
    values = [example_value(node) for node in inputs]
    scalars = tuple(not isinstance(v, torch.Tensor) for v in values)
    autocast_dtype = projection.autocast_dtype()
    roles = tuple("hidden states" if node is rebuilt else _role(node, projection) for node in inputs)
    module = _copy_nodes(projection.node.graph, made, inputs, scalars, chain[-1], projection, rebuilt)
    head = head_of(projection, chain, inputs, rebuilt or projection.hidden, autocast_dtype, tiles)
    return TakenOut(Recipe(module, roles, scalars, autocast_dtype, head), tuple(inputs))


def returned_head(projection: Projection, dead: set[Node],
                  tiles: tuple[int | None, int | None] = (None, None)) -> tuple[Head, list[Node]] | None:
    """The head the recipe of ``projection``'s returned logits will have once the ``dead`` nodes
    are erased (a single-device head's; as :func:`take_out` makes it), and their chain; None when
    there is none (no returned chain, inputs a recipe cannot take, a chain the op cannot round as)."""
    chain = returned_chain(projection.node, dead)
    made = recipe_nodes(projection, chain) if chain is not None and projection.sharded is None else None
    if made is None:
        return None
    head = head_of(projection, chain, made[1], projection.hidden, projection.autocast_dtype(), tiles)
    return None if head is None else (head, chain)


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


def add_outputs(graph: Graph) -> LazyOutputs | None:
    """Append every stand-in's recipe inputs (scalars as 0-d CPU tensors), then its row
    statistics, to ``graph``'s (tuple) output; the :class:`compile_pass.lazy_logits.LazyOutputs` of the
    slots, or None when the output holds no stand-in."""
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
        statistics = tuple(range(len(extras), len(extras) + len(taken.statistics)))
        extras.extend(taken.statistics)
        slots.append(Slot(position, taken.recipe, tuple(indices), statistics))
    if not slots:
        return None
    if extras:
        output.args = (type(values)([*values, *extras]),)
    return LazyOutputs(len(values), tuple(slots))


def head_of(projection: Projection, chain: list[Node], inputs: list[Node], hidden: Node,
            autocast_dtype: torch.dtype | None, tiles: tuple[int | None, int | None] = (None, None)) -> Head | None:
    """The head of a recipe over ``inputs`` running ``chain`` (``[projection, step, ...,
    returned]``), whose hidden states are the input ``hidden``, read in ``tiles`` (``(chunk_size,
    chunk_bytes)``, None: the op's rule); None when the op cannot take it."""
    position = {node: i for i, node in enumerate(inputs)}
    operands = (hidden, projection.weight, projection.bias)
    if any(node is not None and node not in position for node in operands):
        return None
    segments: list[list[torch.dtype]] = [[example_value(projection.node).dtype]]  # dtypes before / after the scale
    scale = None
    for node in chain[1:]:
        read = read_scale(node)
        if read is not None and read.scale is not None:
            if scale is not None:
                return None
            scale = read.scale
            segments.append([scale.dtype])
        else:
            segments[-1].append(example_value(node).dtype)
    if not all(_one_rounding(dtypes) for dtypes in segments):
        return None
    bias = None if projection.bias is None else position[projection.bias]
    common = dict(hidden=position[hidden], weight=position[projection.weight], bias=bias,
                  logits_dtype=segments[-1][-1], weight_is_hv=projection.weight_is_hv,
                  projection_dtype=autocast_dtype, sharded=projection.sharded is not None,
                  chunk_size=tiles[0], chunk_bytes=tiles[1])
    if scale is None:
        return Head(computed_dtype=segments[0][0], **common)
    if scale.tensor is not None and scale.tensor not in position:
        return None
    return Head(computed_dtype=scale.dtype, scale=scale.map(position.__getitem__), **common)


def _one_rounding(dtypes: list[torch.dtype]) -> bool:
    """Whether casting through ``dtypes`` rounds as one cast from the first to the last does."""
    return all(holds(dtype, dtypes[0]) for dtype in dtypes[1:-1])


def returned_chain(node: Node, dead: set[Node] = frozenset()) -> list[Node] | None:
    """``[node, step, ..., returned]``: the projection and the steps of :func:`_is_step_of` (each
    read by nothing but the next, ``dead`` nodes aside) up to a tensor the graph returns; None
    when anything else reads them, or nothing does."""
    chain = [node]
    while True:
        users = [user for user in chain[-1].users if user not in dead]
        if users and all(user.op == "output" for user in users):
            return chain if isinstance(example_value(chain[-1]), torch.Tensor) else None
        if len(users) != 1 or not _is_step_of(users[0], chain[-1]):
            return None
        chain.append(users[0])


def _is_step_of(node: Node, source: Node) -> bool:
    """Whether ``node`` gives logits of ``source``'s shape and device, floating, from
    ``source`` by a dtype cast (``.type_as(other)`` reads only ``other``'s dtype), a copy
    or a scale the pass absorbs (:func:`compile_pass.graph.projection.read_scale`)."""
    before, after = example_value(source), example_value(node)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and after.is_floating_point()
            and after.shape == before.shape and after.device == before.device):
        return False
    name = tensor_op_name(node)
    if name in CASTS or name in COPIES:
        return bool(node.args) and node.args[0] is source
    read = read_scale(node)
    return read is not None and read.scale is not None and read.logits is source


def recipe_nodes(projection: Projection, chain: list[Node]) -> tuple[list[Node], list[Node]] | None:
    """The nodes a recipe of ``chain`` runs (in graph order) and their inputs; None when an
    input is not a tensor or a number (a recipe cannot take it)."""
    order = {node: i for i, node in enumerate(projection.node.graph.nodes)}
    made = sorted({*projection.inner, *chain}, key=order.__getitem__)
    inputs = list(dict.fromkeys(arg for node in made for arg in node.all_input_nodes if arg not in made))
    if not all(isinstance(example_value(node), (torch.Tensor, torch.SymInt, torch.SymFloat, int, float))
               for node in inputs):
        return None
    return made, inputs
