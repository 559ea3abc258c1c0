"""Per-chunk math of the op: the two kernels of one tile of logits ``[n, Vb]``.

Loss per token ``i`` (target ``y``, logits ``z`` in ``logits_dtype``, class weights ``w``,
``W = sum_c w_c``, smoothing ``eps``, ``C = V``), ATen's ``cross_entropy_loss_label_smoothing``::

    loss_i = (1 - eps) * w_y * (lse_i - z_iy) + eps / C * sum_c w_c * (lse_i - z_ic)
    d loss_i / d z_ic = ((1 - eps) * w_y + eps * W / C) * p_ic - (1 - eps) * w_y * [c == y] - eps / C * w_c

and 0 for ignored tokens. Derivation, rounding and the online log-sum-exp: docs/op.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from compile_pass.op.dtypes import accumulate_dtype

if TYPE_CHECKING:
    from compile_pass.op.transform import HeadTransform


class KernelArgs(NamedTuple):
    """The constants of one kernel call (every argument but its tensors); Dynamo reads its
    numbers as graph inputs, so a new value does not recompile."""

    ignore_index: int
    label_smoothing: float | None  # None: no smoothing term in the graph
    logits_dtype: torch.dtype  # the dtype the loss is computed in
    vocab_start: int  # the tile's first vocabulary column
    vocab_size: int  # V, the whole vocabulary
    transform: HeadTransform  # resolved: applied to the projection before the loss

    def detached(self) -> KernelArgs:
        """These constants with the transform's tensors detached."""
        return self._replace(transform=self.transform.detached())


def _safe_target(target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``valid [n]`` and the target with ignored tokens pointed at class 0."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, 0)


def chunk_forward(
    logits: Tensor,  # [n, Vb] projection dtype: vocabulary columns [vocab_start, vocab_start + Vb)
    target: Tensor,  # [n] int64
    class_weight: Tensor | None,  # [V] (the whole vocabulary) or None
    row_max: Tensor,  # [n] the running state over the row's earlier blocks (initial_state) ...
    sum_exp: Tensor,  # [n]
    z_target: Tensor,  # [n]
    smooth: Tensor | None,  # [n], None without label smoothing
    args: KernelArgs,  # the tile's block is the columns [args.vocab_start, args.vocab_start + Vb)
) -> tuple[Tensor, ...]:
    """One vocabulary block of the log-sum-exp, online across the row's blocks.

    Returns ``(loss, row_max, row_log_sum, sum_exp, z_target, smooth)``, ``[n]`` each in
    ``accumulate_dtype`` (``smooth`` None without smoothing); the last four are the state the
    next block takes (:func:`initial_state` starts it). After a row's last block ``loss`` is
    its per-token loss and ``row_max + row_log_sum`` its log-sum-exp, kept in two parts as
    ``F.log_softmax`` keeps it. A row with ``+inf`` or only ``-inf`` gives nan, as torch.
    """
    ignore_index, label_smoothing, logits_dtype, vocab_start, vocab_size, transform = args
    block = logits.shape[-1]
    z = transform.apply(logits)
    z = z.to(logits_dtype).to(accumulate_dtype(logits_dtype))  # [n, Vb], fused, never stored
    new_max = torch.maximum(row_max, torch.amax(z, dim=-1))  # [n]
    old_shift = torch.where(row_max == float("-inf"), 0.0, row_max)  # [n]
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)  # [n]
    shifted = z - shift.unsqueeze(1)  # [n, Vb]
    sum_exp = sum_exp * torch.exp(row_max - shift) + torch.exp(shifted).sum(dim=-1)  # [n]
    valid, safe_target = _safe_target(target, ignore_index)
    local = safe_target - vocab_start  # [n]: the target's column in this block
    in_block = (local >= 0) & (local < block)
    picked = z.gather(1, local.clamp(0, block - 1).unsqueeze(1)).squeeze(1)
    z_target = torch.where(in_block, picked, z_target)  # [n]
    row_log_sum = sum_exp.log()  # [n]
    nll = row_log_sum - (z_target - new_max)
    w = None if class_weight is None else class_weight.to(z.dtype)  # [V]
    if w is not None:
        nll = nll * w[safe_target]
    loss = nll
    if label_smoothing is not None:
        if w is None:
            seen, total, block_terms = vocab_start, vocab_size, shifted.sum(dim=-1)
        else:
            seen, total = w.narrow(0, 0, vocab_start).sum(), w.sum()
            block_terms = (shifted * w.narrow(0, vocab_start, block)).sum(dim=-1)
        smooth = smooth + seen * (old_shift - shift) + block_terms  # [n]
        smoothing_term = total * row_log_sum - smooth  # sum_c w_c (lse - z_c) over the columns seen
        loss = (1.0 - label_smoothing) * nll + (label_smoothing / vocab_size) * smoothing_term
    return torch.where(valid, loss, 0.0), new_max, row_log_sum, sum_exp, z_target, smooth


def initial_state(num_tokens: int, like: Tensor, smoothing: bool) -> tuple[Tensor, ...]:
    """The state :func:`chunk_forward` takes for a row's first block: ``row_max = -inf``,
    ``sum_exp = 0``, ``z_target = 0``, ``smooth = 0`` (None without smoothing), ``[n]`` each
    in ``like``'s dtype and device."""
    zeros = [like.new_zeros(num_tokens) for _ in range(3 if smoothing else 2)]
    return (like.new_full((num_tokens,), float("-inf")), *zeros, *([] if smoothing else [None]))


def _gradient_coefficients(
    grad: Tensor,  # [n] g_i: the upstream gradient, 0 for ignored tokens
    safe_target: Tensor,  # [n] int64
    class_weight: Tensor | None,  # [V] in grad's dtype, or None
    label_smoothing: float | None,
    vocab_size: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The per-token factors of ``g_i * d loss_i / d z_ic``, ``[n]`` each: ``coef_probs``
    (times ``p_ic``), ``coef_target`` (subtracted at ``c == y``), ``coef_uniform`` (times
    ``w_c``; None without smoothing)."""
    grad_target = grad if class_weight is None else grad * class_weight[safe_target]  # g_i * w_y
    if label_smoothing is None:
        return grad_target, grad_target, None
    coef_target = (1.0 - label_smoothing) * grad_target
    total_weight = float(vocab_size) if class_weight is None else class_weight.sum()  # W
    coef_probs = coef_target + grad * (label_smoothing * total_weight / vocab_size)
    return coef_probs, coef_target, grad * (label_smoothing / vocab_size)


def chunk_backward(
    logits: Tensor,  # [n, Vb] projection dtype: vocabulary columns [vocab_start, vocab_start + Vb)
    row_max: Tensor,  # [n] fp32: the forward kernel's row maximum of the whole row
    row_log_sum: Tensor,  # [n] fp32: and its log-sum of the shifted row
    target: Tensor,  # [n] int64
    class_weight: Tensor | None,  # [V] (the whole vocabulary) or None
    grad_loss: Tensor,  # [n] fp32
    args: KernelArgs,  # the tile's block is the columns [args.vocab_start, args.vocab_start + Vb)
) -> None:
    """Gradient of ``sum_i grad_loss_i * loss_i`` w.r.t. one block of the chunk's logits,
    written over ``logits`` in place (``[n, Vb]``, projection dtype, rounded through
    ``logits_dtype`` and the head transform's backward as autograd rounds it).

    ``row_max`` / ``row_log_sum`` are the forward kernel's, of the whole row.
    """
    ignore_index, label_smoothing, logits_dtype, vocab_start, vocab_size, transform = args
    block = logits.shape[-1]
    z = transform.apply(logits)
    z = z.to(logits_dtype).to(accumulate_dtype(logits_dtype))  # [n, Vb]
    probs = torch.exp((z - row_max.unsqueeze(1)) - row_log_sum.unsqueeze(1))  # [n, Vb] p_ic
    valid, safe_target = _safe_target(target, ignore_index)
    grad = torch.where(valid, grad_loss.to(z.dtype), 0.0)  # [n]
    w = None if class_weight is None else class_weight.to(z.dtype)  # [V]
    coef_probs, coef_target, coef_uniform = _gradient_coefficients(
        grad, safe_target, w, label_smoothing, vocab_size)  # [n] each
    columns = torch.arange(block, device=logits.device) + vocab_start  # [Vb]
    is_target = columns.unsqueeze(0) == safe_target.unsqueeze(1)  # [n, Vb]
    out = coef_probs.unsqueeze(1) * probs - torch.where(is_target, coef_target.unsqueeze(1), 0.0)
    if coef_uniform is not None:
        uniform = coef_uniform.unsqueeze(1)  # [n, 1]
        out = out - (uniform if w is None else uniform * w.narrow(0, vocab_start, block))  # [n, Vb]
    out = transform.backward(out.to(logits_dtype), logits)  # the chain rule through the transform
    # In place: a chunk's working set is one [n, Vb] buffer.
    logits.copy_(out)
