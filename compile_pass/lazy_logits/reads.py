"""Fused reads: row statistics of a lazy tensor through the op, never its values.

Recognised at ``__torch_function__`` level (above autograd), on a tensor with a form
(:mod:`compile_pass.lazy_logits.forms`), the last dim the vocabulary:

    gather / take_along_dim(x, idx, -1)     x logits z, log-probs lp (z - lse) or probs p (exp(z - lse))
    logsumexp(z, -1)                        lse
    z.sum(-1), lp.sum(-1)                   row_sum, row_sum - V lse
    (p * lp).sum(-1), (p * z).sum(-1)       -entropy, lse - entropy
    x.mean(-1); x.sum(), x.mean()           a sum over V; over every value (x: any of the four above)
    F.cross_entropy(z, t, reduction=r)      lse - z[t] (0 where t == ignore_index), r "none", "sum" or
                                            "mean" (over rows not ignored); 1-D or 2-D z, no weight,
                                            no label smoothing
    argmax(z, -1), max(z, -1)               argmax; (max, argmax)

each with ``keepdim`` where torch has it. The result has stock's dtype and shape (computed in the op's
accumulate dtype, rounded once as stock rounds its log-probs), and gradients to the head's hidden
states, weight and bias through the op; detached when the tensor does not require grad or grad mode
is off. :func:`fused` returns ``NotImplemented`` for anything else (the caller runs it as torch does).

The reductions (``logsumexp``, ``sum``, ``mean``) are one table, beside the statistics op that
serves them (:data:`compile_pass.op.statistics.REDUCTIONS`,
:func:`~compile_pass.op.statistics.reduction_from_statistics`): which functions, over which row
values, give which statistic. The graph pass reads the same table for the same reductions written
inside a compiled graph (:mod:`compile_pass.graph.spellings.reductions`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.lazy_logits.cache import cache_of
from compile_pass.lazy_logits.forms import Form, form_of
from compile_pass.op.checks import LOSS_REDUCTIONS, is_last_dim
from compile_pass.op.statistics import REDUCTIONS, Reduction, RowContent, RowStatistics, reduction_from_statistics


def fused(func: object, args: tuple, kwargs: dict) -> object:
    """``func(*args, **kwargs)`` as a fused read, or ``NotImplemented``."""
    read = _READS.get(func)
    if read is None:
        return NotImplemented
    try:
        bound = inspect.signature(read).bind(*args, **kwargs)
    except TypeError:
        return NotImplemented
    if getattr(bound.arguments.get("input"), "rows", None) is None:
        return NotImplemented
    return read(**bound.arguments)


def _last(input: Tensor, dim: object) -> bool:
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return not isinstance(dim, bool) and is_last_dim(dim, input.dim())  # a bool torch will refuse


def _grad(input: Tensor) -> bool:
    return torch.is_grad_enabled() and input.requires_grad


def _statistics(form: Form, grad: bool, indices: Tensor | None = None) -> RowStatistics:
    """The statistics of every row of ``form`` (gathered at ``indices`` ``[n, K]``), key by key."""
    groups = form.groups()
    if len(groups) == 1:
        return cache_of(groups[0][0]).read(form.head_rows, grad, indices)
    parts, order = [], []
    for key, where in groups:
        part_indices = None if indices is None else indices.index_select(0, where.to(indices.device))
        parts.append(cache_of(key).read(form.head_rows[where], grad, part_indices))
        order.append(where)
    inverse = torch.argsort(torch.cat(order))
    joined = [None if p0 is None else torch.cat([p[i] for p in parts]) for i, p0 in enumerate(parts[0])]
    return RowStatistics(*(None if t is None else t.index_select(0, inverse.to(t.device)) for t in joined))


def _rounded(values: Tensor, form: Form, dtype: torch.dtype) -> Tensor:
    """``values`` (accumulate dtype) as stock holds them: rounded to the form's values, then ``dtype``."""
    if form.value_dtype is not None:
        values = values.to(form.value_dtype)
    return values.to(dtype)


def _rows_out(values: Tensor, input: Tensor, keepdim: bool) -> Tensor:
    values = values.reshape(input.shape[:-1])
    return values.unsqueeze(-1) if keepdim else values


def _read_dtype(func: Callable, input: Tensor, *probe_args: object) -> torch.dtype:
    """The dtype torch computes ``func`` of ``input`` in: ``input``'s, or autocast's (probed on a tiny tensor)."""
    if not torch.is_autocast_enabled(input.device.type):
        return input.dtype
    with internals.disable_torch_function_subclass():
        return func(torch.zeros(1, 2, dtype=input.dtype, device=input.device), *probe_args).dtype


def _reads_in(form: Form, dtype: torch.dtype) -> bool:
    return all(key.reads_in(dtype) for key, _ in form.groups())


def _gather(input: Tensor, dim: int, index: Tensor, *, sparse_grad: bool = False, out: Tensor | None = None) -> object:
    form = form_of(input)
    if (form is None or form.kind not in (RowContent.LOGITS, RowContent.LOG_PROBS, RowContent.PROBS) or out is not None
            or sparse_grad or not _last(input, dim)
            or not isinstance(index, Tensor) or index.dtype != torch.int64 or index.dim() != input.dim()
            or index.shape[:-1] != input.shape[:-1]):
        return NotImplemented
    flat = index.reshape(-1, index.shape[-1]) if index.dim() > 0 else index.reshape(1, 1)
    stats = _statistics(form, _grad(input), flat)
    values = stats.selected
    if form.kind is not RowContent.LOGITS:
        values = values - stats.lse.unsqueeze(-1)
        values = values.exp() if form.kind is RowContent.PROBS else values
    return _rounded(values, form, input.dtype).reshape(index.shape)


def _take_along_dim(input: Tensor, indices: Tensor, dim: int | None = None, *, out: Tensor | None = None) -> object:
    if dim is None:
        return NotImplemented
    return _gather(input, dim, indices, out=out)


def _reduce(function: Callable, input: Tensor, dim: object = None, keepdim: bool = False, *,
            dtype: torch.dtype | None = None, out: Tensor | None = None) -> object:
    """``function`` (one of :data:`REDUCTIONS`) of ``input`` over its last dim, or of every value
    (``dim`` None: a sum or mean)."""
    reduction, form = REDUCTIONS[function], form_of(input)
    value = None if form is None else reduction_from_statistics(reduction, form.kind)
    every = dim is None and reduction is not Reduction.LOGSUMEXP
    if value is None or dtype is not None or out is not None or not (every or _last(input, dim)):
        return NotImplemented
    read_dtype = input.dtype  # a derived form was made only where its dtype reads in the op's precision
    if form.kind is RowContent.LOGITS:
        read_dtype = _read_dtype(function, input, -1)
        if not _reads_in(form, read_dtype):
            return NotImplemented
    values = value(_statistics(form, _grad(input)), input.shape[-1])  # [n]
    if every:  # every row's values, as torch reduces them: in the accumulate dtype, rounded once
        return _rounded(values.mean() if reduction is Reduction.MEAN else values.sum(), form, read_dtype)
    return _rows_out(_rounded(values, form, read_dtype), input, keepdim)


def _cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: object = None,
                   ignore_index: int = -100, reduce: object = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> object:
    form = form_of(input)
    if (form is None or form.kind is not RowContent.LOGITS or weight is not None or size_average is not None or reduce is not None
            or reduction not in LOSS_REDUCTIONS or label_smoothing != 0.0 or input.dim() not in (1, 2)
            or not isinstance(target, Tensor) or target.dtype != torch.int64 or target.shape != input.shape[:-1]):
        return NotImplemented
    probe_target = torch.zeros(1, dtype=torch.int64, device=input.device)
    dtype = _read_dtype(F.cross_entropy, input, probe_target, None, None, ignore_index, None, "none")
    if not _reads_in(form, dtype):
        return NotImplemented
    ignored = target.reshape(-1) == ignore_index
    stats = _statistics(form, _grad(input), target.reshape(-1, 1).masked_fill(ignored.unsqueeze(-1), 0))
    loss = (stats.lse - stats.selected.squeeze(-1)).masked_fill(ignored, 0.0)
    if reduction == "sum":
        return loss.sum().to(dtype)
    if reduction == "mean":  # over the rows not ignored: NaN when every row is, as torch's
        return (loss.sum() / (~ignored).sum()).to(dtype)
    return loss.to(dtype).reshape(target.shape)


def _argmax(input: Tensor, dim: int | None = None, keepdim: bool = False, *, out: Tensor | None = None) -> object:
    form = form_of(input)
    if form is None or form.kind is not RowContent.LOGITS or out is not None or not _last(input, dim):
        return NotImplemented
    groups = form.groups()  # the argmax alone: kept, or a walk for the maximum only (no exponential)
    if len(groups) == 1:
        argmax = cache_of(groups[0][0]).argmax(form.head_rows)
    else:
        parts = [cache_of(key).argmax(form.head_rows[where]) for key, where in groups]
        inverse = torch.argsort(torch.cat([where for _, where in groups]))
        argmax = torch.cat(parts).index_select(0, inverse.to(parts[0].device))
    return _rows_out(argmax, input, keepdim)


def _max(input: Tensor, dim: object = None, keepdim: bool = False, *, out: object = None) -> object:
    form = form_of(input)
    if form is None or form.kind is not RowContent.LOGITS or out is not None or not _last(input, dim):
        return NotImplemented
    stats = _statistics(form, _grad(input))
    values = _rows_out(stats.max.to(input.dtype), input, keepdim)
    return torch.return_types.max((values, _rows_out(stats.argmax, input, keepdim)))


_READS: dict[object, Callable] = {
    torch.gather: _gather, Tensor.gather: _gather, torch.take_along_dim: _take_along_dim,
    Tensor.take_along_dim: _take_along_dim, F.cross_entropy: _cross_entropy, torch.argmax: _argmax,
    Tensor.argmax: _argmax, torch.max: _max, Tensor.max: _max,
    **{function: partial(_reduce, function) for function in REDUCTIONS},
}
