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

from compile_pass.op.kernels import HeadScale
from compile_pass.op.statistics import RowStatistics, linear_statistics


@dataclass(frozen=True)
class Head:
    """The recipe's logits as the op computes them: ``scale(linear(hidden, weight, bias)).to(logits_dtype)``.

    ``hidden``, ``weight`` and ``bias`` are positions among the recipe's inputs (``bias`` None:
    none), and so is the tensor of ``scale`` (the graph's :class:`HeadScale`, mapped to positions).
    ``weight`` is ``[V, H]``, ``[H, V]`` when ``weight_is_hv`` (``h @ W``), or a vocabulary-sharded
    DTensor (``sharded``: a colwise_rep tensor-parallel head; ``hidden`` is then the replicated
    hidden states' local tensor). ``projection_dtype`` is autocast's, ``computed_dtype`` the dtype
    the head computes its last value in (the scale's, else the projection's), ``logits_dtype`` the
    returned logits'.
    """

    hidden: int
    weight: int
    bias: int | None
    logits_dtype: torch.dtype
    computed_dtype: torch.dtype
    weight_is_hv: bool = False
    scale: HeadScale[int] = HeadScale()
    projection_dtype: torch.dtype | None = None
    sharded: bool = False
    chunk_size: int | None = None  # the tiles of its reads (the backend's options); None: the op's rule
    chunk_bytes: int | None = None

    def num_rows(self, tensors: Sequence[Tensor]) -> int:
        hidden = tensors[self.hidden]
        return hidden.numel() // max(hidden.shape[-1], 1)

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
                transform=self.scale.map(tensors.__getitem__), temperature=temperature, temperature_multiplies=multiplies,
                statistics_dtype=statistics_dtype, row_statistics=row_statistics,
                maximum_only=maximum_only, chunk_size=self.chunk_size, chunk_bytes=self.chunk_bytes)
