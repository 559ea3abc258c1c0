"""Every refused site says what to do about it: ``SiteRecord.fix`` is never empty.

The fix is the refusal kind's (``compile_pass.graph.refusals.Refusal``, and ``fix_for`` by
reason key): how to make the site rewritable, or that nothing can be done and the site stays
unfused, exact. Checked here for every kind of the table (so that a new kind needs a fix) and
for real refusals through the backend (the report's table prints it under the row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_pass
from compile_pass.graph import report
from compile_pass.graph.refusals import Refusal, fix_for

H, V = 8, 11


def test_every_refusal_kind_has_its_own_fix():
    keys = {kind.key for kind in Refusal}
    assert {"graph_break", "loss_spelling", "mutation", "scale_operand", "op_{op}"} <= keys
    for kind in Refusal:
        assert kind.fix.startswith("fix: ") and len(kind.fix) > len("fix: ") + 10, kind
        key = kind.key.format(op="tanh")
        assert fix_for(key) == kind.fix, kind  # kinds counted under one key share their fix
        record = report.SiteRecord("x.py:1 in f: loss", "lm_head", report.Decision.REFUSED, "why", key)
        assert record.fix == kind.fix, kind
    for key in ("op_iadd", "some_future_key"):
        record = report.SiteRecord("x.py:1 in f: loss", "lm_head", report.Decision.REFUSED, "why", key)
        assert record.fix.startswith("fix: ") and len(record.fix) > len("fix: ") + 10, key
    rewritten = report.SiteRecord("x.py:1 in f: loss", "lm_head", report.Decision.REWRITTEN, "")
    assert rewritten.fix == ""


class Head(nn.Module):
    def __init__(self, between):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V)
        self.between = between

    def forward(self, h, y):
        return F.cross_entropy(self.between(self.lm_head(h)).reshape(-1, V), y.reshape(-1))


@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
@pytest.mark.parametrize("between,key", [(torch.tanh, "soft_cap"), (torch.relu, "op_relu"),
                                         (lambda z: z.half().float(), "lossy_cast")])
def test_refused_sites_carry_a_fix_in_the_report(between, key):
    compiled = torch.compile(Head(between), backend="chunkce", options={"inner_backend": "aot_eager"})
    compiled(torch.randn(2, 3, H), torch.randint(0, V, (2, 3)))
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key) == ("refused", key)
    assert record.fix == fix_for(key) and record.fix.startswith("fix: ")
    assert record.fix in str(compile_pass.last_report())
