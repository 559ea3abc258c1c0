"""The chunked linear-cross-entropy op's public function, :func:`linear_cross_entropy`, and
its traceable body, :func:`chunked_cross_entropy` (flatten, the custom op, the reduction in
torch ops), which the graph pass traces into a rewritten site. Module map: docs/design.md."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compile_pass.op import vocab_parallel
from compile_pass.op.checks import check_chunking, check_loss_options, check_scale, check_tensors
from compile_pass.op.chunking import Tiles, resolve_tiles
from compile_pass.op.custom_ops import FunctorchForward
from compile_pass.op.grads_in_forward import grads_wanted, summed_loss
from compile_pass.op.loops import autocast_enabled
from compile_pass.op.reduction import reduce_total
from compile_pass.op.schema import loss_inputs
from compile_pass.op.transform import HeadTransform


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

    The argument names are those of torch 2.13's
    ``torch.nn.functional.linear_cross_entropy``. The logits are computed
    ``chunk_size`` tokens at a time in the projection's dtype, rounded to
    ``logits_dtype``, and reduced with an fp32 log-sum-exp; backward recomputes
    each chunk (formulas in :mod:`compile_pass.op.kernels`) and accumulates the
    weight and bias gradients in fp32.

    Args:
        input: hidden states ``[N, H]`` or ``[B, T, H]`` (any leading dims), or one
            token ``[H]`` (unbatched: logits ``[V]``, a 0-d ``target``, as
            ``F.cross_entropy`` takes them), floating dtype.
        linear_weight: the lm_head weight ``[V, H]``, same dtype as ``input``; or a DTensor
            sharded over the vocabulary (``Shard(0)`` on one mesh dimension, ``Replicate()`` on
            any other: what ``ColwiseParallel`` makes of an ``nn.Linear``; shards may be
            uneven): then every rank of the mesh calls with the same ``input`` and ``target``
            (plain, or DTensors replicated everywhere, as ``linear_bias`` is sharded as the
            weight and ``weight`` replicated), walks its shard only and combines the row
            statistics over that mesh dimension's group
            (:func:`compile_pass.op.vocab_parallel.sharded_loss`; no ``[N, V]``
            or ``[N, V_local]`` tensor on any rank); the loss is a plain tensor, the same on
            every rank, ``input``'s gradient the full one and the weight's a DTensor of its
            layout.
        target: class indices, int64 (or uint8, as ``F.cross_entropy``),
            ``input.shape[:-1]``, each in ``[0, V)`` or ``ignore_index``; another
            value raises a ``RuntimeError`` on CPU (``F.cross_entropy`` raises
            ``IndexError``) and a device-side assert on CUDA, and is not checked on
            ``meta``.
        linear_bias: ``[V]`` or None.
        weight: class weights ``[V]`` in the logits' dtype (any floating dtype
            under autocast, which casts them) or None; not differentiated, as in
            ``F.cross_entropy``.
        reduction: ``"mean"`` (sum over tokens divided by the number of
            non-ignored tokens, or by the sum of their class weights; nan when
            every token is ignored), ``"sum"`` or ``"none"``.
        ignore_index: target value that contributes neither loss nor gradient.
        label_smoothing: at most 1, as in ``F.cross_entropy``, which also takes a
            value <= 0 (or nan) as no smoothing.
        logits_dtype: dtype the logits are cast to before the loss (e.g.
            ``torch.float32`` for HF's ``logits.float()``); None = the
            projection's dtype. Under ``torch.autocast`` the projection runs in
            the autocast dtype and the loss in fp32, as torch's autocast does.
        chunk_size: tokens per tile (the ``n`` of the op's ``[n, Vb]`` tiles); None =
            ``CHUNKCE_CHUNK_SIZE``, else automatic (:func:`compile_pass.op.chunking.resolve_tiles`).
        logit_scale: multiply the logits by it before the loss (Cohere's
            ``logit_scale``): a Python number or a real 0-d tensor (on the input's
            device or the CPU) that does not require grad; None = no scaling. It is
            applied in ``scale_dtype`` and rounds exactly as ``logits * logit_scale``
            does there (computed in fp32 for half precision, rounded once); the
            gradient is scaled the same way, as autograd's ``mul`` backward.
        logit_divisor: divide the logits by it (Granite's ``logits_scaling``, a
            sampling temperature); as ``logit_scale`` otherwise. It divides,
            rounding as ``logits / logit_divisor`` does, not as a multiplication by
            ``1 / logit_divisor``. At most one of the two.
        scale_dtype: the dtype the scaling happens in: None = the projection's
            dtype (``lm_head(h) * s``, as Cohere and Granite do); ``torch.float32``
            for a scale after ``logits.float()``. A 0-d tensor's own dtype does not
            change it, as torch's type promotion does not.
        chunk_bytes: the budget of one tile of logits in bytes: it sets the tile's
            vocabulary width ``Vb`` (and the automatic ``n`` where whole rows fit);
            None = ``CHUNKCE_CHUNK_BYTES``, else the device's default
            (:func:`compile_pass.op.chunking.resolve_tiles`).
        grads_in_forward: opt-in: for ``"mean"`` / ``"sum"`` with gradients wanted,
            compute the gradients during forward (three matmuls a chunk instead of
            the recompute's four) and hold them, ``[N, H] + [V, H]``, until backward
            (:mod:`compile_pass.op.grads_in_forward`; not with activation offloading or
            pipeline parallelism). ``"none"``, or no gradient wanted, runs the recompute op.

    Returns:
        The loss: a 0-d tensor, or ``target``-shaped for ``"none"``, in
        ``logits_dtype``.

    Raises:
        TypeError / ValueError: an argument of the wrong type, dtype or shape
            (the message names it).
        NotImplementedError: probability (floating) targets; a scale that requires
            grad; double backward; ``grads_in_forward`` with a sharded weight.
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
        transform=HeadTransform(scale=logit_divisor if logit_scale is None else logit_scale,
                                divides=logit_divisor is not None, dtype=scale_dtype),
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
    transform: HeadTransform | None = None,
    projection_dtype: torch.dtype | None = None,
    grads_in_forward: list[bool] | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group_name: str | None = None,
) -> Tensor:
    """:func:`linear_cross_entropy` after its checks, with every decision made by the caller.

    The custom op ``chunkce::linear_cross_entropy`` on the flattened tokens, then
    the reduction in plain torch ops. It reads no tensor's value or metadata, so
    the graph pass calls it with FX proxies to emit a rewritten site's nodes
    (:func:`compile_pass.graph.nodes.trace_into`): the graph then holds only
    registered ops and tensor methods, which the compile caches accept.

    Args:
        hidden_states: ``[..., H]``; weight ``[V, H]``; target ``hidden_states.shape[:-1]``
            int64; bias, class_weight ``[V]`` or None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index, label_smoothing: as :func:`linear_cross_entropy`'s.
        logits_dtype: the dtype the loss is computed in (resolved, not None).
        chunk_size, chunk_bytes: the tiles; None: ``CHUNKCE_*``, else automatic, resolved
            by the op at run time (:func:`compile_pass.op.chunking.resolve_tiles`).
        transform: the head's transform (:class:`compile_pass.op.transform.HeadTransform`,
            whose scale is a Python number or a 0-d tensor, or the proxy of one); None = none.
        projection_dtype: cast hidden_states, weight and bias to it first (the
            autocast dtype); None = no cast.
        grads_in_forward: None = the recompute op; else which of ``[hidden_states, weight,
            bias]`` need a gradient (:func:`compile_pass.op.grads_in_forward.grads_wanted`),
            computed during forward by :mod:`compile_pass.op.grads_in_forward` for
            ``"mean"`` / ``"sum"`` (``"none"`` keeps the recompute op).
        vocab_start, vocab_size, group_name: a vocabulary-sharded head's shard (``weight`` and
            ``bias`` this rank's ``[V_local, H]`` / ``[V_local]`` from global class ``vocab_start``,
            of ``vocab_size`` in all, over the c10d group ``group_name``):
            :func:`compile_pass.op.vocab_parallel.sharded_loss`; ``group_name`` None: the whole head.

    Returns:
        The loss in ``logits_dtype``: 0-d, or shaped like ``target`` for ``"none"``.

    Raises:
        TypeError: a keyword that is not an option's name. NotImplementedError: ``grads_in_forward``
        with a shard.
    """
    if group_name is not None and grads_in_forward is not None:
        raise NotImplementedError(
            f"{vocab_parallel.NAME}: grads_in_forward is not supported for a vocabulary-sharded head; "
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
        if torch._C._are_functorch_transforms_active():
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
    environment as it is now: :func:`compile_pass.op.chunking.resolve_tiles`, the function
    the op's body calls (:meth:`compile_pass.op.schema.ChunkPlan.resolve`), for the op the
    call picks (whole rows for the grads-in-forward op). The graph pass's report shows them
    for each rewritten site, from its sizes (their hints where they are symbolic).

    Args:
        num_tokens: N, the flattened tokens; vocab_size: V.
        projection_dtype: the dtype the projection runs in (a tile's logits).
        device_type: the hidden states' device type.
        reduction, grads_in_forward, options: as :func:`chunked_cross_entropy` takes them (of
            the options, ``chunk_size`` and ``chunk_bytes`` set the tiles; None or absent:
            automatic).

    Raises:
        ValueError: a ``CHUNKCE_*`` variable holds a bad value.
    """
    return resolve_tiles(options.get("chunk_size"), num_tokens, vocab_size, projection_dtype.itemsize,
                         device_type, chunk_bytes=options.get("chunk_bytes"),
                         whole_rows=_gradients_now(grads_in_forward, reduction))
