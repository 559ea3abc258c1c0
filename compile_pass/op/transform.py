"""The head's transform: what happens to the logits between the projection and the loss.

One value, :class:`HeadTransform`, carries it from the graph pass (which reads it:
:mod:`compile_pass.graph.scale`) or the public function (``logit_scale=`` /
``logit_divisor=`` / ``scale_dtype=``) through the op's options (one option, flattened
to the schema's torch types in :mod:`compile_pass.op.schema`) to the per-chunk kernels,
which apply it (:meth:`HeadTransform.apply`) and differentiate it
(:meth:`HeadTransform.backward`) in this one place. Today it is a scale:

    z = (x.to(dtype) * scale).to(logits_dtype)        or  x.to(dtype) / scale  when ``divides``

for the projection ``x`` (Cohere's ``logits * logit_scale``, Granite's ``logits /
logits_scaling``), rounded as torch's ``mul`` / ``div`` round. Adding a transform: a field
here (its default: no transform), its part of :meth:`apply`, :meth:`backward` and
:meth:`form`, its schema arguments in :mod:`compile_pass.op.schema`, and its reading from the
graph in :mod:`compile_pass.graph.scale`.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass.op.kernels import accumulate_dtype


@dataclass(frozen=True)
class HeadTransform:
    """What the graph does to the logits between the projection and the loss; the
    default, ``HeadTransform()``, does nothing.

    ``scale`` is a Python number or a 0-d real tensor (never differentiated; an FX proxy of
    one while the pass traces the op's call), ``divides`` says ``logits / scale`` (else
    ``logits * scale``), ``dtype`` the dtype it applies in (None = the projection's:
    :meth:`resolve`). Nothing reads a tensor's value, so it traces; the kernels only compute
    with ``scale``, never branch on it, so a compiled kernel takes it as an input
    (:meth:`form` is its part of the compile key).
    """

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
        """The kernels' compile key of this transform: what it does and in which dtype
        (multiply or divide, by a Python number or a tensor), never its value. None: none."""
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
        """``logits [n, Vb]`` (the projection, any floating dtype) transformed, in ``dtype``;
        ``logits`` itself for the identity. Resolved transforms only (:meth:`resolve`).

        Rounds as torch's ``mul`` / ``div`` of a tensor by a Python number or a 0-d tensor
        of the same category (the result keeps the tensor's dtype: type promotion's rule for
        dimensionless operands): computed in ``accumulate_dtype(dtype)`` (torch's
        ``opmath_type``, fp32 for half precision) with the scale converted to it, then rounded
        once to ``dtype``. It divides when the graph divided (``x / s`` and ``x * (1 / s)``
        round differently).
        """
        if self.is_identity:
            return logits
        opmath = accumulate_dtype(self.dtype)
        scale = self.scale
        if isinstance(scale, Tensor):
            scale = scale.to(device=logits.device, dtype=opmath)
        x = logits.to(self.dtype).to(opmath)
        return (x / scale if self.divides else x * scale).to(self.dtype)

    def backward(self, grad: Tensor, logits: Tensor) -> Tensor:
        """The chain rule through :meth:`apply`: ``grad [n, Vb]``, the gradient w.r.t. the
        transformed logits, taken to the gradient w.r.t. the projection ``logits [n, Vb]``
        (which a transform whose derivative depends on them reads), in ``dtype`` (``grad``
        itself for the identity). For the scale that is autograd's ``mul`` / ``div``
        backward at the same point: ``grad.to(dtype) * s`` (``/ s``), rounded as :meth:`apply`."""
        if self.is_identity:
            return grad
        return self.apply(grad)
