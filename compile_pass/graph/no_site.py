"""A training graph with logits but no cross-entropy site: the win lost without a refusal.

    found = unmatched_projections(graph)   # [] unless the rule below holds

chunkce saves memory only where it finds the loss. A model compiled on its own, whose
loss is computed outside the compiled region (``model(input_ids)`` then
``F.cross_entropy(out.logits, ...)`` in eager code), or a loss spelled in a way the
matcher does not read (:mod:`compile_pass.graph.sites`), leaves a graph that computes
the full ``[N, V]`` logits, and in backward their gradient, with no site to rewrite or
refuse. This module finds such a projection, so that the report can say so
(:func:`compile_pass.graph.publish.publish` logs it once at WARNING, with the fix).

The rule, read by the driver only on a top-level graph (not a higher-order op's body)
in which the pass found no cross-entropy site at all (none rewritten, none refused): a
projection (:func:`compile_pass.graph.forms.as_projection`: a linear / matmul by a
2-D weight, with or without a bias) is a *projection to the vocabulary* when

1. its output requires grad: a training graph (eval and generation under ``no_grad``,
   and the forward of an ``autograd.Function``, are never flagged);
2. its last dim ``V`` is a vocabulary's (:func:`is_vocabulary`: at least :data:`VOCAB_MIN`,
   wider than its input, ``V > H``), and the widest of every projection's in the graph
   (an MLP's up projection is narrower than the head beside it; a down projection narrows);
3. its output, directly or through shape/dtype-only ops (views, reshapes, token
   slices, transposes that keep the last dim, casts, copies) and scalings by a
   constant, is returned by the graph (the loss is computed outside it) or normalised
   over its last dim by ``softmax`` / ``log_softmax`` / ``logsumexp`` (a loss or a
   distribution the pass does not read).

Not flagged, by that rule: graphs without a wide projection (TRL's fused LM head
computes per-token log-probabilities inside an ``autograd.Function``: no logits in
the graph), an MLP whose outputs feed other layers, attention scores (a matmul by a
4-D key tensor is not a projection), a soft-capped head's logits (``tanh`` on the way: the
pass refuses those by design anyway). A graph break right after the head leaves a
graph whose logits are returned: flagged, and the loss's own graph is reported as a
``graph_break`` refusal beside it (the warning says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from compile_pass.graph.forms import Projection, as_projection
from compile_pass.graph.nodes import CASTS, COPIES, example_value, is_tensor_node, op_name, size_hint, tensor_op_name
from compile_pass.graph.scale import read_scale

VOCAB_MIN = 1024  # below it the logits cost about what a hidden state does: little to lose
RETURNED = "returned by the graph"

# Ops on the logits that keep every logit as it is (shape, dtype or copy only).
_SHAPE_DTYPE_ONLY = CASTS | COPIES | {
    "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as",
    "getitem", "narrow", "select", "transpose", "swapaxes", "swapdims", "permute",
}
_NORMALISERS = {"softmax", "log_softmax", "logsumexp", "_softmax", "_log_softmax"}  # over the vocab dim


@dataclass(frozen=True)
class VocabProjection:
    """A projection to the vocabulary that no cross-entropy site reads."""

    projection: Projection  # its node's output is the logits, [..., V]
    vocab: int  # V (a size hint when symbolic)
    use: str  # RETURNED, or "normalised by `<op>`"


def is_vocabulary(vocab: int, hidden: int | None = None) -> bool:
    """Whether logits ``[..., vocab]`` projected from hidden states ``[..., hidden]`` are a
    vocabulary's, the only logits whose rewrite saves memory: at least :data:`VOCAB_MIN`
    classes, and more than ``hidden`` (a classifier's few classes, or a projection that
    narrows, cost no more than the hidden states). ``hidden`` None (not known): the floor alone.

    The rule of this module's projections to the vocabulary, and of which refused sites
    warn (:func:`compile_pass.graph.publish.publish`).
    """
    return vocab >= VOCAB_MIN and (hidden is None or vocab > hidden)


def unmatched_projections(graph: Graph, *, training: bool = True) -> list[VocabProjection]:
    """Every projection of ``graph`` the module's rule calls a projection to the vocabulary;
    ``training=False``: without rule 1 (a forward under ``no_grad`` too).

    The caller checks that ``graph`` has no cross-entropy site and is a top-level graph
    (and catches what this raises: only a warning depends on it, never a rewrite).
    """
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
            found.append(VocabProjection(projection, vocab, use))
    return found


def _use(logits: Node) -> str | None:
    """:data:`RETURNED` or ``normalised by `<op>``` when the logits, through shape/dtype-only
    ops and scalings, reach the graph output or a softmax over their last dim; else None."""
    seen, stack, use = {logits}, [logits], None
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "output":
                return RETURNED
            if user in seen or not user.args or user.args[0] is not node and not _scales(user, node):
                continue
            if op_name(user) in _NORMALISERS and _over_last_dim(user, node):
                use = use or f"normalised by `{op_name(user)}`"
            elif _keeps_logits(user, node) or _scales(user, node):
                seen.add(user)
                stack.append(user)
    return use


def _keeps_logits(user: Node, logits: Node) -> bool:
    """``user`` only reshapes, slices, casts or copies ``logits``, keeping their last dim whole."""
    if tensor_op_name(user) not in _SHAPE_DTYPE_ONLY or not is_tensor_node(user):
        return False
    before, after = example_value(logits), example_value(user)
    return after.dim() >= 1 and size_hint(after.shape[-1]) == size_hint(before.shape[-1])


def _scales(user: Node, logits: Node) -> bool:
    """``user`` multiplies or divides ``logits`` by a constant (a temperature)."""
    read = read_scale(user)
    return read is not None and read.scale is not None and read.scale.logits is logits


def _over_last_dim(user: Node, logits: Node) -> bool:
    dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    ndim = example_value(logits).dim()
    return isinstance(dim, int) and dim % ndim == ndim - 1
