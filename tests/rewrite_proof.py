"""Proof on the graph that the pass rewrote a site, or left it alone.

Counters are the pass's own word; these read the graphs it handed to the inner
backend. A rewritten site has the op's node and no ``[N, V]`` logits node (no
node whose fake value holds ``N * V`` elements with ``V`` its last dim); a
refused one has no op node. The reference is the same model compiled by the
stock backend: loss, outputs and every gradient compared.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from conftest import OP, train_step
from torch._dynamo.backends.registry import lookup_backend
from torch._inductor.utils import run_and_get_code
from torch.fx import GraphModule

from compile_pass.graph.nodes import size_hint


@dataclass(frozen=True)
class NodeFact:
    """What a test needs of one node, read when the graph reached the inner backend
    (Inductor's own passes change the graph afterwards)."""

    op: str
    target: object
    shape: tuple[int, ...] | None  # of its fake value, sizes as hints; None when not a tensor
    expanded: bool = False  # a broadcast view (a stride 0 over a dim > 1): no memory of its own


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
        return sum(fact.target is OP for graph in self.graphs for fact in graph)

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
        assert self.op_count() == 0


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _fact(node) -> NodeFact:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return NodeFact(node.op, node.target, None)
    shape = tuple(size_hint(s) for s in value.shape)
    expanded = any(size_hint(stride) == 0 and size > 1 for stride, size in zip(value.stride(), shape))
    return NodeFact(node.op, node.target, shape, expanded)


def _clone(inputs):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs]


def compare_with_stock(model, *inputs, inner: str = "aot_eager", options=None, calls=None, dynamic=None,
                       exact: bool = False, **tolerances):
    """Compile ``model`` with chunkce (inner backend ``inner``, recorded) and a deep copy with
    stock ``inner``; run a training step of each on every input tuple of ``calls`` (default:
    ``inputs``), cloned; assert every output and every parameter / input gradient equal
    (``exact``: bit for bit). Returns ``(recorder, Inductor's generated code)``."""
    calls = calls or [inputs]
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
    return recorder, "\n".join(code)
