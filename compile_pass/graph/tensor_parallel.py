"""Tensor-parallel heads: an lm_head sharded over the vocabulary read as one projection.

Tensor-parallel heads: an lm_head sharded over the vocabulary (a ``DTensor`` weight,
``Shard(0)`` on a 1-D mesh) read as one projection, for the vocabulary-parallel op. Gathered
(colwise_rep) or ``Shard(-1)`` logits under ``loss_parallel()`` are taken; a head sharded any
other way is refused as ``tensor_parallel``. What Dynamo captures: docs/distributed.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.fx import Graph, Node

import compile_pass.torch_internals as internals
from compile_pass.graph.nodes import create_node, example_value, tensor_op_name
from compile_pass.graph.projection import Projection, as_projection
from compile_pass.op.checks import is_last_dim
from compile_pass.op.vocab_parallel import is_dtensor

_GATHERS = ("to_local", "full_tensor")  # the replicated logits' local tensor: [..., V] on every rank


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocabulary-sharded head, read from its fake ``DTensor`` weight:
    the group, this shard's ``vocab_start`` and ``local_size`` rows of ``vocab_size``, the mesh
    node, whether the loss is a ``loss_parallel()`` DTensor, and the graph's ``from_local``."""

    group_name: str
    vocab_start: int
    vocab_size: int
    local_size: int
    mesh: Node | None
    loss_parallel: bool
    from_local: Any = None


def read_sharded(node: Any) -> tuple[Projection | None, str | None] | None:
    """A vocabulary-sharded projection ending at ``node``: ``(projection, None)``; ``(None, why)``
    when ``node`` gathers or keeps the logits of a ``DTensor`` projection that the op cannot take;
    None when ``node`` is no such thing (the walk goes on as for plain tensors)."""
    if not isinstance(node, Node):
        return None
    name = tensor_op_name(node)
    if name in _GATHERS and node.args and is_dtensor(example_value(node.args[0])):
        source, loss_parallel = node.args[0], False
        if name == "to_local":
            source = _redistributed(source, replicate=True) or source
    elif name == "redistribute" and is_dtensor(example_value(node)):
        source, loss_parallel = _redistributed(node, replicate=False), True
        if source is None:
            return None, f"`redistribute` to {_placements_of(node)} of the logits (expected Shard(-1))"
    elif is_dtensor(example_value(node)) and as_projection(node) is not None:
        source, loss_parallel = node, True
    else:
        return None
    projection = as_projection(source)
    if projection is None:
        return None
    why = _why_not(projection, loss_parallel)
    if why is not None:
        return None, why
    return _sharded(node, projection, source, loss_parallel), None


def _redistributed(node: Node, replicate: bool) -> Node | None:
    """The input of ``node`` when it is ``x.redistribute(...)`` to ``(Replicate(),)`` (``replicate``)
    or to ``(Shard(-1),)`` on the same mesh, else None."""
    if tensor_op_name(node) != "redistribute" or not node.args or not is_dtensor(example_value(node.args[0])):
        return None
    before, after = example_value(node.args[0]), example_value(node)
    if after.device_mesh != before.device_mesh or after.device_mesh.ndim != 1:
        return None
    placement = after.placements[0]
    if replicate:
        return node.args[0] if placement.is_replicate() else None
    return node.args[0] if placement.is_shard() and is_last_dim(placement.dim, after.dim()) else None


def _placements_of(node: Node) -> str:
    return str(tuple(example_value(node).placements))


def _why_not(projection: Projection, loss_parallel: bool) -> str | None:
    """What of a ``DTensor`` projection the vocabulary-parallel op cannot take, or None."""
    weight, hidden = example_value(projection.weight), example_value(projection.hidden)
    if projection.weight_is_hv or not is_dtensor(weight):
        return "a DTensor projection whose weight is not a [V, H] DTensor"
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        return (f"the lm_head weight is sharded on a {mesh.ndim}-D mesh {tuple(weight.placements)} (expected "
                "Shard(0) on the tensor-parallel mesh)")
    if not weight.placements[0].is_shard(0):
        return f"the lm_head weight's placements are {tuple(weight.placements)} (expected (Shard(0),): the vocabulary)"
    if not is_dtensor(hidden) or hidden.device_mesh != mesh or not all(p.is_replicate() for p in hidden.placements):
        where = tuple(hidden.placements) if is_dtensor(hidden) else "a plain tensor"
        return f"the hidden states into the lm_head are {where} (expected (Replicate(),) on the head's mesh)"
    if projection.bias is not None:
        bias = example_value(projection.bias)
        if not is_dtensor(bias) or bias.device_mesh != mesh or not bias.placements[0].is_shard(0):
            return "the lm_head bias is not sharded as its weight (Shard(0))"
    if loss_parallel and _mesh_node(projection.hidden) is None:
        return "no device mesh in the graph to make the loss a DTensor"
    return None


def _mesh_node(hidden: Node) -> Node | None:
    """The node giving the mesh: the ``from_local`` the hidden states come from (through redistributes)."""
    node = hidden
    while isinstance(node, Node) and tensor_op_name(node) == "redistribute":
        node = node.args[0]
    if isinstance(node, Node) and node.op == "call_function" and getattr(node.target, "__name__", "") == "from_local":
        mesh = node.args[1] if len(node.args) > 1 else node.kwargs.get("device_mesh")
        return mesh if isinstance(mesh, Node) else None
    return None


def _sharded(node: Node, projection: Projection, source: Node, loss_parallel: bool) -> Projection:
    """``projection`` read up to ``node``, with its :class:`VocabShard`."""
    weight = example_value(projection.weight)
    mesh = weight.device_mesh
    local_shape, offset = internals.local_shape_and_offset(weight.shape, mesh, weight.placements)
    mesh_node = _mesh_node(projection.hidden)
    shard = VocabShard(
        group_name=mesh.get_group(0).group_name, vocab_start=int(offset[0]), vocab_size=int(weight.shape[0]),
        local_size=int(local_shape[0]), mesh=mesh_node, loss_parallel=loss_parallel,
        from_local=_from_local_target(projection.hidden))
    between = [n for n in (source, node.args[0] if node is not source else None) if n is not None and n is not node]
    inner = (*projection.inner, *dict.fromkeys(between))
    return Projection(node, projection.hidden, projection.weight, projection.bias, False, inner, sharded=shard)


def _from_local_target(hidden: Node) -> Any:
    node = hidden
    while isinstance(node, Node) and tensor_op_name(node) == "redistribute":
        node = node.args[0]
    return node.target if isinstance(node, Node) and node.op == "call_function" else None


def local_value(value: Any) -> Any:
    """A ``DTensor`` example value's local tensor; anything else as it is."""
    return internals.local_tensor.read(value) if is_dtensor(value) else value


def local_operands(projection: Projection, graph: Graph, meta: dict, *, hidden: bool = True,
                   weight: bool = True) -> tuple[Node | None, Node | None, Node | None]:
    """``(hidden_states, weight, bias)`` of a sharded projection as the op takes them, nodes inserted
    at the graph's insertion point (None for those not asked for): ``h_d.to_local()`` ``[..., H]``
    (replicated: the hidden states as the layout gathered them), ``W_d.to_local()`` ``[V_local, H]``,
    ``b_d.to_local()`` ``[V_local]``."""
    def local(node: Node | None, wanted: bool) -> Node | None:
        if node is None or not wanted:
            return None
        return create_node(graph, "call_method", "to_local", (node,), meta=meta)

    return local(projection.hidden, hidden), local(projection.weight, weight), local(projection.bias, weight)


def loss_function(shard: VocabShard) -> Any:
    """The function whose traced nodes compute the loss (``chunked_cross_entropy``'s signature),
    for this rank's shard."""
    return partial(_vocab_parallel_loss, vocab_start=shard.vocab_start, vocab_size=shard.vocab_size,
                   group_name=shard.group_name)


def _vocab_parallel_loss(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                         class_weight: Tensor | None, *, grads_in_forward: Any = None, **options: Any) -> Tensor:
    """The op's call; ``grads_in_forward`` is not an option of the sharded op (the pass passes None)."""
    from compile_pass.op.loss import chunked_cross_entropy

    return chunked_cross_entropy(hidden_states, weight, target, bias, class_weight, **options)


def as_dtensor_loss(shard: VocabShard, loss: Node, graph: Graph, meta: dict) -> Node:
    """``loss`` as the ``loss_parallel()`` loss is: a replicated ``DTensor`` on the head's mesh."""
    from torch.distributed.tensor import Replicate

    return create_node(graph, "call_function", shard.from_local, (loss, shard.mesh, (Replicate(),)),
                       {"run_check": False}, meta=meta)


def loss_parallel_problem(loss: Node, projection: Projection) -> str | None:
    """Under ``loss_parallel()`` the loss must be a replicated ``DTensor`` (what the rewrite gives)."""
    value = example_value(loss)
    if not is_dtensor(value) or not all(p.is_replicate() for p in value.placements):
        return "the loss of Shard(-1) DTensor logits is not a replicated DTensor (loss_parallel())"
    if projection.sharded.from_local is None:
        return "no DTensor.from_local in the graph to make the loss a DTensor"
    return None


def recipe_hidden_states(projection: Projection, graph: Graph) -> Node:
    """``h_d.to_local()`` ``[..., H]`` inserted after ``h_d``, for the lazy logits of a gathered
    head (a DTensor output would fail AOTAutograd's tangent check); :func:`replicated_in` undoes it."""
    with graph.inserting_after(projection.hidden):
        return create_node(graph, "call_method", "to_local", (projection.hidden,),
                           meta={"example_value": local_value(example_value(projection.hidden))})


MESH_ATTRIBUTE = "chunkce_device_mesh"  # the recipe module's attribute holding the head's DeviceMesh


def replicated_in(copy: Graph, hidden_states: Node, projection: Projection) -> tuple[Node, Any]:
    """In a recipe's graph ``copy``: ``DTensor.from_local(hidden_states, mesh, (Replicate(),))``, and the
    mesh (the head's, read from the fake ``DTensor`` at compile time), which the recipe module must
    hold as its attribute :data:`MESH_ATTRIBUTE`."""
    mesh = copy.get_attr(MESH_ATTRIBUTE)
    return copy.call_function(_replicated, (hidden_states, mesh)), example_value(projection.hidden).device_mesh


def _replicated(hidden_states: Tensor, mesh: Any) -> Tensor:
    """``DTensor.from_local(hidden_states, mesh, (Replicate(),))``, ``hidden_states`` detached where grad mode is
    off (a read in a backward): a DTensor that requires grad there is detached in place, which DTensor before
    torch 2.13 has no rule for; a function of the graph's own (torch 2.11 has no name for DTensor.from_local's)."""
    from torch.distributed.tensor import DTensor, Replicate

    hidden_states = hidden_states if torch.is_grad_enabled() else hidden_states.detach()
    return DTensor.from_local(hidden_states, mesh, (Replicate(),), run_check=False)


def logits_shards(projection: Projection) -> list[Tensor]:
    """The local tensors of a vocabulary-sharded ``projection``'s ``[..., V_local]`` logits
    (``Shard(-1)`` DTensors inside it), as fake values; ``[]`` for a plain head."""
    if projection.sharded is None:
        return []
    values = [example_value(node) for node in projection.inner]
    return [local_value(v) for v in values
            if is_dtensor(v) and v.dim() >= 2 and any(p.is_shard() for p in v.placements)]
