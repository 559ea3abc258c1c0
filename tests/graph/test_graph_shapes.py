"""Graph shapes the pass must get right, each against stock compile (loss, outputs and
every gradient) and proven on the graph the inner backend got (op nodes present, no
``[N, V]`` logits node unless another user needs the logits):

- several cross-entropy sites in one graph;
- sites on both sides of a graph break (two graphs, one site each);
- the same logits feeding two losses with different reductions: both rewritten, and
  the logits reported gone (after the second rewrite nothing reads them), not kept;
- other users of the logits (a z-loss, an argmax accuracy, returned logits): the loss
  is rewritten, the logits stay, exact, and are reported kept.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import Recorder, compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from compile_pass.graph import report
from compile_pass import DroppedLogits

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V, V2 = 2, 7, 16, 37, 29
N = B * T


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=gen).requires_grad_()
    labels = torch.randint(0, V2, (B, T), generator=gen)  # valid for both vocabularies
    labels[0, :2] = -100
    return h, labels


class TwoHeads(nn.Module):
    """An lm_head and a second head (multi-token prediction, an auxiliary classifier)."""

    def __init__(self, graph_break=False):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.aux_head = nn.Linear(H, V2, bias=True)
        self.graph_break = graph_break

    def forward(self, h, labels):
        main = F.cross_entropy(self.lm_head(h)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        if self.graph_break:
            torch._dynamo.graph_break()
        aux = F.cross_entropy(self.aux_head(torch.tanh(h)).reshape(-1, V2), labels.reshape(-1), reduction="sum")
        return main + 0.1 * aux


def records():
    return compile_pass.last_report().records


def test_several_sites_in_one_graph():
    recorder, _ = compare_with_stock(TwoHeads(), *inputs())
    assert len(recorder.graphs) == 1
    recorder.assert_rewritten(N, V, sites=2)
    assert recorder.logits_like(N, V2) == []
    stats = counters["chunkce"]
    assert (stats["sites_found"], stats["sites_rewritten"], stats["logits_kept"]) == (2, 2, 0)
    assert [r.decision for r in records()] == [report.Decision.REWRITTEN] * 2


def test_sites_on_both_sides_of_a_graph_break():
    recorder, _ = compare_with_stock(TwoHeads(graph_break=True), *inputs())
    assert len(recorder.graphs) == 2
    recorder.assert_rewritten(N, V, sites=2)
    assert recorder.logits_like(N, V2) == []
    assert [sum(fact.target is torch.ops.chunkce.linear_cross_entropy.default for fact in g)
            for g in recorder.graphs] == [1, 1]
    assert (counters["chunkce"]["sites_rewritten"], counters["chunkce"]["sites_refused"]) == (2, 0)


class SharedLogits(nn.Module):
    """One projection, two losses: a per-token one and the mean; optionally the logits returned."""

    def __init__(self, returns_logits=False):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.returns_logits = returns_logits

    def forward(self, h, labels):
        logits = self.lm_head(h).float()
        per_token = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
        mean = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), label_smoothing=0.1)
        loss = mean + (per_token * torch.linspace(0, 1, N)).sum()
        return (loss, logits) if self.returns_logits else loss


def test_same_logits_feeding_two_losses_are_not_reported_kept():
    recorder, _ = compare_with_stock(SharedLogits(), *inputs())
    recorder.assert_rewritten(N, V, sites=2)
    assert [(r.decision, r.reason, r.fix) for r in records()] == [(report.Decision.REWRITTEN, "", "")] * 2
    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["logits_kept"]) == (2, 0), dict(stats)
    logits_bytes = N * V * 4
    assert stats["logits_bytes_avoided"] == logits_bytes + 2 * (2 * logits_bytes)  # + each loss's two buffers


def test_same_logits_feeding_two_losses_and_returned_kept():
    """returned_logits='keep': the projection stays in the graph for the output."""
    recorder, _ = compare_with_stock(SharedLogits(returns_logits=True), *inputs(),
                                     options={"returned_logits": "keep"})
    assert recorder.op_count() == 2 and recorder.logits_like(N, V) != []
    assert [(r.reason, r.fix) for r in records()] == [(report.LOGITS_KEPT, report.DROP_LOGITS_FIX)] * 2
    assert (counters["chunkce"]["logits_kept"], counters["chunkce"]["logits_lazy"]) == (2, 0)


def test_same_logits_feeding_two_losses_and_returned_are_lazy_by_default():
    """The default: the second rewrite leaves the output as the logits' only user, so the
    projection leaves the graph; the step's outputs and every gradient (the returned
    logits summed into the loss, as train_step does) equal stock's."""
    recorder, _ = compare_with_stock(SharedLogits(returns_logits=True), *inputs())
    recorder.assert_rewritten(N, V, sites=2)
    assert [r.reason for r in records()] == ["", report.LOGITS_LAZY]
    assert (counters["chunkce"]["logits_kept"], counters["chunkce"]["logits_lazy"]) == (0, 1)


def test_same_logits_feeding_two_losses_and_returned_then_dropped():
    """returned_logits="drop": the second rewrite leaves the output as the logits' only user and
    drops them; neither site's logits are then kept."""
    model = SharedLogits(returns_logits=True)
    reference = copy.deepcopy(model)
    recorder = Recorder()
    compiled = torch.compile(model, backend="chunkce",
                             options={"inner_backend": recorder, "returned_logits": "drop"})
    h, labels = inputs()
    loss, logits = compiled(h, labels)
    loss.backward()
    ref_h = h.detach().clone().requires_grad_()
    ref_loss, _ = torch.compile(reference, backend="aot_eager")(ref_h, labels)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(h.grad, ref_h.grad)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad)
    assert isinstance(logits, DroppedLogits) and logits.shape == (B, T, V)
    recorder.assert_rewritten(N, V, sites=2)
    assert [r.reason for r in records()] == ["", report.LOGITS_DROPPED]
    assert (counters["chunkce"]["logits_kept"], counters["chunkce"]["logits_dropped"]) == (0, 1)


def z_loss(logits, labels):
    ce = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))
    return ce + 1e-2 * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def accuracy(logits, labels):
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
    valid = labels != -100
    correct = (logits.argmax(-1) == labels) & valid
    return ce, correct.sum() / valid.sum()


def returned(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)), logits


class ExtraUser(nn.Module):
    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=True)
        self.loss = loss

    def forward(self, h, labels):
        return self.loss(self.lm_head(h), labels)


@pytest.mark.parametrize("loss", [z_loss, accuracy], ids=lambda f: f.__name__)
def test_other_users_of_the_logits_see_them_exact(loss):
    h, labels = inputs()
    model = ExtraUser(loss)
    recorder, _ = compare_with_stock(model, h, labels)
    assert recorder.op_count() == 1
    assert recorder.logits_like(N, V) != []  # the projection stays for its other user
    (record,) = records()
    assert (record.decision, record.reason, record.fix) == (report.Decision.REWRITTEN, report.LOGITS_KEPT, "")
    assert counters["chunkce"]["logits_kept"] == 1
    if loss is accuracy:  # the metric reads the logits' values: the exact argmax, not a close one
        compiled = torch.compile(ExtraUser(loss), backend="chunkce", options={"inner_backend": "aot_eager"})
        assert compiled(h, labels)[1] == accuracy(ExtraUser(loss).lm_head(h), labels)[1]


@pytest.mark.parametrize("mode", ["lazy", "keep"])
def test_returned_logits_see_them_exact(mode):
    """Logits the graph only returns: lazy (the default) or kept; either way the step's
    outputs and gradients, with the returned logits summed into the loss, are stock's."""
    h, labels = inputs()
    recorder, _ = compare_with_stock(ExtraUser(returned), h, labels, options={"returned_logits": mode})
    (record,) = records()
    if mode == "keep":
        assert recorder.op_count() == 1 and recorder.logits_like(N, V) != []
        assert (record.reason, record.fix) == (report.LOGITS_KEPT, report.DROP_LOGITS_FIX)
    else:
        recorder.assert_rewritten(N, V)
        assert (record.reason, record.fix) == (report.LOGITS_LAZY, "")
    assert counters["chunkce"]["logits_kept"] == (mode == "keep")
    assert counters["chunkce"]["logits_lazy"] == (mode == "lazy")


def test_a_fault_while_planning_the_logits_keeps_the_rewrite(caplog):
    """Telling what becomes of the logits is a stage of its own (``fate``): a fault there is
    logged, and the compile goes on with the losses rewritten."""
    from compile_pass.graph import stages

    def broken(node):
        raise RuntimeError("injected")

    with stages.hooked("fate", broken), caplog.at_level("WARNING", logger="compile_pass"):
        recorder, _ = compare_with_stock(SharedLogits(), *inputs())
    recorder.assert_rewritten(N, V, sites=2)
    assert any("could not tell which rewritten sites' logits are kept" in r.getMessage() for r in caplog.records)
