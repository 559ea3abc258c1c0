"""An in-place bias, ``logits = h @ W.T; logits += bias`` (Cut Cross-Entropy's reference
spelling), is a projection with a bias (compile_pass/graph/projection.py): rewritten, and equal
to stock compile in loss and every gradient. Other in-place ops between the projection and
the loss stay refused, bit for bit stock: an added tensor that is not a ``[V]`` bias, a bias
added in place to logits that something else also reads, and a change of what the projection
read (compile_pass/graph/guard.py); one on a tensor the graph allocated that is none of the
head's tensors or the logits (ProphetNet fills its targets in place) is rewritten.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 23


class Head(nn.Module):
    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(V, H) * 0.2)
        self.bias = nn.Parameter(torch.randn(V) * 0.1)
        self.register_buffer("offset", torch.randn(B, T, V))
        self.loss = loss

    def forward(self, h, y):
        return self.loss(self, h, y)


def iadd_matmul(m, h, y):
    logits = h @ m.weight.T  # [B, T, V]
    logits += m.bias
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


def add__linear(m, h, y):
    logits = F.linear(h, m.weight).add_(m.bias)
    return F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="sum")


def inputs():
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, V, (B, T), generator=gen)
    y[0, 0] = -100
    return torch.randn(B, T, H, generator=gen).requires_grad_(), y


@pytest.mark.parametrize("loss", [iadd_matmul, add__linear], ids=["iadd_matmul", "add__linear"])
def test_in_place_bias_is_rewritten_and_matches_stock(loss):
    recorder, _ = compare_with_stock(Head(loss), *inputs())
    recorder.assert_rewritten(B * T, V)
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["sites_refused"] == 0


def iadd_not_a_bias(m, h, y):
    logits = h @ m.weight.T
    logits += m.offset  # [B, T, V]: an added tensor, not a bias
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


def iadd_read_before(m, h, y):
    logits = h @ m.weight.T
    unbiased = logits.sum(-1).mean()  # reads the logits before the in-place add
    logits += m.bias
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + unbiased


def add__result_unused(m, h, y):
    logits = F.linear(h, m.weight)
    logits.add_(m.bias)  # the loss reads the mutated `logits`, not add_'s result: a mutation
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


@pytest.mark.parametrize("loss,key", [(iadd_not_a_bias, "op_iadd"), (iadd_read_before, "op_iadd"),
                                      (add__result_unused, "mutation")],
                         ids=["not_a_bias", "read_before", "add__result_unused"])
def test_other_in_place_adds_stay_refused(loss, key):
    recorder, _ = compare_with_stock(Head(loss), *inputs(), exact=True)
    recorder.assert_untouched()
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key) == ("refused", key), record.reason
    assert "F.linear(h, W, b)" in record.fix and "logits += b" in record.fix, record.fix  # how to get it taken


def targets_filled_in_place(m, h, y):  # as ProphetNet's _compute_loss
    logits = h @ m.weight.T
    targets = y.new_zeros(B, T).fill_(-100)
    targets[:, 1:] = y[:, 1:]
    return F.cross_entropy(logits.view(-1, V), targets.view(-1))


def test_targets_filled_in_place_are_rewritten_and_match_stock():
    recorder, _ = compare_with_stock(Head(targets_filled_in_place), *inputs())
    recorder.assert_rewritten(B * T, V)
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["sites_refused"] == 0


# A frozen head (autograd then saves no input of the projection: changing it is legal), whose
# input is changed after the projection read it: the op would read the changed values.
def hidden_changed_after(m, h, y):
    buffer = h.clone()
    logits = F.linear(buffer, m.weight.detach())
    buffer.mul_(2.0)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + buffer.sum()


def view_of_the_hidden_changed(m, h, y):
    buffer = h.clone()
    logits = F.linear(buffer[:, :], m.weight.detach())
    buffer[:, 0] = 0.0
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + buffer.sum()


@pytest.mark.parametrize("loss", [hidden_changed_after, view_of_the_hidden_changed], ids=["hidden", "view"])
def test_a_change_of_what_the_projection_read_stays_refused(loss):
    recorder, _ = compare_with_stock(Head(loss), *inputs(), exact=True)
    recorder.assert_untouched()
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key) == ("refused", "mutation"), record.reason
