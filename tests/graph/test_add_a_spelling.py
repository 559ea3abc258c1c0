"""A spelling added as docs/design.md ("Adding a spelling") says is found and rewritten.

The toy spelling is the cross-entropy of one-hot labels, a form no built-in spelling reads:

    -(F.log_softmax(z, -1) * F.one_hot(y, V)).sum(-1)      per token, then reduced as the user wrote

It is what the documented steps make of it: a reader (the consuming node -> a ``LossCall``, or
None), a replacement (``chunked_cross_entropy``'s signature) and a ``Spelling`` of the two, added
to ``SPELLINGS``. The step's loss and every gradient equal stock compile's, the op is in the graph
with no ``[N, V]`` tensor left, and the record names the new spelling.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters
from torch.fx import Node

import compile_pass
from compile_pass.graph import spellings
from compile_pass.graph.nodes import function_of
from compile_pass.graph.spellings.call import LossCall, Spelling, StepKind
from compile_pass.graph.spellings.losses import NO_IGNORE_INDEX
from compile_pass.op.loss import chunked_cross_entropy

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 23


def read_one_hot(node: Node) -> LossCall | None:
    """``(log_softmax(z, -1) * one_hot(y, V)).sum(-1)``: the log-probability of each label."""
    if function_of(node) not in (torch.sum, torch.Tensor.sum) or node.args[1:] != (-1,) or node.kwargs:
        return None
    product = node.args[0]
    if not isinstance(product, Node) or function_of(product) not in (operator.mul, torch.mul, torch.Tensor.mul):
        return None
    log_probs, one_hot = product.args
    if function_of(log_probs) is not F.log_softmax or function_of(one_hot) is not F.one_hot:
        return None
    return LossCall(input=log_probs.args[0], target=one_hot.args[0], ignore_index=NO_IGNORE_INDEX, reduction="none",
                    spelling=ONE_HOT, class_dim=-1, inner=(product, log_probs, one_hot),
                    passes={log_probs: StepKind.LOG_SOFTMAX})


def replace_one_hot(call: LossCall, projection):
    def log_prob_of_label(hidden_states, weight, target, bias, class_weight, **options):
        return chunked_cross_entropy(hidden_states, weight, target, bias, class_weight, **options).neg()

    return log_prob_of_label


ONE_HOT = Spelling("one_hot", read_one_hot, replace_one_hot)


class OneHotLoss(nn.Linear):
    """An lm_head whose forward is the one-hot cross-entropy of its logits."""

    def forward(self, h, y):
        log_probs = F.log_softmax(super().forward(h), -1)  # [B, T, V]
        return -(log_probs * F.one_hot(y, V)).sum(-1).mean()


def model() -> OneHotLoss:
    torch.manual_seed(0)
    return OneHotLoss(H, V, bias=False)


def test_a_spelling_added_as_documented_is_rewritten(monkeypatch):
    h = torch.randn(B, T, H, generator=torch.Generator().manual_seed(0)).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    recorder, _ = compare_with_stock(model(), h, y)  # before: no spelling reads it
    recorder.assert_untouched()
    assert counters["chunkce"]["sites_found"] == 0, dict(counters["chunkce"])

    monkeypatch.setattr(spellings, "SPELLINGS", (*spellings.SPELLINGS, ONE_HOT))  # the documented line
    torch._dynamo.reset()
    recorder, _ = compare_with_stock(model(), h, y)
    recorder.assert_rewritten(B * T, V)
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.spelling) == ("rewritten", "one_hot"), record
