"""Row statistics of a vocabulary-sharded (tensor-parallel) head: each rank walks its shard and
the statistics are combined by one all-reduce max and one sum (every rank gets the global
values); the combination and its gradient: docs/op.md, "Row statistics".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compile_pass.op import statistics_kernels, statistics_ops
from compile_pass.op.custom_ops import input_grads
from compile_pass.op.statistics_ops import OPTIONS, STATISTICS, TENSORS
from compile_pass.op.vocab_parallel_ops import all_reduce

PARALLEL_NAME = "chunkce.vocab_parallel_row_statistics"
ROW_STATISTICS_SCHEMA = (f"(Tensor selected, Tensor lse, Tensor entropy, Tensor max, {TENSORS}, {STATISTICS}, *, "
                         f"str group_name, {OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)")


def vocab_parallel_statistics(inputs: tuple, arguments: dict[str, Any], group_name: str) -> tuple[Tensor, ...]:
    """``(selected [N, K], lse, entropy, max, argmax)`` of the whole vocabulary on every rank;
    ``inputs`` / ``arguments`` as ``chunkce::linear_statistics`` takes them (this rank's shard,
    ``vocab_start``, the global ``vocab_size``). Traceable."""
    hidden_states, weight, bias, indices, temperature, scale_tensor = inputs
    selected, lse, entropy, local_max, local_argmax, local_log_sum, local_mean = torch.ops.chunkce.linear_statistics.default(
        hidden_states.detach(), weight.detach(), None if bias is None else bias.detach(), indices, temperature,
        scale_tensor, **arguments)
    if not arguments["row_statistics"]:
        selected = all_reduce(selected, "sum", group_name)
        statistics = (local_max, local_log_sum, local_mean, local_argmax)  # empty
    else:
        row_max = all_reduce(local_max, "max", group_name)  # [N]
        shift, local_shift = statistics_kernels.row_shift(row_max), statistics_kernels.row_shift(local_max)
        share = torch.exp(local_log_sum + local_shift - shift)  # [N] w_r
        shifted = torch.where(share > 0.0, share * (local_mean + local_shift - shift), 0.0)  # [N]
        sums = all_reduce(torch.cat([share.unsqueeze(1), shifted.unsqueeze(1), selected], dim=1), "sum", group_name)
        lse, entropy, row_log_sum, row_mean = statistics_kernels.finish(row_max, sums[:, 0], sums[:, 1])
        selected = sums[:, 2:]  # [N, K]
        candidates = torch.where(local_max == row_max, local_argmax, arguments["vocab_size"])
        argmax = all_reduce(candidates, "min", group_name)  # [N] the first column of the maximum
        statistics, local_max = (row_max, row_log_sum, row_mean, argmax), row_max
    selected, lse, entropy, row_max = torch.ops.chunkce.vocab_parallel_row_statistics.default(
        selected, lse, entropy, local_max, *inputs, *statistics, group_name=group_name, **arguments)
    return selected, lse, entropy, row_max, statistics[3]


@torch.library.custom_op("chunkce::vocab_parallel_row_statistics", mutates_args=(), schema=ROW_STATISTICS_SCHEMA)
def _row_statistics_op(selected: Tensor, lse: Tensor, entropy: Tensor, max: Tensor, *tensors,
                       **arguments) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The global ``selected``, ``lse``, ``entropy`` and ``max`` copied; then
    ``chunkce::linear_statistics``' tensors (this rank's shard), the global ``row_max``,
    ``row_log_sum``, ``row_mean`` and ``argmax``, the group, and the options."""
    return selected.clone(), lse.clone(), entropy.clone(), max.clone()


@_row_statistics_op.register_fake
def _(selected, lse, entropy, max, *tensors, **arguments):
    return tuple(torch.empty_like(value) for value in (selected, lse, entropy, max))


def _parallel_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs[4:])  # the six tensors, then the four statistics
    arguments = dict(keyword_only_inputs)
    ctx.group_name = arguments.pop("group_name")
    ctx.arguments = arguments
    ctx.num_inputs = len(inputs)


def _parallel_backward(ctx, grad_selected, grad_lse, grad_entropy, grad_max):
    grad_hidden, grad_weight, grad_bias = statistics_ops.backward(
        (grad_selected, grad_lse, grad_entropy, grad_max), ctx.saved_tensors, ctx.arguments,
        ctx.needs_input_grad[4:7])
    if grad_hidden is not None:
        grad_hidden = all_reduce(grad_hidden, "sum", ctx.group_name)  # every shard's terms
    return input_grads(ctx, {4: grad_hidden, 5: grad_weight, 6: grad_bias})


_row_statistics_op.register_autograd(_parallel_backward, setup_context=_parallel_setup_context)
