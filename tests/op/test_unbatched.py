"""Unbatched input, as ``F.cross_entropy`` takes it: logits ``[V]`` and a 0-d target.

The op takes hidden states ``[H]`` (logits ``[V]``) and a 0-d target, and gives a 0-d
loss for every reduction, as torch does; the pass rewrites a loss on one token's logits
(``lm_head(h[0, 0])`` or a 1-D hidden input). Loss and every gradient against torch's
unfused ops / stock compile; the rewrite proved on the graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

from compile_pass import linear_cross_entropy

H, V = 8, 11


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label", [3, -100], ids=["label", "ignored"])
@pytest.mark.parametrize("extras", ["plain", "bias_weight_smoothing"])
def test_op_takes_unbatched_input_as_torch_does(reduction, label, extras):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(H, generator=gen).requires_grad_()
    weight = torch.randn(V, H, generator=gen).requires_grad_()
    bias = torch.randn(V, generator=gen).requires_grad_() if extras != "plain" else None
    kwargs = {"reduction": reduction}
    if extras != "plain":
        kwargs.update(weight=torch.rand(V, generator=gen) + 0.5, label_smoothing=0.1)
    target = torch.tensor(label)
    expected = F.cross_entropy(F.linear(hidden, weight, bias), target, **kwargs)
    got = linear_cross_entropy(hidden, weight, target, linear_bias=bias, **kwargs)
    assert got.shape == expected.shape == ()
    torch.testing.assert_close(got, expected, equal_nan=True)
    if expected.isnan():  # mean over no token: nan, as torch; no gradient to compare
        return
    params = [p for p in (hidden, weight, bias) if p is not None]
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(expected, params)):
        torch.testing.assert_close(a, b)


def test_op_unbatched_target_must_be_0d():
    with pytest.raises(ValueError, match=r"expected target of shape \(\)"):
        linear_cross_entropy(torch.randn(H), torch.randn(V, H), torch.tensor([3]))


class OneToken(nn.Module):
    def __init__(self, pick):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)  # a [V] bias would look like one token's logits to the proof
        self.pick = pick

    def forward(self, h, y):
        return self.pick(self, h, y)


@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
@pytest.mark.parametrize("pick", [
    lambda m, h, y: F.cross_entropy(m.lm_head(h[0, 0]), y[0, 0]),  # one token's hidden states
    lambda m, h, y: F.cross_entropy(m.lm_head(h)[1, 2].float(), y[1, 2], reduction="sum"),  # its logits
    lambda m, h, y: F.cross_entropy(m.lm_head(h[0, -1]), y[0, -1], reduction="none"),
], ids=["hidden_token", "logits_token", "none"])
def test_pass_rewrites_unbatched_loss(pick):
    gen = torch.Generator().manual_seed(1)
    h, y = torch.randn(2, 3, H, generator=gen).requires_grad_(), torch.randint(0, V, (2, 3), generator=gen)
    recorder, _ = compare_with_stock(OneToken(pick), h, y)
    recorder.assert_rewritten(1, V)
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["sites_refused"] == 0
