"""Per-token losses reduced as F.cross_entropy reduces them (the loss and the vocabulary-parallel loss).

The reduction of per-token losses as ``F.cross_entropy`` reduces them: one function, shared by
the single-device loss (:mod:`compile_pass.op.loss`) and the vocabulary-parallel one
(:mod:`compile_pass.op.vocab_parallel`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_pass.op.tiling import accumulate_dtype


def reduce_total(total: Tensor, flat_target: Tensor, class_weight: Tensor | None, reduction: str,
                 ignore_index: int, label_smoothing: float, logits_dtype: torch.dtype) -> Tensor:
    """The summed loss ``total`` (0-d, fp32 or fp64) reduced as ``F.cross_entropy`` reduces it,
    ``"sum"`` or ``"mean"`` (over the non-ignored targets ``flat_target [N]``, or over their class
    weights ``class_weight [V]``), in ``logits_dtype``."""
    if reduction == "sum":
        return total.to(logits_dtype)
    valid = flat_target != ignore_index  # [N]
    if class_weight is None:
        denominator = valid.sum()
    else:
        class_weight = class_weight.to(accumulate_dtype(logits_dtype))
        denominator = (class_weight[flat_target.masked_fill(~valid, 0)] * valid).sum()
    mean = total / denominator
    if class_weight is not None and label_smoothing > 0.0:
        # torch divides the nll and the smoothing terms by the weight sum separately: with
        # a zero sum its nll's 0 / 0 makes the loss nan, where total / 0 would be inf
        mean = mean + torch.zeros_like(denominator) / denominator  # + 0, or nan when the sum is 0
    return mean.to(logits_dtype)
