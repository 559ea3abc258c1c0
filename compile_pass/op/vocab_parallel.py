"""Cross-entropy of a vocabulary-sharded (tensor-parallel) head, exact, with no ``[N, V]`` or
``[N, V_local]`` tensor on any rank: each rank walks its shard for its row statistics, all-reduces
them over ``[N]`` vectors, and backward recomputes each tile against the global ones. The
formula, step by step: docs/op.md, "A vocabulary-sharded head".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op.dtypes import accumulate_dtype
from compile_pass.op.reduction import reduce_total
from compile_pass.op.schema import NAME as PUBLIC_NAME
from compile_pass.op.vocab_parallel_ops import NAME, all_reduce


def sharded_loss(tensors: tuple[Tensor | None, ...], options: dict[str, Any], target_shape: torch.Size, *,
                 reduction: str, vocab_start: int, vocab_size: int, group_name: str) -> Tensor:
    """The global loss of a vocabulary-sharded head, the same on every rank of the group: the body
    of :func:`compile_pass.op.function.chunked_cross_entropy` given a ``group_name``.

    Exactly (up to floating-point summation order), ``full_weight`` / ``full_bias`` the ranks'
    shards concatenated in rank order::

        logits = F.linear(hidden_states, full_weight, full_bias)   # transformed and cast as the
        F.cross_entropy(logits.flatten(0, -2), target.flatten(),   # single-device op does
                        weight=class_weight, reduction=reduction, ...)

    Gradients: ``hidden_states``' the full one (all-reduced), ``weight``'s and ``bias``' this
    rank's rows. Every rank calls it with the same hidden states, target, class weights and options.

    Args:
        tensors: ``(hidden_states [N, H], weight [V_local, H], target [N] int64 (global classes),
            bias [V_local] or None, class_weight [V] or None, logit_scale_tensor 0-d or None)``.
        options: the op's keywords (:func:`compile_pass.op.schema.loss_inputs`).
        target_shape: the loss's shape for ``"none"``.
        vocab_start: this rank's first class; vocab_size: V; group_name: the c10d group.

    Returns:
        The loss in ``options["logits_dtype"]``: 0-d, or ``target_shape`` for ``"none"``.

    Raises:
        RuntimeError: (CPU) a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    hidden_states, weight, flat_target, bias, class_weight, scale_tensor = tensors
    ignore_index, label_smoothing, logits_dtype = (options[k] for k in ("ignore_index", "label_smoothing",
                                                                         "logits_dtype"))
    shard = {"vocab_start": vocab_start, "vocab_size": vocab_size}
    accumulate = accumulate_dtype(logits_dtype)
    row_max, sum_exp, z_target, smooth, weight_sum = torch.ops.chunkce.vocab_parallel_statistics(
        hidden_states.detach(), weight.detach(), flat_target, None if bias is None else bias.detach(),
        class_weight, scale_tensor, **shard, **options)  # [N] each (smooth [0] without smoothing), weight_sum 0-d
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
        loss, hidden_states, weight, flat_target, bias, class_weight, scale_tensor, global_max, row_log_sum,
        **shard, group_name=group_name, **options)  # the gradient attaches here
    if reduction == "none":
        return loss.view(target_shape).to(logits_dtype)
    return reduce_total(loss.sum(), flat_target, class_weight, reduction, ignore_index, label_smoothing, logits_dtype)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (False where torch.distributed is unavailable)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def vocabulary_mesh_dim(linear_weight: Tensor, linear_bias: Tensor | None, where: str = PUBLIC_NAME,
                        names: tuple[str, str] = ("linear_weight", "linear_bias")) -> int:
    """The mesh dimension the head's DTensor weight is ``Shard(0)`` over (``Replicate()`` on the
    others), the bias laid out the same; ``where`` and ``names`` are the messages'.

    Raises:
        TypeError: a plain weight with a DTensor bias. ValueError: another layout.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    weight_name, bias_name = names
    if not isinstance(linear_weight, DTensor):
        raise TypeError(f"{where}: expected {weight_name} to be a DTensor sharded over the vocabulary (Shard(0)) "
                        f"with a DTensor {bias_name}, got a {type(linear_weight).__name__}; pass both as plain "
                        "tensors, or both as DTensors")
    placements = tuple(linear_weight.placements)
    sharded = [dim for dim, placement in enumerate(placements) if placement == Shard(0)]
    if len(sharded) != 1 or any(p != Replicate() for dim, p in enumerate(placements) if dim != sharded[0]):
        raise ValueError(f"{where}: expected {weight_name} sharded over the vocabulary on one mesh dimension "
                         f"(Shard(0) there, Replicate() on the others), got placements {placements}; "
                         "redistribute it to that layout (e.g. ColwiseParallel on a 1-D tensor-parallel mesh)")
    if linear_bias is not None and (not isinstance(linear_bias, DTensor)
                                    or tuple(linear_bias.placements) != placements
                                    or linear_bias.device_mesh != linear_weight.device_mesh):
        got = tuple(linear_bias.placements) if isinstance(linear_bias, DTensor) else type(linear_bias).__name__
        raise ValueError(f"{where}: expected {bias_name} as a DTensor on {weight_name}'s mesh with its placements "
                         f"{placements}, got {got}")
    return sharded[0]


def shard_of(linear_weight: Tensor, mesh_dim: int) -> tuple[int, str]:
    """``(vocab_start, group_name)`` of this rank's rows of a DTensor weight sharded over
    ``mesh_dim``: its first class (DTensor's layout) and the group's c10d name."""
    _, (vocab_start, _) = internals.local_shape_and_offset(
        tuple(linear_weight.shape), linear_weight.device_mesh, linear_weight.placements)
    return vocab_start, linear_weight.device_mesh.get_group(mesh_dim).group_name


def replicated(name: str, value: Tensor | None) -> Tensor | None:
    """``value``'s local tensor where it is a DTensor replicated everywhere; a plain tensor (or
    None) as it is. Raises ValueError: another layout."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return value
    if any(placement != Replicate() for placement in value.placements):
        raise ValueError(f"{PUBLIC_NAME}: expected {name} replicated on every mesh dimension (the same on every "
                         f"rank), got placements {tuple(value.placements)}; pass value.full_tensor()")
    return value.to_local()
