"""Proof on the graph that the pass rewrote a site, or left it alone; the one comparison
with stock compile (:func:`compare_with_stock`).

Counters are the pass's own word; these read the graphs it handed to the inner
backend. A rewritten site has the op's node and no ``[N, V]`` logits node (no
node whose fake value holds ``N * V`` elements with ``V`` its last dim); a
refused one has no op node. The reference is the same model compiled by the
stock backend: loss, outputs and every gradient compared; and whatever the
counters say of the compile is proven on the recorded graphs (:meth:`Recorder.assert_counted`).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass

import torch
from builders import OP, train_step
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch.fx import GraphModule

from compile_pass.graph.returned_logits import STAND_IN, TakenOut
from compile_pass.lazy_logits import Recipe
from compile_pass.graph.nodes import size_hint

STATISTICS = torch.ops.chunkce.linear_statistics.default


@dataclass(frozen=True)
class NodeFact:
    """What a test needs of one node, read when the graph reached the inner backend
    (Inductor's own passes change the graph afterwards)."""

    op: str
    target: object
    shape: tuple[int, ...] | None  # of its fake value, sizes as hints; None when not a tensor
    expanded: bool = False  # a broadcast view (a stride 0 over a dim > 1): no memory of its own
    site: tuple[int, int] | None = None  # a chunkce op node's (tokens, vocab): of its hidden states and weight


class Recorder:
    """An inner backend: records every graph it is given, then compiles it with ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = inner
        self.graphs: list[list[NodeFact]] = []

    def __call__(self, gm: GraphModule, example_inputs):
        self.graphs.append([_fact(node) for module in gm.modules() if isinstance(module, GraphModule)
                            for node in module.graph.nodes])
        return lookup_backend(self.inner)(gm, example_inputs)

    def op_count(self) -> int:
        """``chunkce::linear_cross_entropy`` nodes in every recorded graph."""
        return sum(fact.target is OP for graph in self.graphs for fact in graph)

    def sites(self) -> list[tuple[int, int]]:
        """(tokens, vocab) of every chunkce op node (either op: grads in forward too)."""
        return [fact.site for graph in self.graphs for fact in graph if fact.site is not None]

    def logits_like(self, tokens: int, vocab: int) -> list[NodeFact]:
        """Nodes holding ``tokens x vocab`` values with ``vocab`` last: the logits or a view of them
    (not a broadcast stand-in, e.g. dropped logits)."""
        return [fact for graph in self.graphs for fact in graph if fact.shape and not fact.expanded
                and fact.shape[-1] == vocab and _numel(fact.shape) == tokens * vocab]

    def assert_rewritten(self, tokens: int, vocab: int, sites: int = 1) -> None:
        assert self.graphs, "the inner backend was never called"
        assert self.op_count() == sites, f"{self.op_count()} op node(s), expected {sites}"
        assert self.logits_like(tokens, vocab) == [], "[N, V] logits still in the rewritten graph"

    def assert_untouched(self) -> None:
        assert self.graphs, "the inner backend was never called"
        assert self.sites() == [], "a chunkce op node in a graph the pass should have left alone"

    def assert_counted(self, stats: Counter) -> None:
        """What the counters ``stats`` (of these graphs' compiles) say, proven on the graphs: one
        op node a rewritten site (a row statistic folded into a loss's walk has none of its own), and,
        when every site was rewritten and none kept its logits, no ``[N, V]`` logits node of any op
        node's shape."""
        assert self.graphs, "the inner backend was never called"
        sites = self.sites()
        assert len(sites) == stats["sites_rewritten"] - stats["statistics_folded"], (
            f"{len(sites)} chunkce op node(s) in the graphs, counters say {dict(stats)}")
        if stats["sites_refused"] == 0 and stats["logits_kept"] == 0:
            for tokens, vocab in sites:
                assert tokens, "an op node without fake values on its hidden states and weight"
                assert self.logits_like(tokens, vocab) == [], f"[{tokens}, {vocab}] logits beside the op node"


class GraphCopies:
    """An inner backend: keeps a deep copy of each graph it is given (its nodes' meta too: fake values,
    the stand-in's ``STAND_IN`` mark) and whether grad was on, then compiles it with ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = inner
        self.graphs: list[tuple[bool, torch.fx.Graph]] = []

    def __call__(self, gm: GraphModule, example_inputs):
        self.graphs.append((torch.is_grad_enabled(), copy.deepcopy(gm.graph)))
        return lookup_backend(self.inner)(gm, example_inputs)

    def training(self) -> list[torch.fx.Graph]:
        """The graphs compiled under grad mode."""
        return [graph for grad, graph in self.graphs if grad]


def assert_logits_lazy(graph: torch.fx.Graph, vocab: int) -> None:
    """One op node computing the loss (the cross-entropy op; in an evaluation graph, where the loss
    is one walk with the returned logits' row statistics, the statistics op), and the only node (not
    an input) holding ``[..., vocab]`` values (the logits or a view of them) is the lazy stand-in
    (``meta[STAND_IN]`` a :class:`TakenOut` with a :class:`Recipe`), read by the output alone."""
    ops = [n.target for n in graph.nodes if n.target in (OP, STATISTICS)]
    taken = [n.meta[STAND_IN] for n in graph.nodes if STAND_IN in n.meta]
    assert ops == [STATISTICS if any(t.statistics for t in taken) else OP], ops
    vocab_shaped = [n for n in graph.nodes if n.op != "placeholder"
                    and isinstance(value := n.meta.get("example_value"), torch.Tensor)
                    and value.dim() >= 2 and size_hint(value.shape[-1]) == vocab]
    assert len(vocab_shaped) == 1, [n.format_node() for n in vocab_shaped]
    (stand_in,) = vocab_shaped
    taken = stand_in.meta.get(STAND_IN)
    assert isinstance(taken, TakenOut) and isinstance(taken.recipe, Recipe), stand_in.format_node()
    assert [user.op for user in stand_in.users] == ["output"]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shape(value) -> tuple[int, ...]:
    return tuple(size_hint(s) for s in value.shape)


def _fact(node) -> NodeFact:
    site = None
    if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "chunkce":
        hidden, weight = (getattr(argument, "meta", {}).get("example_value") for argument in node.args[:2])
        known = isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)  # [..., H], [V, H]
        site = (_numel(_shape(hidden)[:-1]), _shape(weight)[0]) if known else (0, 0)
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return NodeFact(node.op, node.target, None, site=site)
    shape = _shape(value)
    expanded = any(size_hint(stride) == 0 and size > 1 for stride, size in zip(value.stride(), shape))
    return NodeFact(node.op, node.target, shape, expanded, site)


def _clone(inputs):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs]


def compare_with_stock(model, *inputs, inner: str = "aot_eager", options=None, calls=None, dynamic=None,
                       exact: bool = False, **tolerances):
    """Compile ``model`` with chunkce (inner backend ``inner``, recorded) and a deep copy with
    stock ``inner``; run a training step of each on every input tuple of ``calls`` (default:
    ``inputs``), cloned; assert every output and every parameter / input gradient equal
    (``exact``: bit for bit); and prove on the recorded graphs what the counters say of the
    compile (:meth:`Recorder.assert_counted`). Returns ``(recorder, Inductor's generated code)``
    ("" for other inner backends): a test says what it expects of the recorder
    (``assert_rewritten`` / ``assert_untouched``)."""
    calls = calls or [inputs]
    before = Counter(counters["chunkce"])
    recorder = Recorder(inner)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="chunkce", dynamic=dynamic,
                             options={**(options or {}), "inner_backend": recorder})
    stock = torch.compile(reference, backend=inner, dynamic=dynamic)
    if exact:
        tolerances = {"atol": 0.0, "rtol": 0.0}
    code = []
    for args in calls:
        args = list(args)
        (outputs, grads), step_code = run_and_get_code(train_step, compiled, _clone(args))
        code += step_code
        ref_outputs, ref_grads = train_step(stock, _clone(args))
        torch.testing.assert_close(outputs, ref_outputs, **tolerances)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **tolerances,
                                       msg=lambda m, name=name: f"{name}: {m}")
    recorder.assert_counted(Counter(counters["chunkce"]) - before)
    return recorder, "\n".join(code)
