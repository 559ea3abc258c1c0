"""Find: every node of a graph a spelling reads, as a site matched back to its projection.

    sites = find_sites(graph)   # [Site], in graph order; pure (the graph is not changed)

Each node is offered to the spellings' table (:mod:`compile_pass.graph.spellings`); a node
one reads is walked back to its projection (:func:`compile_pass.graph.sites.match_site`). A row
statistic (``kind=STATISTIC``: a logsumexp, an entropy) is a site only where that walk reaches a
projection to a vocabulary (:func:`compile_pass.graph.no_site.is_vocabulary`) that a loss site
reads too: the same sum over attention scores, a router's few experts or a graph input is no loss
of logits, and a graph with no loss site is reported as one (:mod:`compile_pass.graph.no_site`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.fx import Graph, Node

from compile_pass.graph import stages
from compile_pass.graph.calls import SpellingKind
from compile_pass.graph.no_site import is_vocabulary
from compile_pass.graph.nodes import example_value, module_attr, size_hint
from compile_pass.graph.refusals import Refusal
from compile_pass.graph.sites import Site, match_site
from compile_pass.graph.spellings import read_call


def find_sites(graph: Graph, in_subgraph: bool = False, strict: bool = False) -> list[Site]:
    """Every node of ``graph`` a spelling reads, in graph order, matched back to its projection;
    a node that fails to read is a site stopped as ``INTERNAL_ERROR`` (unless ``strict``).

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
        site = stages.attempt(strict, partial(_read, node, in_subgraph), partial(_unreadable, node),
                              "could not read %s; left it unfused", node.name)
        if site is not None:
            sites.append(site)
    losses = {site.projection.node for site in sites if site.projection is not None and site.call is not None
              and site.call.spelling.kind is not SpellingKind.STATISTIC}
    return [site for site in sites if site.call is None or site.call.spelling.kind is not SpellingKind.STATISTIC
            or site.projection.node in losses]


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


def _unreadable(node: Node, exc: Exception) -> Site:
    return Site(node, None, stop=node, stop_kind=Refusal.INTERNAL_ERROR, error=f"{type(exc).__name__}: {exc}")
