"""The default for returned logits: not computed in the step, computed exactly when first read.

    model = torch.compile(model, backend="chunkce")
    out = model(input_ids=ids, labels=labels)   # the step computes no [N, V] logits
    out.loss.backward()                         # as usual
    out.logits.argmax(-1)                       # computed now, from the step's hidden states and head

HF causal LMs return ``logits`` beside ``loss``. Once the loss is rewritten, the
projection stays in the graph only for that output. In a training graph and in a graph
without grad (an evaluation step under ``no_grad``) alike, logits that
fed a rewritten loss and that nothing but the graph output reads (directly, or
through dtype casts, copies and an absorbed scale: :func:`compile_pass.graph.logits_drop.only_returned`)
are taken out of the graph. (An evaluation step that kept them would compute the
``[N, V]`` projection for them and the op would project every tile again: two
projections for stock's one, and no memory saved.) The graph returns, instead, the tensors they are made from
(the hidden states ``[..., H]``, the head's weight and bias, a scale), and the
backend's wrapper hands the caller a :class:`compile_pass.graph.lazy_tensor.LazyLogits` in the logits' slot.

What the caller gets, and why it is never wrong: :mod:`compile_pass.graph.lazy_tensor`.
Returning the hidden states from the graph costs no memory of its own in the step
(the op saves them for backward anyway); holding the output object afterwards keeps
them (``[..., H]``) and references to the head's tensors alive, not ``[..., V]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from compile_pass.graph.forms import Projection
from compile_pass.graph.lazy_tensor import Recipe, lazy_logits
from compile_pass.graph.logits_drop import DROPPED, DroppedLogits, only_returned, returned_chain, take_out
from compile_pass.graph.nodes import Edit, example_value, is_tensor_node


@dataclass(frozen=True)
class Deferred:
    """What a lazy stand-in node of the graph output carries (``node.meta[DROPPED]``)."""

    recipe: Recipe
    inputs: tuple[Node, ...]  # the recipe's inputs, nodes of the graph


def defer_if_only_returned(projection: Projection, edit: Edit) -> int:
    """Take a kept projection (and the casts up to the graph output) out of the graph if
    it is :func:`compile_pass.graph.logits_drop.only_returned`, as part of the site's ``edit``:
    a stand-in carrying a :class:`Deferred` takes the returned value's place
    (:func:`add_outputs` then returns its inputs from the graph). Returns the bytes of
    logits no longer computed (0: left as is, e.g. an input the recipe cannot take)."""
    if not only_returned(projection.node):
        return 0
    chain = returned_chain(projection.node)
    graph: Graph = projection.node.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    made = sorted({*projection.inner, *chain}, key=order.__getitem__)
    inputs = list(dict.fromkeys(arg for node in made for arg in node.all_input_nodes if arg not in made))
    values = [example_value(node) for node in inputs]
    if not all(isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, int, float)) for v in values):
        return 0
    roles = tuple(_role(node, projection) for node in inputs)
    scalars = tuple(not isinstance(v, torch.Tensor) for v in values)
    projected = example_value(projection.node)
    operands = [example_value(a) for a in (projection.hidden, projection.weight) if is_tensor_node(a)]
    autocast_dtype = projected.dtype if any(v.dtype != projected.dtype for v in operands) else None
    recipe = Recipe(_copy_nodes(graph, made, inputs, scalars, chain[-1]), roles, scalars, autocast_dtype)
    return take_out(projection, edit, Deferred(recipe, tuple(inputs)))


def _role(node: Node, projection: Projection) -> str:
    if node is projection.hidden:
        return "hidden states"
    if node is projection.weight:
        return "lm_head weight"
    if node is projection.bias:
        return "lm_head bias"
    return "scale"


def _copy_nodes(graph: Graph, made: list[Node], inputs: list[Node], scalars: tuple[bool, ...],
                returned: Node) -> GraphModule:
    """A GraphModule running ``made`` (in graph order) on placeholders for ``inputs``."""
    copy = Graph()
    env: dict[Node, Node] = {}
    for i, (node, scalar) in enumerate(zip(inputs, scalars)):
        placeholder = copy.placeholder(f"input_{i}")
        env[node] = copy.call_method("item", (placeholder,)) if scalar else placeholder
    for node in made:
        env[node] = copy.node_copy(node, env.__getitem__)
        env[node].meta = {}  # no fake values kept alive
    copy.output(env[returned])
    return GraphModule(graph.owning_module or torch.nn.Module(), copy, class_name="ChunkceLogitsRecipe")


@dataclass(frozen=True)
class Plan:
    """Where the wrapper finds what it hands back: the graph's original output count,
    each lazy slot with its recipe and the positions of its inputs among the extra
    outputs, and the slots of :mod:`compile_pass.graph.logits_drop`'s stand-ins."""

    num_outputs: int
    lazy: tuple[tuple[int, Recipe, tuple[int, ...]], ...]
    dropped: tuple[int, ...]


def add_outputs(graph: Graph) -> Plan | None:
    """Append every lazy stand-in's inputs to ``graph``'s (flat) output, scalars as 0-d
    CPU tensors; None when the output holds no stand-in."""
    (output,) = graph.find_nodes(op="output")
    values = output.args[0]
    as_tuple = isinstance(values, (tuple, list))
    values = list(values) if as_tuple else [values]
    lazy, dropped, extras = [], [], []
    for position, value in enumerate(values):
        mark = value.meta.get(DROPPED) if isinstance(value, Node) else None
        if mark is True:
            dropped.append(position)
        elif isinstance(mark, Deferred):
            indices = []
            for node, scalar in zip(mark.inputs, mark.recipe.scalars):
                if scalar:
                    with graph.inserting_before(output):
                        dtype = torch.float64 if isinstance(example_value(node), (float, torch.SymFloat)) \
                            else torch.int64
                        node = graph.call_function(torch.scalar_tensor, (node,), {"dtype": dtype, "device": "cpu"})
                indices.append(len(extras))
                extras.append(node)
            lazy.append((position, mark.recipe, tuple(indices)))
    if not lazy and not dropped:
        return None
    if extras:
        if not as_tuple:
            raise RuntimeError("chunkce: expected a graph with a tuple output to return lazy logits from")
        output.args = (type(output.args[0])([*values, *extras]),)
    return Plan(len(values), tuple(lazy), tuple(dropped))


def wrap(compiled: Callable[..., Any], plan: Plan) -> Callable[..., Any]:
    """``compiled`` handing out a :class:`compile_pass.graph.lazy_tensor.LazyLogits` at each lazy slot of ``plan`` (and a
    :class:`compile_pass.graph.logits_drop.DroppedLogits` at each dropped one), with the
    extra outputs taken off."""
    @functools.wraps(compiled)  # keeps its attributes (e.g. _boxed_call): called as it would be
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        swapped = list(outputs[:plan.num_outputs])
        extras = outputs[plan.num_outputs:]
        for position, recipe, indices in plan.lazy:
            stand_in = swapped[position]
            swapped[position] = lazy_logits(recipe, [extras[i] for i in indices], stand_in)
        for position in plan.dropped:
            stand_in = swapped[position]
            swapped[position] = DroppedLogits(stand_in.shape, stand_in.dtype, stand_in.device)
        return type(outputs)(swapped) if isinstance(outputs, tuple) else swapped

    return run


