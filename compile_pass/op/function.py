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
:mod:`compile_pass.op.grads_in_forward`), their options in :mod:`compile_pass.op.schema`,
their chunk loops in :mod:`compile_pass.op.loops`, the per-chunk math in
:mod:`compile_pass.op.kernels`.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from compile_pass.op.custom_ops import FunctorchForward
from compile_pass.op.grads_in_forward import grads_wanted, summed_loss
from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.loops import autocast_enabled
from compile_pass.op.schema import NAME as _NAME
from compile_pass.op.schema import OpOptions

_REDUCTIONS = ("mean", "sum", "none")
_TARGET_DTYPES = (torch.int64, torch.uint8)  # what F.cross_entropy accepts for class indices


def _fail(kind: type[Exception], message: str) -> None:
    raise kind(f"{_NAME}: {message}")


def _check_tensors(input, linear_weight, target, linear_bias, weight, logits_dtype) -> None:
    """Types, dtypes, shapes and devices of the tensor arguments."""
    for name, value in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(value, Tensor):
            _fail(TypeError, f"expected {name} to be a Tensor, got {type(value).__name__}")
    if input.dim() < 1:
        _fail(ValueError, f"expected input of shape [N, H], [B, T, H] or [H] (one token), got {tuple(input.shape)}")
    if not input.is_floating_point():
        _fail(TypeError, f"expected a floating-point input, got {input.dtype}")
    if linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1]:
        _fail(ValueError, f"expected linear_weight of shape [V, {input.shape[-1]}], "
                         f"got {tuple(linear_weight.shape)}")
    if linear_weight.dtype != input.dtype and not autocast_enabled(input.device.type):
        _fail(TypeError, f"expected linear_weight of dtype {input.dtype} (the input's), "
                        f"got {linear_weight.dtype}")
    if target.is_floating_point():
        _fail(NotImplementedError, "probability (soft) targets are not supported; "
                                  "pass class indices of dtype torch.int64")
    if target.dtype not in _TARGET_DTYPES:
        _fail(TypeError, f"expected target of dtype torch.int64 (or torch.uint8, as "
                         f"F.cross_entropy accepts), got {target.dtype}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        _fail(ValueError, f"expected target of shape {tuple(input.shape[:-1])} (input's without "
                         f"the hidden dim), got {tuple(target.shape)}")
    vocab_size = linear_weight.shape[0]
    for name, value in (("linear_bias", linear_bias), ("weight", weight)):
        if value is not None and (not isinstance(value, Tensor) or tuple(value.shape) != (vocab_size,)):
            _fail(ValueError, f"expected {name} of shape [{vocab_size}], got "
                             f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
    if weight is not None and not weight.is_floating_point():
        _fail(TypeError, f"expected a floating-point weight (class weights), got {weight.dtype}")
    if weight is not None and not autocast_enabled(input.device.type):
        expected = logits_dtype if isinstance(logits_dtype, torch.dtype) else input.dtype
        if weight.dtype != expected:  # F.cross_entropy refuses it too
            _fail(TypeError, f"expected weight (class weights) of dtype {expected} (the logits'), "
                             f"got {weight.dtype}; pass weight.to({expected})")
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        _fail(NotImplementedError, "class weights (weight=) that require grad are not supported: "
                                  "torch's cross_entropy does not differentiate them either; "
                                  "pass weight.detach()")
    for name, value in (("linear_weight", linear_weight), ("target", target),
                        ("linear_bias", linear_bias), ("weight", weight)):
        if value is not None and value.device != input.device:
            _fail(ValueError, f"expected {name} on {input.device} (the input's device), got {value.device}")


def _check_scale(input, logit_scale, logit_divisor, scale_dtype) -> None:
    """The scaling arguments: at most one of the two scales, each a real Python number or
    a real 0-d tensor that needs no gradient, and a floating ``scale_dtype`` only with one."""
    if logit_scale is not None and logit_divisor is not None:
        _fail(ValueError, "expected at most one of logit_scale and logit_divisor, got both; "
                         "fold them into one: logit_scale=scale / divisor")
    for name, value in (("logit_scale", logit_scale), ("logit_divisor", logit_divisor)):
        if value is None:
            continue
        if isinstance(value, Tensor):
            if value.dim() != 0:
                _fail(ValueError, f"expected {name} to be a number or a 0-d tensor, got a tensor of "
                                 f"shape {tuple(value.shape)}: a per-class scale is not supported")
            if value.is_complex() or value.dtype == torch.bool:
                _fail(TypeError, f"expected a real {name}, got a tensor of dtype {value.dtype}")
            if value.device != input.device and value.device.type != "cpu":
                _fail(ValueError, f"expected {name} on {input.device} (the input's device) or the "
                                 f"CPU, got {value.device}")
            if value.requires_grad and torch.is_grad_enabled():
                _fail(NotImplementedError, f"a {name} that requires grad is not supported: the op "
                                          f"does not differentiate the scale; pass {name}.detach() "
                                          f"(or freeze it: requires_grad_(False))")
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            _fail(TypeError, f"expected {name} to be a number or a 0-d tensor, got {type(value).__name__}")
    if scale_dtype is not None:
        if not isinstance(scale_dtype, torch.dtype) or not scale_dtype.is_floating_point:
            _fail(TypeError, f"expected scale_dtype to be a floating torch.dtype, got {scale_dtype!r}")
        if logit_scale is None and logit_divisor is None:
            _fail(ValueError, "scale_dtype was given without logit_scale or logit_divisor")


def _check_options(reduction, ignore_index, label_smoothing, logits_dtype, chunk_size, chunk_bytes) -> None:
    """The non-tensor arguments."""
    if reduction not in _REDUCTIONS:
        _fail(ValueError, f"expected reduction in {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        _fail(TypeError, f"expected ignore_index to be an int, got {type(ignore_index).__name__}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        _fail(TypeError, f"expected label_smoothing to be a float, got {type(label_smoothing).__name__}")
    if label_smoothing > 1.0:  # F.cross_entropy's own rule: <= 0 (and nan) mean no smoothing
        _fail(ValueError, f"expected label_smoothing of at most 1.0, got {label_smoothing}")
    if logits_dtype is not None and (not isinstance(logits_dtype, torch.dtype)
                                     or not logits_dtype.is_floating_point):
        _fail(TypeError, f"expected logits_dtype to be a floating torch.dtype, got {logits_dtype!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        _fail(ValueError, f"expected chunk_size to be a positive int or None, got {chunk_size!r}")
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                    or chunk_bytes <= 0):
        _fail(ValueError, f"expected chunk_bytes to be a positive int or None, got {chunk_bytes!r}")


def _check_grads_in_forward(grads_in_forward) -> None:
    if not isinstance(grads_in_forward, bool):
        _fail(TypeError, f"expected grads_in_forward to be a bool, got {type(grads_in_forward).__name__}")


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
        chunk_size: tokens per chunk; None = automatic
            (:func:`compile_pass.op.chunking.resolve_chunk_size`: ``CHUNKCE_CHUNK_SIZE``, else by size).
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
        chunk_bytes: the budget of one chunk's logits in bytes, from which the
            automatic ``chunk_size`` is chosen; None = the default budget
            (:func:`compile_pass.op.chunking.resolve_chunk_size`).
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
    _check_options(reduction, ignore_index, label_smoothing, logits_dtype, chunk_size, chunk_bytes)
    _check_tensors(input, linear_weight, target, linear_bias, weight, logits_dtype)
    _check_scale(input, logit_scale, logit_divisor, scale_dtype)
    _check_grads_in_forward(grads_in_forward)
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
        chunk_size=chunk_size or 0, release_cache=release_cache,
        logit_scale=logit_divisor if logit_scale is None else logit_scale,
        scale_divides=logit_divisor is not None, scale_dtype=scale_dtype,
        chunk_bytes=chunk_bytes or 0,
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
            ``chunk_size`` (0 = automatic), ...), where ``logit_scale`` is the logits'
            scale as a Python number or a 0-d tensor (:meth:`OpOptions.of`): they are
            divided by it when ``scale_divides``, else multiplied, in ``scale_dtype``
            (None = the projection dtype): :func:`compile_pass.op.kernels.scale_logits`.

    Returns:
        The loss in ``logits_dtype``: 0-d, or shaped like ``target`` for ``"none"``.

    Raises:
        TypeError: a keyword in ``options`` that is not an option's name.
    """
    op_options = OpOptions.of(**options)
    ignore_index, logits_dtype = op_options.ignore_index, op_options.logits_dtype
    label_smoothing = op_options.label_smoothing
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    flat_target = target.reshape(-1)  # [N]
    forward_op = (FunctorchForward.apply if torch._C._are_functorch_transforms_active()
                  else torch.ops.chunkce.linear_cross_entropy.default)
    if grads_in_forward is not None and reduction != "none":  # the gradients now: grads_in_forward.py
        total = summed_loss(hidden_states.flatten(0, -2), weight, flat_target, bias, class_weight,
                            grads_in_forward, op_options)  # 0-d fp32 (fp64 for fp64)
    else:
        loss = forward_op(
            hidden_states.flatten(0, -2), weight, flat_target, bias, class_weight, *op_options.args(),
        )[0]  # [N] fp32 (fp64 for fp64 logits); [1], [2] are the row statistics backward takes
        if reduction == "none":
            return loss.view_as(target).to(logits_dtype)
        total = loss.sum()
    if reduction == "sum":
        return total.to(logits_dtype)
    valid = flat_target != ignore_index  # [N]
    if class_weight is None:
        denominator = valid.sum()
    else:
        class_weight = class_weight.to(accumulate_dtype(logits_dtype))
        denominator = (class_weight[flat_target.masked_fill(~valid, 0)] * valid).sum()
    mean = total / denominator
    if class_weight is not None and label_smoothing > 0.0:
        # torch divides the nll and the smoothing terms by the weight sum separately: with
        # a zero sum its nll's 0 / 0 makes the loss nan, where total / 0 would be inf
        mean = mean + torch.zeros_like(denominator) / denominator  # + 0, or nan when the sum is 0
    return mean.to(logits_dtype)
