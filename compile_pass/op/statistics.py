"""Per-row statistics of a linear head's logits, without materializing them.

:func:`linear_statistics` (checked, eager) and :func:`chunked_statistics` (the traceable entry,
every decision made by the caller) call ``chunkce::linear_statistics``, or, for a
vocabulary-sharded weight, each rank's shard combined across ranks.

The custom ops and their autograd:
``chunkce::linear_statistics`` walks the ``[n, Vb]`` tiles once
(:func:`compile_pass.op.statistics_loops.statistics_walk`), or with ``row_statistics=False``
gathers the selected logits only (:func:`~compile_pass.op.statistics_loops.selected_forward`).
Its outputs: ``selected [N, K]``, ``lse``, ``entropy``, ``max``, ``argmax``, the two ``[N]``
parts backward takes, ``row_log_sum = log s`` and ``row_mean = t / s``
(:mod:`compile_pass.op.kernels`), and ``row_sum`` (appended last, differentiable); with
``maximum_only=True`` the walk computes ``max`` and ``argmax`` (and ``selected``) only, no
exponential, and the other five are empty ``[0]``. Autograd saves its tensor inputs and the ``[N]``
statistics; ``chunkce::linear_statistics_backward`` recomputes (its own autograd refuses double
backward). A gradient not given (None: ``ctx.set_materialize_grads(False)``) costs no term.

The tensors are positional (torch refuses keyword-only tensors in a custom op), the options
keyword-only; ``vocab_start`` / ``vocab_size`` place a shard of the vocabulary: its columns' global indices, and the range the
indices are checked against.

A vocabulary-sharded (tensor-parallel) head: each rank walks its shard and
the statistics are combined by one all-reduce max and one sum (every rank gets the global
values); the combination and its gradient: docs/op.md, "Row statistics".
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import kernels, loops, statistics_loops
from compile_pass.op.checks import check_bool, check_positive_int
from compile_pass.op.custom_ops import fake_gradients, input_grads, refuse_double_backward
from compile_pass.op.kernels import HeadScale
from compile_pass.op.schema import GROUP_NAME, OUTPUT_MASK, SCALE_OPTIONS, Argument, OpSchema, option_defaults
from compile_pass.op.tiling import accumulate_dtype
from compile_pass.op.vocab_parallel import all_reduce, is_dtensor, shard_of, vocabulary_mesh_dim

_assert_async = internals.assert_async.get()  # checks a range with no host sync


class RowStatistics(NamedTuple):
    """What :func:`linear_statistics` returns, per row ``i`` of the values ``z [N, V]`` (the
    logits after every transform, in ``statistics_dtype``), each in
    ``accumulate_dtype(statistics_dtype)`` (fp32 for half precision and fp32, fp64 for fp64)."""

    selected: Tensor | None  # [N, K]: z[i, indices[i, k]]; None without indices (differentiable)
    lse: Tensor  # [N]: log sum_c exp(z_ic) (differentiable)
    entropy: Tensor  # [N]: -sum_c p_ic log p_ic, p = softmax(z) (differentiable)
    max: Tensor  # [N]: max_c z_ic (differentiable: the gradient goes to the argmax column, as torch.max(dim))
    argmax: Tensor  # [N] int64: the first column holding the maximum (torch.argmax's rule)
    row_sum: Tensor  # [N]: sum_c z_ic, of the values rounded as z holds them (differentiable)


class RowContent(Enum):
    """What rows of values ``z [N, V]`` hold (a lazy tensor's rows, a graph's reduced operand)."""

    LOGITS = "z"
    LOG_PROBS = "lp"  # log_softmax(z)
    PROBS = "p"  # softmax(z)
    P_LOG_P = "plp"  # p * lp, summed: the negated entropy
    P_Z = "pz"  # p * z, summed: lse - entropy


class Reduction(Enum):
    """A reduction of the row values over the last dim that the row statistics give."""

    LOGSUMEXP = "logsumexp"
    SUM = "sum"
    MEAN = "mean"  # the sum over the vocabulary's size


REDUCTIONS: dict[object, Reduction] = {
    torch.logsumexp: Reduction.LOGSUMEXP, Tensor.logsumexp: Reduction.LOGSUMEXP,
    torch.special.logsumexp: Reduction.LOGSUMEXP, torch.sum: Reduction.SUM, Tensor.sum: Reduction.SUM,
    torch.mean: Reduction.MEAN, Tensor.mean: Reduction.MEAN,
}
"""The torch functions (as a graph's nodes and ``__torch_function__`` see them) of each reduction."""

FromStatistics = Callable[[RowStatistics, int], Tensor]  # (the op's statistics of rows, V) -> [n], accumulate dtype
_ROW_SUMS: dict[RowContent, FromStatistics] = {
    RowContent.LOGITS: lambda stats, vocab_size: stats.row_sum,
    RowContent.LOG_PROBS: lambda stats, vocab_size: stats.row_sum - vocab_size * stats.lse,
    RowContent.P_LOG_P: lambda stats, vocab_size: -stats.entropy,
    RowContent.P_Z: lambda stats, vocab_size: stats.lse - stats.entropy,
}


def reduction_from_statistics(reduction: Reduction, kind: RowContent) -> FromStatistics | None:
    """The value per row of ``reduction`` over the last dim of rows holding ``kind``, from the op's
    statistics of those rows (:class:`compile_pass.op.statistics.RowStatistics`) and the
    vocabulary's size; None where no statistic gives it."""
    if reduction is Reduction.LOGSUMEXP:
        return (lambda stats, vocab_size: stats.lse) if kind is RowContent.LOGITS else None
    row_sum = _ROW_SUMS.get(kind)
    if row_sum is None or reduction is Reduction.SUM:
        return row_sum
    return lambda stats, vocab_size: row_sum(stats, vocab_size) / vocab_size


def linear_statistics(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    indices: Tensor | None = None,
    *,
    logits_dtype: torch.dtype | None = None,
    projection_dtype: torch.dtype | None = None,
    transform: HeadScale = HeadScale(),
    temperature: float | Tensor | None = None,
    temperature_multiplies: bool = False,
    statistics_dtype: torch.dtype | None = None,
    row_statistics: bool = True,
    maximum_only: bool = False,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
) -> RowStatistics:
    """Row statistics of ``z`` (below) computed tile by tile; the values are, exactly (up to
    floating-point summation order)::

        x = F.linear(hidden_states.to(projection_dtype), weight.to(projection_dtype), bias)  # [N, V]
        z = transform.apply(x).to(logits_dtype)        # the head's own scale, then the logits' dtype
        z = (z / temperature).to(statistics_dtype)     # temperature: a number or a [N] tensor (per row),
                                                       # divided in accumulate_dtype(statistics_dtype);
                                                       # * temperature with temperature_multiplies
        selected = z.gather(-1, indices); lse = z.logsumexp(-1)
        entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1); max, argmax = z.max(-1)
        row_sum = z.sum(-1)

    with ``0 log 0 = 0`` in the entropy and a row holding ``+inf`` or only ``-inf`` as torch's
    (docs/op.md, "Row statistics").

    Args:
        hidden_states: ``[N, H]``, floating.
        weight: ``[V, H]``, or a DTensor ``Shard(0)`` on a 1-D mesh (every rank must call and gets
            the global values); bias: ``[V]`` (sharded as ``weight``) or None.
        indices: ``[N, K]`` int64 in ``[0, V)``, or None.
        logits_dtype: the head's output dtype (None = the projection's); projection_dtype:
            autocast's, the operands cast to it first (None = no cast).
        transform: the head's own scale (:class:`compile_pass.op.kernels.HeadScale`).
        temperature: a number or a ``[N]`` / 0-d floating tensor, never differentiated (None =
            none); ``temperature_multiplies``: multiply instead of divide.
        statistics_dtype: the dtype of ``z``; None = ``logits_dtype``.
        row_statistics: False: only ``selected``, from the gathered weight rows (no vocabulary
            walk); the others empty ``[0]``.
        maximum_only: only ``max`` / ``argmax`` (and ``selected``), no exponential; ``lse``,
            ``entropy`` and ``row_sum`` empty ``[0]`` (a sharded head computes them all).
        chunk_size, chunk_bytes: the tiles, as :func:`compile_pass.op.loss.linear_cross_entropy`.

    Returns:
        :class:`RowStatistics`. Gradients flow to ``hidden_states``, ``weight`` and ``bias`` from
        ``selected``, ``lse``, ``entropy``, ``max`` and ``row_sum``; a backward recomputes the tiles.

    Raises:
        ValueError / TypeError: an argument of the wrong shape, dtype or type.
        NotImplementedError: a ``temperature`` tensor that requires grad; double backward.
        RuntimeError: (CPU) an index outside ``[0, V)``.
    """
    _check_arguments(hidden_states, weight, bias, indices, temperature, projection_dtype, transform,
                     logits_dtype=logits_dtype, statistics_dtype=statistics_dtype)
    for name, flag in (("temperature_multiplies", temperature_multiplies), ("row_statistics", row_statistics),
                       ("maximum_only", maximum_only)):
        check_bool(name, flag, STATISTICS_NAME)
    for name, size in (("chunk_size", chunk_size), ("chunk_bytes", chunk_bytes)):
        check_positive_int(name, size, STATISTICS_NAME)
    vocab_parallel = None
    if is_dtensor(weight):
        mesh_dim = vocabulary_mesh_dim(weight, bias, where=STATISTICS_NAME, names=("weight", "bias"))
        vocab_parallel = (*shard_of(weight, mesh_dim), weight.shape[0])  # (vocab_start, group_name, V)
        weight, bias = weight.to_local(), None if bias is None else bias.to_local()
    if isinstance(temperature, Tensor) and temperature.dim() == 0:
        temperature = temperature.expand(hidden_states.shape[0])  # [N]
    elif temperature is not None and not isinstance(temperature, Tensor):
        temperature = float(temperature)
    logits_dtype = logits_dtype or projection_dtype or hidden_states.dtype
    return chunked_statistics(
        hidden_states, weight, bias, indices, temperature, projection_dtype=projection_dtype,
        vocab_parallel=vocab_parallel, logits_dtype=logits_dtype, statistics_dtype=statistics_dtype or logits_dtype,
        transform=transform, temperature_multiplies=temperature_multiplies, row_statistics=row_statistics,
        maximum_only=maximum_only, chunk_size=chunk_size, chunk_bytes=chunk_bytes)


def chunked_statistics(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    indices: Tensor | None,
    temperature: float | Tensor | None,
    *,
    logits_dtype: torch.dtype,
    statistics_dtype: torch.dtype,
    transform: HeadScale | None = None,
    temperature_multiplies: bool = False,
    row_statistics: bool = True,
    maximum_only: bool = False,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    projection_dtype: torch.dtype | None = None,
    vocab_parallel: tuple[int, str, int] | None = None,
) -> RowStatistics:
    """:func:`linear_statistics` after its checks, traceable with FX proxies (as
    :func:`compile_pass.op.loss.chunked_cross_entropy`): ``temperature`` a number, a ``[N]``
    tensor or None; ``logits_dtype`` / ``statistics_dtype`` resolved; ``vocab_parallel``:
    ``(vocab_start, group_name, V)`` of a vocabulary shard (``weight`` / ``bias`` this rank's),
    None = the whole head; the others as :func:`linear_statistics` takes them."""
    number = temperature is None or isinstance(temperature, numbers.Real)
    scale_tensor, scale_options = (  # HeadScale() made here: Dynamo cannot wrap a default's instance
        HeadScale() if transform is None else transform).op_arguments()
    arguments = dict(
        logits_dtype=logits_dtype, statistics_dtype=statistics_dtype, temperature_value=temperature if number else None,
        temperature_multiplies=temperature_multiplies, row_statistics=row_statistics,
        maximum_only=maximum_only and vocab_parallel is None, chunk_size=chunk_size, chunk_bytes=chunk_bytes,
        **scale_options)
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    if indices is None and not row_statistics:  # nothing to compute
        empty = hidden_states.new_empty(0, dtype=accumulate_dtype(statistics_dtype))
        return RowStatistics(None, empty, empty, empty, empty.long(), empty)
    inputs = (hidden_states, weight, bias, indices, None if number else temperature, scale_tensor)
    if vocab_parallel is None:
        selected, lse, entropy, row_max, argmax, _, _, row_sum = torch.ops.chunkce.linear_statistics.default(
            *inputs, **arguments)
    else:
        vocab_start, group_name, vocab_size = vocab_parallel
        selected, lse, entropy, row_max, argmax, row_sum = vocab_parallel_statistics(
            inputs, {**arguments, "vocab_start": vocab_start, "vocab_size": vocab_size}, group_name)
    return RowStatistics(None if indices is None else selected, lse, entropy, row_max, argmax, row_sum)


def _bad_argument(kind: type[Exception], message: str) -> None:
    raise kind(f"{STATISTICS_NAME}: {message}")


def _check_arguments(hidden_states, weight, bias, indices, temperature, projection_dtype, transform,
                     **dtypes) -> None:
    """Types, shapes, dtypes and devices (:func:`linear_statistics`' Raises)."""
    for name, value in (("hidden_states", hidden_states), ("weight", weight)):
        if not isinstance(value, Tensor):
            _bad_argument(TypeError, f"expected {name} to be a Tensor, got {type(value).__name__}")
    if hidden_states.dim() != 2 or not hidden_states.is_floating_point():
        _bad_argument(ValueError, f"expected floating hidden_states of shape [N, H], got {hidden_states.dtype} "
                                  f"{tuple(hidden_states.shape)}; flatten the leading dims first")
    (num_tokens, hidden_size), device = hidden_states.shape, hidden_states.device
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        _bad_argument(ValueError, f"expected weight of shape [V, {hidden_size}], got {tuple(weight.shape)}")
    vocab_size = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (vocab_size,)):
        _bad_argument(ValueError, f"expected bias of shape [{vocab_size}] or None, got "
                                  f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and projection_dtype is None and value.dtype != hidden_states.dtype:
            _bad_argument(TypeError, f"expected {name} of dtype {hidden_states.dtype} (the hidden states'), got "
                                     f"{value.dtype}; pass projection_dtype= to cast them")
    if indices is not None:
        if not isinstance(indices, Tensor) or indices.dtype != torch.int64 or indices.dim() != 2 \
                or indices.shape[0] != num_tokens:
            got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, Tensor) else type(indices).__name__
            _bad_argument(ValueError, f"expected indices of dtype torch.int64 and shape [{num_tokens}, K], got {got}")
    if isinstance(temperature, Tensor):
        if not temperature.is_floating_point() or tuple(temperature.shape) not in ((), (num_tokens,)):
            _bad_argument(ValueError, f"expected a floating temperature of shape [{num_tokens}] or [], got "
                                      f"{temperature.dtype} {tuple(temperature.shape)}")
        if temperature.requires_grad and torch.is_grad_enabled():
            _bad_argument(NotImplementedError,
                          "a temperature that requires grad is not supported; pass temperature.detach()")
    elif temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)):
        _bad_argument(TypeError,
                      f"expected temperature to be a number, a tensor or None, got {type(temperature).__name__}")
    for name, dtype in (("projection_dtype", projection_dtype), *dtypes.items()):
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            _bad_argument(TypeError, f"expected {name} to be a floating torch.dtype or None, got {dtype!r}")
    if not isinstance(transform, HeadScale):
        _bad_argument(TypeError, f"expected transform to be a HeadScale, got {type(transform).__name__}")
    for name, value in (("weight", weight), ("bias", bias), ("indices", indices), ("temperature", temperature)):
        if isinstance(value, Tensor) and value.device != device:
            _bad_argument(ValueError, f"expected {name} on {device} (the hidden states' device), got {value.device}")


STATISTICS_NAME = "chunkce.linear_statistics"  # how the op names itself in messages
UNFUSED = "the unfused F.linear and torch's logsumexp / softmax / gather"
TENSORS = (
    Argument("hidden_states", "Tensor"), Argument("weight", "Tensor"), Argument("bias", "Tensor?"),
    Argument("indices", "Tensor?"), Argument("temperature", "Tensor?"), Argument(*HeadScale.TENSOR_ARGUMENT),
)
STATISTICS = tuple(Argument(name, "Tensor") for name in ("row_max", "row_log_sum", "row_mean", "argmax"))
STATISTICS_OPTIONS = (
    Argument("logits_dtype", "ScalarType"), Argument("statistics_dtype", "ScalarType"), *SCALE_OPTIONS,
    Argument("temperature_value", "float?", None),
    Argument("temperature_multiplies", "bool", False), Argument("row_statistics", "bool", True),
    Argument("maximum_only", "bool", False), Argument("chunk_size", "SymInt?", None),
    Argument("chunk_bytes", "SymInt?", None), Argument("vocab_start", "SymInt", 0),
    Argument("vocab_size", "SymInt?", None),
)
GRADS = tuple(Argument(f"grad_{name}", "Tensor?") for name in ("selected", "lse", "entropy", "max", "sum"))
STATISTICS_FORWARD_SCHEMA = OpSchema("chunkce::linear_statistics", TENSORS, returns=8, options=STATISTICS_OPTIONS)
STATISTICS_BACKWARD_SCHEMA = OpSchema("chunkce::linear_statistics_backward", (*GRADS, *TENSORS, *STATISTICS),
                                      returns=3, own=(OUTPUT_MASK,), options=STATISTICS_OPTIONS)


STATISTICS_DEFAULTS = option_defaults(STATISTICS_OPTIONS)


def _check_indices(indices: Tensor | None, vocab_size: int) -> None:
    """Raise (CPU) or device-assert (no host sync) on an index outside ``[0, V)``."""
    if indices is not None and indices.numel():
        in_range = (indices >= 0) & (indices < vocab_size)
        _assert_async(in_range.all(), f"{STATISTICS_NAME}: expected every index in [0, {vocab_size})")


@STATISTICS_FORWARD_SCHEMA.custom_op
def _linear_statistics_op(hidden_states: Tensor, weight: Tensor, bias: Tensor | None, indices: Tensor | None,
                          temperature: Tensor | None, logit_scale_tensor: Tensor | None,
                          **arguments) -> tuple[Tensor, ...]:
    """``(selected [N, K], lse, entropy, max, argmax, row_log_sum, row_mean, row_sum)`` (module
    docstring); with ``row_statistics=False`` the last seven are empty ``[0]``."""
    arguments = {**STATISTICS_DEFAULTS, **arguments}
    vocab_start, vocab_size = arguments["vocab_start"], arguments["vocab_size"]
    _check_indices(indices, weight.shape[0] if vocab_size is None else vocab_size)
    with loops.op_body(hidden_states, weight, logit_scale_tensor, arguments) as op_call:
        if arguments["row_statistics"]:
            return statistics_loops.statistics_walk(op_call, hidden_states, weight, bias, indices, temperature,
                                                    vocab_start)
        selected = statistics_loops.selected_forward(op_call, hidden_states, weight, bias, indices, temperature,
                                                     vocab_start)
        return (selected, *_empty_statistics(selected))


def _empty_statistics(like: Tensor) -> tuple[Tensor, ...]:
    empty = like.new_empty(0)
    return empty, empty.clone(), empty.clone(), empty.long(), empty.clone(), empty.clone(), empty.clone()


@_linear_statistics_op.register_fake
def _(hidden_states, weight, bias, indices, temperature, logit_scale_tensor, **arguments):
    arguments = {**STATISTICS_DEFAULTS, **arguments}
    accumulate = accumulate_dtype(arguments["statistics_dtype"])
    num_tokens = hidden_states.shape[0]
    num_indices = 0 if indices is None else indices.shape[1]
    selected = hidden_states.new_empty(num_tokens, num_indices, dtype=accumulate)
    if not arguments["row_statistics"]:
        return (selected, *_empty_statistics(selected))
    lse, entropy, row_max, row_log_sum, row_mean, row_sum = (
        hidden_states.new_empty(0 if arguments["maximum_only"] and k != 2 else num_tokens, dtype=accumulate)
        for k in range(6))
    argmax = hidden_states.new_empty(num_tokens, dtype=torch.int64)
    return selected, lse, entropy, row_max, argmax, row_log_sum, row_mean, row_sum


@STATISTICS_BACKWARD_SCHEMA.custom_op
def _linear_statistics_backward_op(grad_selected: Tensor | None, grad_lse: Tensor | None,
                                   grad_entropy: Tensor | None, grad_max: Tensor | None, grad_sum: Tensor | None,
                                   hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                                   indices: Tensor | None, temperature: Tensor | None,
                                   logit_scale_tensor: Tensor | None, row_max: Tensor, row_log_sum: Tensor,
                                   row_mean: Tensor, argmax: Tensor, **arguments) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. hidden_states ``[N, H]``, weight ``[V_local, H]``, bias ``[V_local]`` (each in
    its parameter's dtype; empty where ``output_mask`` does not ask) of the given output gradients
    (accumulate dtype; None: no term), from the forward's ``[N]`` statistics."""
    output_mask = arguments.pop("output_mask")
    arguments = {**STATISTICS_DEFAULTS, **arguments}
    vocab_start = arguments["vocab_start"]
    with loops.op_body(hidden_states, weight, logit_scale_tensor, arguments) as op_call:
        return statistics_loops.statistics_gradients(
            op_call, (grad_selected, grad_lse, grad_entropy, grad_max, grad_sum), hidden_states, weight, bias, indices,
            temperature, (row_max, row_log_sum, row_mean, argmax), output_mask, vocab_start)


@_linear_statistics_backward_op.register_fake
def _(grad_selected, grad_lse, grad_entropy, grad_max, grad_sum, hidden_states, weight, bias, *rest, **arguments):
    return fake_gradients(hidden_states, weight, bias, arguments["output_mask"])


def backward(grads: tuple, saved: tuple[Tensor, ...], arguments: dict[str, Any],
             needs_input_grad: tuple[bool, ...]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward op's gradients of ``hidden_states``, ``weight``, ``bias`` (None where not
    needed, or where no output gradient is given): ``saved`` are the forward op's six tensors and
    its ``(row_max, row_log_sum, row_mean, argmax)``; shared with the vocabulary-parallel op."""
    want = list(needs_input_grad[:3])
    if not arguments.get("row_statistics", True):  # lse, entropy, max, argmax, row_sum are empty
        grads = (grads[0], None, None, None, None)
    elif arguments.get("maximum_only", False):  # lse, entropy and row_sum were not computed (empty): no term
        grads = (grads[0], None, None, grads[3], None)
    if all(grad is None for grad in grads) or not any(want):
        return None, None, None
    gradients = torch.ops.chunkce.linear_statistics_backward(*grads, *saved, output_mask=want, **arguments)
    return tuple(grad if wanted else None for grad, wanted in zip(gradients, want))


def _linear_statistics_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, _, _, row_max, argmax, row_log_sum, row_mean, _ = output
    ctx.mark_non_differentiable(argmax, row_log_sum, row_mean)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs, row_max, row_log_sum, row_mean, argmax)
    ctx.arguments = keyword_only_inputs
    ctx.num_inputs = len(inputs)


def _linear_statistics_backward(ctx, grad_selected, grad_lse, grad_entropy, grad_max, _argmax, _row_log_sum,
                                _row_mean, grad_sum):
    grads = (grad_selected, grad_lse, grad_entropy, grad_max, grad_sum)
    grad_hidden, grad_weight, grad_bias = backward(grads, ctx.saved_tensors, ctx.arguments, ctx.needs_input_grad)
    return input_grads(ctx, {0: grad_hidden, 1: grad_weight, 2: grad_bias})


_linear_statistics_op.register_autograd(_linear_statistics_backward, setup_context=_linear_statistics_setup_context)
_linear_statistics_backward_op.register_autograd(refuse_double_backward(STATISTICS_NAME, UNFUSED),
                                                 setup_context=lambda ctx, inputs, keyword_only_inputs, output: None)


PARALLEL_STATISTICS_NAME = "chunkce.vocab_parallel_row_statistics"
PARALLEL_STATISTICS_SCHEMA = OpSchema(
    "chunkce::vocab_parallel_row_statistics",
    (*(Argument(name, "Tensor") for name in ("selected", "lse", "entropy", "max", "row_sum")), *TENSORS, *STATISTICS),
    returns=5, own=(GROUP_NAME,), options=STATISTICS_OPTIONS)


def vocab_parallel_statistics(inputs: tuple, arguments: dict[str, Any], group_name: str) -> tuple[Tensor, ...]:
    """``(selected [N, K], lse, entropy, max, argmax, row_sum)`` of the whole vocabulary on every rank;
    ``inputs`` / ``arguments`` as ``chunkce::linear_statistics`` takes them (this rank's shard,
    ``vocab_start``, the global ``vocab_size``). Traceable."""
    hidden_states, weight, bias, indices, temperature, scale_tensor = inputs
    selected, lse, entropy, local_max, local_argmax, local_log_sum, local_mean, row_sum = torch.ops.chunkce.linear_statistics.default(
        hidden_states.detach(), weight.detach(), None if bias is None else bias.detach(), indices, temperature,
        scale_tensor, **arguments)
    if not arguments["row_statistics"]:
        selected = all_reduce(selected, "sum", group_name)
        statistics = (local_max, local_log_sum, local_mean, local_argmax)  # empty
    else:
        row_max = all_reduce(local_max, "max", group_name)  # [N]
        shift, local_shift = kernels.row_shift(row_max), kernels.row_shift(local_max)
        share = torch.exp(local_log_sum + local_shift - shift)  # [N] w_r
        shifted = torch.where(share > 0.0, share * (local_mean + local_shift - shift), 0.0)  # [N]
        parts = [share.unsqueeze(1), shifted.unsqueeze(1), row_sum.unsqueeze(1), selected]
        sums = all_reduce(torch.cat(parts, dim=1), "sum", group_name)
        lse, entropy, row_log_sum, row_mean = kernels.finish(row_max, sums[:, 0], sums[:, 1])
        row_sum, selected = sums[:, 2], sums[:, 3:]  # [N], [N, K]
        candidates = torch.where(local_max == row_max, local_argmax, arguments["vocab_size"])
        argmax = all_reduce(candidates, "min", group_name)  # [N] the first column of the maximum
        statistics, local_max = (row_max, row_log_sum, row_mean, argmax), row_max
    selected, lse, entropy, row_max, row_sum = torch.ops.chunkce.vocab_parallel_row_statistics.default(
        selected, lse, entropy, local_max, row_sum, *inputs, *statistics, group_name=group_name, **arguments)
    return selected, lse, entropy, row_max, statistics[3], row_sum


@PARALLEL_STATISTICS_SCHEMA.custom_op
def _parallel_statistics_op(selected: Tensor, lse: Tensor, entropy: Tensor, max: Tensor, row_sum: Tensor, *tensors,
                            **arguments) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The global ``selected``, ``lse``, ``entropy``, ``max`` and ``row_sum`` copied; then
    ``chunkce::linear_statistics``' tensors (this rank's shard), the global ``row_max``,
    ``row_log_sum``, ``row_mean`` and ``argmax``, the group, and the options."""
    return selected.clone(), lse.clone(), entropy.clone(), max.clone(), row_sum.clone()


@_parallel_statistics_op.register_fake
def _(selected, lse, entropy, max, row_sum, *tensors, **arguments):
    return tuple(torch.empty_like(value) for value in (selected, lse, entropy, max, row_sum))


def _parallel_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs[5:])  # the six tensors, then the four statistics
    arguments = dict(keyword_only_inputs)
    ctx.group_name = arguments.pop("group_name")
    ctx.arguments = arguments
    ctx.num_inputs = len(inputs)


def _parallel_backward(ctx, grad_selected, grad_lse, grad_entropy, grad_max, grad_sum):
    grad_hidden, grad_weight, grad_bias = backward(
        (grad_selected, grad_lse, grad_entropy, grad_max, grad_sum), ctx.saved_tensors, ctx.arguments,
        ctx.needs_input_grad[5:8])
    if grad_hidden is not None:
        grad_hidden = all_reduce(grad_hidden, "sum", ctx.group_name)  # every shard's terms
    return input_grads(ctx, {5: grad_hidden, 6: grad_weight, 7: grad_bias})


_parallel_statistics_op.register_autograd(_parallel_backward, setup_context=_parallel_setup_context)
