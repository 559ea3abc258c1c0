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

:func:`vocab_parallel_cross_entropy` is the traceable entry (what the graph pass emits, every
decision made by the caller); :func:`vocab_parallel_linear_cross_entropy` the checked eager one, on
a DTensor weight. Every collective is over ``[N]`` vectors (and the ``[N, H]`` hidden-state gradient), made with
``torch.ops._c10d_functional`` (all-reduce, wait), which Dynamo, AOTAutograd and Inductor trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compile_pass.op.checks import check_chunking, check_loss_options, check_scale, check_tensors
from compile_pass.op.function import reduce_total
from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.loops import autocast_enabled
from compile_pass.op.schema import OpOptions
from compile_pass.op.transform import HeadTransform
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
    if reduction == "none":
        return loss.view_as(target).to(op_options.logits_dtype)
    return reduce_total(loss.sum(), flat_target, class_weight, reduction, op_options)


def vocab_parallel_linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    weight: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logits_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    release_cache: bool | None = None,
    logit_scale: float | Tensor | None = None,
    logit_divisor: float | Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
) -> Tensor:
    """:func:`compile_pass.linear_cross_entropy` for a head whose weight is a DTensor sharded over
    the vocabulary (``Shard(0)`` on one mesh dimension, ``Replicate()`` on any other: what
    ``ColwiseParallel`` makes of an ``nn.Linear``), checked, eager: the loss and gradients of
    ``F.cross_entropy(F.linear(input, linear_weight.full_tensor(), ...), ...)`` with no ``[N, V]``
    or ``[N, V_local]`` tensor on any rank (:func:`vocab_parallel_cross_entropy`, over the group of
    that mesh dimension). Every rank of the mesh calls it with the same ``input`` and ``target``.

    Args:
        input: hidden states ``[..., H]`` or ``[H]``: a plain tensor, or a DTensor replicated on
            every mesh dimension; its gradient is the full one on every rank.
        linear_weight: DTensor ``[V, H]`` (global shape), sharded as above (shards may be uneven);
            its gradient is a DTensor of the same layout.
        target: ``input.shape[:-1]`` class indices (plain or replicated).
        linear_bias: a DTensor ``[V]`` sharded as the weight, or None.
        weight: class weights ``[V]``, plain or replicated, or None.
        the others: as :func:`compile_pass.linear_cross_entropy`.

    Returns:
        The loss, a plain tensor, the same on every rank: 0-d, or ``target``-shaped for ``"none"``.

    Raises:
        TypeError / ValueError: as :func:`compile_pass.linear_cross_entropy`; ``linear_weight``
            not a DTensor, or sharded otherwise; ``linear_bias`` not sharded as it; ``input``,
            ``target`` or ``weight`` a DTensor that is not replicated.
        NotImplementedError: as :func:`compile_pass.linear_cross_entropy`.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh_dim = _vocabulary_mesh_dim(linear_weight, linear_bias)
    input, target, weight = (_replicated(name, value) for name, value in
                             (("input", input), ("target", target), ("weight", weight)))
    check_loss_options(reduction, ignore_index, label_smoothing, logits_dtype)
    check_chunking(chunk_size, chunk_bytes, False)
    check_tensors(input, linear_weight, target, linear_bias, weight, logits_dtype)  # the global shapes
    check_scale(input, logit_scale, logit_divisor, scale_dtype)
    vocab_size, hidden_size = linear_weight.shape
    _, (vocab_start, _) = compute_local_shape_and_global_offset(
        (vocab_size, hidden_size), linear_weight.device_mesh, linear_weight.placements)
    if target.dtype != torch.int64:
        target = target.long()
    if input.dim() == 1:  # unbatched: one token
        input = input.unsqueeze(0)
    projection_dtype = None
    if autocast_enabled(input.device.type):  # the projection in the autocast dtype, the loss in fp32
        projection_dtype = torch.get_autocast_dtype(input.device.type)
        logits_dtype = logits_dtype or torch.float32
    return vocab_parallel_cross_entropy(
        input, linear_weight.to_local(), target, None if linear_bias is None else linear_bias.to_local(), weight,
        reduction=reduction, vocab_start=vocab_start, vocab_size=vocab_size,
        group_name=linear_weight.device_mesh.get_group(mesh_dim).group_name, projection_dtype=projection_dtype,
        ignore_index=ignore_index, label_smoothing=float(label_smoothing), logits_dtype=logits_dtype or input.dtype,
        chunk_size=chunk_size, release_cache=release_cache, chunk_bytes=chunk_bytes,
        transform=HeadTransform(scale=logit_divisor if logit_scale is None else logit_scale,
                                divides=logit_divisor is not None, dtype=scale_dtype))


def _vocabulary_mesh_dim(linear_weight: Tensor, linear_bias: Tensor | None) -> int:
    """The mesh dimension the head's vocabulary is sharded over (``Shard(0)``; ``Replicate()`` on
    the others), checked; the bias sharded the same way."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(linear_weight, DTensor):
        raise TypeError(f"{NAME}: expected linear_weight to be a DTensor sharded over the vocabulary "
                        f"(Shard(0)), got {type(linear_weight).__name__}; for a plain tensor use "
                        "compile_pass.linear_cross_entropy")
    placements = tuple(linear_weight.placements)
    sharded = [dim for dim, placement in enumerate(placements) if placement == Shard(0)]
    if len(sharded) != 1 or any(p != Replicate() for dim, p in enumerate(placements) if dim != sharded[0]):
        raise ValueError(f"{NAME}: expected linear_weight sharded over the vocabulary on one mesh dimension "
                         f"(Shard(0) there, Replicate() on the others), got placements {placements}; "
                         "redistribute it to that layout (e.g. ColwiseParallel on a 1-D tensor-parallel mesh)")
    if linear_bias is not None and (not isinstance(linear_bias, DTensor)
                                    or tuple(linear_bias.placements) != placements
                                    or linear_bias.device_mesh != linear_weight.device_mesh):
        got = tuple(linear_bias.placements) if isinstance(linear_bias, DTensor) else type(linear_bias).__name__
        raise ValueError(f"{NAME}: expected linear_bias as a DTensor on linear_weight's mesh with its placements "
                         f"{placements}, got {got}")
    return sharded[0]


def _replicated(name: str, value: Tensor | None) -> Tensor | None:
    """``value``'s local tensor where it is a DTensor replicated on every mesh dimension; a plain
    tensor (or None) as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return value
    if any(placement != Replicate() for placement in value.placements):
        raise ValueError(f"{NAME}: expected {name} replicated on every mesh dimension (the same on every "
                         f"rank), got placements {tuple(value.placements)}; pass value.full_tensor()")
    return value.to_local()
