"""Per-tile math of the row-statistics op. The values of a tile (:func:`values`), ``acc =
accumulate_dtype(statistics_dtype)``::

    z = (transform.apply(x).to(logits_dtype).to(acc) / T).to(statistics_dtype).to(acc)

The online state across vocabulary blocks (``shift``: the running maximum, 0 where infinite)::

    s = sum_c exp(z_c - shift),   t = sum_c exp(z_c - shift) (z_c - shift)    (0 log 0 = 0)
    lse = shift + log s,          entropy = log s - t / s
    dz = p (g_lse + g_ent (t / s - (z - shift))) + g_max [c == argmax]

with ``p = exp((z - shift) - log s)``; derivation: docs/op.md, "Row statistics".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from compile_pass.op.dtypes import accumulate_dtype

if TYPE_CHECKING:
    from compile_pass.op.transform import HeadTransform


class StatisticsArgs(NamedTuple):
    """The constants of one kernel call (numbers are graph inputs, as in ``kernels.KernelArgs``)."""

    logits_dtype: torch.dtype
    statistics_dtype: torch.dtype
    transform: HeadTransform  # resolved
    temperature: float | None  # a number; None: none, or a per-row tensor argument
    temperature_multiplies: bool
    vocab_start: int  # the tile's first column in the whole vocabulary

    def detached(self) -> StatisticsArgs:
        return self._replace(transform=self.transform.detached())


def _temperature(temperature_rows: Tensor | None, args: StatisticsArgs, dtype: torch.dtype):
    """The temperature as the values take it: ``[n, 1]`` in ``dtype``, the number, or None."""
    return args.temperature if temperature_rows is None else temperature_rows.to(dtype).unsqueeze(-1)


def values(logits: Tensor, temperature_rows: Tensor | None, args: StatisticsArgs) -> Tensor:
    """``z [n, C]`` in ``accumulate_dtype(statistics_dtype)`` of the projection ``logits [n, C]``
    (any columns: a tile, or the gathered ``[N, K]``) and ``temperature_rows [n]`` (or None)."""
    z = args.transform.apply(logits).to(args.logits_dtype)
    accumulate = accumulate_dtype(args.statistics_dtype)
    temperature = _temperature(temperature_rows, args, accumulate)
    if temperature is not None:
        z = z.to(accumulate)
        z = z * temperature if args.temperature_multiplies else z / temperature
    return z.to(args.statistics_dtype).to(accumulate)


def values_backward(grad: Tensor, logits: Tensor, temperature_rows: Tensor | None,
                    args: StatisticsArgs) -> Tensor:
    """The gradient w.r.t. the projection ``logits [n, C]`` of ``grad [n, C]``, the gradient
    w.r.t. :func:`values`' ``z``: through each cast and the temperature, then the transform's
    backward (in the transform's dtype, else ``logits_dtype``)."""
    grad = grad.to(args.statistics_dtype)
    accumulate = accumulate_dtype(args.statistics_dtype)
    temperature = _temperature(temperature_rows, args, accumulate)
    if temperature is not None:
        grad = grad.to(accumulate)
        grad = grad * temperature if args.temperature_multiplies else grad / temperature
    return args.transform.backward(grad.to(args.logits_dtype), logits)


def row_shift(row_max: Tensor) -> Tensor:
    """``row_max`` where finite, else 0 (``torch.logsumexp``'s shift)."""
    return torch.where(row_max.abs() == float("inf"), 0.0, row_max)


def initial_statistics(num_tokens: int, num_indices: int | None, like: Tensor) -> tuple:
    """A row's state before its first block: ``(row_max -inf, s 0, t 0, argmax 0, selected 0
    [n, K] or None)``, in ``like``'s dtype and device."""
    zeros = [like.new_zeros(num_tokens) for _ in range(2)]
    selected = None if num_indices is None else like.new_zeros(num_tokens, num_indices)
    return (like.new_full((num_tokens,), float("-inf")), *zeros,
            like.new_zeros(num_tokens, dtype=torch.int64), selected)


def statistics_forward(
    logits: Tensor,  # [n, Vb] projection dtype: the columns [vocab_start, vocab_start + Vb)
    indices: Tensor | None,  # [n, K] int64 (whole-vocabulary columns)
    temperature_rows: Tensor | None,  # [n]
    row_max: Tensor,  # [n] the state of the row's earlier blocks (initial_statistics) ...
    sum_exp: Tensor,  # [n] s
    sum_shifted: Tensor,  # [n] t
    argmax: Tensor,  # [n] int64
    selected: Tensor | None,  # [n, K]
    args: StatisticsArgs,
) -> tuple[Tensor, ...]:
    """One block of the online state (module docstring): the new ``(row_max, sum_exp,
    sum_shifted, argmax, selected)``. A new maximum must be strictly larger (or the first nan)
    to move ``argmax``, so ties keep the first column."""
    z = values(logits, temperature_rows, args)  # [n, Vb], fused, never stored
    new_max, argmax = _maximum(z, row_max, argmax, args.vocab_start)
    old_shift, shift = row_shift(row_max), row_shift(new_max)
    rescale = torch.where(row_max == float("-inf"), 0.0, torch.exp(old_shift - shift))  # [n]
    selected = _selected(z, indices, selected, args.vocab_start)
    shifted = z - shift.unsqueeze(1)  # [n, Vb]
    exp = torch.exp(shifted)
    block_sum = exp.sum(dim=-1)
    terms = shifted.mul_(exp).masked_fill_(exp == 0.0, 0.0)  # in place (eager: fewer tiles); 0 log 0 = 0
    sum_shifted = rescale * (sum_shifted + (old_shift - shift) * sum_exp) + terms.sum(dim=-1)
    sum_exp = sum_exp * rescale + block_sum
    return new_max, sum_exp, sum_shifted, argmax, selected


def maximum_forward(
    logits: Tensor,  # [n, Vb], as statistics_forward takes it
    indices: Tensor | None,
    temperature_rows: Tensor | None,
    row_max: Tensor,  # [n]
    argmax: Tensor,  # [n] int64
    selected: Tensor | None,  # [n, K]
    args: StatisticsArgs,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`statistics_forward` without the sums (no exponential): the new ``(row_max, argmax,
    selected)``."""
    z = values(logits, temperature_rows, args)  # [n, Vb]
    new_max, argmax = _maximum(z, row_max, argmax, args.vocab_start)
    return new_max, argmax, _selected(z, indices, selected, args.vocab_start)


def _maximum(z: Tensor, row_max: Tensor, argmax: Tensor, vocab_start: int) -> tuple[Tensor, Tensor]:
    """The row's maximum and its first column after the block ``z [n, Vb]``: a new maximum must be
    strictly larger (or the first nan) to move ``argmax``."""
    block_max, block_arg = torch.amax(z, dim=-1), torch.argmax(z, dim=-1)  # [n]
    larger = (block_max > row_max) | (torch.isnan(block_max) & ~torch.isnan(row_max))
    return torch.maximum(row_max, block_max), torch.where(larger, block_arg + vocab_start, argmax)


def _selected(z: Tensor, indices: Tensor | None, selected: Tensor | None, vocab_start: int) -> Tensor | None:
    """``selected [n, K]`` with the block's values at the indices it holds."""
    if selected is None:
        return None
    block = z.shape[-1]
    local = indices - vocab_start  # [n, K]: the columns in this block
    picked = z.gather(1, local.clamp(0, block - 1))
    return torch.where((local >= 0) & (local < block), picked, selected)


def finish(row_max: Tensor, sum_exp: Tensor, sum_shifted: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(lse, entropy, row_log_sum, row_mean)`` ``[n]`` of a row's final state: ``row_log_sum =
    log s`` and ``row_mean = t / s`` (what backward takes with ``row_max``)."""
    row_log_sum, row_mean = sum_exp.log(), sum_shifted / sum_exp
    return row_shift(row_max) + row_log_sum, row_log_sum - row_mean, row_log_sum, row_mean


def statistics_backward(
    logits: Tensor,  # [n, Vb] projection dtype: the columns [vocab_start, vocab_start + Vb)
    temperature_rows: Tensor | None,  # [n]
    row_max: Tensor,  # [n] the whole rows' (forward's): max, log s, t / s, argmax
    row_log_sum: Tensor,
    row_mean: Tensor,
    argmax: Tensor,
    grad_lse: Tensor | None,  # [n] each, accumulate dtype, or None (no term)
    grad_entropy: Tensor | None,
    grad_max: Tensor | None,
    args: StatisticsArgs,
) -> None:
    """The tile's gradient (module docstring), written over ``logits`` in the projection dtype
    (through :func:`values_backward`); the caller's tile is consumed."""
    z = values(logits, temperature_rows, args)  # [n, Vb]
    shifted = z - row_shift(row_max).unsqueeze(1)
    grad = torch.zeros_like(z)
    if grad_lse is not None or grad_entropy is not None:
        probs = torch.exp(shifted - row_log_sum.unsqueeze(1))  # [n, Vb]
        if grad_lse is not None:
            grad = probs * grad_lse.unsqueeze(1)
        if grad_entropy is not None:
            term = torch.where(probs == 0.0, 0.0, probs * (row_mean.unsqueeze(1) - shifted))
            grad = grad + term * grad_entropy.unsqueeze(1)
    if grad_max is not None:
        columns = torch.arange(z.shape[-1], device=z.device) + args.vocab_start  # [Vb]
        grad = grad + torch.where(columns == argmax.unsqueeze(1), grad_max.unsqueeze(1), 0.0)
    logits.copy_(values_backward(grad, logits, temperature_rows, args))
