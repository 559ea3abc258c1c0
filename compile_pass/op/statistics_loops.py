"""The row-statistics op's loops: the walk over the tiles and the selected logits.

The row-statistics op's loops: the walk over ``[n, Vb]`` tiles (forward, and the recompute
backward of the dense terms), and the selected logits from the gathered weight rows
``weight[indices] [N, K, H]`` (no walk). A vocabulary shard walks its own columns; an index
outside it selects 0 and has no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_pass.op import kernel_runner, kernels, loops
from compile_pass.op.kernels import StatisticsArgs
from compile_pass.op.schema import ResolvedCall
from compile_pass.op.tiling import accumulate_dtype


def kernel_args(op_call: ResolvedCall, vocab_start: int) -> StatisticsArgs:
    """The kernels' constants for columns from ``vocab_start`` (``op_call.options``: the keywords of
    ``chunkce::linear_statistics``, :data:`compile_pass.op.statistics.STATISTICS_OPTIONS`)."""
    options = op_call.options
    return StatisticsArgs(options["logits_dtype"], options["statistics_dtype"], op_call.transform,
                          options["temperature_value"], options["temperature_multiplies"], vocab_start)


def variant(op_call: ResolvedCall, logits: Tensor, *present) -> tuple:
    """The kernels' compile key: device, dtypes, the transform's variant, whether a temperature is given, which
    optional tensors are given (``present``), never a value."""
    options = op_call.options
    temperature = None if options["temperature_value"] is None else "number"
    return (logits.device.type, logits.dtype, options["logits_dtype"], options["statistics_dtype"],
            op_call.transform.variant(), temperature, options["temperature_multiplies"],
            *(tensor is not None for tensor in present))


def statistics_walk(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                    indices: Tensor | None, temperature: Tensor | None, vocab_start: int) -> tuple[Tensor, ...]:
    """``(selected [N, K], lse, entropy, max, argmax, row_log_sum, row_mean, row_sum)`` (``[N]``
    each, ``argmax`` int64 in whole-vocabulary columns, the rest in the statistics' accumulate
    dtype; ``selected [N, 0]`` without indices) of the columns ``weight [V_local, H]`` holds. With
    the option ``maximum_only`` the tiles take no exponential: ``lse``, ``entropy``,
    ``row_log_sum``, ``row_mean`` and ``row_sum`` are empty ``[0]``."""
    maximum_only = op_call.options["maximum_only"]
    num_tokens = hidden_states.shape[0]
    accumulate = accumulate_dtype(op_call.options["statistics_dtype"])
    indices, temperature = _dense_tensor(indices), _dense_tensor(temperature)
    num_indices = None if indices is None else indices.shape[1]
    state = kernels.statistics_state(num_tokens, num_indices, hidden_states.new_empty(0, dtype=accumulate),
                                     maximum_only)
    fn_name = "maximum_forward" if maximum_only else "statistics_forward"

    def tile_kernel(logits: Tensor, start: int, end: int, block_start: int) -> None:
        index_rows = None if indices is None else indices[start:end]
        temperature_rows = None if temperature is None else temperature[start:end]
        state_rows = state.rows(start, end)
        if maximum_only:
            state_rows = (state_rows[0], state_rows[3], state_rows[4])  # row_max, argmax, selected
        kernel_runner.run(fn_name, variant(op_call, logits, index_rows, temperature_rows), op_call.eager_kernels,
                          logits, index_rows, temperature_rows, *state_rows,
                          kernel_args(op_call, vocab_start + block_start))

    loops.forward_walk(op_call, hidden_states, weight, bias, tile_kernel)
    if weight.shape[0] == 0 and not maximum_only:  # an empty shard: no tile wrote the outputs
        for output, value in zip(state[6:], kernels.finish(state.row_max, state.sum_exp, state.sum_shifted)):
            output.copy_(value)
    row_max, _, _, argmax, selected, row_sum, lse, entropy, row_log_sum, row_mean = (
        hidden_states.new_empty(0, dtype=accumulate) if tensor is None else tensor for tensor in state)
    if num_indices is None:
        selected = hidden_states.new_zeros(num_tokens, 0, dtype=accumulate)
    return selected, lse, entropy, row_max, argmax, row_log_sum, row_mean, row_sum


def statistics_gradients(op_call: ResolvedCall, grads: tuple, hidden_states: Tensor, weight: Tensor,
                         bias: Tensor | None, indices: Tensor | None, temperature: Tensor | None,
                         statistics: tuple[Tensor, ...], output_mask: list[bool],
                         vocab_start: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_hidden_states [N, H], grad_weight [V_local, H], grad_bias [V_local])`` (empty where
    ``output_mask`` does not ask) of ``grads = (grad_selected [N, K], grad_lse, grad_entropy,
    grad_max, grad_sum [N])`` (None: no term), given the forward's ``statistics = (row_max, row_log_sum,
    row_mean, argmax)`` of the whole rows. The walk runs only for a dense term."""
    grad_selected, *dense = (_dense_tensor(grad) for grad in grads)
    temperature = _dense_tensor(temperature)
    if any(grad is not None for grad in dense):
        row_max, row_log_sum, row_mean, argmax = statistics

        def tile_gradient(logits: Tensor, start: int, end: int, block_start: int) -> Tensor:
            rows = slice(start, end)
            temperature_rows = None if temperature is None else temperature[rows]
            tile_grads = [None if grad is None else grad[rows] for grad in dense]
            kernel_runner.run(
                "statistics_backward", variant(op_call, logits, temperature_rows, *tile_grads), op_call.eager_kernels,
                logits, temperature_rows, row_max[rows], row_log_sum[rows], row_mean[rows], argmax[rows],
                *tile_grads, kernel_args(op_call, vocab_start + block_start))
            return logits

        gradients = loops.backward_walk(op_call, hidden_states, weight, bias, output_mask, tile_gradient)
    else:
        gradients = _zero_gradients(hidden_states, weight, bias, output_mask)
    if grad_selected is not None and indices is not None:
        selected_backward(op_call, grad_selected, hidden_states, weight, bias, indices, temperature, vocab_start,
                          gradients)
    return gradients


def _dense_tensor(tensor: Tensor | None) -> Tensor | None:
    """The tensor with one stride pattern for the kernels: ``[N]`` as ``loops.dense_vector`` makes it,
    ``[N, K]`` contiguous (a copy where strided or expanded)."""
    if tensor is None or tensor.dim() == 1:
        return loops.dense_vector(tensor)
    return tensor.contiguous()


def _zero_gradients(hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                    output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    want_hidden, want_weight, want_bias = output_mask
    return (torch.zeros_like(hidden_states) if want_hidden else hidden_states.new_empty(0),
            torch.zeros_like(weight) if want_weight else weight.new_empty(0),
            torch.zeros_like(bias) if want_bias and bias is not None else weight.new_empty(0))


def _gathered(weight: Tensor, bias: Tensor | None, indices: Tensor, vocab_start: int):
    """``(rows [N, K, H], bias_rows [N, K] or None, owned [N, K], local [N, K])`` of the
    indices this shard holds (the others point at row 0, masked by ``owned``)."""
    local = indices - vocab_start
    owned = (local >= 0) & (local < weight.shape[0])
    local = torch.where(owned, local, 0)
    return weight[local], None if bias is None else bias[local], owned, local


def _project(hidden_states: Tensor, rows: Tensor, bias_rows: Tensor | None) -> Tensor:
    """``x [N, K]``: each row's logits at its indices, as ``F.linear`` computes them."""
    column = hidden_states.unsqueeze(-1)  # [N, H, 1]
    if bias_rows is None:
        return torch.bmm(rows, column).squeeze(-1)
    return torch.baddbmm(bias_rows.unsqueeze(-1), rows, column).squeeze(-1)


def selected_forward(op_call: ResolvedCall, hidden_states: Tensor, weight: Tensor, bias: Tensor | None,
                     indices: Tensor, temperature: Tensor | None, vocab_start: int) -> Tensor:
    """``selected [N, K]`` (accumulate dtype) from the gathered rows, 0 at an index this shard
    does not hold."""
    accumulate = accumulate_dtype(op_call.options["statistics_dtype"])
    if weight.shape[0] == 0:  # a shard of no rows
        return hidden_states.new_zeros(indices.shape, dtype=accumulate)
    rows, bias_rows, owned, _ = _gathered(weight, bias, indices, vocab_start)
    z = kernels.values(_project(hidden_states, rows, bias_rows), temperature,
                                  kernel_args(op_call, vocab_start))
    return torch.where(owned, z, 0.0)


def selected_backward(op_call: ResolvedCall, grad_selected: Tensor, hidden_states: Tensor, weight: Tensor,
                      bias: Tensor | None, indices: Tensor, temperature: Tensor | None, vocab_start: int,
                      gradients: tuple[Tensor, Tensor, Tensor]) -> None:
    """Adds ``selected``'s gradient (``grad_selected [N, K]``) into ``gradients`` (the three of
    :func:`statistics_gradients`, empty where not wanted), in place: ``O(N K H)``, no ``[V, H]``
    temporary (a half-precision weight's rows sum in its own dtype; its bias's in fp32)."""
    grad_hidden, grad_weight, grad_bias = gradients
    if weight.shape[0] == 0:
        return
    rows, bias_rows, owned, local = _gathered(weight, bias, indices, vocab_start)
    logits = _project(hidden_states, rows, bias_rows)  # [N, K]
    grad = torch.where(owned, grad_selected.to(accumulate_dtype(op_call.options["statistics_dtype"])), 0.0)
    grad_logits = kernels.values_backward(grad, logits, temperature,
                                                     kernel_args(op_call, vocab_start)).to(logits.dtype)  # [N, K]
    if grad_hidden.numel():
        grad_hidden += torch.bmm(grad_logits.unsqueeze(1), rows).squeeze(1)  # [N, H]
    flat = local.flatten()  # [N K]
    accumulate = accumulate_dtype(weight.dtype)
    if grad_weight.numel():  # each product rounded once to the weight's dtype, then summed there
        products = grad_logits.unsqueeze(-1).to(accumulate) * hidden_states.unsqueeze(1).to(accumulate)  # [N, K, H]
        grad_weight.index_add_(0, flat, products.flatten(0, 1).to(grad_weight.dtype))
    if grad_bias.numel():
        grad_bias += torch.zeros_like(grad_bias, dtype=accumulate).index_add_(
            0, flat, grad_logits.flatten().to(accumulate)).to(grad_bias.dtype)
