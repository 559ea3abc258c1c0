"""What becomes of a projection's logits once the sites reading them are rewritten: pure queries.

    fate, droppable = logits_fate(projection, rewritten, options.returned_logits, in_subgraph)

``GONE``: nothing reads them any more (the rewrites erase the projection). ``LAZY`` /
``DROPPED``: only the graph output reads them, directly or through dtype casts, copies and a
scale the pass absorbs (:func:`returned_chain`), and ``returned_logits`` takes them out
(:mod:`compile_pass.graph.returned_logits`). ``KEPT``: computed in the step (another reader,
``"keep"``, a higher-order op's body, inputs a recipe cannot take, a ``loss_parallel`` head's
``Shard(-1)`` logits). ``droppable``: the output alone reads them (a kept one could be lazy).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

import torch
from torch.fx import Node

from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import CASTS, COPIES, example_value, tensor_op_name
from compile_pass.graph.scale import read_scale
from compile_pass.graph.sites import Site



class Fate(Enum):
    """What becomes of a projection's logits (the module docstring says when each)."""

    GONE = "gone"
    KEPT = "kept"
    LAZY = "lazy"
    DROPPED = "dropped"


def logits_fate(projection: Projection, rewritten: list[Site], mode: str, in_subgraph: bool) -> tuple[Fate, bool]:
    """``(fate, droppable)`` of ``projection``'s logits after ``rewritten`` (the sites reading
    them that will be rewritten) under ``returned_logits=mode``."""
    dead = dead_after(rewritten)
    if projection.node in dead:
        return Fate.GONE, False
    chain = returned_chain(projection.node, dead)
    loss_parallel = projection.sharded is not None and projection.sharded.loss_parallel
    droppable = chain is not None and not in_subgraph and not loss_parallel
    (output,) = projection.node.graph.find_nodes(op="output")
    if not droppable or mode not in ("lazy", "drop") or not isinstance(output.args[0], (tuple, list)):
        return Fate.KEPT, droppable
    if mode == "drop" and example_value(chain[-1]).requires_grad:
        return Fate.DROPPED, True
    return (Fate.LAZY if recipe_nodes(projection, chain) is not None else Fate.KEPT), True


def dead_after(sites: Iterable[Site]) -> set[Node]:
    """The nodes the rewrites of ``sites`` leave unread (each site's loss node, and what of
    :meth:`compile_pass.graph.sites.Site.erasable` only dead nodes read), as the rewrites erase them."""
    sites = list(sites)
    dead = {site.node for site in sites}
    candidates = [node for site in sites for node in site.erasable()]
    grew = True
    while grew:
        grew = False
        for node in candidates:
            if node not in dead and all(user in dead for user in node.users):
                dead.add(node)
                grew = True
    return dead


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
