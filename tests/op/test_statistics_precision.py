"""The row-statistics op no less accurate than torch's fp32 unfused computation at any logit
magnitude (the oracle: ``statistics_oracle.py``): each output and each gradient's relative error
against fp64, at most ``FACTOR`` times torch's plus ``FLOOR`` (``test_op_precision.py``'s rule)."""

from __future__ import annotations

import pytest
from statistics_oracle import CASES, QUANTITIES, case_errors

FACTOR = 1.5
FLOOR = 3e-8


@pytest.mark.parametrize("spread, offset, temperature", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_error_against_fp64_no_worse_than_torch(spread, offset, temperature):
    theirs, ours = case_errors(spread, offset, temperature)
    for name, torch_error, op_error in zip(QUANTITIES, theirs, ours, strict=True):
        assert op_error <= FACTOR * torch_error + FLOOR, (name, op_error, torch_error)
