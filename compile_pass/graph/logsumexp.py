"""The spelling ``logsumexp``: the log-sum-exp of each row of the logits, a row statistic.

    torch.logsumexp(z, -1)    z.logsumexp(dim=-1), torch.special.logsumexp; dim -1 or [-1], keepdim

as in the z-loss (``logsumexp(logits.float(), -1).pow(2)``, masked and averaged after it: those
ops stay as the user wrote them). Replaced by the ``lse`` of ``chunkce::linear_statistics``
(:mod:`compile_pass.graph.row_statistic`), whose backward recomputes the tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from compile_pass.graph.calls import Spelling, SpellingKind, StatisticCall
from compile_pass.graph.forms import Projection
from compile_pass.graph.refusals import Reason
from compile_pass.graph.row_statistic import last_dim_reduction, statistic_replacement

_LOGSUMEXP = (torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp)


def read_logsumexp(node: Node) -> StatisticCall | None:
    """The logsumexp over the last dim of ``z`` (``Call.input``), or None."""
    reduced = last_dim_reduction(node, _LOGSUMEXP)
    if reduced is None:
        return None
    logits, keepdim = reduced
    return StatisticCall(input=logits, spelling=LOGSUMEXP, class_dim=-1, keepdim=keepdim)


def replace_logsumexp(call: StatisticCall, projection: Projection) -> Callable[..., Any] | Reason:
    return statistic_replacement(call, projection, lambda statistics: statistics.lse, keepdim=call.keepdim)


LOGSUMEXP = Spelling("logsumexp", read_logsumexp, replace_logsumexp, kind=SpellingKind.STATISTIC)
