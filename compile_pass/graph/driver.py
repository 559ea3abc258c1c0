"""The pass: find every cross-entropy site, guard it, rewrite its loss, report it.

    report = fuse_linear_cross_entropy(gm.graph, Options(chunk_size=1024))

The driver rewrites losses only. The logits a rewritten loss read stay in the graph where
anything still reads them; the returned-logits pass (:mod:`compile_pass.graph.returned_logits`,
which the backend runs after :func:`rewrite_losses`) takes out those only the output reads.

Works on torch-level graphs (what Dynamo captures; Inductor's pre-grad graph) and
the subgraphs of their higher-order ops.
A refused site is left as it is; only ``Options(strict=True)`` turns a refusal
into an error.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from compile_pass.graph import guard, publish, report
from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import Edit, example_value, module_attr
from compile_pass.graph.refusals import Reason
from compile_pass.graph.returned_logits import only_returned, taken_out_as
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

    Only losses are rewritten: logits that something still reads, the graph output
    included, stay computed (the report says ``LOGITS_KEPT``); the backend then runs the
    returned-logits pass (:mod:`compile_pass.graph.returned_logits`) and wraps the compiled
    graph. A site of a graph without grad whose logits stay computed is left as stock
    unless ``options.returned_logits`` says they will be taken out (``"lazy"`` / ``"drop"``,
    the backend's run): a caller that runs no returned-logits pass passes ``"keep"``, as
    :class:`compile_pass.pre_grad.ChunkcePreGradPass` does.

    Args:
        subgraphs: also rewrite the subgraphs of higher-order ops (e.g. the body of a
            ``torch.utils.checkpoint`` region), innermost first. Inductor's pre-grad
            pass passes False: Inductor calls it on every subgraph itself.
        publish: log the report, count it in ``counters["chunkce"]`` and keep it as
            :func:`compile_pass.graph.publish.last_report` (:func:`publish_report`). False:
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
    result = rewrite_losses(graph, options, subgraphs=subgraphs).report
    if publish:
        publish_report(result, (options or Options()).strict)
    return result


@dataclass
class Fused:
    """What :func:`rewrite_losses` did to a graph: its report, and, for the returned-logits
    pass (:func:`compile_pass.graph.returned_logits.take_out_returned_logits`), the projection
    of each rewritten site of the top-level graph whose logits the graph still computes, with
    the index of the site's record."""

    report: report.PassReport
    kept: list[tuple[int, Projection]]


def rewrite_losses(graph: Graph, options: Options | None = None, *, subgraphs: bool = True) -> Fused:
    """:func:`fuse_linear_cross_entropy` without publishing: the report, and the projections
    the returned-logits pass reads (:class:`Fused`). Raises as it does."""
    options = options or Options()
    settings()  # a malformed CHUNKCE_* variable is the user's error to see, not a refused site
    done: list[tuple[report.SiteRecord, Site | None]] = []  # a site of the top-level graph beside its record
    if subgraphs:
        for subgraph in _subgraph_modules(graph):
            done += [(record, None) for record, _ in _fuse_graph(subgraph.graph, options, in_subgraph=True)]
            subgraph.recompile()
    in_subgraph = not subgraphs and is_subgraph(graph)
    done += [(record, None if in_subgraph else site) for record, site in _fuse_graph(graph, options, in_subgraph)]
    records = [record for record, _ in done]
    result = report.PassReport(records)
    if not records and not is_subgraph(graph):  # no site: is the win lost anyway? (graph/no_site.py)
        result.unmatched = report.unmatched(graph)
    kept = [(i, site.projection) for i, (record, site) in enumerate(done)
            if site is not None and record.decision == report.REWRITTEN and site.projection.node.users]
    return Fused(result, kept)


def publish_report(result: report.PassReport, strict: bool = False) -> None:
    """:func:`compile_pass.graph.publish.publish`; a failure is logged, not raised, unless ``strict``."""
    try:
        publish.publish(result)
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


def _fuse_graph(graph: Graph, options: Options, in_subgraph: bool) -> list[tuple[report.SiteRecord, Site | None]]:
    """Each site's record, beside the site (None where the graph could not be read)."""
    try:
        sites = find_sites(graph, in_subgraph)
    except Exception as exc:
        if options.strict:
            raise
        log.warning("chunkce: could not read the graph's cross-entropy sites; left it unchanged", exc_info=True)
        return [(report.failed("(whole graph)", guard.internal_error(f"{type(exc).__name__}: {exc}")), None)]
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
    sites = [site for site, _ in decisions]
    try:
        records = [_settle_logits(record, site, in_subgraph) if record.decision == report.REWRITTEN else record
                   for record, site in zip(records, sites)]
    except Exception:
        if options.strict:
            raise
        log.warning("chunkce: could not tell which rewritten sites' logits are kept; the graph is rewritten",
                    exc_info=True)
    return list(zip(records, sites))


class _OnlyCosts(Exception):
    """Raised inside a site's :class:`Edit` to undo a rewrite that would only cost."""


def _decide(site: Site, reason: Reason | None, options: Options, in_subgraph: bool) -> report.SiteRecord:
    """The record of a refused site, or rewrite an accepted one's loss, all or nothing.

    A site whose loss computes no gradient and whose logits the graph still computes after
    the rewrite and the returned-logits pass (another reader; ``"keep"``; the pre-grad pass,
    which runs no returned-logits pass: :func:`compile_pass.graph.returned_logits.taken_out_as`)
    is left as it was (``report.LEFT``): without grad stock Inductor holds only the logits (it
    fuses the fp32 upcast and the log-softmax into reductions), so the rewrite would add a
    second projection and save nothing (measured: docs/models.md)."""
    if reason is not None:
        return report.refused(site, reason)
    record = report.rewritten(site)  # before the rewrite: it reads the site's nodes
    without_grad = not _requires_grad(site.node)
    graph = site.node.graph
    try:
        with Edit(graph) as edit:
            done = rewrite_site(site, edit, options)
            if without_grad and site.projection.node.users and taken_out_as(
                    site.projection, options.returned_logits, in_subgraph) is None:
                raise _OnlyCosts
            graph.lint()
    except _OnlyCosts:  # the graph is as it was
        return dataclasses.replace(record, decision=report.LEFT, reason=report.NO_GRAD_LOGITS_READ,
                                   reason_key="no_grad_logits_read", tiles=None)
    return dataclasses.replace(record, logits_bytes_avoided=done.logits_bytes_avoided, tiles=done.tiles)


def _requires_grad(loss: Node) -> bool:
    """Whether the loss node's value requires grad (True when unknown: rewriting is the safe default)."""
    value = example_value(loss)
    return not isinstance(value, torch.Tensor) or value.requires_grad


def _settle_logits(record: report.SiteRecord, site: Site, in_subgraph: bool) -> report.SiteRecord:
    """A rewritten site's record once every site of its graph is done: its logits are
    kept only if the projection still has users (an erased node has none). (Right
    after one site's rewrite, the next site fed by the same logits still reads them.) The
    returned-logits pass amends the records of the logits it takes out."""
    node = site.projection.node
    if not node.users:
        return dataclasses.replace(record, reason="", fix="")
    # (loss_parallel's Shard(-1) DTensor logits stay computed: returned_logits.taken_out_as)
    sharded = site.projection.sharded
    takeable = not in_subgraph and (sharded is None or not sharded.loss_parallel) and only_returned(node)
    fix = report.DROP_LOGITS_FIX if takeable else ""
    return dataclasses.replace(record, reason=report.LOGITS_KEPT, fix=fix)


def _check(site: Site, order: dict) -> Reason | None:
    try:
        return guard.check(site, order)
    except Exception as exc:  # noqa: BLE001 - refusing is always safe; failing the compile is not
        log.warning("chunkce: guard failed on %s", site.node.format_node(), exc_info=True)
        return guard.internal_error(f"{type(exc).__name__}: {exc}")
