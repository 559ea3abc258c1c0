"""The per-tile math of both ops (loss and row statistics) and the head's transform it applies.

Over one tile of logits ``[n, Vb]``: the loss's two kernels and the row statistics' online state.

Loss per token ``i`` (target ``y``, logits ``z`` in ``logits_dtype``, class weights ``w``,
``W = sum_c w_c``, smoothing ``eps``, ``C = V``), ATen's ``cross_entropy_loss_label_smoothing``::

    loss_i = (1 - eps) * w_y * (lse_i - z_iy) + eps / C * sum_c w_c * (lse_i - z_ic)
    d loss_i / d z_ic = ((1 - eps) * w_y + eps * W / C) * p_ic - (1 - eps) * w_y * [c == y] - eps / C * w_c

and 0 for ignored tokens. Derivation, rounding and the online log-sum-exp: docs/op.md.

The row statistics. The values of a tile (:func:`values`), ``acc =
accumulate_dtype(statistics_dtype)``::

    z = (transform.apply(x).to(logits_dtype).to(acc) / T).to(statistics_dtype).to(acc)

The online state across vocabulary blocks (``shift``: the running maximum, 0 where infinite)::

    s = sum_c exp(z_c - shift),   t = sum_c exp(z_c - shift) (z_c - shift)    (0 log 0 = 0)
    lse = shift + log s,          entropy = log s - t / s,     row_sum = sum_c z_c
    dz = p (g_lse + g_ent (t / s - (z - shift))) + g_max [c == argmax] + g_sum

with ``p = exp((z - shift) - log s)``; derivation: docs/op.md, "Row statistics". The head's
transform, ``z = (x.to(dtype) * scale).to(logits_dtype)`` (``/ scale`` when it divides), is one
:class:`HeadScale` from the graph (:mod:`compile_pass.graph.projection`) to these kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import torch
from torch import Tensor

from compile_pass.op.tiling import accumulate_dtype

Operand, Mapped = TypeVar("Operand"), TypeVar("Mapped")  # a scale: a node, a recipe input position, a tensor


class KernelArgs(NamedTuple):
    """The constants of one kernel call (all but its tensors); numbers are graph inputs (no recompile)."""

    ignore_index: int
    label_smoothing: float | None  # None: no smoothing term in the graph
    logits_dtype: torch.dtype  # the dtype the loss is computed in
    vocab_start: int  # the tile's first vocabulary column
    vocab_size: int  # V, the whole vocabulary
    transform: HeadScale  # resolved: applied to the projection before the loss

    def detached(self) -> KernelArgs:
        """These constants with the transform's tensors detached."""
        return self._replace(transform=self.transform.detached())


def _safe_target(target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``valid [n]`` and the target with ignored tokens pointed at class 0."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, 0)


def chunk_forward(
    logits: Tensor,  # [n, Vb] projection dtype: vocabulary columns [vocab_start, vocab_start + Vb)
    target: Tensor,  # [n] int64
    class_weight: Tensor | None,  # [V] (the whole vocabulary) or None
    loss: Tensor,  # [n] written: the loss of the columns seen so far
    row_max: Tensor,  # [n] the running state over the row's earlier blocks (forward_state), updated ...
    row_log_sum: Tensor,  # [n] written
    sum_exp: Tensor,  # [n]
    z_target: Tensor,  # [n]
    smooth: Tensor | None,  # [n], None without label smoothing
    args: KernelArgs,  # the tile's block is the columns [args.vocab_start, args.vocab_start + Vb)
) -> None:
    """One vocabulary block of the log-sum-exp, online across the row's blocks, in place: updates the
    running state ``row_max``, ``sum_exp``, ``z_target``, ``smooth`` (``[n]`` each in
    ``accumulate_dtype``; :func:`forward_state` starts it) and writes ``loss`` and ``row_log_sum``
    of the columns seen so far: after a row's last block ``loss`` is its per-token loss and
    ``row_max + row_log_sum`` its log-sum-exp, in two parts as ``F.log_softmax`` keeps it. A row with
    ``+inf`` or only ``-inf`` gives nan, as torch. In place, the compiled kernel stores straight into
    the walk's buffers; the row maximum is one pass of ``max(z, row_max)`` (docs/op.md, "Per-chunk kernels")."""
    ignore_index, label_smoothing, logits_dtype, vocab_start, vocab_size, transform = args
    block = logits.shape[-1]
    z = transform.apply(logits)
    z = z.to(logits_dtype).to(accumulate_dtype(logits_dtype))  # [n, Vb], fused, never stored
    new_max = torch.maximum(z, row_max.unsqueeze(1)).amax(dim=-1)  # [n]: max(row_max, amax(z))
    old_shift = torch.where(row_max == float("-inf"), 0.0, row_max)  # [n]
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)  # [n]
    shifted = z - shift.unsqueeze(1)  # [n, Vb]
    new_sum_exp = sum_exp * torch.exp(row_max - shift) + torch.exp(shifted).sum(dim=-1)  # [n]
    valid, safe_target = _safe_target(target, ignore_index)
    local = safe_target - vocab_start  # [n]: the target's column in this block
    in_block = (local >= 0) & (local < block)
    picked = z.gather(1, local.clamp(0, block - 1).unsqueeze(1)).squeeze(1)
    new_z_target = torch.where(in_block, picked, z_target)  # [n]
    new_row_log_sum = new_sum_exp.log()  # [n]
    nll = new_row_log_sum - (new_z_target - new_max)
    w = None if class_weight is None else class_weight.to(z.dtype)  # [V]
    if w is not None:
        nll = nll * w[safe_target]
    value = nll
    if label_smoothing is not None:
        if w is None:
            seen, total, block_terms = vocab_start, vocab_size, shifted.sum(dim=-1)
        else:
            seen, total = w.narrow(0, 0, vocab_start).sum(), w.sum()
            block_terms = (shifted * w.narrow(0, vocab_start, block)).sum(dim=-1)
        new_smooth = smooth + seen * (old_shift - shift) + block_terms  # [n]
        smoothing_term = total * new_row_log_sum - new_smooth  # sum_c w_c (lse - z_c) over the columns seen
        value = (1.0 - label_smoothing) * nll + (label_smoothing / vocab_size) * smoothing_term
        smooth.copy_(new_smooth)
    loss.copy_(torch.where(valid, value, 0.0))
    row_max.copy_(new_max)
    row_log_sum.copy_(new_row_log_sum)
    sum_exp.copy_(new_sum_exp)
    z_target.copy_(new_z_target)


def _buffer_rows(buffers: tuple[Tensor | None, ...], start: int, end: int) -> tuple[Tensor | None, ...]:
    """The rows ``[start, end)`` of each of a walk's buffers (None stays None), as kernels take them."""
    return tuple(None if buffer is None else buffer[start:end] for buffer in buffers)


class ForwardState(NamedTuple):
    """The forward walk's buffers, ``[N]`` each in the accumulate dtype: what :func:`chunk_forward`
    writes (``loss``, ``row_log_sum``) and the running state it carries across a row's blocks."""

    loss: Tensor
    row_max: Tensor
    row_log_sum: Tensor
    sum_exp: Tensor
    z_target: Tensor
    smooth: Tensor | None  # None without label smoothing

    rows = _buffer_rows


def forward_state(num_tokens: int, like: Tensor, smoothing: bool) -> ForwardState:
    """The state :func:`chunk_forward` takes for the rows' first blocks: ``row_max = -inf``, ``sum_exp =
    0``, ``z_target = 0``, ``smooth = 0`` (None without smoothing), ``loss`` and ``row_log_sum``
    uninitialised; ``[N]`` each in ``like``'s dtype and device, for a whole walk (a call's fills)."""
    return ForwardState(like.new_empty(num_tokens), like.new_full((num_tokens,), float("-inf")),
                        like.new_empty(num_tokens), like.new_zeros(num_tokens), like.new_zeros(num_tokens),
                        like.new_zeros(num_tokens) if smoothing else None)


def _gradient_coefficients(
    grad: Tensor,  # [n] g_i: the upstream gradient, 0 for ignored tokens
    safe_target: Tensor,  # [n] int64
    class_weight: Tensor | None,  # [V] in grad's dtype, or None
    label_smoothing: float | None,
    vocab_size: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The per-token factors of ``g_i * d loss_i / d z_ic``, ``[n]`` each: ``coef_probs``
    (times ``p_ic``), ``coef_target`` (subtracted at ``c == y``), ``coef_uniform`` (times
    ``w_c``; None without smoothing)."""
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
    """Gradient of ``sum_i grad_loss_i * loss_i`` w.r.t. one block of the chunk's logits,
    written over ``logits`` in place (``[n, Vb]``, projection dtype, rounded through
    ``logits_dtype`` and the head transform's backward as autograd rounds it).

    ``row_max`` / ``row_log_sum`` are the forward kernel's, of the whole row.
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
    # In place: a chunk's working set is one [n, Vb] buffer.
    logits.copy_(out)


class StatisticsArgs(NamedTuple):
    """The constants of one kernel call (numbers are graph inputs, as in ``kernels.KernelArgs``)."""

    logits_dtype: torch.dtype
    statistics_dtype: torch.dtype
    transform: HeadScale  # resolved
    temperature: float | None  # a number; None: none, or a per-row tensor argument
    temperature_multiplies: bool
    vocab_start: int  # the tile's first column in the whole vocabulary

    def detached(self) -> StatisticsArgs:
        return self._replace(transform=self.transform.detached())


def _temperature(temperature_rows: Tensor | None, args: StatisticsArgs, dtype: torch.dtype):
    """The temperature as the values take it: ``[n, 1]`` in ``dtype``, the number, or None."""
    return args.temperature if temperature_rows is None else temperature_rows.to(dtype).unsqueeze(-1)


def values(logits: Tensor, temperature_rows: Tensor | None, args: StatisticsArgs) -> Tensor:
    """``z [n, C]`` in ``accumulate_dtype(statistics_dtype)`` of the projection ``logits [n, C]``
    (any columns: a tile, or the gathered ``[N, K]``) and ``temperature_rows [n]`` (or None)."""
    z = args.transform.apply(logits).to(args.logits_dtype)
    accumulate = accumulate_dtype(args.statistics_dtype)
    temperature = _temperature(temperature_rows, args, accumulate)
    if temperature is not None:
        z = z.to(accumulate)
        z = z * temperature if args.temperature_multiplies else z / temperature
    return z.to(args.statistics_dtype).to(accumulate)


def values_backward(grad: Tensor, logits: Tensor, temperature_rows: Tensor | None,
                    args: StatisticsArgs) -> Tensor:
    """The gradient w.r.t. the projection ``logits [n, C]`` of ``grad [n, C]``, the gradient
    w.r.t. :func:`values`' ``z``: through each cast and the temperature, then the transform's
    backward (in the transform's dtype, else ``logits_dtype``)."""
    grad = grad.to(args.statistics_dtype)
    accumulate = accumulate_dtype(args.statistics_dtype)
    temperature = _temperature(temperature_rows, args, accumulate)
    if temperature is not None:
        grad = grad.to(accumulate)
        grad = grad * temperature if args.temperature_multiplies else grad / temperature
    return args.transform.backward(grad.to(args.logits_dtype), logits)


def row_shift(row_max: Tensor) -> Tensor:
    """``row_max`` where finite, else 0 (``torch.logsumexp``'s shift)."""
    return torch.where(row_max.abs() == float("inf"), 0.0, row_max)


class StatisticsState(NamedTuple):
    """The statistics walk's buffers, ``[N]`` each in the accumulate dtype (``argmax`` int64, ``selected
    [N, K]``): the running state :func:`statistics_forward` carries across a row's blocks (``row_max``,
    ``sum_exp`` s, ``sum_shifted`` t, ``argmax``, ``selected``, ``row_sum``) and what it writes of the
    columns seen so far (``lse``, ``entropy``, ``row_log_sum``, ``row_mean``); :func:`maximum_forward`
    takes ``row_max``, ``argmax``, ``selected`` only."""

    row_max: Tensor
    sum_exp: Tensor | None  # None: the maximum alone (no exponential)
    sum_shifted: Tensor | None
    argmax: Tensor
    selected: Tensor | None  # None without indices
    row_sum: Tensor | None
    lse: Tensor | None
    entropy: Tensor | None
    row_log_sum: Tensor | None
    row_mean: Tensor | None

    rows = _buffer_rows


def statistics_state(num_tokens: int, num_indices: int | None, like: Tensor, maximum_only: bool) -> StatisticsState:
    """The state for the rows' first blocks, ``[N]`` each in ``like``'s dtype and device, for a whole walk
    (a call's fills): ``row_max -inf``, ``s``, ``t``, ``argmax``, ``selected [N, K]`` (None without
    indices) and ``row_sum`` 0, the outputs uninitialised (each block writes them; a shard with no
    columns writes :func:`finish` of this state); with ``maximum_only`` the sums and outputs None."""
    selected = None if num_indices is None else like.new_zeros(num_tokens, num_indices)
    row_max = like.new_full((num_tokens,), float("-inf"))
    argmax = like.new_zeros(num_tokens, dtype=torch.int64)
    if maximum_only:
        return StatisticsState(row_max, None, None, argmax, selected, *(None,) * 5)
    sums = (like.new_zeros(num_tokens) for _ in range(2))
    outputs = (like.new_empty(num_tokens) for _ in range(4))
    return StatisticsState(row_max, *sums, argmax, selected, like.new_zeros(num_tokens), *outputs)


def statistics_forward(
    logits: Tensor,  # [n, Vb] projection dtype: the columns [vocab_start, vocab_start + Vb)
    indices: Tensor | None,  # [n, K] int64 (whole-vocabulary columns)
    temperature_rows: Tensor | None,  # [n]
    row_max: Tensor,  # [n] the state of the row's earlier blocks (statistics_state), updated ...
    sum_exp: Tensor,  # [n] s
    sum_shifted: Tensor,  # [n] t
    argmax: Tensor,  # [n] int64
    selected: Tensor | None,  # [n, K]
    row_sum: Tensor,  # [n]
    lse: Tensor,  # [n] written: finish's of the columns seen so far
    entropy: Tensor,
    row_log_sum: Tensor,
    row_mean: Tensor,
    args: StatisticsArgs,
) -> None:
    """One block of the online state (module docstring), in place: updates ``row_max``,
    ``sum_exp``, ``sum_shifted``, ``argmax``, ``selected``, ``row_sum`` and writes :func:`finish`'s
    four of the columns seen so far (the whole row's after its last block). A new maximum must be
    strictly larger (or the first nan) to move ``argmax``, so ties keep the first column. Written in
    place, the compiled kernel stores straight into the walk's buffers; two passes over the tile,
    the maximum's and the exponential's (with the argmax: docs/op.md, "Per-chunk kernels")."""
    z = values(logits, temperature_rows, args)  # [n, Vb], fused, never stored
    new_max, new_argmax = _maximum(z, row_max, argmax, args.vocab_start)
    old_shift, shift = row_shift(row_max), row_shift(new_max)
    rescale = torch.where(row_max == float("-inf"), 0.0, torch.exp(old_shift - shift))  # [n]
    new_selected = _selected(z, indices, selected, args.vocab_start)
    new_row_sum = row_sum + z.sum(dim=-1)
    shifted = z - shift.unsqueeze(1)  # [n, Vb]
    exp = torch.exp(shifted)
    block_sum = exp.sum(dim=-1)
    terms = shifted.mul_(exp).masked_fill_(exp == 0.0, 0.0)  # in place (eager: fewer tiles); 0 log 0 = 0
    new_sum_shifted = rescale * (sum_shifted + (old_shift - shift) * sum_exp) + terms.sum(dim=-1)
    new_sum_exp = sum_exp * rescale + block_sum
    for buffer, value in zip((lse, entropy, row_log_sum, row_mean), finish(new_max, new_sum_exp, new_sum_shifted)):
        buffer.copy_(value)
    _write_maximum(row_max, argmax, selected, new_max, new_argmax, new_selected)
    sum_exp.copy_(new_sum_exp)
    sum_shifted.copy_(new_sum_shifted)
    row_sum.copy_(new_row_sum)


def maximum_forward(
    logits: Tensor,  # [n, Vb], as statistics_forward takes it
    indices: Tensor | None,
    temperature_rows: Tensor | None,
    row_max: Tensor,  # [n] updated in place
    argmax: Tensor,  # [n] int64
    selected: Tensor | None,  # [n, K]
    args: StatisticsArgs,
) -> None:
    """:func:`statistics_forward` without the sums (no exponential): updates ``row_max``,
    ``argmax`` and ``selected`` in place."""
    z = values(logits, temperature_rows, args)  # [n, Vb]
    new_max, new_argmax = _maximum(z, row_max, argmax, args.vocab_start)
    _write_maximum(row_max, argmax, selected, new_max, new_argmax,
                   _selected(z, indices, selected, args.vocab_start))


def _write_maximum(row_max: Tensor, argmax: Tensor, selected: Tensor | None, new_max: Tensor,
                   new_argmax: Tensor, new_selected: Tensor | None) -> None:
    """The maximum kernels' state written in place (after every read of the old)."""
    row_max.copy_(new_max)
    argmax.copy_(new_argmax)
    if selected is not None:
        selected.copy_(new_selected)


def _maximum(z: Tensor, row_max: Tensor, argmax: Tensor, vocab_start: int) -> tuple[Tensor, Tensor]:
    """The row's maximum and its first column after the block ``z [n, Vb]``: a new maximum must be
    strictly larger (or the first nan) to move ``argmax``. ``max(z, row_max)`` reduced at once (one
    reduction, no ``[n]`` step between): it is larger than ``row_max`` exactly where the block's
    maximum is, and nan exactly where either is; there the block's column (:func:`_first_column`)."""
    new_max = torch.maximum(z, row_max.unsqueeze(1)).amax(dim=-1)  # [n]
    larger = (new_max > row_max) | (torch.isnan(new_max) & ~torch.isnan(row_max))
    return new_max, torch.where(larger, _first_column(z, new_max) + vocab_start, argmax)


def _first_column(z: Tensor, new_max: Tensor) -> Tensor:
    """``[n]`` int64: the first column of ``z [n, Vb]`` holding ``new_max [n]`` or, where that is nan,
    the first nan (``torch.argmax``'s, on the rows :func:`_maximum` reads: those whose maximum is
    in the block). The least matching column in float32 (exact below 2**24 columns), nan as
    ``z != z``: Inductor's CPU code reduces argmax's value-index pairs, and tests ``isnan``, about
    2.5x slower (``python -m benchmarks.tile_kernels argmax``), and the minimum joins the
    statistics kernel's exponential pass over the tile."""
    block = z.shape[-1]
    if block >= 2 ** 24:
        return torch.argmax(z, dim=-1)
    columns = torch.arange(block, device=z.device, dtype=torch.float32)  # [Vb]
    holds = (z == new_max.unsqueeze(1)) | (z != z)  # [n, Vb]
    return torch.where(holds, columns, float(block)).amin(dim=-1).long()


def _selected(z: Tensor, indices: Tensor | None, selected: Tensor | None, vocab_start: int) -> Tensor | None:
    """``selected [n, K]`` with the block's values at the indices it holds."""
    if selected is None:
        return None
    block = z.shape[-1]
    local = indices - vocab_start  # [n, K]: the columns in this block
    picked = z.gather(1, local.clamp(0, block - 1))
    return torch.where((local >= 0) & (local < block), picked, selected)


def finish(row_max: Tensor, sum_exp: Tensor, sum_shifted: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(lse, entropy, row_log_sum, row_mean)`` ``[n]`` of a row's final state: ``row_log_sum =
    log s`` and ``row_mean = t / s`` (what backward takes with ``row_max``)."""
    row_log_sum, row_mean = sum_exp.log(), sum_shifted / sum_exp
    return row_shift(row_max) + row_log_sum, row_log_sum - row_mean, row_log_sum, row_mean


def statistics_backward(
    logits: Tensor,  # [n, Vb] projection dtype: the columns [vocab_start, vocab_start + Vb)
    temperature_rows: Tensor | None,  # [n]
    row_max: Tensor,  # [n] the whole rows' (forward's): max, log s, t / s, argmax
    row_log_sum: Tensor,
    row_mean: Tensor,
    argmax: Tensor,
    grad_lse: Tensor | None,  # [n] each, accumulate dtype, or None (no term)
    grad_entropy: Tensor | None,
    grad_max: Tensor | None,
    grad_sum: Tensor | None,
    args: StatisticsArgs,
) -> None:
    """The tile's gradient (module docstring), written over ``logits`` in the projection dtype
    (through :func:`values_backward`); the caller's tile is consumed."""
    z = values(logits, temperature_rows, args)  # [n, Vb]
    shifted = z - row_shift(row_max).unsqueeze(1)
    grad = torch.zeros_like(z)
    if grad_lse is not None or grad_entropy is not None:
        probs = torch.exp(shifted - row_log_sum.unsqueeze(1))  # [n, Vb]
        if grad_lse is not None:
            grad = probs * grad_lse.unsqueeze(1)
        if grad_entropy is not None:
            term = torch.where(probs == 0.0, 0.0, probs * (row_mean.unsqueeze(1) - shifted))
            grad = grad + term * grad_entropy.unsqueeze(1)
    if grad_max is not None:
        columns = torch.arange(z.shape[-1], device=z.device) + args.vocab_start  # [Vb]
        grad = grad + torch.where(columns == argmax.unsqueeze(1), grad_max.unsqueeze(1), 0.0)
    if grad_sum is not None:  # every column of the row
        grad = grad + grad_sum.unsqueeze(1)
    logits.copy_(values_backward(grad, logits, temperature_rows, args))


@dataclasses.dataclass(frozen=True)
class HeadScale(Generic[Operand]):
    """The head's one scaling between projection and loss (Cohere's ``logit_scale``, Granite's ``logits_scaling``):
    ``logits * scale`` (``/ scale`` when ``divides``) in ``dtype`` (None: the projection's), the scale a Python
    ``number`` or a 0-d ``tensor`` (never differentiated), its node in the graph, its position among a recipe's
    inputs (:meth:`map`: one to another). ``HeadScale()`` is none. An op's flat arguments: :meth:`op_arguments`."""

    number: float | None = None
    tensor: Operand | None = None
    divides: bool = False
    dtype: torch.dtype | None = None

    # its arguments of every op's schema, (name, type, default): a tensor (positional) and keywords
    TENSOR_ARGUMENT: ClassVar[tuple] = ("logit_scale_tensor", "Tensor?")
    KEYWORD_ARGUMENTS: ClassVar[tuple] = (("logit_scale", "float?", None), ("scale_divides", "bool", False),
                                          ("scale_dtype", "ScalarType?", None))

    @property
    def is_identity(self) -> bool:
        """Whether the logits reach the loss as the projection left them (but for casts)."""
        return self.number is None and self.tensor is None

    def map(self, function: Callable[[Operand], Mapped]) -> HeadScale[Mapped]:
        """This scaling with ``function`` of its tensor (a number stays as it is)."""
        return dataclasses.replace(self, tensor=None if self.tensor is None else function(self.tensor))

    def op_arguments(self) -> tuple[Operand | None, dict[str, Any]]:
        """``(logit_scale_tensor, keywords)`` as the ops take them (a number: the float ``logit_scale``)."""
        number = None if self.number is None else float(self.number)
        return self.tensor, dict(zip((a[0] for a in self.KEYWORD_ARGUMENTS), (number, self.divides, self.dtype)))

    @staticmethod
    def from_op_arguments(tensor: Tensor | None, options: Mapping[str, Any]) -> HeadScale[Tensor]:
        """The scaling of :meth:`op_arguments` (a keyword missing: the schema's default)."""
        number, divides, dtype = (options.get(name, default) for name, _, default in HeadScale.KEYWORD_ARGUMENTS)
        return HeadScale(number, tensor, divides, dtype)

    @staticmethod
    def of(scale: float | Tensor | None, divides: bool = False, dtype: torch.dtype | None = None) -> HeadScale[Tensor]:
        """The scaling by ``scale``, a number or a 0-d tensor (None: none)."""
        tensor = isinstance(scale, Tensor)
        return HeadScale(None if tensor else scale, scale if tensor else None, divides, dtype)

    def resolve(self, projection_dtype: torch.dtype) -> HeadScale[Operand]:
        """This scaling with its dtype decided: None is ``projection_dtype``."""
        return self if self.is_identity or self.dtype is not None else dataclasses.replace(self, dtype=projection_dtype)

    def variant(self) -> tuple | None:
        """The kernels' compile key: multiply or divide, number or tensor, dtype; None: identity."""
        return None if self.is_identity else (
            "div" if self.divides else "mul", "number" if self.tensor is None else "tensor", self.dtype)

    def detached(self) -> HeadScale[Operand]:
        """This scaling with its tensor detached (what a compiled kernel takes)."""
        return self.map(Tensor.detach) if isinstance(self.tensor, Tensor) else self

    def apply(self, logits: Tensor) -> Tensor:
        """``logits [n, Vb]`` scaled, in ``dtype``, computed in ``accumulate_dtype(dtype)`` and
        rounded once, as torch's ``mul`` / ``div`` by a dimensionless operand. Resolved only."""
        if self.is_identity:
            return logits
        opmath = accumulate_dtype(self.dtype)
        scale = self.number if self.tensor is None else self.tensor.to(device=logits.device, dtype=opmath)
        x = logits.to(self.dtype).to(opmath)
        return (x / scale if self.divides else x * scale).to(self.dtype)

    def backward(self, grad: Tensor, logits: Tensor) -> Tensor:
        """The chain rule through :meth:`apply`: ``grad [n, Vb]`` to the projection ``logits``', in ``dtype``."""
        return self.apply(grad)
