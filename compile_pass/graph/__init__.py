"""The graph pass: find ``linear -> cross_entropy`` sites in a torch-level FX graph and rewrite them.

    driver.py       fuse_linear_cross_entropy: every site of a graph (and its subgraphs)
    forms.py        reading nodes: the spellings of the projection and of the cross-entropy call
    sites.py        find sites: walk back from each cross-entropy to its projection
    guard.py        accept a site, or refuse it with a one-line reason
    rewrite.py      replace an accepted site with the op (:mod:`compile_pass.op`)
    logits_drop.py  opt-in: returned logits nothing reads are not computed
    report.py       what was done at each site: log records, counters, a table

Imports the op and :mod:`compile_pass.options`; never the entry points above it.
"""
from compile_pass.graph.driver import fuse_linear_cross_entropy

__all__ = ["fuse_linear_cross_entropy"]
