"""The pass: find every cross-entropy site, guard it, rewrite it, report it.

    report = fuse_linear_cross_entropy(gm.graph, Options(chunk_size=1024))

Works on torch-level graphs (what Dynamo captures; Inductor's pre-grad graph) and
the subgraphs of their higher-order ops.
A refused site is left as it is; only ``Options(strict=True)`` turns a refusal
into an error.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.fx import Graph, GraphModule, Node

from compile_pass.graph import guard, lazy_logits, logits_drop, report
from compile_pass.graph.nodes import Edit, example_value, module_attr
from compile_pass.graph.refusals import Reason
from compile_pass.graph.rewrite import rewrite_site
from compile_pass.graph.sites import Site, find_sites
from compile_pass.op.settings import settings
from compile_pass.options import Options

log = logging.getLogger(__name__)


def fuse_linear_cross_entropy(graph: Graph, options: Options | None = None, *,
                              subgraphs: bool = True, publish: bool = True) -> report.PassReport:
    """Rewrite every accepted ``linear -> cross_entropy`` site of ``graph`` in place.

    Each site is all-or-nothing: an exception at any step of its rewrite leaves the
    graph exactly as it was (:class:`compile_pass.graph.nodes.Edit`), logs a warning
    with the reason, and records the site as refused with key ``internal_error``;
    an exception while finding the sites or reporting them is logged the same way.
    The compile then goes on as it would without chunkce.

    Args:
        subgraphs: also rewrite the subgraphs of higher-order ops (e.g. the body of a
            ``torch.utils.checkpoint`` region), innermost first. Inductor's pre-grad
            pass passes False: Inductor calls it on every subgraph itself.
        publish: log the report, count it in ``counters["chunkce"]`` and keep it as
            :func:`compile_pass.graph.report.last_report` (:func:`publish_report`). False:
            the caller publishes it, or not (``explain`` does not; the backend does once
            its inner backend has compiled the graph, so that a frame Dynamo traces again
            is counted once).

    Returns:
        The report.

    Raises:
        NotImplementedError: ``options.strict`` and a site was refused (the
            message carries the guard's reason).
        ValueError: a ``CHUNKCE_*`` environment variable is malformed (``CHUNKCE_CHUNK_SIZE``
            or ``CHUNKCE_CHUNK_BYTES`` not a positive integer).
        Exception: ``options.strict`` and the pass itself failed (the original error).
    """
    options = options or Options()
    settings()  # a malformed CHUNKCE_* variable is the user's error to see, not a refused site
    records = []
    if subgraphs:
        for subgraph in _subgraph_modules(graph):
            records += _fuse_graph(subgraph.graph, options, in_subgraph=True)
            subgraph.recompile()
        records += _fuse_graph(graph, options, in_subgraph=False)
    else:
        records += _fuse_graph(graph, options, in_subgraph=is_subgraph(graph))
    result = report.PassReport(records)
    if not records and not is_subgraph(graph):  # no site: is the win lost anyway? (graph/no_site.py)
        result.unmatched = report.unmatched(graph)
    if publish:
        publish_report(result, options.strict)
    return result


def publish_report(result: report.PassReport, strict: bool = False) -> None:
    """:func:`compile_pass.graph.report.publish`; a failure is logged, not raised, unless ``strict``."""
    try:
        report.publish(result)
    except Exception:
        if strict:
            raise
        log.warning("chunkce: could not report the pass's decisions; the graph is rewritten", exc_info=True)


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


def _fuse_graph(graph: Graph, options: Options, in_subgraph: bool) -> list[report.SiteRecord]:
    try:
        sites = find_sites(graph, in_subgraph)
    except Exception as exc:
        if options.strict:
            raise
        log.warning("chunkce: could not read the graph's cross-entropy sites; left it unchanged", exc_info=True)
        return [report.failed("(whole graph)", guard.internal_error(f"{type(exc).__name__}: {exc}"))]
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
        try:
            records.append(_decide(site, reason, options, in_subgraph))
        except Exception as exc:
            if options.strict:
                raise
            log.warning("chunkce: rewriting %s failed; left it unfused", site.node.format_node(), exc_info=True)
            records.append(report.failed(site.node.name, guard.internal_error(f"{type(exc).__name__}: {exc}")))
    try:
        return [_settle_logits(record, site, in_subgraph) if record.decision == report.REWRITTEN else record
                for record, (site, _) in zip(records, decisions)]
    except Exception:
        if options.strict:
            raise
        log.warning("chunkce: could not tell which rewritten sites' logits are kept; the graph is rewritten",
                    exc_info=True)
        return records


class _OnlyCosts(Exception):
    """Raised inside a site's :class:`Edit` to undo a rewrite that would only cost."""


def _decide(site: Site, reason: Reason | None, options: Options, in_subgraph: bool) -> report.SiteRecord:
    """The record of a refused site, or rewrite an accepted one (and take its returned
    logits out of the graph, lazy or dropped, as ``options.returned_logits`` says), all or nothing.

    ``"drop"`` drops training logits only (:func:`compile_pass.graph.logits_drop.droppable`);
    only-returned logits of a graph without grad are lazy under ``"drop"`` as under ``"lazy"``.
    A site whose loss computes no gradient and whose logits the graph still computes after
    the rewrite (another reader; ``"keep"``; the pre-grad pass) is left as it was
    (``report.LEFT``): without grad stock Inductor holds only the logits (it fuses the fp32
    upcast and the log-softmax into reductions), so the rewrite would add a second projection
    and save nothing (measured: docs/models.md)."""
    if reason is not None:
        return report.refused(site, reason)
    record = report.rewritten(site)  # before the rewrite: it reads the site's nodes
    without_grad = not _requires_grad(site.node)
    graph = site.node.graph
    try:
        with Edit(graph) as edit:
            done = rewrite_site(site, edit, options)
            dropped, mode = 0, options.returned_logits
            lazy = done.logits_kept and not in_subgraph and mode in ("lazy", "drop")
            if lazy and mode == "drop" and logits_drop.droppable(site.projection.node):
                dropped, lazy = logits_drop.drop_if_only_returned(site.projection, edit), False
            elif lazy:
                dropped = lazy_logits.defer_if_only_returned(site.projection, edit)
            if without_grad and site.projection.node.users:
                raise _OnlyCosts
            graph.lint()
    except _OnlyCosts:  # the graph is as it was
        return dataclasses.replace(record, decision=report.LEFT, reason=report.NO_GRAD_LOGITS_READ,
                                   reason_key="no_grad_logits_read", tiles=None)
    note = (report.LOGITS_LAZY if lazy else report.LOGITS_DROPPED) if dropped else ""  # kept: _settle_logits
    return dataclasses.replace(record, reason=note, logits_bytes_avoided=done.logits_bytes_avoided + dropped,
                               tiles=done.tiles)


def _requires_grad(loss: Node) -> bool:
    """Whether the loss node's value requires grad (True when unknown: rewriting is the safe default)."""
    value = example_value(loss)
    return not isinstance(value, torch.Tensor) or value.requires_grad


def _settle_logits(record: report.SiteRecord, site: Site, in_subgraph: bool) -> report.SiteRecord:
    """A rewritten site's record once every site of its graph is done: its logits are
    kept only if the projection still has users (an erased node has none). (Right
    after one site's rewrite, the next site fed by the same logits still reads them.)"""
    if record.reason in (report.LOGITS_DROPPED, report.LOGITS_LAZY):
        return record
    node = site.projection.node
    if not node.users:
        return dataclasses.replace(record, reason="", fix="")
    fix = report.DROP_LOGITS_FIX if not in_subgraph and logits_drop.only_returned(node) else ""
    return dataclasses.replace(record, reason=report.LOGITS_KEPT, fix=fix)


def _check(site: Site, order: dict) -> Reason | None:
    try:
        return guard.check(site, order)
    except Exception as exc:  # noqa: BLE001 - refusing is always safe; failing the compile is not
        log.warning("chunkce: guard failed on %s", site.node.format_node(), exc_info=True)
        return guard.internal_error(f"{type(exc).__name__}: {exc}")
