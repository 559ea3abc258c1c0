"""The older loss spellings (compile_pass/graph/spellings/__init__.py): rewritten exactly, or refused with a reason.

    F.nll_loss(F.log_softmax(logits, -1), labels, ...)      nn.NLLLoss()(nn.LogSoftmax(-1)(logits), labels)
    -log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), reduced by mean / sum / a mask

Every case runs a training step through ``backend="chunkce"`` (inner aot_eager,
recorded) against stock aot_eager (:func:`rewrite_proof.compare_with_stock`): the
graph the inner backend got holds the op and no ``[N, V]`` tensor (the log_softmax
is gone with the logits), and the loss and every gradient equal stock's. A refused
form: no op node, the ``refused_<key>`` counter, the reason naming the cause, and the
results bit for bit stock's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from compile_pass.graph.report import LOGITS_KEPT
from compile_pass.graph.spellings.losses import NO_IGNORE_INDEX

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 23
IGNORE = -100
OP_NAME = "chunkce.linear_cross_entropy"


class Head(nn.Module):
    """An lm_head (odd vocabulary), class weights, and a loss ``loss(module, hidden, labels)``."""

    def __init__(self, loss: Callable, *, bias: bool = False, dtype: torch.dtype = torch.float32, **loss_args):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=bias, dtype=dtype)
        nn.init.normal_(self.lm_head.weight, std=0.02 * H**0.5)  # logits of std ~0.1 x |h|
        self.register_buffer("class_weight", torch.rand(V) + 0.5)
        self.nll = nn.NLLLoss(**loss_args)
        self.log_softmax = nn.LogSoftmax(dim=-1)
        self.loss = loss

    def forward(self, h, y):
        return self.loss(self, h, y)


def hidden(seed=0, dtype=torch.float32):
    return torch.randn(B, T, H, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def labels(ignored=False, seed=0):
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed + 1))
    if ignored:
        y[0, :2] = IGNORE
        y[1, -1] = IGNORE
    return y


def rewritten(model, *inputs, spelling="nll_loss", tokens=B * T, inner="aot_eager", **tolerances):
    recorder, code = compare_with_stock(model, *inputs, inner=inner, **tolerances)
    recorder.assert_rewritten(tokens, V)
    stats = counters["chunkce"]
    assert stats["sites_rewritten"] == 1 and stats["sites_refused"] == 0, dict(stats)
    (record,) = compile_pass.last_report().records
    assert record.spelling == spelling and f"rewritten  {spelling}" in str(compile_pass.last_report())
    return code


def refused(model, key, words, chunkce_logs, *inputs):
    recorder, _ = compare_with_stock(model, *(inputs or (hidden(), labels())), exact=True)
    recorder.assert_untouched()
    stats = counters["chunkce"]
    assert stats["sites_rewritten"] == 0 and stats[f"refused_{key}"] == stats["sites_refused"] == 1, dict(stats)
    (record,) = compile_pass.last_report().records
    assert record.reason_key == key and words in record.reason, record.reason
    assert any(words in r.getMessage() for r in chunkce_logs.records if r.name.startswith("compile_pass"))


# -- nll_loss(log_softmax(logits)) ------------------------------------------------------------------------------


def nll_functional(m, h, y, **kwargs):
    log_probs = F.log_softmax(m.lm_head(h), dim=-1)  # [B, T, V]
    return F.nll_loss(log_probs.view(-1, V), y.view(-1), **kwargs)


def nll_class_dim_1(m, h, y, **kwargs):  # [B, V, T] log-probs, [B, T] labels: Tensor.log_softmax, a cast
    return F.nll_loss(m.lm_head(h).float().log_softmax(-1).transpose(1, 2), y, **kwargs)


def nll_torch_log_softmax_dtype(m, h, y, weight=None, **kwargs):  # dtype= is a cast before the log_softmax
    kwargs["weight"] = None if weight is None else weight.double()  # torch wants the log-probs' dtype
    return F.nll_loss(torch.log_softmax(m.lm_head(h), -1, dtype=torch.float64).flatten(0, 1), y.flatten(), **kwargs)


def nll_shifted(m, h, y, **kwargs):  # a causal LM's shift, on the log-probs
    log_probs = F.log_softmax(m.lm_head(h), dim=-1)[:, :-1].contiguous()
    return F.nll_loss(log_probs.view(-1, V), y[:, 1:].reshape(-1), **kwargs)


NLL_FORMS = {"functional": nll_functional, "class_dim_1": nll_class_dim_1,
             "torch_log_softmax_dtype": nll_torch_log_softmax_dtype, "shifted": nll_shifted}
TOKENS = {"shifted": B * (T - 1)}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weight"])
@pytest.mark.parametrize("ignored", [False, True], ids=["all_valid", "ignored"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss_of_log_softmax_every_reduction(reduction, ignored, weighted):
    def loss(m, h, y):
        return nll_functional(m, h, y, reduction=reduction, weight=m.class_weight if weighted else None)

    rewritten(Head(loss), hidden(), labels(ignored))


@pytest.mark.parametrize("form", sorted(set(NLL_FORMS) - {"functional"}))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nll_loss_forms(form, reduction):
    def loss(m, h, y):
        return NLL_FORMS[form](m, h, y, reduction=reduction, weight=m.class_weight)

    rewritten(Head(loss, bias=True), hidden(), labels(ignored=True), tokens=TOKENS.get(form, B * T))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss_and_log_softmax_modules(reduction):
    """``nn.NLLLoss(weight=..., ignore_index=3, reduction=...)(nn.LogSoftmax(dim=-1)(logits), labels)``."""
    def loss(m, h, y):
        return m.nll(m.log_softmax(m.lm_head(h)).view(-1, V), y.view(-1))

    model = Head(loss, ignore_index=3, reduction=reduction)
    model.nll.weight = model.class_weight
    y = labels()
    y[0, 0] = 3
    rewritten(model, hidden(), y)


def test_nll_loss_nd_with_the_reduction_enum():
    """``torch._C._nn.nll_loss_nd(input, target, weight, reduction: int, ignore_index)``, as torch calls it."""
    def loss(m, h, y):
        return torch._C._nn.nll_loss_nd(F.log_softmax(m.lm_head(h), -1).view(-1, V), y.view(-1), m.class_weight,
                                        2, IGNORE)  # 2 = sum

    rewritten(Head(loss), hidden(), labels(ignored=True))


def test_nll_loss_masked_by_the_caller():
    def loss(m, h, y):
        nll = nll_functional(m, h, y.clamp(min=0), reduction="none").view(B, T)
        mask = (y != IGNORE).float()
        return (nll * mask).sum() / mask.sum()

    rewritten(Head(loss), hidden(), labels(ignored=True))


def test_bf16_head_log_softmax_in_float32():
    """``log_softmax(bf16 logits, dtype=torch.float32)``: the op upcasts where the graph did."""
    def loss(m, h, y):
        return F.nll_loss(torch.log_softmax(m.lm_head(h), -1, dtype=torch.float32).view(-1, V), y.view(-1))

    rewritten(Head(loss, dtype=torch.bfloat16), hidden(dtype=torch.bfloat16), labels(), atol=2e-2, rtol=2e-2)


def test_logits_scaled_before_the_log_softmax():
    """``log_softmax(logits / temperature)``: the scaling is the op's own logit scale."""
    def loss(m, h, y):
        return F.nll_loss(F.log_softmax(m.lm_head(h) / 0.7, dim=-1).view(-1, V), y.view(-1))

    rewritten(Head(loss), hidden(), labels(ignored=True))


def test_log_probs_with_another_user_are_kept_and_the_loss_rewritten():
    """The log-probs are also returned: they (and the logits under them) stay, the loss is the op's."""
    def loss(m, h, y):
        log_probs = F.log_softmax(m.lm_head(h), -1)
        return F.nll_loss(log_probs.view(-1, V), y.view(-1)), log_probs

    recorder, _ = compare_with_stock(Head(loss), hidden(), labels())
    assert recorder.op_count() == 1
    (record,) = compile_pass.last_report().records
    assert record.decision == "rewritten" and record.reason == LOGITS_KEPT


@pytest.mark.slow
def test_rewritten_with_inductor():
    code = rewritten(Head(lambda m, h, y: nll_functional(m, h, y, weight=m.class_weight)), hidden(),
                     labels(ignored=True), inner="inductor")
    assert OP_NAME in code
    assert "_log_softmax" not in code  # neither aten._log_softmax nor its backward


# -- -log_softmax(logits).gather(-1, labels[..., None]) ---------------------------------------------------------


def gather_method(m, h, y):  # [B, T] log p(y)
    return F.log_softmax(m.lm_head(h), dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def gather_torch(m, h, y):  # torch.gather, indexed [..., None] / [..., 0]
    return torch.gather(m.lm_head(h).log_softmax(-1), -1, y[..., None])[..., 0]


def gather_negated_first(m, h, y):  # -(-log p): the negation before the gather
    return -torch.take_along_dim(-torch.log_softmax(m.lm_head(h), 2), y[..., None], dim=-1).squeeze(-1)


def gather_shifted(m, h, y):  # shifted, on flat tokens
    log_probs = F.log_softmax(m.lm_head(h)[:, :-1], dim=-1).reshape(-1, V)
    return log_probs.gather(1, y[:, 1:].reshape(-1, 1)).squeeze(1)


def gather_shifted_index(m, h, y):  # the shift in one index: labels[:, 1:, None]
    return F.log_softmax(m.lm_head(h)[:, :-1], dim=-1).gather(-1, y[:, 1:, None]).squeeze(-1)


def gather_permuted_index(m, h, y):  # an index made some other way, [B, T, 1]: squeezed
    return F.log_softmax(m.lm_head(h), -1).gather(-1, y.unsqueeze(0).permute(1, 2, 0)).squeeze(-1)


GATHER_FORMS = {"method": gather_method, "torch_gather": gather_torch, "negated_first": gather_negated_first,
                "shifted": gather_shifted, "shifted_index": gather_shifted_index,
                "permuted_index": gather_permuted_index}
SHIFTED = ("shifted", "shifted_index")


def _reduce(log_p, y, reduction):
    if reduction == "mean":
        return -log_p.mean()
    if reduction == "sum":
        return -log_p.sum()
    if reduction == "masked":  # labels 0 at the masked tokens; mask from the original labels
        mask = (y != IGNORE).view_as(log_p)
        return -(log_p * mask).sum() / mask.sum()
    return -log_p


@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "masked"])
@pytest.mark.parametrize("form", sorted(GATHER_FORMS))
def test_gathered_log_probs(form, reduction):
    def loss(m, h, y):
        safe = y.clamp(min=0)  # gather has no ignore_index: masked tokens read class 0
        return _reduce(GATHER_FORMS[form](m, h, safe), y[:, 1:] if form in SHIFTED else y, reduction)

    tokens = B * (T - 1) if form in SHIFTED else B * T
    rewritten(Head(loss, bias=True), hidden(), labels(ignored=True), spelling="gather", tokens=tokens)


def test_gathered_log_probs_per_sequence():
    """DPO-style per-sequence log-probabilities: ``(log p * mask).sum(-1)``, a [B] output."""
    def loss(m, h, y):
        log_p = gather_method(m, h, y.clamp(min=0))
        return (log_p * (y != IGNORE)).sum(-1)

    rewritten(Head(loss), hidden(), labels(ignored=True), spelling="gather")


@pytest.mark.parametrize("bad", [V, -1, NO_IGNORE_INDEX], ids=["V", "minus_1", "int64_min"])
def test_gather_label_out_of_range_raises_as_stock_does(bad):
    """A gather has no ignore_index: every label outside [0, V) raises, the op's ignore_index value included."""
    model = Head(lambda m, h, y: -gather_method(m, h, y).mean())
    y = labels()
    y[1, 2] = bad
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.compile(Head(model.loss), backend="aot_eager")(hidden(), y)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    with pytest.raises(RuntimeError, match=r"expected every target in \[0, 23\)") as raised:
        compiled(hidden(), y)
    assert "ignore_index" not in str(raised.value)  # a gather has none to name
    assert counters["chunkce"]["sites_rewritten"] == 1


@pytest.mark.parametrize("bad", [-1, -100, V, 3 * V + 2], ids=["minus_1", "minus_100", "V", "3V_plus_2"])
def test_take_along_dim_wraps_labels_as_stock_does(bad):
    """take_along_dim checks no index: it reads class ``index % V`` (torch._refs), so labels such as
    -100 left in the index and masked out after the gather give stock's loss and gradients (they
    raised in the op before), and an unmasked one reads the wrapped class, as stock."""
    def loss(m, h, y):
        log_p = torch.take_along_dim(F.log_softmax(m.lm_head(h), -1), y[..., None], dim=-1).squeeze(-1)
        mask = y != bad
        return -(log_p * mask).sum() / mask.sum() - 0.5 * log_p[0, 0]  # token (0, 0) read unmasked

    y = labels()
    y[0, 0] = y[1, 2] = bad
    rewritten(Head(loss, bias=True), hidden(), y, spelling="gather")


# -- refused spellings ------------------------------------------------------------------------------------------


REFUSED = {
    "log_of_softmax": (lambda m, h, y: F.nll_loss(torch.log(torch.softmax(m.lm_head(h), -1)).view(-1, V), y.view(-1)),
                       "loss_spelling", "nll_loss: log(softmax(logits)) is not torch's log_softmax"),
    "log_softmax_dim_1": (lambda m, h, y: F.nll_loss(F.log_softmax(m.lm_head(h).transpose(1, 2), dim=1), y),
                          "loss_spelling", "nll_loss: log_softmax over dim 1 of shape (2, 23, 5)"),
    "cast_after_log_softmax": (lambda m, h, y: F.nll_loss(F.log_softmax(m.lm_head(h), -1).half().float()
                                                          .view(-1, V), y.view(-1)),
                               "loss_spelling", "log-probabilities cast from torch.float32 to torch.float16 after"),
    "gather_index_smaller": (lambda m, h, y: -F.log_softmax(m.lm_head(h), -1).gather(
                                 -1, y[:, 1:].unsqueeze(-1)).mean(),
                             "loss_spelling", "gather index of shape (2, 4, 1) for log-probabilities of shape"),
    "negated_log_probs_in_nll_loss": (lambda m, h, y: F.nll_loss(-F.log_softmax(m.lm_head(h), -1).view(-1, V),
                                                                 y.view(-1)),
                                      "op_neg", "`neg` between projection and loss is not shape/dtype-only"),
    "scaled_log_probs": (lambda m, h, y: -(F.log_softmax(m.lm_head(h), -1) * 0.5).gather(-1, y[..., None]).mean(),
                         "scale_operand", "a scaling of the log-probabilities, after the log_softmax"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_spelling_is_left_as_stock_compile_leaves_it(case, chunkce_logs):
    loss, key, words = REFUSED[case]
    refused(Head(loss), key, words, chunkce_logs)


def test_nll_loss_of_something_else_is_not_a_site():
    """nll_loss of log-probabilities that are no log_softmax of a projection (here: a table) is not a
    cross-entropy of logits: no site, nothing counted."""
    table = nn.Parameter(torch.randn(V, V).log_softmax(-1))

    def loss(m, h, y):
        return F.nll_loss(F.embedding(y.view(-1), table), y.view(-1))

    model = Head(loss)
    recorder, _ = compare_with_stock(model, hidden(), labels(), exact=True)
    recorder.assert_untouched()
    assert counters["chunkce"]["sites_found"] == 0


# -- a transformers-like model --------------------------------------------------------------------------------


class ToyCausalLM(nn.Module):
    """Embedding, one MLP block, RMSNorm, untied lm_head; the loss as older codebases wrote it."""

    def __init__(self, vocab_size=V, hidden_size=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.up = nn.Linear(hidden_size, 2 * hidden_size)
        self.down = nn.Linear(2 * hidden_size, hidden_size)
        self.norm = nn.RMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        for module in (self.embed_tokens, self.up, self.down, self.lm_head):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids, labels):
        x = self.embed_tokens(input_ids)
        x = x + self.down(F.silu(self.up(x)))
        logits = self.lm_head(self.norm(x))  # [B, T, V]
        shift_logits = logits[:, :-1, :].contiguous().float()
        shift_labels = labels[:, 1:].contiguous()
        log_probs = F.log_softmax(shift_logits, dim=-1)
        return F.nll_loss(log_probs.view(-1, log_probs.size(-1)), shift_labels.view(-1), ignore_index=IGNORE)


def test_transformers_like_model_with_nll_loss():
    ids = torch.randint(3, V, (B, 8), generator=torch.Generator().manual_seed(0))
    target = ids.clone()
    target[:, :3] = IGNORE  # a prompt
    rewritten(ToyCausalLM(), ids, target, tokens=B * 7)
