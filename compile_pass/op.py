"""STUB: reference implementation with the final signature; replaced by the chunked op."""
from __future__ import annotations
import torch
import torch.nn.functional as F
from torch import Tensor


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                         linear_bias: Tensor | None = None, weight: Tensor | None = None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, logits_dtype: torch.dtype | None = None,
                         chunk_size: int | None = None, release_cache: bool | None = None) -> Tensor:
    logits = F.linear(input, linear_weight, linear_bias)
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    loss = F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=weight, reduction=reduction,
                           ignore_index=ignore_index, label_smoothing=label_smoothing)
    return loss.view(target.shape) if reduction == "none" else loss
