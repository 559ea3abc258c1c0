"""The chunked linear-cross-entropy op: ``chunkce::linear_cross_entropy``.

Public entry point: :func:`linear_cross_entropy`, a drop-in for torch 2.13's
``torch.nn.functional.linear_cross_entropy`` (class-index targets) that never
materializes the ``[N, V]`` logits, their fp32 upcast, their log-softmax or their
gradient. It is a traceable Python function: argument checks, then
:func:`chunked_cross_entropy`: flattening, the custom op (one opaque node for
Dynamo, AOTAutograd and Inductor) and the reduction in ordinary torch ops, so that
``mean`` over class weights, and anything the surrounding graph does with the
loss, stays visible to the compiler. The graph pass emits a rewritten site by
tracing :func:`chunked_cross_entropy` into the graph, so a rewritten site and an
eager call run the same code.

The custom ops and their autograd are in :mod:`compile_pass.op.custom_ops` (and
:mod:`compile_pass.op.grads_in_forward`, with its chunk loop), their options in
:mod:`compile_pass.op.schema`, the recompute op's chunk loops in :mod:`compile_pass.op.loops`,
their products into the gradients in :mod:`compile_pass.op.gradient_products`, the per-chunk
math in :mod:`compile_pass.op.kernels`, and how it is compiled and run in
:mod:`compile_pass.op.kernel_runner`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compile_pass.op.checks import check_chunking, check_loss_options, check_scale, check_tensors
from compile_pass.op.chunking import Tiles, resolve_tiles
from compile_pass.op.custom_ops import FunctorchForward
from compile_pass.op.grads_in_forward import grads_wanted, summed_loss
from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.loops import autocast_enabled
from compile_pass.op.schema import OpOptions
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
    release_cache: bool | None = None,
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
        linear_weight: the lm_head weight ``[V, H]``, same dtype as ``input``.
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
        chunk_size: tokens per tile (the ``n`` of the op's ``[n, Vb]`` tiles); None = automatic
            (:func:`compile_pass.op.chunking.resolve_tiles`: ``CHUNKCE_CHUNK_SIZE`` when
            ``chunk_bytes`` is None too, else the rule).
        release_cache: empty the device allocator's cache after forward and
            backward; None = ``CHUNKCE_RELEASE_CACHE``. Read at run time.
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
            (:func:`compile_pass.op.chunking.resolve_tiles`). Given, it also sets
            ``CHUNKCE_CHUNK_SIZE`` aside.
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
            grad; double backward.
    """
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
    return chunked_cross_entropy(
        input, linear_weight, target, linear_bias, weight,
        reduction=reduction, ignore_index=ignore_index, label_smoothing=float(label_smoothing),
        logits_dtype=logits_dtype or input.dtype, projection_dtype=projection_dtype,
        chunk_size=chunk_size, release_cache=release_cache,
        transform=HeadTransform(scale=logit_divisor if logit_scale is None else logit_scale,
                                divides=logit_divisor is not None, dtype=scale_dtype),
        chunk_bytes=chunk_bytes,
        grads_in_forward=grads_wanted(input, linear_weight, linear_bias, torch.is_grad_enabled())
        if grads_in_forward else None,
    )


def chunked_cross_entropy(
    hidden_states: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    *,
    reduction: str,
    projection_dtype: torch.dtype | None = None,
    grads_in_forward: list[bool] | None = None,
    **options: Any,
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
        projection_dtype: cast hidden_states, weight and bias to it first (the
            autocast dtype); None = no cast.
        grads_in_forward: None = the recompute op; else which of ``[hidden_states, weight,
            bias]`` need a gradient (:func:`compile_pass.op.grads_in_forward.grads_wanted`),
            computed during forward by :mod:`compile_pass.op.grads_in_forward` for
            ``"mean"`` / ``"sum"`` (``"none"`` keeps the recompute op).
        options: the op's options by name (:class:`compile_pass.op.schema.OpOptions`:
            ``ignore_index``, ``label_smoothing``, ``logits_dtype`` (resolved, not None),
            ``chunk_size`` and ``chunk_bytes`` (None = automatic), ``transform``: the head's
            transform, :class:`compile_pass.op.transform.HeadTransform`, whose scale is a
            Python number or a 0-d tensor (or the proxy of one), ...).

    Returns:
        The loss in ``logits_dtype``: 0-d, or shaped like ``target`` for ``"none"``.

    Raises:
        TypeError: a keyword in ``options`` that is not an option's name.
    """
    op_options = OpOptions(**options)
    logits_dtype = op_options.logits_dtype
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    flat_target = target.reshape(-1)  # [N]
    forward_op = (FunctorchForward.apply if torch._C._are_functorch_transforms_active()
                  else torch.ops.chunkce.linear_cross_entropy.default)
    if _gradients_now(grads_in_forward, reduction):  # the gradients now: grads_in_forward.py
        total = summed_loss(hidden_states.flatten(0, -2), weight, flat_target, bias, class_weight,
                            grads_in_forward, op_options)  # 0-d fp32 (fp64 for fp64)
    else:
        loss = forward_op(
            hidden_states.flatten(0, -2), weight, flat_target, bias, class_weight, *op_options.args(),
        )[0]  # [N] fp32 (fp64 for fp64 logits); [1], [2] are the row statistics backward takes
        if reduction == "none":
            return loss.view_as(target).to(logits_dtype)
        total = loss.sum()
    return reduce_total(total, flat_target, class_weight, reduction, op_options)


def reduce_total(total: Tensor, flat_target: Tensor, class_weight: Tensor | None, reduction: str,
                 options: OpOptions) -> Tensor:
    """The summed loss ``total`` (0-d, fp32 or fp64) reduced as ``F.cross_entropy`` reduces it,
    ``"sum"`` or ``"mean"`` (over the non-ignored targets ``flat_target [N]``, or over their class
    weights), in ``options.logits_dtype``; shared with :mod:`compile_pass.op.vocab_parallel`."""
    if reduction == "sum":
        return total.to(options.logits_dtype)
    valid = flat_target != options.ignore_index  # [N]
    if class_weight is None:
        denominator = valid.sum()
    else:
        class_weight = class_weight.to(accumulate_dtype(options.logits_dtype))
        denominator = (class_weight[flat_target.masked_fill(~valid, 0)] * valid).sum()
    mean = total / denominator
    if class_weight is not None and options.label_smoothing > 0.0:
        # torch divides the nll and the smoothing terms by the weight sum separately: with
        # a zero sum its nll's 0 / 0 makes the loss nan, where total / 0 would be inf
        mean = mean + torch.zeros_like(denominator) / denominator  # + 0, or nan when the sum is 0
    return mean.to(options.logits_dtype)


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
