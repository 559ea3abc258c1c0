"""The checks of the op's arguments, and the one validation of the chunking options.

The checks of the op's arguments, and the one validation of the options the graph pass's
:class:`compile_pass.options.Options` shares with the op (``chunk_size``, ``chunk_bytes``,
``grads_in_forward``: :func:`check_chunking`, which ``Options`` calls).

Every message names where the argument was given (``chunkce.linear_cross_entropy:`` for
the public function, ``chunkce:`` for an option), what was expected and what was got.
:func:`compile_pass.op.loss.linear_cross_entropy` runs them all before any work.

Two facts the graph pass and the lazy tensors' reads ask of the same steps, in one definition
each: whether a cast is exact (:func:`holds`) and whether a dim is the vocabulary's (:func:`is_last_dim`).
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from compile_pass.op.loops import autocast_enabled
from compile_pass.op.schema import LOSS_NAME

LOSS_REDUCTIONS = ("mean", "sum", "none")  # a loss's reductions, as torch spells them
_TARGET_DTYPES = (torch.int64, torch.uint8)  # what F.cross_entropy accepts for class indices


def _fail(kind: type[Exception], message: str, where: str = LOSS_NAME) -> None:
    raise kind(f"{where}: {message}")


def check_tensors(input, linear_weight, target, linear_bias, weight, logits_dtype) -> None:
    """Types, dtypes, shapes and devices of the tensor arguments.

    Raises:
        TypeError / ValueError / NotImplementedError: as :func:`compile_pass.op.loss.linear_cross_entropy` documents.
    """
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


def check_scale(input, logit_scale, logit_divisor, scale_dtype) -> None:
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


def check_loss_options(reduction, ignore_index, label_smoothing, logits_dtype) -> None:
    """The loss's non-tensor arguments: ``reduction``, ``ignore_index``, ``label_smoothing``,
    ``logits_dtype``.

    Raises:
        TypeError / ValueError: as :func:`compile_pass.op.loss.linear_cross_entropy` documents.
    """
    if reduction not in LOSS_REDUCTIONS:
        _fail(ValueError, f"expected reduction in {LOSS_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        _fail(TypeError, f"expected ignore_index to be an int, got {type(ignore_index).__name__}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        _fail(TypeError, f"expected label_smoothing to be a float, got {type(label_smoothing).__name__}")
    if label_smoothing > 1.0:  # F.cross_entropy's own rule: <= 0 (and nan) mean no smoothing
        _fail(ValueError, f"expected label_smoothing of at most 1.0, got {label_smoothing}")
    if logits_dtype is not None and (not isinstance(logits_dtype, torch.dtype)
                                     or not logits_dtype.is_floating_point):
        _fail(TypeError, f"expected logits_dtype to be a floating torch.dtype, got {logits_dtype!r}")


def check_positive_int(name: str, value, where: str = LOSS_NAME) -> None:
    """``value`` is a positive int (not a bool) or None (automatic).

    Raises:
        ValueError: it is not; the message is ``"{where}: expected {name} to be a positive
            int or None, got {value!r}"``.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        _fail(ValueError, f"expected {name} to be a positive int or None, got {value!r}", where)


def check_bool(name: str, value, where: str = LOSS_NAME) -> None:
    """``value`` is a bool.

    Raises:
        TypeError: it is not (the message names ``name`` and the type got).
    """
    if not isinstance(value, bool):
        _fail(TypeError, f"expected {name} to be a bool, got {type(value).__name__}", where)


def check_chunking(chunk_size, chunk_bytes, grads_in_forward, where: str = LOSS_NAME, prefix: str = "") -> None:
    """How a call is chunked, as the public function's keywords and the pass's ``Options``
    fields of the same names give it: ``chunk_size`` (tokens a tile) and ``chunk_bytes`` (a
    tile's byte budget) positive ints or None (automatic), ``grads_in_forward`` a bool.
    ``prefix`` goes before each name in a message (``"option "`` for ``Options``).

    Raises:
        ValueError: a size that is not a positive int or None.
        TypeError: ``grads_in_forward`` is not a bool.
    """
    check_positive_int(f"{prefix}chunk_size", chunk_size, where)
    check_positive_int(f"{prefix}chunk_bytes", chunk_bytes, where)
    check_bool(f"{prefix}grads_in_forward", grads_in_forward, where)


_WIDER = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
          torch.float32: (torch.float64,)}


def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of ``narrow`` is a value of ``wide`` (a cast to ``wide`` is exact)."""
    return wide == narrow or wide in _WIDER.get(narrow, ())


def is_last_dim(dim: object, ndim: int) -> bool:
    """Whether ``dim`` names the last (vocabulary) dim of an ``ndim``-dim tensor: an int (a bool as
    its int, as ``permute`` takes it) equal to ``ndim - 1`` modulo ``ndim``. The pass and the lazy
    tensors' reads ask it of every dim they read (a reduction's, a softmax's, a gather's, an index's)."""
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1
