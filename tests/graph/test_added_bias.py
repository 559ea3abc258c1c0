"""A ``[V]`` / ``[1, ..., 1, V]`` tensor added to the projection's output (HF's
``final_logits_bias``, a ``[1, V]`` buffer, in BART, mBART, Marian, Pegasus...) is the op's
bias (compile_pass/graph/projection.py): rewritten, equal to stock compile in loss, every
gradient and the returned logits. An added tensor that varies per token or per row, one
that widens the logits' shape or dtype, and a second bias on a linear that has one stay
refused, bit for bit stock.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from builders import OP
from rewrite_proof import GraphCopies, compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from compile_pass.graph.returned_logits import STAND_IN

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 23


class Head(nn.Module):
    """``logits = h @ W.T`` (``spelling``), plus ``added`` (a buffer, or a parameter when
    ``trained``); the loss of the logits, and the logits when ``returns_logits``."""

    def __init__(self, added_shape, spelling="linear", trained=False, dtype=torch.float32, returns_logits=False):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(V, H) * 0.2)
        self.bias = nn.Parameter(torch.randn(V) * 0.1)
        added = torch.randn(added_shape, dtype=dtype)
        if trained:
            self.added = nn.Parameter(added)
        else:
            self.register_buffer("added", added)
        self.spelling, self.returns_logits = spelling, returns_logits

    def forward(self, h, y):
        if self.spelling == "linear":  # BART's: lm_head(h) + self.final_logits_bias.to(device)
            logits = F.linear(h, self.weight) + self.added.to(h.device)
        elif self.spelling == "matmul_reversed":
            logits = self.added + h @ self.weight.T
        elif self.spelling == "in_place":
            logits = h @ self.weight.T
            logits += self.added
        else:  # "two_biases": a linear with its own bias, then another one
            logits = F.linear(h, self.weight, self.bias) + self.added
        loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
        return (loss, logits) if self.returns_logits else loss


def inputs():
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, V, (B, T), generator=gen)
    y[0, 0] = -100
    return torch.randn(B, T, H, generator=gen).requires_grad_(), y


@pytest.mark.parametrize("shape,spelling,trained", [
    ((1, V), "linear", False), ((1, V), "linear", True), ((V,), "linear", False),
    ((1, 1, V), "matmul_reversed", True), ((1, V), "in_place", False),
], ids=["buffer_1v", "parameter_1v", "buffer_v", "parameter_11v_reversed", "in_place_1v"])
def test_an_added_bias_is_the_ops_bias_and_matches_stock(shape, spelling, trained):
    recorder, _ = compare_with_stock(Head(shape, spelling, trained), *inputs())
    recorder.assert_rewritten(B * T, V)
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["sites_refused"] == 0


def test_logits_returned_beside_an_added_bias_are_lazy_and_equal_stocks():
    graphs = GraphCopies()
    model = Head((1, V), trained=True, returns_logits=True)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": graphs})
    stock = torch.compile(Head((1, V), trained=True, returns_logits=True), backend="aot_eager")
    (loss, logits), (expected_loss, expected_logits) = compiled(*inputs()), stock(*inputs())
    (graph,) = graphs.training()
    assert [n for n in graph.nodes if n.target is OP] != []
    logits_like = [n for n in graph.nodes if isinstance(v := n.meta.get("example_value"), torch.Tensor)
                   and v.numel() == B * T * V]
    assert [n.meta.get(STAND_IN) is not None for n in logits_like] == [True]  # only the output's stand-in
    assert type(logits) is compile_pass.LazyLogits and not logits.is_computed
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(logits, expected_logits)  # the recipe's read: the graph's own add


@pytest.mark.parametrize("shape,spelling,dtype", [
    ((B, T, V), "linear", torch.float32),  # per token
    ((B, 1, V), "linear", torch.float32),  # per row
    ((1, T, V), "linear", torch.float32),  # per position
    ((1, 1, 1, V), "linear", torch.float32),  # widens the logits to [1, B, T, V]
    ((1, V), "linear", torch.float64),  # promotes the logits to float64
    ((1, V), "two_biases", torch.float32),  # a second bias: not folded into the linear's
], ids=["per_token", "per_row", "per_position", "more_dims", "promoting", "two_biases"])
def test_other_added_tensors_stay_refused(shape, spelling, dtype):
    recorder, _ = compare_with_stock(Head(shape, spelling, dtype=dtype), *inputs(), exact=True)
    recorder.assert_untouched()
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key) == ("refused", "op_add"), record.reason
