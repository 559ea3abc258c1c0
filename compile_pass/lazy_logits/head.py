"""A recipe's head as the row-statistics op takes it (Head), and its call of the op.

What the row-statistics op needs of a recipe's head: :class:`Head`, read by the graph pass where
it builds the recipe (:mod:`compile_pass.graph.returned_logits`); :meth:`Head.statistics` calls
:func:`compile_pass.op.statistics.linear_statistics` on rows of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass.op.kernels import HeadTransform
from compile_pass.op.statistics import RowStatistics, linear_statistics


@dataclass(frozen=True)
class Head:
    """The recipe's logits as the op computes them: ``transform(linear(hidden, weight, bias)).to(logits_dtype)``.

    ``hidden``, ``weight``, ``bias`` and ``scale_input`` are positions among the recipe's inputs
    (``bias`` None: none). The head scales by ``scale`` (a Python number) or by the tensor at
    ``scale_input``, or neither (both None). ``weight`` is
    ``[V, H]``, ``[H, V]`` when ``weight_is_hv`` (``h @ W``), or a vocabulary-sharded DTensor
    (``sharded``: a colwise_rep tensor-parallel head; ``hidden`` is then the replicated hidden
    states' local tensor). ``scale_dtype`` is the dtype the scale applies in, ``projection_dtype``
    autocast's, ``computed_dtype`` the dtype the head computes its last value in (the scale's, else
    the projection's), ``logits_dtype`` the returned logits'.
    """

    hidden: int
    weight: int
    bias: int | None
    logits_dtype: torch.dtype
    computed_dtype: torch.dtype
    weight_is_hv: bool = False
    scale: float | None = None
    scale_input: int | None = None
    divides: bool = False
    scale_dtype: torch.dtype | None = None
    projection_dtype: torch.dtype | None = None
    sharded: bool = False
    chunk_size: int | None = None  # the tiles of its reads (the backend's options); None: the op's rule
    chunk_bytes: int | None = None

    def num_rows(self, tensors: Sequence[Tensor]) -> int:
        hidden = tensors[self.hidden]
        return hidden.numel() // max(hidden.shape[-1], 1)

    @property
    def scaled(self) -> bool:
        return self.scale is not None or self.scale_input is not None

    def transform(self, tensors: Sequence[Tensor]) -> HeadTransform:
        if not self.scaled:
            return HeadTransform()
        scale = tensors[self.scale_input] if self.scale_input is not None else self.scale
        return HeadTransform(scale=scale, divides=self.divides, dtype=self.scale_dtype)

    def statistics(self, tensors: Sequence[Tensor], rows: Tensor | None, indices: Tensor | None, *,
                   logits_dtype: torch.dtype, statistics_dtype: torch.dtype,
                   temperature: float | Tensor | None, multiplies: bool, row_statistics: bool,
                   maximum_only: bool = False) -> RowStatistics:
        """The op on head rows ``rows`` (``[n]`` int64 on the device; None: every row, in order)."""
        hidden = tensors[self.hidden]
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        if rows is not None:
            hidden = hidden.index_select(0, rows)  # [n, H]
        weight = tensors[self.weight]
        with torch.autocast(hidden.device.type, enabled=False):  # the head's own autocast is projection_dtype
            return linear_statistics(
                hidden, weight.t() if self.weight_is_hv else weight, None if self.bias is None else tensors[self.bias],
                indices, logits_dtype=logits_dtype, projection_dtype=self.projection_dtype,
                transform=self.transform(tensors), temperature=temperature, temperature_multiplies=multiplies,
                statistics_dtype=statistics_dtype, row_statistics=row_statistics,
                maximum_only=maximum_only, chunk_size=self.chunk_size, chunk_bytes=self.chunk_bytes)
