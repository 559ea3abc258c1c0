"""Every spelling the pass reads, in one table, tried in order on each node of a graph.

    losses.py  F.cross_entropy, nn.CrossEntropyLoss (inlined), torch._C._nn.cross_entropy_loss
    losses.py       nll_loss(log_softmax(z)), nn.NLLLoss(nn.LogSoftmax(z)), nll_loss_nd
    losses.py         log_softmax(z).gather(-1, y[..., None]) and take_along_dim, negated or not
    statistics.py      logsumexp(z, -1) (a row statistic: the z-loss's)
    statistics.py        (softmax(z) * log_softmax(z)).sum(-1), (softmax(z) * z).sum(-1) (row statistics)

A spelling (:class:`compile_pass.graph.spellings.call.Spelling`) is a reader and a replacement in its
own module; adding one is that module and a line here (docs/design.md, Loss spellings).
"""

from __future__ import annotations

from torch.fx import Node

from compile_pass.graph.spellings import losses, statistics
from compile_pass.graph.spellings.call import Call, Spelling

SPELLINGS: tuple[Spelling, ...] = (losses.CROSS_ENTROPY, losses.NLL_LOSS, losses.GATHER, statistics.LOGSUMEXP,
                                   statistics.ENTROPY)


def read_call(node: Node) -> Call | None:
    """What ``node`` computes of the logits, in the first spelling that reads it; None: no spelling does."""
    if node.op not in ("call_function", "call_method"):
        return None
    for spelling in SPELLINGS:
        call = spelling.read(node)
        if call is not None:
            return call
    return None
