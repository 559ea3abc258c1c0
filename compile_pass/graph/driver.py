"""The pass: find every cross-entropy site, guard it, rewrite it, report it.

    report = fuse_linear_cross_entropy(gm.graph, Options(chunk_size=1024))

Works on torch-level graphs (what Dynamo captures; Inductor's pre-grad graph) and
the subgraphs of their higher-order ops.
A refused site is left as it is; only ``Options(strict=True)`` turns a refusal
into an error.
"""

from __future__ import annotations

import logging

from torch.fx import Graph, GraphModule

from compile_pass.graph import guard, logits_drop, report
from compile_pass.graph.nodes import example_value, module_attr, size_hint
from compile_pass.graph.rewrite import rewrite_site
from compile_pass.graph.sites import Site, find_sites
from compile_pass.op.chunking import resolve_chunk_size
from compile_pass.options import Options

log = logging.getLogger(__name__)


def fuse_linear_cross_entropy(graph: Graph, options: Options | None = None) -> report.PassReport:
    """Rewrite every accepted ``linear -> cross_entropy`` site of ``graph`` in place.

    Subgraphs of higher-order ops (e.g. the body of a ``torch.utils.checkpoint``
    region) are rewritten too, innermost first.

    Returns:
        The report (also logged, counted in ``counters["chunkce"]`` and kept as
        :func:`compile_pass.graph.report.last_report`).

    Raises:
        NotImplementedError: ``options.strict`` and a site was refused (the
            message carries the guard's reason).
    """
    options = options or Options()
    records = []
    for subgraph in _subgraph_modules(graph):
        records += _fuse_graph(subgraph.graph, options, in_subgraph=True)
        subgraph.recompile()
    records += _fuse_graph(graph, options, in_subgraph=False)
    result = report.PassReport(records)
    report.publish(result)
    return result


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


def _fuse_graph(graph: Graph, options: Options, in_subgraph: bool) -> list[report.SiteRecord]:
    sites = find_sites(graph, in_subgraph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    decisions = [(site, _check(site, order)) for site in sites]
    refused = [(site, reason) for site, reason in decisions if reason is not None]
    if options.strict and refused:
        site, reason = refused[0]
        raise NotImplementedError(
            f"chunkce: cannot rewrite the cross-entropy at {report.source_of(site.node)}: {reason} "
            "(strict=True; pass strict=False to leave such sites unfused)"
        )
    records = []
    for site, reason in decisions:
        source = report.source_of(site.node)
        module = report.module_of(site.projection.node if site.projection else site.stop)
        if reason is not None:
            fix = report.GRAPH_BREAK_FIX if reason.key == "graph_break" else ""
            records.append(report.SiteRecord(source, module, report.REFUSED, str(reason), reason.key, fix=fix))
            continue
        chunk = _chunk_size(site, options)
        done = rewrite_site(site, options.chunk_size)
        note, fix, dropped = "", "", 0
        if done.logits_kept and not in_subgraph and options.drop_unused_logits:
            dropped = logits_drop.drop_if_only_returned(site.projection)
        if dropped:
            note = report.LOGITS_DROPPED
        elif done.logits_kept:
            note = report.LOGITS_KEPT
            fix = report.DROP_LOGITS_FIX if logits_drop.droppable(site.projection.node) else ""
        records.append(report.SiteRecord(
            source, module, report.REWRITTEN, note, chunk_size=chunk,
            logits_bytes_avoided=done.logits_bytes_avoided + dropped, fix=fix,
        ))
    if any(r.decision == report.REWRITTEN for r in records):
        graph.lint()
    return records


def _check(site: Site, order: dict) -> guard.Reason | None:
    try:
        return guard.check(site, order)
    except Exception as exc:  # noqa: BLE001 - refusing is always safe; failing the compile is not
        log.warning("chunkce: guard failed on %s", site.node.format_node(), exc_info=True)
        return guard.internal_error(f"{type(exc).__name__}: {exc}")


def _chunk_size(site: Site, options: Options) -> int:
    """The chunk size the op will use at this site for the traced example's size (the
    op's own rule, :func:`compile_pass.op.chunking.resolve_chunk_size`), for the report."""
    hidden = example_value(site.projection.hidden)  # [..., H]
    logits = example_value(site.projection.node)  # [..., V], projection dtype
    return resolve_chunk_size(options.chunk_size, size_hint(example_value(site.call.target).numel()),
                              size_hint(hidden.shape[-1]), size_hint(logits.shape[-1]),
                              logits.element_size(), logits.device.type)
