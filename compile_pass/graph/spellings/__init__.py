"""Every spelling the pass reads, in one table (:data:`SPELLINGS`), tried in order on each node.

    losses.py      CROSS_ENTROPY  F.cross_entropy, nn.CrossEntropyLoss (inlined), torch._C._nn.cross_entropy_loss
                   NLL_LOSS       nll_loss(log_softmax(z)), nn.NLLLoss(nn.LogSoftmax(z)), nll_loss_nd
                   GATHER         log_softmax(z).gather(-1, y[..., None]) and take_along_dim, negated or not
    reductions.py  LOGSUMEXP      logsumexp(z, -1) (a row statistic: the z-loss's)
                   ENTROPY        (softmax(z) * log_softmax(z)).sum(-1), (softmax(z) * z).sum(-1), or .mean
                   ROW_SUM        z.sum(-1), z.mean(-1), z.sum(), z.mean() (after ENTROPY: a product is its)

The order: a node is read by the first spelling whose reader returns a call, so a spelling that
reads a node another also matches comes first. Each reader matches its consuming node's own op
(``cross_entropy``, ``nll_loss``, ``gather``, ``logsumexp``, ``sum`` / ``mean``); ``ENTROPY``
and ``ROW_SUM`` both read a sum, and ``ENTROPY`` comes first (a sum of ``p * lp`` is an entropy,
not a row sum of a product); the losses come before the statistics, so that a loss is never read
as a statistic of its own log-probabilities. A spelling (:class:`compile_pass.graph.spellings.call.Spelling`) is a
reader and a replacement in the module of its family; adding one: docs/design.md, "Adding a
spelling".
"""

from __future__ import annotations

from torch.fx import Node

from compile_pass.graph.nodes import CALLS
from compile_pass.graph.spellings import losses, reductions
from compile_pass.graph.spellings.call import Call, Spelling

SPELLINGS: tuple[Spelling, ...] = (losses.CROSS_ENTROPY, losses.NLL_LOSS, losses.GATHER, reductions.LOGSUMEXP,
                                   reductions.ENTROPY, reductions.ROW_SUM)


def read_call(node: Node) -> Call | None:
    """What ``node`` computes of the logits, in the first spelling that reads it; None: no spelling does."""
    if node.op not in CALLS:
        return None
    for spelling in SPELLINGS:
        call = spelling.read(node)
        if call is not None:
            return call
    return None
