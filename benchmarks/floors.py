"""The matmul floors: what the op's matmuls alone cost on a shape, as autograd functions.

    loss = RecomputeFloor.apply(hidden, weight, tokens, vocab_block)   # [N, H], [V, H] -> a zero scalar
    loss.backward()                                            # hidden.grad, weight.grad: matmul results

``RecomputeFloor`` runs the four ``N x H x V`` matmuls of the recompute design
(projection; in backward its recompute, ``grad_hidden``, ``grad_weight``), tile by
tile (chunkce's tiles); ``FourMatmulFloor`` the same four on the whole ``[N, V]`` (the
"whole-shape four-matmul floor"); ``UnfusedFloor`` the three of the unfused
design on the whole ``[N, V]``.
Nothing else: no softmax, no loss, so their time is the floor a provider of that
design can approach, and ``bench_op`` reports every provider against it. The
gradients they leave are matmul results, not a loss's gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _project_tile(buffer: Tensor, rows: Tensor, block: Tensor) -> Tensor:
    """``rows @ block.T`` ([n, Vb]) written into the front of the flat ``buffer``; returns the tile."""
    tile = buffer[:rows.shape[0] * block.shape[0]].view(rows.shape[0], block.shape[0])
    return torch.mm(rows, block.t(), out=tile)


class RecomputeFloor(torch.autograd.Function):
    """The recompute design's four ``N x H x V`` matmuls and nothing else, tile by tile.

    forward: ``logits_tile = hidden_chunk @ weight_block.T`` into one ``[tokens, vocab_block]``
    buffer; backward: the same product again (the recompute), then
    ``grad_hidden_chunk += logits_tile @ weight_block`` and
    ``grad_weight_block += logits_tile.T @ hidden_chunk``, the recomputed logits standing
    in for their gradient (same shape, so the same matmul cost), vocabulary blocks outer
    as chunkce's backward walks them. Returns a zero scalar: a floor has no loss.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: int, vocab_block: int) -> Tensor:
        n, v = hidden.shape[0], weight.shape[0]
        buffer = hidden.new_empty(min(tokens, n) * min(vocab_block, v))
        for start in range(0, n, tokens):
            rows = hidden[start:start + tokens]  # [n, H]
            for vocab_start in range(0, v, vocab_block):
                block = weight[vocab_start:vocab_start + vocab_block]  # [Vb, H]
                _project_tile(buffer, rows, block)
        ctx.save_for_backward(hidden, weight)
        ctx.tiles = (tokens, vocab_block)
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        hidden, weight = ctx.saved_tensors
        (n, v), (tokens, vocab_block) = (hidden.shape[0], weight.shape[0]), ctx.tiles
        buffer = hidden.new_empty(min(tokens, n) * min(vocab_block, v))
        grad_hidden = torch.zeros_like(hidden)  # [N, H]
        grad_weight = torch.zeros_like(weight)  # [V, H]
        for vocab_start in range(0, v, vocab_block):
            block = weight[vocab_start:vocab_start + vocab_block]  # [Vb, H]
            for start in range(0, n, tokens):
                rows = hidden[start:start + tokens]  # [n, H]
                tile = _project_tile(buffer, rows, block)
                grad_hidden[start:start + tokens].addmm_(tile, block)
                grad_weight[vocab_start:vocab_start + vocab_block].addmm_(tile.t(), rows)
        return grad_hidden, grad_weight, None, None


class FourMatmulFloor(torch.autograd.Function):
    """The recompute design's four matmuls on the whole ``[N, V]``: ``logits = hidden @ weight.T``
    in forward (freed); in backward the same product again, ``grad_hidden = logits @ weight``,
    ``grad_weight = logits.T @ hidden``. The time target for chunkce: at most 1.05x this."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        logits = hidden @ weight.t()  # [N, V]
        del logits
        ctx.save_for_backward(hidden, weight)
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        hidden, weight = ctx.saved_tensors
        logits = hidden @ weight.t()  # [N, V]: the recompute
        return logits @ weight, logits.t() @ hidden


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
