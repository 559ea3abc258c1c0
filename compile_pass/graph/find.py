"""Find: every node of a graph a spelling reads, as a site matched back to its projection.

    sites = find_sites(graph)               # [Site], in graph order; pure (the graph is not changed)
    found = unmatched_projections(graph)    # a graph with no site: its projections to the vocabulary

Each node is offered to the spellings' table (:mod:`compile_pass.graph.spellings`); a node
one reads is walked back to its projection (:func:`compile_pass.graph.sites.match_site`). A row
statistic (a logsumexp, an entropy) is a site only where that walk reaches a projection to a
vocabulary (:func:`is_vocabulary`) that a loss site reads too: the same sum over attention
scores, a router's few experts or a graph input is no loss of logits.

A training graph with logits but no cross-entropy site (the loss computed outside the compiled
region, or spelled in a way no spelling reads) loses the win without a refusal; it is found so
that the report can say so: a projection whose output requires grad, whose last dim is a
vocabulary's and the widest of the graph's projections, and whose output, through shape /
dtype-only ops and scalings by a constant, is returned by the graph or normalised over its last
dim (``softmax``, ``log_softmax``, ``logsumexp``). What is flagged: docs/api.md, ``UnmatchedRecord``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from compile_pass.graph import stages
from compile_pass.graph.nodes import (
    CASTS,
    COPIES,
    RESHAPES,
    TOKEN_INDEXES,
    example_value,
    is_tensor_node,
    module_attr,
    op_name,
    size_hint,
    tensor_op_name,
)
from compile_pass.graph.projection import Projection, as_projection, read_scale
from compile_pass.graph.refusals import Refusal
from compile_pass.graph.sites import Site, match_site
from compile_pass.graph.spellings import read_call
from compile_pass.graph.spellings.call import SpellingKind
from compile_pass.op.checks import is_last_dim


def _unread_graph(graph: Graph, in_subgraph: bool, exc: Exception) -> Exception:
    return exc


@stages.tolerant("could not read the graph's cross-entropy sites; left it unchanged", fallback=_unread_graph)
def find_sites(graph: Graph, in_subgraph: bool = False, *, strict: bool) -> list[Site]:
    """Every node of ``graph`` a spelling reads, in graph order, matched back to its projection;
    a node that fails to read is a site stopped as ``INTERNAL_ERROR`` (unless ``strict``); the
    exception where the graph cannot be read (called with ``strict=``: :func:`compile_pass.graph.stages.tolerant`).

    ``in_subgraph``: ``graph`` is a higher-order op's body, whose inputs come from the
    enclosing graph (a loss on such an input is ``subgraph_input``, not a graph break).
    """
    stages.reached("find", graph)
    sites = []
    for node in graph.nodes:
        if node.op == "call_module":
            if isinstance(module_attr(graph, node.target), torch.nn.CrossEntropyLoss):
                sites.append(Site(node, None, stop=node, stop_kind=Refusal.CALL_MODULE))
            continue
        site = _read(node, in_subgraph, strict=strict)
        if site is not None:
            sites.append(site)
    losses = {site.projection.node for site in sites if site.projection is not None and site.call is not None
              and site.call.spelling.kind is not SpellingKind.STATISTIC}
    return [site for site in sites if site.call is None or site.call.spelling.kind is not SpellingKind.STATISTIC
            or site.projection.node in losses]


def _unreadable(node: Node, in_subgraph: bool, exc: Exception) -> Site:
    return Site(node, None, stop=node, stop_kind=Refusal.INTERNAL_ERROR, error=f"{type(exc).__name__}: {exc}")


@stages.tolerant("could not read {node.name}; left it unfused", fallback=_unreadable)
def _read(node: Node, in_subgraph: bool) -> Site | None:
    call = read_call(node)
    if call is None:
        return None
    stages.reached("read", node)
    site = match_site(node, call, in_subgraph)
    if call.spelling.kind is SpellingKind.STATISTIC and not _of_a_vocabulary(site):
        return None
    return site


def _of_a_vocabulary(site: Site) -> bool:
    """Whether ``site``'s walk reached a projection whose logits are a vocabulary's."""
    if site.stop_kind is not None or site.projection is None:
        return False
    logits, hidden = example_value(site.projection.node), example_value(site.projection.hidden)
    hidden_size = size_hint(hidden.shape[-1]) if isinstance(hidden, torch.Tensor) and hidden.dim() else None
    return is_vocabulary(size_hint(logits.shape[-1]), hidden_size)


VOCAB_MIN = 1024  # below it the logits cost about what a hidden state does: little to lose

# Ops on the logits that keep every logit as it is (shape, dtype or copy only).
_SHAPE_DTYPE_ONLY = CASTS | COPIES | RESHAPES | TOKEN_INDEXES
_NORMALISERS = {"softmax", "log_softmax", "logsumexp", "_softmax", "_log_softmax"}  # over the vocab dim


@dataclass(frozen=True)
class VocabProjection:
    """A projection to the vocabulary that no cross-entropy site reads."""

    projection: Projection  # its node's output is the logits, [..., V]
    vocab: int  # V (a size hint when symbolic)
    use: str  # what reads them: "returned by the graph", or "normalised by `<op>`"
    returned: bool  # the graph output reads them


def is_vocabulary(vocab: int, hidden: int | None = None) -> bool:
    """Whether logits ``[..., vocab]`` projected from ``[..., hidden]`` are a vocabulary's (the
    only logits whose rewrite saves memory): at least :data:`VOCAB_MIN` classes and more than
    ``hidden`` (None: the floor alone)."""
    return vocab >= VOCAB_MIN and (hidden is None or vocab > hidden)


def decode_sized(projection: Projection) -> bool:
    """Whether the logits hold one row per sequence (``[B, 1, V]``, a decode step's): small, read at
    once; neither taken out lazy nor warned of."""
    shape = example_value(projection.node).shape
    return len(shape) < 2 or size_hint(shape[-2]) <= 1


def unmatched_projections(graph: Graph, *, training: bool = True) -> list[VocabProjection]:
    """Every projection to the vocabulary of ``graph``; ``training=False`` drops the
    requires-grad condition. The caller checks that ``graph`` is a top-level graph with no
    cross-entropy site, and catches what this raises."""
    projections = [p for node in graph.nodes if is_tensor_node(node) and (p := as_projection(node)) is not None]
    inner = {node for p in projections for node in p.inner}  # the matmul under a bias add: one projection
    projections = [p for p in projections if p.node not in inner and example_value(p.node).dim() >= 1]
    widths = [size_hint(example_value(p.node).shape[-1]) for p in projections]
    widest = max(widths, default=0)
    found = []
    for projection, vocab in zip(projections, widths):
        logits = example_value(projection.node)
        if training and not logits.requires_grad or vocab != widest or not is_tensor_node(projection.hidden):
            continue
        if not is_vocabulary(vocab, size_hint(example_value(projection.hidden).shape[-1])):
            continue
        use = _use(projection.node)
        if use is not None:
            found.append(VocabProjection(projection, vocab, *use))
    return found


def _use(logits: Node) -> tuple[str, bool] | None:
    """``(use, returned)`` when the logits, through shape/dtype-only ops and scalings, reach the
    graph output (``returned``) or a softmax over their last dim; else None."""
    seen, stack, use = {logits}, [logits], None
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "output":
                return "returned by the graph", True
            if user in seen or not user.args or user.args[0] is not node and not _scales(user, node):
                continue
            if op_name(user) in _NORMALISERS and _over_last_dim(user, node):
                use = use or f"normalised by `{op_name(user)}`"
            elif _keeps_logits(user, node) or _scales(user, node):
                seen.add(user)
                stack.append(user)
    return None if use is None else (use, False)


def _keeps_logits(user: Node, logits: Node) -> bool:
    """``user`` only reshapes, slices, casts or copies ``logits``, keeping their last dim whole."""
    if tensor_op_name(user) not in _SHAPE_DTYPE_ONLY or not is_tensor_node(user):
        return False
    before, after = example_value(logits), example_value(user)
    return after.dim() >= 1 and size_hint(after.shape[-1]) == size_hint(before.shape[-1])


def _scales(user: Node, logits: Node) -> bool:
    """``user`` multiplies or divides ``logits`` by a constant (a temperature)."""
    read = read_scale(user)
    return read is not None and read.scale is not None and read.logits is logits


def _over_last_dim(user: Node, logits: Node) -> bool:
    dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return is_last_dim(dim, example_value(logits).dim())
