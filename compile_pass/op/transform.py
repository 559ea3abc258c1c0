"""The head's transform: what happens to the logits between the projection and the loss, a scale::

    z = (x.to(dtype) * scale).to(logits_dtype)        or  x.to(dtype) / scale  when ``divides``

(Cohere's ``logit_scale``, Granite's ``logits_scaling``), rounded as torch's ``mul`` / ``div``.
Read by :mod:`compile_pass.graph.scale`, applied and differentiated by the kernels.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass.op.dtypes import accumulate_dtype


@dataclass(frozen=True)
class HeadTransform:
    """``scale`` (a Python number or a 0-d tensor, never differentiated), ``divides`` (else
    multiplies), ``dtype`` it applies in (None: the projection's). ``HeadTransform()`` is none."""

    scale: float | Tensor | None = None
    divides: bool = False
    dtype: torch.dtype | None = None

    @property
    def is_identity(self) -> bool:
        """Whether the logits reach the loss as the projection left them (but for casts)."""
        return self.scale is None

    def resolve(self, projection_dtype: torch.dtype) -> HeadTransform:
        """This transform with its dtype decided: None is ``projection_dtype``."""
        if self.is_identity or self.dtype is not None:
            return self
        return dataclasses.replace(self, dtype=projection_dtype)

    def form(self) -> tuple | None:
        """The kernels' compile key: multiply or divide, number or tensor, dtype; None: identity."""
        if self.is_identity:
            return None
        kind = "number" if isinstance(self.scale, numbers.Real) else "tensor"
        return ("div" if self.divides else "mul", kind, self.dtype)

    def detached(self) -> HeadTransform:
        """This transform with its tensor detached (what a compiled kernel takes)."""
        if isinstance(self.scale, Tensor):
            return dataclasses.replace(self, scale=self.scale.detach())
        return self

    def apply(self, logits: Tensor) -> Tensor:
        """``logits [n, Vb]`` transformed, in ``dtype``, computed in ``accumulate_dtype(dtype)`` and
    rounded once, as torch's ``mul`` / ``div`` by a dimensionless operand. Resolved only."""
        if self.is_identity:
            return logits
        opmath = accumulate_dtype(self.dtype)
        scale = self.scale
        if isinstance(scale, Tensor):
            scale = scale.to(device=logits.device, dtype=opmath)
        x = logits.to(self.dtype).to(opmath)
        return (x / scale if self.divides else x * scale).to(self.dtype)

    def backward(self, grad: Tensor, logits: Tensor) -> Tensor:
        """The chain rule through :meth:`apply`: ``grad [n, Vb]`` w.r.t. the transformed logits to
    the gradient w.r.t. the projection ``logits``, in ``dtype``."""
        if self.is_identity:
            return grad
        return self.apply(grad)
