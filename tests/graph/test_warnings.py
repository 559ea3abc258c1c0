"""Nobody loses the win without being told.

Compiled with ``backend="chunkce"`` (or Inductor with ``ChunkcePreGradPass``), a refused
site is logged at WARNING once per process for each (source line, reason key), with its
reason and its fix; a soft-capped head says it is refused by design. A graph that returns
its logits and has no cross-entropy site (a forward without labels) returns them lazy by
default, and a loss computed outside reads them fused; with ``returned_logits="keep"``, or
logits a loss the pass does not read consumes in the graph, it is logged once at WARNING
with the fix (``compile_pass.graph.find``). A rewritten site, an eval graph
(no grad) and ``compile_pass.explain`` log no warning. A repeat is logged at DEBUG.

Only where a rewrite would have saved memory: a refused site of a few
classes (a classifier's score layer, ``find.is_vocabulary`` false) is logged at INFO and
stays in the report; the refused sites above are a vocabulary's (``WIDE``).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from builders import H, Head, V
from builders import hidden_states as hidden
from builders import labels_of as labels
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from compile_pass.graph import find, report

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

WIDE = 2 * find.VOCAB_MIN  # a vocabulary the no-site rule calls one; conftest's V (23) is below it
OPTIONS = {"inner_backend": "aot_eager"}
KEEP = {**OPTIONS, "returned_logits": "keep"}  # returned logits computed in the step, as stock's


@pytest.fixture(autouse=True)
def logs(caplog):
    """Every ``compile_pass`` record from DEBUG up, in a process that has warned of nothing yet."""
    report.forget_warnings()
    caplog.set_level(logging.DEBUG, logger="compile_pass")
    return caplog


def warnings_of(logs) -> list[str]:
    return [r.getMessage() for r in logs.records if r.name.startswith("compile_pass") and r.levelno >= logging.WARNING]


def clamped(m, h, y):
    return F.cross_entropy(m.lm_head(h).clamp(-1.0, 1.0).flatten(0, -2), y.reshape(-1))


def lossy(m, h, y):
    return F.cross_entropy(m.lm_head(h).bfloat16().float().flatten(0, -2), y.reshape(-1))


def soft_capped(m, h, y):
    return F.cross_entropy((torch.tanh(m.lm_head(h) / 30.0) * 30.0).flatten(0, -2), y.reshape(-1))


def train(model, lengths=(3, 4, 5), **compile_kwargs):
    """A training step of ``model`` compiled by chunkce at each sequence length (a graph each:
    ``dynamic=False``), twice."""
    compiled = torch.compile(model, backend="chunkce", options=OPTIONS, dynamic=False, **compile_kwargs)
    vocab = model.lm_head.out_features
    for _ in range(2):
        for length in lengths:
            compiled(hidden(2, length, H), labels(2, length, vocab=vocab)).backward()
    assert counters["stats"]["unique_graphs"] == len(lengths)
    return compiled


def test_a_refused_site_warns_once_with_its_reason_and_fix(logs):
    train(Head(clamped, vocab=WIDE))
    record = compile_pass.last_report().records[0]
    assert counters["chunkce"]["refused_op_clamp"] == 3  # each graph refused and reported ...
    (message,) = warnings_of(logs)  # ... one warning
    assert message.startswith(f"chunkce: left {record.source} unfused") and message.endswith(
        f": {record.reason}; {record.fix}")
    assert "`clamp` between projection and loss" in record.reason and record.fix.startswith("fix: ")
    repeats = [r for r in logs.records if r.levelno == logging.DEBUG and r.getMessage() == message]
    assert len(repeats) == 2  # the other graphs' refusals, at DEBUG


def test_two_refused_sites_warn_once_each(logs):
    def two_losses(m, h, y):
        return clamped(m, h, y) + lossy(m, h, y)

    train(Head(two_losses, vocab=WIDE))
    messages = warnings_of(logs)
    assert len(messages) == 2, messages
    assert "`clamp` between projection and loss" in messages[0]
    assert "lossy intermediate dtype (float32 -> bfloat16 -> float32)" in messages[1]
    assert all("; fix: " in m for m in messages)


def test_a_soft_capped_head_says_it_is_refused_by_design_once(logs):
    train(Head(soft_capped, vocab=WIDE))
    (message,) = warnings_of(logs)
    assert "soft-capped logits: `tanh` between projection and loss" in message
    assert "by design: the op has no soft cap" in message and "stock compile" in message


@pytest.mark.slow
def test_a_refused_site_warns_under_the_pre_grad_pass_once(logs):
    """Inductor runs the pre-grad pass at each compile: two sequence lengths, one warning."""
    with torch._inductor.config.patch(pre_grad_custom_pass=compile_pass.ChunkcePreGradPass()):
        compiled = torch.compile(Head(clamped, vocab=WIDE), backend="inductor", dynamic=False)
        for length in (3, 4):
            compiled(hidden(2, length, H), labels(2, length, vocab=WIDE)).backward()
    assert counters["chunkce"]["refused_op_clamp"] == 2
    (message,) = warnings_of(logs)
    assert "`clamp` between projection and loss" in message and "; fix: " in message


def test_strict_still_raises():
    compiled = torch.compile(Head(clamped), backend="chunkce", options={**OPTIONS, "strict": True})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="`clamp` between projection and loss"):
        compiled(hidden(), labels())


class ReturnsLogits(nn.Module):
    """A model compiled without its loss: ``[B, T, V]`` logits of a wide vocabulary, returned."""

    def __init__(self, vocab=WIDE):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, vocab, bias=False)

    def forward(self, h):
        return self.lm_head(h)


def loss_outside(compiled, length):
    """The loss computed outside the compiled region, as a user who compiled only the model does."""
    logits = compiled(hidden(2, length, H))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels(2, length, vocab=logits.shape[-1]).reshape(-1))


def test_returned_logits_of_a_graph_without_a_loss_are_lazy_and_the_loss_outside_is_fused(logs):
    """The default: a forward without labels returns lazy logits; the loss outside reads them fused
    (equal to eager's, every gradient too), and nothing warns."""
    model = ReturnsLogits()
    eager = ReturnsLogits()
    compiled = torch.compile(model, backend="chunkce", options=OPTIONS, dynamic=False)
    logits = compiled(hidden(2, 4, H))
    assert isinstance(logits, compile_pass.LazyLogits) and not logits.is_computed
    loss = loss_outside(compiled, 4)
    expected = loss_outside(eager, 4)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, eager.lm_head.weight.grad)
    assert warnings_of(logs) == [] and counters["chunkce"]["unmatched_projections"] == 0
    assert counters["chunkce"]["logits_lazy"] == 1 and counters["chunkce"]["sites_found"] == 0


def test_a_training_graph_with_logits_kept_and_no_loss_warns_once(logs):
    compiled = torch.compile(ReturnsLogits(), backend="chunkce", options=KEEP, dynamic=False)
    for length in (3, 4, 3):
        loss_outside(compiled, length).backward()
    assert counters["chunkce"]["unmatched_projections"] == 2 and counters["chunkce"]["sites_found"] == 0
    (message,) = warnings_of(logs)
    assert "(module lm_head) projects to a vocabulary of 2048 in a training graph with no cross-entropy loss" in message
    assert "(the logits are returned by the graph)" in message
    assert "fix: compute the loss inside the compiled region" in message and "compile_pass.explain" in message


def test_a_decode_sized_training_graph_does_not_warn(logs):
    """One token per sequence (``[B, 1, V]`` logits, as a decode step's): small, returned computed,
    and no warning, though the graph has grad and no loss."""
    compiled = torch.compile(ReturnsLogits(), backend="chunkce", options=OPTIONS, dynamic=False)
    logits = compiled(hidden(2, 1, H))
    assert type(logits) is torch.Tensor and logits.shape == (2, 1, WIDE)
    logits.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert warnings_of(logs) == [] and counters["chunkce"]["unmatched_projections"] == 0


def test_an_eval_graph_with_logits_does_not_warn(logs):
    compiled = torch.compile(ReturnsLogits(), backend="chunkce", options=OPTIONS)
    with torch.no_grad():
        loss_outside(compiled, 3)
    assert counters["stats"]["unique_graphs"] == 1
    assert warnings_of(logs) == [] and counters["chunkce"]["unmatched_projections"] == 0


def test_a_loss_the_pass_does_not_read_warns(logs):
    """``logsumexp(z) - z[y]``: cross-entropy, but not a spelling the matcher reads."""
    class OwnLoss(ReturnsLogits):
        def forward(self, h, y):
            logits = self.lm_head(h).float()  # [B, T, V]
            return (logits.logsumexp(-1) - logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)).mean()

    compiled = torch.compile(OwnLoss(), backend="chunkce", options=OPTIONS)
    compiled(hidden(), labels(vocab=WIDE)).backward()
    (message,) = warnings_of(logs)
    assert "(the logits are normalised by `logsumexp`)" in message


def test_a_graph_break_between_head_and_loss_is_fused_by_the_lazy_logits(logs):
    """The default: the head's graph returns lazy logits and the loss after the break reads them
    fused (equal to eager's); nothing is lost, nothing warns."""
    def broken(m, h, y):
        logits = m.lm_head(h)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits.reshape(-1, WIDE), y.reshape(-1))

    model, eager = Head(broken, vocab=WIDE), Head(broken, vocab=WIDE)
    eager.load_state_dict(model.state_dict())
    h, y = hidden(), labels(vocab=WIDE)
    loss = torch.compile(model, backend="chunkce", options=OPTIONS)(h, y)
    expected = eager(h, y)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, eager.lm_head.weight.grad)
    assert warnings_of(logs) == [] and counters["chunkce"]["logits_lazy"] == 1


def test_a_graph_break_between_head_and_loss_warns_for_both_graphs(logs):
    def broken(m, h, y):
        logits = m.lm_head(h)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits.reshape(-1, WIDE), y.reshape(-1))

    compiled = torch.compile(Head(broken, vocab=WIDE), backend="chunkce", options=KEEP)
    compiled(hidden(), labels(vocab=WIDE)).backward()
    head, loss = warnings_of(logs)
    assert "projects to a vocabulary of 2048" in head and "(graph_break)" in head
    assert "the graph broke between the projection and the loss" in loss and "fix: remove the graph break" in loss


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(H, WIDE)
        self.down = nn.Linear(WIDE, H)

    def forward(self, h):
        return self.down(F.gelu(self.up(h)))


class Fused(torch.autograd.Function):
    """TRL's fused LM head, in small: per-token log-probabilities computed in an ``autograd.Function``."""

    @staticmethod
    def forward(ctx, h, weight, y):
        ctx.save_for_backward(h, weight, y)
        return Fused.log_probs(h, weight, y)

    @staticmethod
    def log_probs(h, weight, y):
        logits = h @ weight.t()  # [B, T, V]: in TRL's kernel a tile at a time
        return logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)

    @staticmethod
    def backward(ctx, grad):
        h, weight, y = ctx.saved_tensors
        logits = h @ weight.t()
        grad_logits = grad.unsqueeze(-1) * (F.one_hot(y, weight.shape[0]).to(logits.dtype) - logits.softmax(-1))
        return grad_logits @ weight, grad_logits.flatten(0, -2).t() @ h.flatten(0, -2), None


def fused_head(m, h, y):
    return -Fused.apply(h, m.lm_head.weight, y).mean()


@pytest.mark.parametrize("case", ["rewritten, logits returned", "mlp", "small vocabulary", "fused head"])
def test_no_warning_without_a_lost_win(case, logs):
    """A rewritten site (its returned logits too), an MLP's wide projection, a small head's
    returned logits, TRL-style fused head (no logits in the graph): no warning."""
    if case == "rewritten, logits returned":
        model = Head(lambda m, h, y: (F.cross_entropy(m.lm_head(h).reshape(-1, WIDE), y.reshape(-1)), m.lm_head(h)),
                     vocab=WIDE)
        loss, logits = torch.compile(model, backend="chunkce", options=OPTIONS)(hidden(), labels(vocab=WIDE))
        (loss + logits.sum()).backward()
        assert counters["chunkce"]["sites_rewritten"] == 1
        assert any(r.getMessage().startswith("chunkce: rewrote") and r.levelno == logging.INFO for r in logs.records)
    elif case == "fused head":
        model = Head(fused_head, vocab=WIDE)
        torch.compile(model, backend="chunkce", options=OPTIONS)(hidden(), labels(vocab=WIDE)).backward()
        assert counters["chunkce"]["sites_found"] == 0
    else:
        model = MLP() if case == "mlp" else ReturnsLogits(vocab=V)
        torch.compile(model, backend="chunkce", options=OPTIONS)(hidden()).sum().backward()
    assert counters["stats"]["unique_graphs"] >= 1
    assert warnings_of(logs) == [] and counters["chunkce"]["unmatched_projections"] == 0


def test_explain_reports_every_site_and_logs_no_warning(logs):
    refused = compile_pass.explain(Head(clamped), hidden(), labels())
    assert [r.reason_key for r in refused.records] == ["op_clamp"] and refused.records[0].fix in str(refused)
    lazy = compile_pass.explain(ReturnsLogits(), hidden())
    assert [r.vocab for r in lazy.returned] == [WIDE] and lazy.unmatched == [] and "lazy logits:" in str(lazy)
    unmatched = compile_pass.explain(ReturnsLogits(), hidden(), options=KEEP)
    assert [u.vocab for u in unmatched.unmatched] == [WIDE]
    assert "no cross-entropy site:" in str(unmatched) and report.NO_SITE_FIX in str(unmatched)
    assert warnings_of(logs) == []
    assert counters["chunkce"]["sites_found"] == counters["chunkce"]["unmatched_projections"] == 0


def test_a_refused_site_with_few_classes_logs_no_warning_and_stays_in_the_report(logs):
    """Refused logits of a few classes (conftest's V, 23: below ``find.VOCAB_MIN``) cost about
    what the hidden states do: a rewrite would save nothing, so no WARNING; INFO, and the report."""
    train(Head(clamped))
    assert counters["chunkce"]["refused_op_clamp"] == 3
    assert warnings_of(logs) == []
    record = compile_pass.last_report().records[0]
    assert (record.reason_key, record.warns) == ("op_clamp", False)
    assert any(r.levelno == logging.INFO and r.getMessage().startswith(f"chunkce: left {record.source} unfused")
               for r in logs.records)


@pytest.mark.slow
def test_a_sequence_classifier_logs_no_warning_and_matches_eager(logs):
    """``LlamaForSequenceClassification(num_labels=3)``: its loss reads the score layer's logits
    at each row's last token (a getitem with tensor indices), a refused site of 3 classes that
    is no vocabulary projection: no warning; the step is exact against eager."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    reference = LlamaForSequenceClassification(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 2])
    compiled = torch.compile(model, backend="chunkce", options=OPTIONS)
    loss = compiled(input_ids=ids, labels=y).loss
    loss.backward()
    expected = reference(input_ids=ids, labels=y).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert warnings_of(logs) == []
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key, record.warns) == (report.Decision.REFUSED, "advanced_index", False)
