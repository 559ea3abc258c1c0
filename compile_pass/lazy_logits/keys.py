"""What the rows of a lazy tensor hold, as a function of the head's row: a :class:`Key`.

A key is the head's logits (:class:`compile_pass.lazy_logits.head.Head`) followed by dtype casts and at
most one temperature (a multiply or divide by a number, a 0-d tensor or one value per row), kept
only while the op's arguments reproduce torch's rounding: the op computes
``((transform(x).to(logits_dtype)).to(acc) / t).to(statistics_dtype)`` in ``acc =
accumulate_dtype(statistics_dtype)``, the statistics in ``acc`` too. Equal chains share one key
(children are memoized) and so one cache of statistics (:mod:`compile_pass.lazy_logits.cache`), computed
for the key's *extent*: the head rows it was made on (every row, for the returned logits themselves).
Whether a cast is exact (:func:`compile_pass.op.checks.holds`) is asked here and by the graph pass,
of the same steps, in one definition.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass.lazy_logits.head import Head
from compile_pass.op.checks import holds
from compile_pass.op.kernels import accumulate_dtype

@dataclass(frozen=True, eq=False)
class Temperature:
    """A temperature: ``number`` (a Python number), ``scalar`` (a 0-d tensor, copied when given) or
    ``values`` per head row (``[m]`` on the device, for head rows ``rows`` ``[m]`` CPU int64, looked
    up through ``lookup`` ``[N]``); ``multiplies``: ``z * t`` (else ``z / t``)."""

    multiplies: bool
    number: float | None = None
    scalar: Tensor | None = None
    values: Tensor | None = None
    lookup: Tensor | None = None

    @staticmethod
    def of(other: object, multiplies: bool, shape: torch.Size, head_rows: Tensor, num_rows: int) -> Temperature | None:
        """The temperature ``other`` is for a tensor of ``shape`` whose rows are head rows
        ``head_rows`` (flattened): a number, a 0-d floating tensor, or a floating ``[..., 1]`` tensor
        broadcast over the rows (distinct head rows only); None for anything else."""
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            return Temperature(multiplies, number=float(other))
        if not isinstance(other, Tensor) or other.requires_grad or not other.is_floating_point():
            return None
        if other.dim() == 0:
            return Temperature(multiplies, scalar=other.detach().clone())
        rows_shape = (*shape[:-1], 1)
        if other.shape[-1] != 1 or other.dim() > len(shape) or torch.broadcast_shapes(other.shape, shape) != shape:
            return None
        if torch.unique(head_rows).numel() != head_rows.numel():
            return None
        lookup = torch.full((num_rows,), -1, dtype=torch.int64)
        lookup[head_rows] = torch.arange(head_rows.numel())
        return Temperature(multiplies, values=other.detach().expand(rows_shape).reshape(-1).clone(), lookup=lookup)

    def dtype_with(self, dtype: torch.dtype) -> torch.dtype:
        """The result dtype of ``z op t`` for ``z`` of ``dtype`` (only a tensor with dims promotes)."""
        return dtype if self.values is None else torch.promote_types(dtype, self.values.dtype)

    def for_rows(self, head_rows: Tensor, device: torch.device) -> float | Tensor:
        """The op's ``temperature`` for head rows ``head_rows`` (CPU, all of them covered)."""
        if self.number is not None:
            return self.number
        if self.scalar is not None:
            return self.scalar.to(device).expand(head_rows.numel())
        return self.values.index_select(0, self.lookup[head_rows].to(self.values.device)).to(device)


class Key:
    """The values of rows of a lazy tensor as the op computes them.

    ``logits_dtype`` is the op's (the head's, or a narrower single rounding of it), ``values`` the
    dtype the values are one rounding to, ``dtype`` the tensor's (it holds ``values``), and
    ``temperature`` the one applied (``rounded``: the quotient was cast narrower once since). The
    op's ``statistics_dtype`` is ``dtype`` before a temperature (the values are exact in it: torch's
    precision for a read of the tensor), and ``values`` after one (the quotient's rounding).
    """

    def __init__(self, source: object, head: Head, extent: Tensor, logits_dtype: torch.dtype, values: torch.dtype,
                 dtype: torch.dtype, temperature: Temperature | None = None, rounded: bool = False) -> None:
        self.source, self.head = source, head  # source: the recipe's Inputs
        self.extent = extent  # [m] CPU int64, sorted distinct head rows
        self.logits_dtype, self.values, self.dtype = logits_dtype, values, dtype
        self.temperature, self.rounded = temperature, rounded
        self.cache = None  # the statistics computed so far (compile_pass.lazy_logits.cache.RowCache)
        self._children: dict[tuple, Key | None] = {}

    @staticmethod
    def root(source: object, head: Head, num_rows: int) -> Key:
        dtype = head.logits_dtype
        return Key(source, head, torch.arange(num_rows), dtype, dtype, dtype)

    @property
    def num_rows(self) -> int:
        """The head's rows ``N``."""
        return self.head.num_rows(self.source.tensors)

    @property
    def statistics_dtype(self) -> torch.dtype:
        return self.dtype if self.temperature is None else self.values

    def widen(self, head_rows: Tensor) -> None:
        """Add ``head_rows`` to the extent."""
        if not bool(torch.isin(head_rows, self.extent).all()):
            self.extent = torch.unique(torch.cat([self.extent, head_rows.reshape(-1)]))

    def _child(self, memo: tuple | None, head_rows: Tensor, **changes: object) -> Key:
        if memo is not None and memo in self._children:
            key = self._children[memo]
            key.widen(head_rows)
            return key
        fields = dict(logits_dtype=self.logits_dtype, values=self.values, dtype=self.dtype,
                      temperature=self.temperature, rounded=self.rounded)
        key = Key(self.source, self.head, torch.unique(head_rows), **{**fields, **changes})
        if memo is not None:
            self._children[memo] = key
        return key

    def cast(self, dtype: torch.dtype, head_rows: Tensor) -> Key | None:
        """These values, at head rows ``head_rows``, cast to ``dtype``; None when the op cannot
        round as the cast does."""
        values, memo = self.values, ("cast", dtype)
        if dtype == self.dtype:
            return self
        if holds(dtype, values) or (self.temperature is not None and holds(dtype, self.dtype)):  # exact
            return self._child(memo, head_rows, dtype=dtype)
        if self.temperature is None and values == self.logits_dtype:  # one rounding of the head's logits
            return self._child(memo, head_rows, values=dtype, dtype=dtype)
        if (self.temperature is not None and not self.rounded and values == accumulate_dtype(values)
                and accumulate_dtype(dtype) == accumulate_dtype(values)):  # one rounding of the quotient
            return self._child(memo, head_rows, values=dtype, dtype=dtype, rounded=True)
        return None

    def scaled(self, temperature: Temperature, dtype: torch.dtype, compute_dtype: torch.dtype,
               head_rows: Tensor) -> Key | None:
        """These values, at head rows ``head_rows``, times / over ``temperature``, computed in
        ``compute_dtype`` and rounded to ``dtype`` (torch's: the op's dtype; in place, the
        tensor's); None when the op cannot."""
        if self.temperature is not None or accumulate_dtype(dtype) != compute_dtype:
            return None
        if self.values != self.logits_dtype and not holds(self.logits_dtype, self.head.computed_dtype):
            return None  # the values were rounded twice (by the head and after it)
        memo = None if temperature.number is None else ("scaled", temperature.multiplies, temperature.number, dtype)
        return self._child(memo, head_rows, logits_dtype=self.values, values=dtype, dtype=dtype,
                           temperature=temperature)

    def reads_in(self, dtype: torch.dtype) -> bool:
        """Whether torch computes softmax statistics of these values, as a tensor of ``dtype``, in the op's precision."""
        return accumulate_dtype(self.statistics_dtype) == accumulate_dtype(dtype)

    def op_arguments(self, head_rows: Tensor, device: torch.device) -> dict:
        temperature = None if self.temperature is None else self.temperature.for_rows(head_rows, device)
        return dict(logits_dtype=self.logits_dtype, statistics_dtype=self.statistics_dtype, temperature=temperature,
                    multiplies=self.temperature is not None and self.temperature.multiplies)
