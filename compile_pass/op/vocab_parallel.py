"""Cross-entropy of a vocabulary-sharded (tensor-parallel) head: the loss and its custom ops.

Cross-entropy of a vocabulary-sharded (tensor-parallel) head, exact, with no ``[N, V]`` or
``[N, V_local]`` tensor on any rank: each rank walks its shard for its row statistics, all-reduces
them over ``[N]`` vectors, and backward recomputes each tile against the global ones. The
formula, step by step: docs/op.md, "A vocabulary-sharded head".

The custom ops:
Each rank of a tensor-parallel group holds one shard of the head, ``weight [V_local, H]``:
the classes ``[vocab_start, vocab_start + V_local)`` of the ``V``. Three ops, each on this
rank's shard only (the collectives between them are plain ``_c10d_functional`` calls in
:func:`compile_pass.op.vocab_parallel.sharded_loss` and in the loss op's
autograd, so Dynamo, AOTAutograd and the graph pass see them):

* ``chunkce::vocab_parallel_statistics`` walks the shard in the op's ``[n, Vb]`` tiles with
  the forward kernel (:func:`compile_pass.op.kernels.chunk_forward`, in the shard's own
  columns) and returns, per token, the shard's ``row_max``, ``sum_exp = sum_c exp(z_c -
  shift)`` (``shift``: ``row_max``, or 0 when that is ``-inf``), the target's logit when
  the target is in the shard (else 0), the smoothing sum ``sum_c w_c (z_c - shift)`` over
  the shard, and the shard's class-weight sum (0-d). Not differentiable (called on detached
  tensors).
* ``chunkce::vocab_parallel_loss`` returns a copy of the loss rows it is given (computed
  from the global statistics in plain torch); its autograd attaches the gradient: it saves
  the global ``row_max`` and ``row_log_sum`` and its backward runs
* ``chunkce::vocab_parallel_backward``: the single-device backward walk
  (:func:`compile_pass.op.loops.chunked_backward`) over the shard against the global row
  statistics, the kernel seeing each tile at its GLOBAL columns (``ResolvedCall.vocab_offset``), with
  the full ``class_weight [V]`` and the global target: a target outside the shard has no
  one-hot term here and is not ignored. It returns this rank's part of the hidden-state
  gradient (all-reduced by the loss op's autograd) and the shard's weight and bias gradients.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import kernel_runner, loops
from compile_pass.op.custom_ops import fake_gradients, input_grads, refuse_double_backward
from compile_pass.op.schema import (
    GROUP_NAME,
    INPUTS,
    LOSS_NAME,
    OUTPUT_MASK,
    ROW_LOG_SUM_EXP,
    Argument,
    OpSchema,
    ResolvedCall,
)
from compile_pass.op.tiling import accumulate_dtype

_assert_async = internals.assert_async.get()  # checks a range with no host sync
_all_reduce, _wait_tensor = internals.c10d_all_reduce.get(), internals.c10d_wait_tensor.get()


def sharded_loss(tensors: tuple[Tensor | None, ...], options: dict[str, Any], target_shape: torch.Size, *,
                 reduction: str, vocab_start: int, vocab_size: int, group_name: str) -> Tensor:
    """The global loss of a vocabulary-sharded head, the same on every rank of the group: the body
    of :func:`compile_pass.op.loss.chunked_cross_entropy` given a ``group_name``.

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
    return loops.reduce_total(loss.sum(), flat_target, class_weight, reduction, ignore_index, label_smoothing,
                              logits_dtype)


def is_dtensor(value: object) -> bool:
    """Whether ``value`` (a tensor, or a node's example value) is a ``DTensor``; never imports
    DTensor's package (no DTensor exists before it is imported, nor where torch.distributed is
    unavailable)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def vocabulary_mesh_dim(linear_weight: Tensor, linear_bias: Tensor | None, where: str = LOSS_NAME,
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
        raise ValueError(f"{LOSS_NAME}: expected {name} replicated on every mesh dimension (the same on every "
                         f"rank), got placements {tuple(value.placements)}; pass value.full_tensor()")
    return value.to_local()


VOCAB_PARALLEL_NAME = "chunkce.vocab_parallel_cross_entropy"  # how these ops name themselves in messages
SHARD = (Argument("vocab_start", "SymInt"), Argument("vocab_size", "SymInt"))  # the ops' own: the shard's place in V
_OUTSIDE = -1  # a target outside the shard (or ignored), as the forward kernel takes it: its ignore_index

STATISTICS_SCHEMA = OpSchema("chunkce::vocab_parallel_statistics", INPUTS, returns=5, own=SHARD)
LOSS_SCHEMA = OpSchema("chunkce::vocab_parallel_loss", (Argument("loss", "Tensor"), *INPUTS, *ROW_LOG_SUM_EXP),
                       returns=1, own=(*SHARD, GROUP_NAME))
VOCAB_PARALLEL_BACKWARD_SCHEMA = OpSchema("chunkce::vocab_parallel_backward",
                                          (Argument("grad_loss", "Tensor"), *INPUTS, *ROW_LOG_SUM_EXP), returns=3,
                                          own=(OUTPUT_MASK, *SHARD))


def check_global_targets(target: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise (CPU) or device-assert on a target outside ``[0, V)`` that is not ``ignore_index``."""
    in_range = ((target >= 0) & (target < vocab_size)) | (target == ignore_index)
    _assert_async(in_range.all(),
                  f"{VOCAB_PARALLEL_NAME}: expected every target in [0, {vocab_size}) or equal to ignore_index ({ignore_index})")


def _in_shard(target: Tensor, vocab_start: int, shard_size: int, ignore_index: int) -> Tensor:
    """``[N]`` bool: the target is one of this shard's classes (and not ignored)."""
    return (target >= vocab_start) & (target < vocab_start + shard_size) & (target != ignore_index)


@STATISTICS_SCHEMA.custom_op
def _statistics_op(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                   class_weight: Tensor | None, logit_scale_tensor: Tensor | None, *, vocab_start: int,
                   vocab_size: int, **options) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The shard's row statistics: ``row_max [N]``, ``sum_exp [N]``, ``z_target [N]``, ``smooth [N]``
    (``[0]`` without label smoothing) and ``weight_sum`` (0-d: the shard's class weights summed, or
    ``V_local``), in ``accumulate_dtype(logits_dtype)``.

    ``hidden_states [N, H]``, ``weight [V_local, H]`` (this rank's shard), ``target [N]`` GLOBAL
    class indices, ``bias [V_local]`` or None, ``class_weight [V]`` (full) or None, the head's
    scale tensor or None; keywords ``vocab_start`` (the shard's first class), ``vocab_size`` (V)
    and the options.
    """
    check_global_targets(target, vocab_size, options["ignore_index"])
    with loops.op_body(hidden_states, weight, logit_scale_tensor, options) as op_call:
        return shard_statistics(op_call, hidden_states, weight, target, bias, class_weight, vocab_start)


@_statistics_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, logit_scale_tensor, **options):
    accumulate = accumulate_dtype(options["logits_dtype"])
    num_tokens = hidden_states.shape[0]
    smooth = num_tokens if options["label_smoothing"] > 0.0 else 0
    return (*(hidden_states.new_empty(num_tokens, dtype=accumulate) for _ in range(3)),
            hidden_states.new_empty(smooth, dtype=accumulate), hidden_states.new_empty((), dtype=accumulate))


def shard_statistics(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, target: Tensor,
                     bias: Tensor | None, class_weight: Tensor | None,
                     vocab_start: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The statistics op's walk (see it for the tensors): for each token chunk, the forward
    kernel over the shard's vocabulary blocks, in the shard's own columns (a target outside
    the shard, or ignored, is the kernel's ``ignore_index``; its picked logit is discarded).
    Holds one ``[n, Vb]`` tile."""
    num_tokens, shard_size = hidden_states.shape[0], weight.shape[0]
    accumulate = accumulate_dtype(op_call.options["logits_dtype"])
    in_shard = _in_shard(target, vocab_start, shard_size, op_call.options["ignore_index"])  # [N]
    local_target = torch.where(in_shard, target - vocab_start, _OUTSIDE)  # [N] in the shard's columns
    local_weight = None if class_weight is None else class_weight.narrow(0, vocab_start, shard_size)  # [V_local]
    state = loops.walk_buffers(op_call, hidden_states, num_tokens)

    def tile_kernel(logits: Tensor, start: int, end: int, block_start: int) -> None:
        kernel_runner.run("chunk_forward", op_call.variant(logits, local_weight), op_call.eager_kernels,
                          logits, local_target[start:end], local_weight, *state.rows(start, end),
                          op_call.kernel_args(block_start)._replace(ignore_index=_OUTSIDE))

    loops.forward_walk(op_call, hidden_states, weight, bias, tile_kernel)
    row_max, sum_exp, z_target, smooth = state.row_max, state.sum_exp, state.z_target, state.smooth
    if smooth is None:
        smooth = hidden_states.new_empty(0, dtype=accumulate)
    z_target = torch.where(in_shard, z_target, 0.0)  # the kernel picked column 0 for the others
    if local_weight is None:
        weight_sum = hidden_states.new_full((), float(shard_size), dtype=accumulate)
    else:
        weight_sum = local_weight.to(accumulate).sum()
    return row_max, sum_exp, z_target, smooth, weight_sum


@LOSS_SCHEMA.custom_op
def _loss_op(loss: Tensor, hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
             class_weight: Tensor | None, logit_scale_tensor: Tensor | None, row_max: Tensor, row_log_sum: Tensor,
             **keywords) -> Tensor:
    """``loss [N]`` copied: the op is where the loss rows' gradient w.r.t. ``hidden_states``,
    ``weight`` and ``bias`` (this rank's shard) attaches; ``row_max`` and ``row_log_sum`` are the
    GLOBAL row statistics; keywords ``vocab_start``, ``vocab_size``, ``group_name`` (the
    tensor-parallel group, which backward all-reduces the hidden-state gradient over) and the options."""
    return loss.clone()


@_loss_op.register_fake
def _(loss, *tensors, **keywords):
    return torch.empty_like(loss)


@VOCAB_PARALLEL_BACKWARD_SCHEMA.custom_op
def _shard_backward_op(grad_loss: Tensor, hidden_states: Tensor, weight: Tensor, target: Tensor,
                       bias: Tensor | None, class_weight: Tensor | None, logit_scale_tensor: Tensor | None,
                       row_max: Tensor, row_log_sum: Tensor, *, output_mask: list[bool], vocab_start: int,
                       vocab_size: int, **options) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's part of the gradient w.r.t. ``hidden_states [N, H]`` (its shard's classes' terms;
    the sum over ranks is the gradient), and the gradients w.r.t. its ``weight [V_local, H]`` and
    ``bias [V_local]``: :func:`compile_pass.op.loops.chunked_backward` over the shard with the global
    ``row_max [N]`` and ``row_log_sum [N]``, GLOBAL ``target [N]`` and full ``class_weight [V]``."""
    if weight.shape[0] == 0:  # a rank DTensor gave no rows (V < ranks * ceil(V / ranks)): no terms
        return (torch.zeros_like(hidden_states, memory_format=torch.contiguous_format)
                if output_mask[0] else hidden_states.new_empty(0),
                torch.empty_like(weight) if output_mask[1] else weight.new_empty(0),
                weight.new_empty(0))  # the bias gradient of no rows: [0] either way
    with loops.op_body(hidden_states, weight, logit_scale_tensor, options, vocab_offset=vocab_start,
                       vocab_size=vocab_size) as op_call:  # the kernels see each tile at its global columns
        return loops.chunked_backward(op_call, grad_loss, hidden_states, weight, target, bias, class_weight,
                                      row_max, row_log_sum, output_mask)


@_shard_backward_op.register_fake
def _(grad_loss, hidden_states, weight, target, bias, class_weight, logit_scale_tensor, row_max, row_log_sum,
      *, output_mask, **keywords):
    return fake_gradients(hidden_states, weight, bias, output_mask)


def all_reduce(tensor: Tensor, op: str, group_name: str) -> Tensor:
    """``tensor`` reduced (``"sum"``, ``"max"``) over the group, waited for: the functional
    collective's two ops, which eager, FX proxies, Dynamo and AOTAutograd all take as they are."""
    return _wait_tensor(_all_reduce(tensor, op, group_name))


def _loss_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[1:])  # the six tensors, row_max, row_log_sum
    keywords = dict(keyword_only_inputs)
    ctx.group_name = keywords.pop("group_name")
    ctx.keywords = keywords  # vocab_start, vocab_size and the options
    ctx.num_inputs = len(inputs)


def _loss_backward(ctx, grad_loss):
    want_hidden, want_weight, want_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[4]
    grad_hidden, grad_weight, grad_bias = torch.ops.chunkce.vocab_parallel_backward(
        grad_loss, *ctx.saved_tensors, output_mask=[want_hidden, want_weight, want_bias], **ctx.keywords)
    return input_grads(ctx, {1: all_reduce(grad_hidden, "sum", ctx.group_name) if want_hidden else None,  # every shard's
                             2: grad_weight if want_weight else None, 4: grad_bias if want_bias else None})


_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup_context)
_shard_backward_op.register_autograd(refuse_double_backward(VOCAB_PARALLEL_NAME, "the unfused F.linear + F.cross_entropy on the gathered head"),
                                     setup_context=lambda ctx, inputs, keyword_only_inputs, output: None)
