"""Opt-in grads-in-forward mode: the gradients computed during forward, by their own op.

Opt-in grads-in-forward mode: ``chunkce::linear_cross_entropy_grads_in_forward`` computes,
in one walk over the token chunks, the summed loss (0-d, fp32; fp64 for fp64 logits) and its
gradients (three matmuls a chunk where the recompute op runs four); backward scales the saved
gradients in place by the upstream gradient, so a second backward through the same graph raises
``NotImplementedError``; ``torch.func`` and double backward are refused. Scalar reductions only.
Design, what it holds and when to use it: docs/op.md, "Grads-in-forward mode".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op.loops import (
    TileBuffer,
    _add_vocabulary_products,
    _backward_kernel,
    _gradient_buffer,
    _matmul_into,
    _product_scratch,
    dense_vector,
    op_body,
    walk_buffers,
    walk_token_chunk,
)
from compile_pass.op.schema import INPUTS, LOSS_NAME, OUTPUT_MASK, OpSchema, ResolvedCall
from compile_pass.op.tiling import accumulate_dtype, spans

OP_NAME = "chunkce::linear_cross_entropy_grads_in_forward"
_are_functorch_transforms_active = internals.are_functorch_transforms_active.get()
SCHEMA = OpSchema(OP_NAME, INPUTS, returns=5, own=(OUTPUT_MASK,))


def _refuse_under_transforms() -> None:
    if _are_functorch_transforms_active():
        raise NotImplementedError(
            f"{LOSS_NAME}: grads_in_forward=True is not supported under torch.func transforms "
            "(grad, vjp, vmap, ...); pass grads_in_forward=False (the recompute op supports "
            "first-order torch.func)"
        )


def grads_wanted(hidden_states: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                 grad_enabled: bool) -> list[bool] | None:
    """The op's ``output_mask``: ``[hidden_states, weight, bias]`` need a gradient (their
    ``requires_grad``: real tensors, or the fake values of a traced graph's nodes; None
    for an absent one); None, meaning the recompute op, when ``grad_enabled`` is False (the
    loss needs no gradient) or none of them needs one. The public function and the graph
    pass's rewrite both ask it."""
    if not grad_enabled:
        return None
    mask = [tensor is not None and tensor.requires_grad for tensor in (hidden_states, weight, bias)]
    return mask if any(mask) else None


def chunked_grads_in_forward(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, target: Tensor,
                             bias: Tensor | None, class_weight: Tensor | None,
                             output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop over whole rows (``op_call.tiles`` of ``Vb = V``: a row's gradient needs the
    whole row's statistics, computed in the same walk): ``total`` (0-d),
    ``grad_hidden_states [N, H]``, ``grad_weight [V, H]``, ``grad_bias [V]`` of
    ``total = sum_i loss_i``, and ``counted [N]`` bool: the tokens that are not ignored.

    ``hidden_states [N, H]``, ``weight [V, H]``, ``target [N]`` int64, ``bias [V]`` and
    ``class_weight [V]`` (or None), as :func:`compile_pass.op.loops.chunked_forward` takes
    them. ``total`` is in ``accumulate_dtype(op_call.options["logits_dtype"])``, summed as the
    recompute path sums its per-token losses (``loss[N].sum()``). A gradient that
    ``output_mask`` (``[hidden, weight, bias]``) does not ask for is an empty ``[0]``
    tensor and costs no work; ``grad_hidden_states`` is in its dtype, ``grad_weight`` and
    ``grad_bias`` in ``accumulate_dtype(weight.dtype)`` (fp32 for a half-precision
    head: backward rounds them to the parameter's dtype once, after the upstream gradient).
    """
    (num_tokens, hidden_size), vocab_size = hidden_states.shape, weight.shape[0]
    want_hidden, want_weight, want_bias = output_mask
    want_bias = want_bias and bias is not None
    target, class_weight = dense_vector(target), dense_vector(class_weight)
    accumulate = accumulate_dtype(op_call.options["logits_dtype"])
    weight_accumulate = accumulate_dtype(weight.dtype)
    state = walk_buffers(op_call, hidden_states, num_tokens)  # loss, row_max, row_log_sum [N], ...
    ones = hidden_states.new_ones(num_tokens, dtype=accumulate)  # [N] d total / d loss_i
    chunks = spans(num_tokens, op_call.tiles.tokens)
    vocab_blocks = spans(vocab_size, op_call.tiles.vocab_block)
    assert len(vocab_blocks) <= 1, "the grads-in-forward op walks whole rows"
    buffer = TileBuffer(hidden_states, chunks, vocab_blocks)
    # the weight gradient sums one product per chunk, or is a half-precision weight's: then it
    # sums in (and is returned in) an fp32 accumulator, rounded once in backward, after the
    # upstream gradient (rounded now and again then, it had 1.7x the unfused path's bf16 error)
    sums = len(chunks) > 1 or weight_accumulate != weight.dtype
    grad_hidden = _gradient_buffer(want_hidden, hidden_states, (num_tokens, hidden_size),
                                   hidden_states.dtype, zeroed=False)  # [N, H]: out= fills each chunk
    grad_weight = _gradient_buffer(want_weight, weight, (vocab_size, hidden_size), weight_accumulate,
                                   zeroed=sums or not chunks)  # [V, H]: one product is written by out=
    grad_bias = _gradient_buffer(want_bias, weight, (vocab_size,), weight_accumulate, zeroed=True)  # [V]
    scratch = _product_scratch(grad_hidden, hidden_states, chunks, hidden_size)  # [n, H]
    for start, end in chunks:
        hidden_chunk = hidden_states[start:end]  # [n, H]
        logits_chunk = walk_token_chunk(op_call, buffer, state, start, end, hidden_states, weight, target, bias,
                                        class_weight, vocab_blocks)  # [n, V]
        if want_hidden or want_weight or want_bias:
            grad_logits = _backward_kernel(op_call, logits_chunk, state.row_max[start:end],
                                           state.row_log_sum[start:end], target[start:end],
                                           class_weight, ones[start:end], 0)  # [n, V]
            del logits_chunk  # grad_logits is the same buffer, overwritten: one [n, V] a chunk
            if want_hidden:
                _add_vocabulary_products(grad_hidden[start:end], grad_logits, weight, scratch, sums=False)
            if want_weight:  # as F.linear's backward
                _matmul_into(grad_weight, grad_logits.t(), hidden_chunk, sums)
            if want_bias:
                grad_bias += grad_logits.sum(0, dtype=weight_accumulate)
            del grad_logits
    counted = target != op_call.options["ignore_index"]  # [N] bool
    return state.loss.sum(), grad_hidden, grad_weight, grad_bias, counted


@SCHEMA.custom_op
def _grads_in_forward_op(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                         class_weight: Tensor | None, logit_scale_tensor: Tensor | None, *,
                         output_mask: list[bool], **options) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``total`` (0-d, fp32; fp64 for fp64 logits): the per-token losses summed, 0 where
    ignored; its gradients w.r.t. hidden_states ``[N, H]``, weight ``[V, H]``, bias
    ``[V]`` (an empty tensor where ``output_mask`` does not ask; the weight's and bias's
    in fp32 for a half-precision head); and ``counted [N]``
    bool: the tokens that are not ignored (backward's zero gradient for the others). The
    arguments are those of ``chunkce::linear_cross_entropy``, with keyword ``output_mask``
    (``[grad_hidden_states, grad_weight, grad_bias]`` wanted), as the recompute backward op
    takes it."""
    with op_body(hidden_states, weight, logit_scale_tensor, options, target, whole_rows=True) as op_call:
        return chunked_grads_in_forward(op_call, hidden_states, weight, target, bias, class_weight, output_mask)


@_grads_in_forward_op.register_fake
def _(hidden_states, weight, target, bias, class_weight, logit_scale_tensor, *, output_mask, **options):
    want_hidden, want_weight, want_bias = output_mask
    return (
        hidden_states.new_empty((), dtype=accumulate_dtype(options["logits_dtype"])),
        torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        if want_hidden else hidden_states.new_empty(0),
        weight.new_empty(weight.shape, dtype=accumulate_dtype(weight.dtype))
        if want_weight else weight.new_empty(0),
        bias.new_empty(bias.shape, dtype=accumulate_dtype(weight.dtype))
        if want_bias and bias is not None else weight.new_empty(0),
        target.new_empty(target.shape, dtype=torch.bool),
    )


def _grads_in_forward_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, grad_hidden, grad_weight, grad_bias, counted = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias, counted)
    ctx.set_materialize_grads(False)  # no zero gradients of those four made for backward
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, counted)
    weight, bias = inputs[1], inputs[3]
    ctx.param_dtypes = (weight.dtype, weight.dtype if bias is None else bias.dtype)  # not tensors
    # the saved gradients' versions (ints): a second backward finds them moved by the first's
    # in-place scaling where a saved-tensor hook handed back the same tensors
    ctx.versions = _versions((grad_hidden, grad_weight, grad_bias))


def _versions(tensors) -> tuple[int, ...] | None:
    """The version counters of plain tensors; None while tracing (fake or functional
    tensors: a compiled graph's own checks apply there)."""
    if torch.compiler.is_compiling() or any(type(t) is not Tensor for t in tensors):
        return None
    return tuple(map(internals.version.read, tensors))


_SECOND_BACKWARD = (
    f"{LOSS_NAME}: expected one backward through a grads_in_forward=True loss, got a second one "
    "(retain_graph=True): the first backward scaled the gradients computed in forward in place "
    "and handed them over, with no copy; pass grads_in_forward=False (the recompute op supports "
    "retain_graph=True) or compute the loss again for each backward"
)


def _grads_in_forward_backward(ctx, grad_total, *_grads_of_grads):
    """``grad_total`` (0-d) times each saved gradient, in place: the saved tensors are
    returned as the gradients (no copy; autograd's accumulation takes them over), except
    a half-precision head's fp32 weight and bias accumulators, whose product is rounded
    to the parameter's dtype once.

    An ignored token's share is 0 whatever ``grad_total``, as torch's: its row of the
    hidden-state gradient, and the weight and bias gradients when every token is ignored.
    (A ``"mean"`` over no counted token hands the op ``grad_total = grad_loss / 0``, inf,
    which times the saved zeros would be nan.)

    Raises:
        NotImplementedError: double backward (``create_graph=True``: grad mode is on), or a
            second backward through the same graph (``retain_graph=True``): the first
            consumed the saved gradients. (Compiled, AOTAutograd's donated-buffer check
            refuses the second backward itself.)
    """
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{LOSS_NAME}: double backward (create_graph=True through the op) is not supported with "
            "grads_in_forward=True; compute higher-order gradients with the unfused F.linear + F.cross_entropy"
        )
    try:
        saved_hidden, saved_weight, saved_bias, counted = ctx.saved_tensors  # counted [N] bool
    except RuntimeError as error:  # autograd's own check: a saved tensor modified in place
        if "modified by an inplace operation" in str(error):
            raise NotImplementedError(_SECOND_BACKWARD) from error
        raise
    if ctx.versions is not None and _versions((saved_hidden, saved_weight, saved_bias)) != ctx.versions:
        raise NotImplementedError(_SECOND_BACKWARD)  # a saved-tensor hook handed back the same tensors
    grads = [None] * len(ctx.needs_input_grad)
    if grad_total is None:  # the loss's gradient is zero: no gradient flows
        return tuple(grads)
    want_hidden, want_weight, _, want_bias = ctx.needs_input_grad[:4]
    if want_hidden:
        grad_rows = torch.where(counted, grad_total, 0.0).unsqueeze(1)  # [N, 1]: 0 for ignored tokens
        grads[0] = saved_hidden.mul_(grad_rows)
    grad_some = torch.where(counted.any(), grad_total, 0.0)  # []: 0 when every token is ignored
    for index, wanted, saved, dtype in ((1, want_weight, saved_weight, ctx.param_dtypes[0]),
                                        (3, want_bias, saved_bias, ctx.param_dtypes[1])):
        if wanted:
            grads[index] = saved.mul_(grad_some).to(dtype)  # an fp32 accumulator rounded once
    return tuple(grads)


_grads_in_forward_op.register_autograd(_grads_in_forward_backward, setup_context=_grads_in_forward_setup_context)


def summed_loss(hidden_states: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
                class_weight: Tensor | None, scale_tensor: Tensor | None, output_mask: list[bool],
                options: Mapping[str, Any]) -> Tensor:
    """The per-token losses summed (0-d, ``accumulate_dtype(options["logits_dtype"])``),
    gradients computed now, through ``chunkce::linear_cross_entropy_grads_in_forward``.

    Traceable (reads no tensor value or metadata):
    :func:`compile_pass.op.loss.chunked_cross_entropy` calls it in place of the
    recompute op for ``"mean"`` / ``"sum"``.

    Args:
        hidden_states: ``[N, H]``; weight ``[V, H]``; target ``[N]`` int64; bias,
            class_weight ``[V]`` or None; scale_tensor: the head's 0-d scale or None.
        output_mask: ``[hidden_states, weight, bias]`` need a gradient (:func:`grads_wanted`).
        options: the op's keyword options (:func:`compile_pass.op.schema.loss_inputs`).

    Raises:
        NotImplementedError: under a ``torch.func`` transform.
    """
    _refuse_under_transforms()
    return torch.ops.chunkce.linear_cross_entropy_grads_in_forward.default(
        hidden_states, weight, target, bias, class_weight, scale_tensor, output_mask=list(output_mask), **options,
    )[0]
