"""One walk serves many reads: a key's row statistics, kept for later reads.

One forward pass serves many reads: the row statistics of a :class:`compile_pass.lazy_logits.keys.Key`,
computed once per head row and kept.

The first read of a key computes every statistic (``lse``, ``entropy``, ``max``, ``argmax``, ``row_sum``) for the
rows of its extent (the head rows it was made on, :attr:`Key.extent`, not only the rows read) in one
op call, and keeps them, differentiably: later reads of those rows (a loop over rows, 128-row chunks)
index the kept vectors, so autograd sums their gradients into that call's one backward. Gathered
values for new indices on kept rows are one op call without a walk over the vocabulary
(``row_statistics=False``). Statistics computed without grad (or by the step itself:
:meth:`RowCache.keep`) serve reads without grad only. A read
of the argmax alone on rows with nothing kept walks for the maximum only (no exponential) and keeps
that argmax.

Once the op can no longer run (a tensor the key reads changed: ``StaleLogitsError``), what was kept
serves again: the statistics of covered rows (kept without grad serve a read with grad too, and its
backward raises), gathered values at indices read before, the argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_pass.lazy_logits.keys import Key
from compile_pass.lazy_logits.staleness import Inputs, StaleLogitsError
from compile_pass.op.statistics import RowStatistics


class _Kept:
    """Statistics kept for some head rows (one part per op call), with or without grad."""

    def __init__(self, num_rows: int) -> None:
        self.position = torch.full((num_rows,), -1, dtype=torch.int64)  # head row -> place in the parts
        self.parts: list[tuple[Tensor, ...]] = []
        self._joined: tuple[Tensor, ...] | None = None

    def covers(self, head_rows: Tensor) -> bool:
        return bool((self.position[head_rows] >= 0).all())

    def add(self, head_rows: Tensor, part: tuple[Tensor, ...]) -> None:
        start = sum(p[0].numel() for p in self.parts)
        self.position[head_rows] = torch.arange(start, start + head_rows.numel())
        self.parts.append(part)
        self._joined = None

    def take(self, head_rows: Tensor) -> tuple[Tensor, ...]:
        if self._joined is None:
            self._joined = self.parts[0] if len(self.parts) == 1 else tuple(torch.cat(t) for t in zip(*self.parts))
        where = self.position[head_rows].to(self._joined[0].device)
        return tuple(t.index_select(0, where) for t in self._joined)


class RowCache:
    """The statistics of one key computed so far (``key.cache``)."""

    def __init__(self, key: Key) -> None:
        self.key = key
        self.num_rows = key.num_rows
        self.kept = {True: _Kept(self.num_rows), False: _Kept(self.num_rows)}  # by grad
        self.argmaxes = _Kept(self.num_rows)  # of the walks for the maximum only
        self.gathered: dict[bool, list[tuple[Tensor, Tensor, Tensor]]] = {True: [], False: []}  # by grad

    def read(self, head_rows: Tensor, grad: bool, indices: Tensor | None = None) -> RowStatistics:
        """The statistics of head rows ``head_rows`` (``[n]`` CPU int64, in read order, all in the
        key's extent), gathered at ``indices`` (``[n, K]``) if given; differentiable when ``grad``.
        Where the op can no longer run, what was kept of them, or :class:`StaleLogitsError`."""
        try:
            stats = self._read(head_rows, grad, indices)
        except StaleLogitsError:
            stats = self._served(head_rows, grad, indices)
            if stats is None:
                raise
            return stats
        if indices is not None and head_rows.numel():
            self.gathered[grad].append((head_rows, indices.detach().clone(), stats.selected))
        return stats

    def _read(self, head_rows: Tensor, grad: bool, indices: Tensor | None) -> RowStatistics:
        if not head_rows.numel():  # no rows (an empty view or mask): the op on none, for stock's dtypes and autograd
            return self._call(head_rows, indices, grad, row_statistics=True)
        kept = self._kept_for(head_rows, grad)
        selected = None
        if not kept.covers(head_rows):
            self.key.widen(head_rows)
            extent = self.key.extent
            missing = extent[kept.position[extent] < 0]
            gather_now = indices is not None and torch.unique(head_rows).numel() == head_rows.numel()
            where = None
            if gather_now:  # the read's indices ride along; other rows gather column 0
                place = torch.full((self.num_rows,), -1, dtype=torch.int64)
                place[missing] = torch.arange(missing.numel())
                where = place[head_rows]
                gather_now = bool((where >= 0).all())
            full = None
            if gather_now:
                full = indices.new_zeros((missing.numel(), indices.shape[-1]))
                full[where.to(indices.device)] = indices
            stats = self._call(missing, full, grad, row_statistics=True)
            kept.add(missing, (stats.lse, stats.entropy, stats.max, stats.argmax, stats.row_sum))
            if gather_now:
                selected = stats.selected.index_select(0, where.to(stats.selected.device))
        lse, entropy, maximum, argmax, row_sum = kept.take(head_rows)
        if not grad:
            lse, entropy, maximum, row_sum = lse.detach(), entropy.detach(), maximum.detach(), row_sum.detach()
        if indices is not None and selected is None:
            selected = self._call(head_rows, indices, grad, row_statistics=False).selected
        return RowStatistics(selected, lse, entropy, maximum, argmax, row_sum)

    def keep(self, lse: Tensor, entropy: Tensor, maximum: Tensor, argmax: Tensor, row_sum: Tensor) -> None:
        """Keep statistics of every head row (``[N]`` each, in head row order) computed elsewhere
        (the step's own walk), as this key's op call computes them; they serve reads without grad."""
        kept = self.kept[False]
        if not kept.covers(self.key.extent):
            kept.add(self.key.extent, tuple(t.detach() for t in (lse, entropy, maximum, argmax, row_sum)))

    def argmax(self, head_rows: Tensor) -> Tensor:
        """The argmax ``[n]`` of head rows ``head_rows`` (as :meth:`read` takes them): kept, or a
        walk of those rows for the maximum only (kept)."""
        kept = self._kept_for(head_rows, grad=False)
        if head_rows.numel() and kept.covers(head_rows):
            return kept.take(head_rows)[3]
        if head_rows.numel() and self.argmaxes.covers(head_rows):
            return self.argmaxes.take(head_rows)[0]
        argmax = self._call(head_rows, None, False, row_statistics=True, maximum_only=True).argmax
        if head_rows.numel():
            self.argmaxes.add(head_rows, (argmax,))
        return argmax

    def _served(self, head_rows: Tensor, grad: bool, indices: Tensor | None) -> RowStatistics | None:
        """The statistics of ``head_rows`` (gathered at ``indices``) from what was kept, None where
        something is missing. Values kept without grad, read with grad, get a backward that raises."""
        kept = next((k for k in (self.kept[grad], self.kept[False]) if head_rows.numel() and k.covers(head_rows)), None)
        if kept is None:
            return None
        selected, lent = None, kept is not self.kept[grad]
        if indices is not None:
            found = [(g, s) for g in (grad, False) for rows, where, s in self.gathered[g]
                     if rows.shape == head_rows.shape and where.shape == indices.shape
                     and torch.equal(rows, head_rows) and torch.equal(where, indices.to(where.device))]
            if not found:
                return None
            selected, lent = found[0][1], lent or found[0][0] is not grad
        lse, entropy, maximum, argmax, row_sum = kept.take(head_rows)
        floats = [lse, entropy, maximum, row_sum, selected]
        if not grad:
            floats = [None if t is None else t.detach() for t in floats]
        elif lent:
            floats = _after_change(self.key.source, floats)
        lse, entropy, maximum, row_sum, selected = floats
        return RowStatistics(selected, lse, entropy, maximum, argmax, row_sum)

    def _kept_for(self, head_rows: Tensor, grad: bool) -> _Kept:
        return self.kept[True] if grad or self.kept[True].covers(head_rows) else self.kept[False]

    def _call(self, head_rows: Tensor, indices: Tensor | None, grad: bool, row_statistics: bool,
              maximum_only: bool = False) -> RowStatistics:
        key, tensors = self.key, self.key.source.tensors
        key.source.check("read")
        device = tensors[key.head.hidden].device
        every = head_rows.numel() == self.num_rows and torch.equal(head_rows, torch.arange(self.num_rows))
        rows = None if every else head_rows.to(device)
        with torch.set_grad_enabled(grad):
            return key.head.statistics(tensors, rows, indices, row_statistics=row_statistics,
                                       maximum_only=maximum_only, **key.op_arguments(head_rows, device))


class _AfterChange(torch.autograd.Function):
    """Values served with grad after the tensors they were computed from changed: backward raises."""

    @staticmethod
    def forward(ctx: object, source: Inputs, *values: Tensor) -> tuple[Tensor, ...]:
        ctx.source = source
        return tuple(v.clone() for v in values)

    @staticmethod
    def backward(ctx: object, *grads: Tensor) -> tuple[None, ...]:
        ctx.source.check("backpropagate through")  # raises: served only once it did
        raise StaleLogitsError("chunkce: cannot backpropagate through values read after their inputs changed")


def _after_change(source: Inputs, values: list[Tensor | None]) -> list[Tensor | None]:
    """``values`` (detached) as outputs of an :class:`_AfterChange` over the source's tensors that require grad."""
    present = [v.detach() for v in values if v is not None]
    outputs = iter(_AfterChange.apply(source, *present, *[t for t in source.tensors if t.requires_grad]))
    return [None if v is None else next(outputs) for v in values]


def cache_of(key: Key) -> RowCache:
    if key.cache is None:
        key.cache = RowCache(key)
    return key.cache
