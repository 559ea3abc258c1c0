"""The matmul floors: what the op's matmuls alone cost on a shape, as autograd functions.

    loss = RecomputeFloor.apply(hidden, weight, chunk_size)   # [N, H], [V, H] -> a zero scalar
    loss.backward()                                            # hidden.grad, weight.grad: matmul results

``RecomputeFloor`` runs the four ``N x H x V`` matmuls of the recompute design
(projection; in backward its recompute, ``grad_hidden``, ``grad_weight``), chunk by
chunk; ``UnfusedFloor`` the three of the unfused design on the whole ``[N, V]``.
Nothing else: no softmax, no loss, so their time is the floor a provider of that
design can approach, and ``bench_op`` reports every provider against it. The
gradients they leave are matmul results, not a loss's gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RecomputeFloor(torch.autograd.Function):
    """The recompute design's four ``N x H x V`` matmuls and nothing else, chunk by chunk.

    forward: ``logits_chunk = hidden_chunk @ weight.T`` into one ``[chunk_size, V]``
    buffer; backward: the same product again (the recompute), then
    ``grad_hidden_chunk = logits_chunk @ weight`` and
    ``grad_weight += logits_chunk.T @ hidden_chunk``, the recomputed logits standing
    in for their gradient (same shape, so the same matmul cost). Returns a zero
    scalar: a floor has no loss.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, chunk_size: int) -> Tensor:
        n, v = hidden.shape[0], weight.shape[0]
        logits_chunk = hidden.new_empty(min(chunk_size, n), v)  # [chunk_size, V]
        for start in range(0, n, chunk_size):
            rows = hidden[start:start + chunk_size]  # [c, H]
            torch.mm(rows, weight.t(), out=logits_chunk[:rows.shape[0]])
        ctx.save_for_backward(hidden, weight)
        ctx.chunk_size = chunk_size
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        hidden, weight = ctx.saved_tensors
        n, v, chunk_size = hidden.shape[0], weight.shape[0], ctx.chunk_size
        logits_chunk = hidden.new_empty(min(chunk_size, n), v)  # [chunk_size, V]
        grad_hidden = torch.empty_like(hidden)  # [N, H]
        grad_weight = torch.zeros_like(weight)  # [V, H]
        for start in range(0, n, chunk_size):
            rows = hidden[start:start + chunk_size]  # [c, H]
            chunk = logits_chunk[:rows.shape[0]]
            torch.mm(rows, weight.t(), out=chunk)
            torch.mm(chunk, weight, out=grad_hidden[start:start + chunk_size])
            grad_weight.addmm_(chunk.t(), rows)
        return grad_hidden, grad_weight, None


class UnfusedFloor(torch.autograd.Function):
    """The unfused design's three matmuls alone: ``logits = hidden @ weight.T`` ``[N, V]`` in
    forward (kept, as autograd keeps them), ``grad_hidden = logits @ weight`` and
    ``grad_weight = logits.T @ hidden`` in backward, the logits standing in for their gradient."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        logits = hidden @ weight.t()  # [N, V]
        ctx.save_for_backward(hidden, weight, logits)
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        hidden, weight, logits = ctx.saved_tensors
        return logits @ weight, logits.t() @ hidden, None
