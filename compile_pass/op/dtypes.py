"""The dtype the op computes a floating dtype's arithmetic in (its "opmath" dtype, as torch's kernels)."""

from __future__ import annotations

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision logits, else the logits' own dtype (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)
