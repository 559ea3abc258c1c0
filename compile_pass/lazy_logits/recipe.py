"""How returned logits the step did not compute are made when read: a :class:`Recipe`, or
:data:`DROPPED`, the recipe of logits that must never be made (``returned_logits="drop"``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from compile_pass.lazy_logits.head import Head

KEEP_OPTION = "options={'returned_logits': 'keep'}"


@dataclass(frozen=True)
class Recipe:
    """How one returned logits value is made, as the graph made it: ``module`` (the graph's
    nodes from the projection, inputs in ``roles``' order: ``"hidden states"``, ``"lm_head
    weight"``, ``"lm_head bias"``, ``"scale"``), ``scalars`` (inputs given as Python numbers,
    passed as 0-d CPU tensors), ``autocast_dtype`` (run under autocast to it) and ``head``
    (for fused reads; None: every read computes the values).
    """

    module: GraphModule
    roles: tuple[str, ...]
    scalars: tuple[bool, ...]
    autocast_dtype: torch.dtype | None
    head: Head | None = None

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0)
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return self.module(*inputs)


@dataclass(frozen=True)
class Refusing:
    """The recipe of logits a training step dropped (``returned_logits="drop"``): no inputs,
    and making them raises ``RuntimeError`` naming the option."""

    roles: tuple[str, ...] = ()
    scalars: tuple[bool, ...] = ()

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise RuntimeError(
            "chunkce: these logits were not computed: this compiled step was built with "
            "options={'returned_logits': 'drop'}, which skips returned logits nothing in the graph reads. "
            "Compile with returned_logits='lazy' (the default: computed when read) or 'keep' to get the logits."
        )


DROPPED = Refusing()
