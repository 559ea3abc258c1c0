"""Cross-entropy of a vocabulary-sharded (tensor-parallel) head, exact, with no ``[N, V]`` or
``[N, V_local]`` tensor on any rank.

Each rank of the tensor-parallel group holds the classes ``[vocab_start, vocab_start + V_local)``
of the head (a DTensor ``Shard(0)`` weight's local tensor, e.g. torch's ``ColwiseParallel``), and
the same hidden states. Per token ``i`` (``z``: the logits, ``w``: class weights, ones without
them, ``W = sum_c w_c``, ``eps``: label smoothing, ``C = V``):

1. each rank walks its shard in the op's ``[n, Vb]`` tiles (``chunkce::vocab_parallel_statistics``,
   :mod:`compile_pass.op.vocab_parallel_ops`) and keeps ``m_r = max_c z_c``, ``s_r = sum_c exp(z_c -
   m_r)``, ``t_r = z_y`` if the target is in its shard (else 0), ``q_r = sum_c w_c (z_c - m_r)``
   (with smoothing) and ``W_r = sum_c w_c``, its classes only;
2. ``m = max_r m_r`` (all-reduce max), then one all-reduce sum of ``[s_r exp(m_r - m), t_r,
   q_r + W_r (m_r - m)]``: ``log_sum = log sum_c exp(z_c - m)``, ``z_y``, ``Q = sum_c w_c (z_c - m)``;
3. ``loss_i = (1 - eps) w_y (log_sum - (z_y - m)) + eps / C (W log_sum - Q)``, 0 where ignored
   (the single-device op's formula, :mod:`compile_pass.op.kernels`), in plain torch; the reduction
   as :func:`compile_pass.op.function.chunked_cross_entropy` does it;
4. backward (``chunkce::vocab_parallel_loss``'s autograd) recomputes each tile of the shard against
   the global ``m`` and ``log_sum`` (the single-device backward walk, each tile at its global
   columns); the hidden-state gradient is all-reduced (sum), the weight and bias gradients are
   the shard's.

Every collective is over ``[N]`` vectors (and the ``[N, H]`` hidden-state gradient), made with
``torch.ops._c10d_functional`` (all-reduce, wait), which Dynamo, AOTAutograd and Inductor trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.schema import OpOptions
from compile_pass.op.vocab_parallel_ops import NAME, all_reduce


def vocab_parallel_cross_entropy(
    hidden_states: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    *,
    reduction: str,
    vocab_start: int,
    vocab_size: int,
    group_name: str,
    projection_dtype: torch.dtype | None = None,
    grads_in_forward: list[bool] | None = None,
    **options: Any,
) -> Tensor:
    """The global loss of a vocabulary-sharded head, the same on every rank of the group.

    Exactly (up to floating-point summation order), with ``full_weight`` / ``full_bias`` the
    shards of every rank concatenated in rank order::

        logits = F.linear(hidden_states, full_weight, full_bias)   # transformed and cast as the
        F.cross_entropy(logits.flatten(0, -2), target.flatten(),   # single-device op does
                        weight=class_weight, reduction=reduction, ...)

    and its gradients: w.r.t. ``hidden_states`` the full one (all-reduced over the group), w.r.t.
    ``weight`` and ``bias`` this rank's rows. Every rank of the group must call it, with the same
    ``hidden_states``, ``target``, ``class_weight`` and options. Like
    :func:`compile_pass.op.function.chunked_cross_entropy` it reads no tensor's value or metadata,
    so the graph pass can call it with FX proxies; it runs under ``torch.compile`` (Dynamo,
    AOTAutograd, Inductor), saved-tensor hooks and activation checkpointing (whose recompute
    repeats the forward's collectives on every rank).

    Args:
        hidden_states: ``[..., H]``, identical on every rank.
        weight: ``[V_local, H]``, this rank's shard of the head (a plain local tensor).
        target: ``hidden_states.shape[:-1]`` int64, GLOBAL class indices in ``[0, V)`` or
            ``ignore_index``.
        bias: ``[V_local]``, this rank's shard, or None.
        class_weight: ``[V]``, the full class weights (replicated), or None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        vocab_start: the global index of this rank's first class (shards may be uneven).
        vocab_size: V, the global vocabulary.
        group_name: the c10d group name of the tensor-parallel group (``ProcessGroup.group_name``,
            ``DeviceMesh.get_group(dim).group_name``).
        projection_dtype: cast hidden_states, weight and bias to it first; None = no cast.
        grads_in_forward: must be None (not on this path).
        options: the op's options by name, as ``chunked_cross_entropy`` takes them
            (:class:`compile_pass.op.schema.OpOptions`: ``ignore_index``, ``label_smoothing``,
            ``logits_dtype`` (resolved), ``chunk_size``, ``chunk_bytes``, ``transform``, ...).

    Returns:
        The loss in ``logits_dtype``: 0-d, or shaped like ``target`` for ``"none"``.

    Raises:
        NotImplementedError: ``grads_in_forward`` given.
        TypeError: a keyword in ``options`` that is not an option's name.
        RuntimeError: (CPU) a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    if grads_in_forward is not None:
        raise NotImplementedError(
            f"{NAME}: grads_in_forward is not supported for a vocabulary-sharded head; "
            "leave it off (the recompute path is exact and holds no [V_local, H] gradient in forward)")
    op_options = OpOptions(**options)
    ignore_index, label_smoothing = op_options.ignore_index, op_options.label_smoothing
    accumulate = accumulate_dtype(op_options.logits_dtype)
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    hidden_states = hidden_states.flatten(0, -2)  # [N, H]
    flat_target = target.reshape(-1)  # [N]
    shard = (vocab_start, vocab_size)
    row_max, sum_exp, z_target, smooth, weight_sum = torch.ops.chunkce.vocab_parallel_statistics(
        hidden_states.detach(), weight.detach(), flat_target, None if bias is None else bias.detach(),
        class_weight, *op_options.args(*shard))  # [N] each (smooth [0] without smoothing), weight_sum 0-d
    global_max = all_reduce(row_max, "max", group_name)  # [N]
    shift = torch.where(global_max == float("-inf"), 0.0, global_max)  # [N]: 0 for a row of -inf only
    parts = [sum_exp * torch.exp(row_max - shift), z_target]  # [N] each
    smoothing = label_smoothing > 0.0  # as the single-device op: <= 0 (and nan) is none
    if smoothing:
        local_shift = torch.where(row_max == float("-inf"), 0.0, row_max)
        parts.append(smooth + weight_sum * (local_shift - shift))  # sum_c w_c (z_c - shift), this shard
    sums = all_reduce(torch.stack(parts), "sum", group_name)  # [2 or 3, N]
    row_log_sum = sums[0].log()  # [N] log sum_c exp(z_c - m) over the whole vocabulary
    nll = row_log_sum - (sums[1] - global_max)  # [N] -log p_y, rounded as torch's log-softmax
    valid = flat_target != ignore_index  # [N]
    safe_target = torch.where(valid, flat_target, 0)
    weights = None if class_weight is None else class_weight.to(accumulate)  # [V]
    if weights is not None:
        nll = nll * weights[safe_target]
    loss = nll
    if smoothing:
        total_weight = float(vocab_size) if weights is None else weights.sum()
        smoothing_term = total_weight * row_log_sum - sums[2]  # sum_c w_c (lse - z_c)
        loss = (1.0 - label_smoothing) * nll + (label_smoothing / vocab_size) * smoothing_term
    loss = torch.where(valid, loss, 0.0)  # [N]
    loss = torch.ops.chunkce.vocab_parallel_loss(
        loss, hidden_states, weight, flat_target, bias, class_weight, global_max, row_log_sum,
        *op_options.args(*shard, group_name))  # the gradient attaches here
    return _reduce(loss, target, flat_target, weights, reduction, op_options)


def _reduce(loss: Tensor, target: Tensor, flat_target: Tensor, weights: Tensor | None, reduction: str,
            options: OpOptions) -> Tensor:
    """``loss [N]`` reduced as ``F.cross_entropy`` reduces it (the same steps as
    :func:`compile_pass.op.function.chunked_cross_entropy`), in ``logits_dtype``."""
    if reduction == "none":
        return loss.view_as(target).to(options.logits_dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(options.logits_dtype)
    valid = flat_target != options.ignore_index  # [N]
    if weights is None:
        denominator = valid.sum()
    else:
        denominator = (weights[flat_target.masked_fill(~valid, 0)] * valid).sum()
    mean = total / denominator
    if weights is not None and options.label_smoothing > 0.0:
        mean = mean + torch.zeros_like(denominator) / denominator  # nan when the weight sum is 0, as torch
    return mean.to(options.logits_dtype)
