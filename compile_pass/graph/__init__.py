"""The graph pass: find ``linear -> cross_entropy`` sites in a torch-level FX graph and rewrite them.

    driver.py       fuse_linear_cross_entropy / rewrite_losses: every loss of a graph (and its subgraphs)
    nodes.py        reading nodes (op names, fake values, sizes) and writing them (create_node, trace_into)
    forms.py        the two ends of a site: the projection and the cross-entropy call, normalised
    spellings.py    the older loss spellings: nll_loss(log_softmax), a gather of log_softmax
    sites.py        find sites: walk back from each loss to its projection, or stop with a kind
    dtype_chains.py the dtypes a site's logits pass through (cast_chains: where the op rounds them)
    scale.py        read one scaling of the logits by a constant (the op's head transform), or a stop
    tensor_parallel.py  a vocabulary-sharded (DTensor) lm_head read as one projection, for the
                    vocabulary-parallel op (compile_pass.op.vocab_parallel), or why not
    refusals.py     every kind of refusal: its counter key, message and fix (one table)
    guard.py        accept a site, or refuse it with a Reason of one kind
    diagnostics.py  what a reason says beyond the site: the op upstream of a stop, DDP / FSDP2 state
    rewrite.py      choose what replaces an accepted site and trace it in (the op, compile_pass.op)
    returned_logits.py  after the driver: returned logits only the output reads leave the graph (lazy / drop)
    no_site.py      a training graph's logits with no cross-entropy site (the win lost, reported)
    report.py       what was done at each site: the records, a table
    publish.py      a report logged (warnings once), counted, kept (last_report)

Imports the op, the runtime of returned logits (:mod:`compile_pass.lazy_logits`, whose recipes
the returned-logits pass makes) and :mod:`compile_pass.options`; never the entry points above it.
"""
from compile_pass.graph.driver import fuse_linear_cross_entropy

__all__ = ["fuse_linear_cross_entropy"]
