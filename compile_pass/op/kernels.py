"""Per-chunk math of the op: the two kernels of one tile of logits, and their constants.

Two functions of one tile of logits ``[n, Vb]`` (``n`` tokens, ``Vb`` vocabulary columns
of the ``V``; the tiles: :mod:`compile_pass.op.chunking`):

* :func:`chunk_forward` -> one vocabulary block of the fp32 log-sum-exp, online across
  the row's blocks (kept in two parts, the row maximum and the log-sum of the shifted
  row), the target's logit from the block that holds it, and the per-token loss;
* :func:`chunk_backward` -> the gradient of the per-token loss with respect to
  the tile's logits, given the upstream per-token gradient and the whole rows'
  statistics, written over the logits.

The matmuls around them (projection, ``grad @ weight``, ``grad.T @ hidden``) run
outside, so their outputs can be written in place into preallocated buffers; what
is compiled is the memory-bound part, which Inductor fuses into a couple of
reductions over the chunk.

They run through :func:`compile_pass.op.kernel_runner.run`: compiled once per variant with
dynamic shapes, or eagerly where Inductor cannot compile for the device.

Loss per token ``i`` with target ``y``, logits ``z`` (cast to ``logits_dtype``),
class weights ``w`` (all ones without them), ``W = sum_c w_c``, smoothing
``eps`` and ``C = V`` classes — the formula of ATen's
``cross_entropy_loss_label_smoothing`` / ``nll_loss`` with ``reduction="none"``:

    lse_i  = log sum_c exp(z_ic)
    loss_i = (1 - eps) * w_y * (lse_i - z_iy) + eps / C * sum_c w_c * (lse_i - z_ic)

and 0 for ignored tokens (``lse_i - z_iy`` computed as torch's log-softmax rounds it:
``log_sum_i - (z_iy - max_i)``, :func:`chunk_forward`). Its gradient, with
``p_ic = exp(z_ic - lse_i)`` (computed as ``exp((z_ic - max_i) - log_sum_i)``):

    d loss_i / d z_ic = ((1 - eps) * w_y + eps * W / C) * p_ic
                        - (1 - eps) * w_y * [c == y] - eps / C * w_c

The head's transform (:class:`compile_pass.op.transform.HeadTransform`, e.g. Cohere's
``logits * logit_scale``, Granite's ``logits / logits_scaling``) gives ``z =
transform.apply(x).to(logits_dtype)`` for the projection ``x``, and the gradient w.r.t. ``x``
is ``transform.backward`` of the gradient w.r.t. ``z`` rounded to ``logits_dtype``: the two
kernels call those two methods and nothing else of it. Both kernels take their constants
as one record, :class:`KernelArgs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from compile_pass.op.transform import HeadTransform


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision logits, else the logits' own dtype (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


class KernelArgs(NamedTuple):
    """The constants of one kernel call (every argument but its tensors), as one record.

    Dynamo takes the numbers in it as graph inputs, as it takes a plain argument (an int
    or a float of a record is not specialised either), so no new ``vocab_start``, scale or
    smoothing value recompiles a kernel; the dtypes, ``label_smoothing``'s presence and the
    transform's :meth:`~compile_pass.op.transform.HeadTransform.form` are in its compile key
    (:meth:`compile_pass.op.schema.ChunkPlan.variant`), never branched on otherwise.
    """

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
    """``valid [n]`` (not ignored) and the target with ignored tokens pointed at class 0,
    so it can index; every use masks those tokens with ``valid``."""
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
    """One vocabulary block of the log-sum-exp, online across the row's blocks, and the
    per-token loss of the columns seen so far.

    Returns ``(loss, row_max, row_log_sum, sum_exp, z_target, smooth)``, ``[n]`` each in
    ``accumulate_dtype`` (``smooth`` None without smoothing): the last four are the state
    the next block of the same rows takes; after a row's last block, ``loss [n]`` is its
    per-token loss and ``row_max`` and ``row_log_sum`` are the whole row's maximum and the
    log of the sum of the row shifted by it (what backward takes): the log-sum-exp kept in
    two parts, as ``F.log_softmax`` (which ``F.cross_entropy`` calls) keeps it, so that
    ``log p = (z - row_max) - row_log_sum`` rounds as torch's log-softmax does (one rounded
    ``lse`` would carry an absolute error of half its ulp into every ``log p``: 3e-5 at an
    lse of 1e3 in fp32, where torch's is that of ``log p`` itself). A row holding ``+inf``
    or only ``-inf`` gives nan, and nan propagates, exactly as torch's loss does
    (``torch.logsumexp`` would return ``inf`` for such a row). The state, started by
    :func:`initial_state`:

    * ``row_max``: the largest logit seen (``-inf`` before any);
    * ``sum_exp = sum_c exp(z_c - shift)`` over the columns seen, ``shift`` being
      ``row_max`` (0 while it is ``-inf``, so a block of ``-inf`` adds 0, not nan); a new
      maximum rescales it by ``exp(old_shift - shift)``, as flash-attention does across keys;
    * ``z_target``: the target's logit, taken from the block that holds it;
    * ``smooth = sum_c w_c (z_c - shift)`` over the columns seen (rescaled with the shift:
      ``+ W_seen (old_shift - shift)``; every term is <= 0, so nothing cancels).

    ``row_log_sum = log(sum_exp)`` and the loss is ``row_log_sum - (z_target - row_max)``,
    torch's ``-log_softmax(z)[y]`` rounded as torch rounds it; the smoothing term is
    ``sum_c w_c (lse - z_c) = W row_log_sum - smooth``. ``label_smoothing`` and the
    transform's scale are only ever computed with, never branched on (Dynamo then passes them
    as graph inputs, the same way in every process). The head's transform
    (:meth:`~compile_pass.op.transform.HeadTransform.apply`) comes before the log-sum-exp.
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
    """The per-token factors of ``g_i * d loss_i / d z_ic``, ``[n]`` each::

        coef_probs_i   = g_i * ((1 - eps) * w_y + eps * W / C)   times p_ic
        coef_target_i  = g_i * (1 - eps) * w_y                   subtracted where c == y
        coef_uniform_i = g_i * eps / C                           times w_c, subtracted at every c

    ``coef_uniform`` is None without label smoothing (``label_smoothing`` None: ``eps = 0``).
    """
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
    """Gradient of ``sum_i grad_loss_i * loss_i`` w.r.t. one block of the chunk's logits::

        grad_ic = coef_probs_i * p_ic - coef_target_i * [c == y_i] - coef_uniform_i * w_c

    (the module's formula times ``grad_loss_i``; factors from :func:`_gradient_coefficients`),
    with ``p = exp((z - row_max) - row_log_sum)``, torch's ``exp(log_softmax(z))``, rounded
    as torch rounds it. ``row_max`` and ``row_log_sum`` are the forward kernel's
    (of the whole row, which a vocabulary block cannot see): the
    grads-in-forward op hands them over, the recompute op saves them for backward, so
    no row is reduced here and every walk, blocked or not, takes the same variant.

    The block is the vocabulary columns ``[vocab_start, vocab_start + Vb)``.
    Returns nothing: ``logits`` is overwritten in place with the gradient ``[n, Vb]`` in
    the projection dtype, rounded through ``logits_dtype`` exactly as autograd rounds it
    through the graph's cast, then through the head transform's backward
    (:meth:`~compile_pass.op.transform.HeadTransform.backward`: ``grad * s`` or ``grad / s``
    in the scale's dtype). The caller's chunk of logits is consumed.
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
    # Into the logits' own buffer: every element is read once, then overwritten by its
    # gradient (pointwise once the row's statistics are known), so a chunk's working set is one [n, Vb]
    # buffer, not two (Inductor stores the fused result in place).
    logits.copy_(out)
