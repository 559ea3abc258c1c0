"""The pass: find -> plan -> apply on a graph and its higher-order ops' bodies, then the report.

    result = run_pass(gm.graph, options, take_out=True)   # the entry points; result.returned: wrap_compiled's
    report = fuse_linear_cross_entropy(gm.graph, options)  # the losses alone (the public graph pass)

Finding (:mod:`compile_pass.graph.find`) and planning (:mod:`compile_pass.graph.plan`) change
nothing; applying (:mod:`compile_pass.graph.apply`) edits each site all or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, GraphModule

from compile_pass.graph import guard
from compile_pass.graph.apply import apply_plans, take_out_returned
from compile_pass.graph.find import find_sites
from compile_pass.graph.nodes import module_attr
from compile_pass.graph.plan import plan_returned, plan_sites
from compile_pass.graph.report import PassReport, SiteRecord, failed, unmatched
from compile_pass.graph.report import publish as publish_report
from compile_pass.graph.returned_logits import add_outputs
from compile_pass.lazy_logits import LazyOutputs
from compile_pass.op.tiling import settings
from compile_pass.options import Options


@dataclass
class PassResult:
    """What :func:`run_pass` did: its report, and the returned logits it took out (None: none)."""

    report: PassReport
    returned: LazyOutputs | None = None  # for compile_pass.lazy_logits.wrap_compiled


def run_pass(graph: Graph, options: Options | None = None, *, subgraphs: bool = True, take_out: bool = False,
             publish: bool = True) -> PassResult:
    """Rewrite every accepted site of ``graph`` in place; ``subgraphs``: its higher-order ops'
    bodies too, innermost first; ``take_out``: the caller wraps the compiled graph with
    ``result.returned``, so returned logits may leave it; ``publish``: log, count, keep the report.

    Raises:
        NotImplementedError: ``options.strict`` and a refused site. ValueError: a malformed
        ``CHUNKCE_*`` variable. Exception: ``options.strict`` and a failure (the original error).
    """
    options = options or Options()
    settings()  # a malformed CHUNKCE_* variable is the user's error to see, not a refused site
    records: list[SiteRecord] = []
    if subgraphs:
        for subgraph in _subgraph_modules(graph):
            records += _run_graph(subgraph.graph, options, in_subgraph=True, take_out=False)
            subgraph.recompile()
    in_subgraph = not subgraphs and is_subgraph(graph)
    records += _run_graph(graph, options, in_subgraph, take_out)
    result = PassResult(PassReport(records))
    if not records and not is_subgraph(graph):  # no site: a forward without labels, or the win lost
        if take_out and not in_subgraph and not _ddp_partition(graph):
            returned = plan_returned(graph, options, strict=options.strict)
            result.report.returned = take_out_returned(returned, options)
        result.report.unmatched = unmatched(graph)
    if take_out and not in_subgraph:
        result.returned = add_outputs(graph)
    if publish:
        publish_report(result.report, options.strict)
    return result


def _ddp_partition(graph: Graph) -> bool:
    """Whether ``graph`` is a partition of a graph DDPOptimizer split at its gradient buckets: its
    outputs feed the next partition (and its compile runs it on fake tensors), so none is taken
    for the user's returned logits."""
    reason = getattr(graph.owning_module, "compile_subgraph_reason", None)
    return "DDPOptimizer" in str(getattr(reason, "reason", ""))


def fuse_linear_cross_entropy(graph: Graph, options: Options | None = None, *, subgraphs: bool = True,
                              publish: bool = True) -> PassReport:
    """:func:`run_pass` without taking returned logits out: the losses alone; its report."""
    return run_pass(graph, options, subgraphs=subgraphs, publish=publish).report


def _run_graph(graph: Graph, options: Options, in_subgraph: bool, take_out: bool) -> list[SiteRecord]:
    sites = find_sites(graph, in_subgraph, strict=options.strict)
    if isinstance(sites, Exception):  # the graph could not be read
        return [failed("(whole graph)", guard.internal_error(f"{type(sites).__name__}: {sites}"))]
    plans, walks, logits = plan_sites(sites, options, in_subgraph, take_out and not in_subgraph)
    return apply_plans(plans, walks, logits, options, take_out and not in_subgraph)


def is_subgraph(graph: Graph) -> bool:
    """Whether ``graph`` is a higher-order op's body rather than a graph Dynamo captured
    (whose inputs carry Dynamo's ``grapharg`` metadata)."""
    inputs = graph.find_nodes(op="placeholder")
    return bool(inputs) and not any("grapharg" in node.meta for node in inputs)


def _subgraph_modules(graph: Graph, seen: set[int] | None = None) -> list[GraphModule]:
    """GraphModules that ``graph``'s get_attr nodes name (higher-order op bodies), innermost first."""
    seen = set() if seen is None else seen
    found = []
    for node in graph.find_nodes(op="get_attr"):
        module = module_attr(graph, node.target)
        if isinstance(module, GraphModule) and id(module) not in seen:
            seen.add(id(module))
            found += [*_subgraph_modules(module.graph, seen), module]
    return found
