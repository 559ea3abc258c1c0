"""The loss op's public function, linear_cross_entropy, and its traceable body.

The op's public function, :func:`linear_cross_entropy`, and its traceable body,
:func:`chunked_cross_entropy`, which the graph pass traces into a rewritten site.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import vocab_parallel
from compile_pass.op.checks import check_chunking, check_loss_options, check_scale, check_tensors
from compile_pass.op.custom_ops import FunctorchForward
from compile_pass.op.grads_in_forward import grads_wanted, summed_loss
from compile_pass.op.kernels import HeadScale
from compile_pass.op.loops import autocast_enabled, reduce_total
from compile_pass.op.schema import loss_inputs
from compile_pass.op.tiling import Tiles, resolve_tiles

_are_functorch_transforms_active = internals.are_functorch_transforms_active.get()


def linear_cross_entropy(
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
    logit_scale: float | Tensor | None = None,
    logit_divisor: float | Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
    grads_in_forward: bool = False,
) -> Tensor:
    """Cross-entropy of a linear projection, without materializing the logits.

    Exactly (loss and every gradient, up to floating-point summation order)::

        logits = F.linear(input, linear_weight, linear_bias)
        logits = (logits.to(scale_dtype) * logit_scale)   # with logit_scale
        logits = (logits.to(scale_dtype) / logit_divisor)  # with logit_divisor
        logits = logits.to(logits_dtype)
        F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=weight,
                        reduction=reduction, ignore_index=ignore_index,
                        label_smoothing=label_smoothing)  # "none": shaped like target

    Names as torch 2.13's ``F.linear_cross_entropy``; numerics and argument rules: docs/op.md,
    "Contract" and "Scaled logits".

    Args:
        input: hidden states ``[N, H]``, ``[B, T, H]`` or one token ``[H]`` (0-d ``target``), floating.
        linear_weight: the lm_head weight ``[V, H]``, ``input``'s dtype; or a DTensor sharded over
            the vocabulary (every rank then passes the same ``input`` and ``target``; the loss is
            plain and the same on every rank: docs/op.md, "A vocabulary-sharded head").
        target: class indices, int64 or uint8, ``input.shape[:-1]``, each in ``[0, V)`` or
            ``ignore_index`` (else ``RuntimeError`` on CPU, a device-side assert on CUDA).
        linear_bias: ``[V]`` or None.
        weight: class weights ``[V]`` in the logits' dtype, or None; not differentiated.
        reduction: ``"mean"`` (nan when every token is ignored), ``"sum"`` or ``"none"``.
        ignore_index, label_smoothing: as ``F.cross_entropy``'s.
        logits_dtype: the loss's dtype (``torch.float32`` for HF's ``logits.float()``); None = the
            projection's. Under ``torch.autocast`` the projection runs in the autocast dtype, the loss in fp32.
        chunk_size: tokens per tile (``n`` of the ``[n, Vb]`` tiles); chunk_bytes: a tile's byte
            budget (sets ``Vb``). None = ``CHUNKCE_*``, else automatic
            (:func:`compile_pass.op.tiling.resolve_tiles`).
        logit_scale / logit_divisor: multiply / divide the logits by a Python number or a 0-d
            tensor that does not require grad (at most one); scale_dtype: the dtype the scaling
            happens in (None = the projection's).
        grads_in_forward: for ``"mean"`` / ``"sum"``, compute the gradients during forward and
            hold ``[N, H] + [V, H]`` until backward (docs/op.md, "Grads-in-forward mode").

    Returns:
        The loss in ``logits_dtype``: 0-d, or ``target``-shaped for ``"none"``.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype or shape (the message names it).
        NotImplementedError: probability (floating) targets; a scale that requires grad; double
            backward; ``grads_in_forward`` with a sharded weight.
    """
    sharded = vocab_parallel.is_dtensor(linear_weight) or vocab_parallel.is_dtensor(linear_bias)
    if sharded:  # the layout decides: the vocabulary-parallel loss
        mesh_dim = vocab_parallel.vocabulary_mesh_dim(linear_weight, linear_bias)
        input, target, weight = (vocab_parallel.replicated(name, value) for name, value in
                                 (("input", input), ("target", target), ("weight", weight)))
    check_loss_options(reduction, ignore_index, label_smoothing, logits_dtype)
    check_chunking(chunk_size, chunk_bytes, grads_in_forward)
    check_tensors(input, linear_weight, target, linear_bias, weight, logits_dtype)
    check_scale(input, logit_scale, logit_divisor, scale_dtype)
    if target.dtype != torch.int64:
        target = target.long()  # uint8 class indices: a new tensor, the caller's is untouched
    if input.dim() == 1:  # unbatched, as F.cross_entropy takes it: logits [V], a 0-d target
        input = input.unsqueeze(0)  # [1, H]; the loss keeps the 0-d target's shape
    projection_dtype = None
    if autocast_enabled(input.device.type):  # the projection in the autocast dtype, the loss in fp32
        projection_dtype = torch.get_autocast_dtype(input.device.type)
        logits_dtype = logits_dtype or torch.float32
    keywords = dict(
        reduction=reduction, ignore_index=ignore_index, label_smoothing=float(label_smoothing),
        logits_dtype=logits_dtype or input.dtype, projection_dtype=projection_dtype,
        chunk_size=chunk_size, chunk_bytes=chunk_bytes,
        transform=HeadScale.of(logit_divisor if logit_scale is None else logit_scale, logit_divisor is not None,
                               scale_dtype),
        grads_in_forward=grads_wanted(input, linear_weight, linear_bias, torch.is_grad_enabled())
        if grads_in_forward else None,
    )
    if sharded:
        vocab_start, group_name = vocab_parallel.shard_of(linear_weight, mesh_dim)
        return chunked_cross_entropy(
            input, linear_weight.to_local(), target, None if linear_bias is None else linear_bias.to_local(), weight,
            vocab_start=vocab_start, vocab_size=linear_weight.shape[0], group_name=group_name, **keywords)
    return chunked_cross_entropy(input, linear_weight, target, linear_bias, weight, **keywords)


def chunked_cross_entropy(
    hidden_states: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    *,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    logits_dtype: torch.dtype,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    transform: HeadScale | None = None,
    projection_dtype: torch.dtype | None = None,
    grads_in_forward: list[bool] | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group_name: str | None = None,
) -> Tensor:
    """:func:`linear_cross_entropy` after its checks, every decision made by the caller: the
    custom op on the flattened tokens, then the reduction in torch ops. It reads no tensor's
    value or metadata, so the graph pass traces it with FX proxies into a rewritten site.

    Args:
        hidden_states ``[..., H]``, weight ``[V, H]``, target ``hidden_states.shape[:-1]`` int64,
        bias / class_weight ``[V]`` or None; the options as :func:`linear_cross_entropy`'s,
        resolved: ``logits_dtype`` not None, ``transform`` a
        :class:`compile_pass.op.kernels.HeadScale` or None, ``projection_dtype`` the
        autocast dtype or None, ``grads_in_forward`` None or the ``[hidden_states, weight, bias]``
        mask of gradients wanted. vocab_start, vocab_size, group_name: a vocabulary shard's
        place over a c10d group (:func:`compile_pass.op.vocab_parallel.sharded_loss`).

    Returns:
        The loss in ``logits_dtype``: 0-d, or shaped like ``target`` for ``"none"``.

    Raises:
        NotImplementedError: ``grads_in_forward`` with a shard.
    """
    if group_name is not None and grads_in_forward is not None:
        raise NotImplementedError(
            f"{vocab_parallel.VOCAB_PARALLEL_NAME}: grads_in_forward is not supported for a vocabulary-sharded head; "
            "leave it off (the recompute path is exact and holds no [V_local, H] gradient in forward)")
    hidden_states, weight, bias, scale_tensor, options = loss_inputs(
        hidden_states, weight, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
        logits_dtype=logits_dtype, chunk_size=chunk_size, chunk_bytes=chunk_bytes, transform=transform,
        projection_dtype=projection_dtype)
    flat_target = target.reshape(-1)  # [N]
    tensors = (hidden_states.flatten(0, -2), weight, flat_target, bias, class_weight, scale_tensor)
    if group_name is not None:
        return vocab_parallel.sharded_loss(tensors, options, target.shape, reduction=reduction,
                                           vocab_start=vocab_start, vocab_size=vocab_size, group_name=group_name)
    if _gradients_now(grads_in_forward, reduction):  # the gradients now: grads_in_forward.py
        total = summed_loss(*tensors, grads_in_forward, options)  # 0-d fp32 (fp64 for fp64)
    else:
        if _are_functorch_transforms_active():
            loss = FunctorchForward.apply(options, *tensors)[0]
        else:  # [N] fp32 (fp64 for fp64 logits); [1], [2] are the row statistics backward takes
            loss = torch.ops.chunkce.linear_cross_entropy.default(*tensors, **options)[0]
        if reduction == "none":
            return loss.view_as(target).to(logits_dtype)
        total = loss.sum()
    return reduce_total(total, flat_target, class_weight, reduction, ignore_index, label_smoothing, logits_dtype)


def _gradients_now(grads_in_forward: list[bool] | None, reduction: str) -> bool:
    """Whether :func:`chunked_cross_entropy` runs the grads-in-forward op (else the recompute op)."""
    return grads_in_forward is not None and reduction != "none"


def planned_tiles(num_tokens: int, vocab_size: int, projection_dtype: torch.dtype, device_type: str, *,
                  reduction: str, grads_in_forward: list[bool] | None = None, **options: Any) -> Tiles:
    """The tiles a :func:`chunked_cross_entropy` call with these arguments runs, with the
    environment as it is now (:func:`compile_pass.op.tiling.resolve_tiles`, whole rows for the
    grads-in-forward op); the pass's report shows them per site. ``num_tokens``: N;
    ``vocab_size``: V; ``projection_dtype``: a tile's logits' dtype.

    Raises:
        ValueError: a ``CHUNKCE_*`` variable holds a bad value.
    """
    return resolve_tiles(options.get("chunk_size"), num_tokens, vocab_size, projection_dtype.itemsize,
                         device_type, chunk_bytes=options.get("chunk_bytes"),
                         whole_rows=_gradients_now(grads_in_forward, reduction))
