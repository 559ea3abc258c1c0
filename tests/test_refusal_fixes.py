"""Every refused site says what to do about it: ``SiteRecord.fix`` is never empty.

The fix is the reason key's (``compile_pass.graph.report.fix_for``): how to make the site
rewritable, or that nothing can be done and the site stays unfused, exact. Checked here for
every reason key the guard can give (read from its source, so that a new key needs a fix)
and for real refusals through the backend (the report's table prints it under the row).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_pass
from compile_pass.graph import guard, report

H, V = 8, 11


def _guard_keys() -> set[str]:
    source = Path(guard.__file__).read_text() + Path(guard.__file__).with_name("driver.py").read_text()
    return set(re.findall(r'Reason\(\s*"([a-z_0-9]+)"', source)) | {"weight_dtype", "subclass", "internal_error"}


def test_every_reason_key_of_the_guard_has_its_own_fix():
    keys = _guard_keys()
    assert {"graph_break", "loss_spelling", "mutation", "scale_operand"} <= keys  # the reading works
    missing = sorted(key for key in keys if key not in report._FIXES)
    assert missing == []
    for key in [*keys, "op_tanh", "op_iadd", "some_future_key"]:
        record = report.SiteRecord("x.py:1 in f: loss", "lm_head", report.REFUSED, "why", key)
        assert record.fix.startswith("fix: ") and len(record.fix) > len("fix: ") + 10, key
    rewritten = report.SiteRecord("x.py:1 in f: loss", "lm_head", report.REWRITTEN, "")
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
    assert record.fix == report.fix_for(key) and record.fix.startswith("fix: ")
    assert record.fix in str(compile_pass.last_report())
