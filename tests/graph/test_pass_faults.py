"""The pass never breaks a compile: a fault at any step leaves the site's graph as it was.

Each test injects an exception into one stage of the pass (finding the sites, the guard,
the rewrite part-way through, reporting), through the pass's own points
(:mod:`compile_pass.graph.stages`), and checks, on a graph Dynamo captured:
the graph is node for node what it was, a warning names the failure, the site is counted
as refused with key ``internal_error`` — and end to end, the model compiled with
``backend="chunkce"`` trains exactly as stock compile does. A fault in the returned-logits
pass (after the losses are rewritten) leaves the graph as the losses' rewrite left it: the loss
rewritten, the logits computed (kept), exact. With ``strict=True`` the original exception
reaches the caller instead.
"""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from builders import OP
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from compile_pass.graph import report, stages
from compile_pass.graph.pipeline import fuse_linear_cross_entropy, run_pass
from compile_pass.options import Options
from compile_pass.pre_grad import ChunkcePreGradPass

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

V, H = 48, 16


class Injected(RuntimeError):
    """The fault the tests inject."""


class Head(torch.nn.Module):
    def __init__(self, returns_logits=False):
        super().__init__()
        self.body = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.returns_logits = returns_logits

    def forward(self, x, labels):
        logits = self.lm_head(torch.tanh(self.body(x)))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return (loss, logits) if self.returns_logits else loss


def _inputs():
    torch.manual_seed(0)
    labels = torch.randint(0, V, (2, 8))
    labels[0, :3] = -100
    return torch.randn(2, 8, H), labels


def _captured(model):
    """The graph Dynamo captures from one training call of ``model``."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=capture)(*_inputs())
    torch._dynamo.reset()
    (gm,) = graphs
    return gm


def _raise(*args, **kwargs):
    raise Injected("injected fault")


@contextlib.contextmanager
def _lint_fails():
    """``Graph.lint`` (which every edit runs before it is kept) raises."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.fx.Graph, "lint", _raise)
        yield


@contextlib.contextmanager
def _lint_fails_from(point):
    """``Graph.lint`` raises once the pass reaches ``point``."""
    with pytest.MonkeyPatch.context() as mp, stages.hooked(point, lambda _: mp.setattr(torch.fx.Graph, "lint", _raise)):
        yield


FAULTS = {  # the stage a fault is injected at: what the pass is doing then
    "matcher": lambda: stages.hooked("find", _raise),  # reading the graph's sites
    "guard": lambda: stages.hooked("check", _raise),
    "report_source": lambda: stages.hooked("plan", _raise),  # reading what the record says of the site
    "rewrite_start": lambda: stages.hooked("rewrite", _raise),
    "rewrite_traced": lambda: stages.hooked("traced", _raise),  # the op's nodes in, the loss not yet replaced
    "rewrite_erased": lambda: stages.hooked("erased", _raise),  # the loss replaced, the dead nodes disconnected
    "lint": _lint_fails,
}


@pytest.mark.parametrize("stage", FAULTS)
def test_a_fault_leaves_the_graph_exactly_as_it_was(stage, caplog):
    gm = _captured(Head(returns_logits=True))
    before = str(gm.graph)
    with FAULTS[stage](), caplog.at_level(logging.WARNING, logger="compile_pass"):
        result = fuse_linear_cross_entropy(gm.graph, Options(returned_logits="drop"))
    assert str(gm.graph) == before
    gm.graph.lint()
    assert not any(node.target is OP for node in gm.graph.nodes)
    assert [r.reason_key for r in result.records] == ["internal_error"]
    assert "injected fault" in result.records[0].reason
    assert counters["chunkce"]["refused_internal_error"] == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and any(r.exc_info and r.exc_info[0] is Injected for r in warnings)


class ZLossFirst(torch.nn.Module):
    """A z-loss written before the cross-entropy, the labels made between them: the fold moves the
    labels above the z-loss (graph/plan.py, _fold). A vocabulary's size (a statistic site)."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(H, 1031, bias=False)

    def forward(self, x, labels):
        logits = self.lm_head(x).float()
        z_loss = logits.logsumexp(-1).pow(2).mean()
        shifted = labels.roll(1, -1)  # made after the z-loss
        return F.cross_entropy(logits.flatten(0, 1), shifted.flatten()) + 1e-4 * z_loss


@pytest.mark.parametrize("stage", ["rewrite_start", "rewrite_traced", "lint"])
def test_a_fault_in_a_folded_loss_leaves_its_moved_labels_where_they_were(stage, caplog):
    """The labels the fold moved go back to their place when the rewrite fails (they stayed moved)."""
    gm = _captured(ZLossFirst())
    before = str(gm.graph)
    with FAULTS[stage](), caplog.at_level(logging.WARNING, logger="compile_pass"):
        result = fuse_linear_cross_entropy(gm.graph, Options())
    assert str(gm.graph) == before
    gm.graph.lint()
    assert [r.reason_key for r in result.records] == ["internal_error", "internal_error"]


RETURNED_FAULTS = {
    "take_out_start": lambda: stages.hooked("take_out", _raise),
    "take_out_done": lambda: stages.hooked("taken_out", _raise),  # the stand-in in the logits' place
    "lint": lambda: _lint_fails_from("take_out"),  # the lint of the take-out's edit
}


def _after_losses(mode):
    """The graph of ``Head(returns_logits=True)`` once its loss is rewritten, its logits kept."""
    gm = _captured(Head(returns_logits=True))
    result = run_pass(gm.graph, Options(returned_logits=mode))  # no take_out: the losses alone
    assert [r.reason for r in result.report.records] == [report.LOGITS_KEPT]
    return str(gm.graph)


@pytest.mark.parametrize("mode", ["lazy", "drop"])
@pytest.mark.parametrize("stage", RETURNED_FAULTS)
def test_a_fault_in_the_returned_logits_pass_leaves_the_logits_computed(stage, mode, caplog):
    """Taking returned logits out runs after the losses are rewritten: a fault while it takes some
    out leaves the graph as the losses' rewrite left it (the loss rewritten, the projection read by
    the output), logs a warning, and the record says the logits are kept."""
    after_losses = _after_losses(mode)
    gm = _captured(Head(returns_logits=True))
    with RETURNED_FAULTS[stage](), caplog.at_level(logging.WARNING, logger="compile_pass"):
        result = run_pass(gm.graph, Options(returned_logits=mode), take_out=True)
    assert result.returned is None and str(gm.graph) == after_losses
    gm.graph.lint()
    assert sum(node.target is OP for node in gm.graph.nodes) == 1
    assert [(r.decision, r.reason) for r in result.report.records] == [(report.Decision.REWRITTEN, report.LOGITS_KEPT)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and any(r.exc_info and r.exc_info[0] is Injected for r in warnings)
    gm = _captured(Head(returns_logits=True))
    with pytest.raises(Injected, match="injected fault"), RETURNED_FAULTS[stage]():  # strict: the original error
        run_pass(gm.graph, Options(returned_logits=mode, strict=True), take_out=True)
    assert str(gm.graph) == after_losses


def test_a_fault_in_the_returned_logits_pass_compiles_and_trains_as_stock_compile():
    """End to end: the step returns the logits computed (a plain tensor), loss, logits and every
    gradient equal to stock compile's."""
    torch.manual_seed(0)
    model, reference = Head(returns_logits=True), Head(returns_logits=True)
    reference.load_state_dict(model.state_dict())
    x, labels = _inputs()
    with RETURNED_FAULTS["take_out_done"]():
        loss, logits = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})(x, labels)
    (loss + logits.sum() * 1e-3).backward()
    expected_loss, expected_logits = torch.compile(reference, backend="aot_eager")(x, labels)
    (expected_loss + expected_logits.sum() * 1e-3).backward()
    assert type(logits) is torch.Tensor
    torch.testing.assert_close((loss, logits), (expected_loss, expected_logits))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["logits_kept"], stats["logits_lazy"]) == (1, 1, 0)


def test_a_fault_in_reporting_keeps_the_rewritten_graph(caplog):
    """Reporting runs after every site is rewritten and proven (lint): the graph stays rewritten."""
    gm = _captured(Head())
    with stages.hooked("report", _raise), caplog.at_level(logging.WARNING, logger="compile_pass"):
        result = fuse_linear_cross_entropy(gm.graph)
    assert [r.decision for r in result.records] == [report.Decision.REWRITTEN]
    assert sum(node.target is OP for node in gm.graph.nodes) == 1
    assert any("could not report" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("stage", ["matcher", "guard", "rewrite_traced", "rewrite_erased"])
def test_a_fault_compiles_and_trains_as_stock_compile(stage):
    torch.manual_seed(0)
    model = Head()
    reference = Head()
    reference.load_state_dict(model.state_dict())
    x, labels = _inputs()
    with FAULTS[stage]():
        loss = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})(x, labels)
        loss.backward()
    expected = torch.compile(reference, backend="aot_eager")(x, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert counters["chunkce"]["refused_internal_error"] == 1
    assert counters["chunkce"]["sites_rewritten"] == 0


@pytest.mark.parametrize("stage", ["matcher", "rewrite_traced", "rewrite_erased"])
def test_strict_raises_the_original_fault_and_leaves_the_graph(stage):
    gm = _captured(Head())
    before = str(gm.graph)
    with pytest.raises(Injected, match="injected fault"), FAULTS[stage]():
        fuse_linear_cross_entropy(gm.graph, Options(strict=True))
    assert str(gm.graph) == before


class CheckpointedLoss(torch.nn.Module):
    """One site inside a checkpoint body, one whose logits enter the body as an input."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def forward(self, x, labels):
        def body(x, logits, labels):
            inner = F.cross_entropy(self.lm_head(x).flatten(0, 1), labels.flatten())
            outer = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return inner + outer

        return checkpoint(body, x, self.lm_head(x) * 2, labels, use_reentrant=False)


@pytest.mark.slow
def test_pre_grad_pass_visits_each_subgraph_once():
    """Inductor runs the pre-grad pass on every higher-order op's body itself: the pass
    must not walk into them again (counts would double, keys would be wrong)."""
    x, labels = _inputs()
    with torch._inductor.config.patch(pre_grad_custom_pass=ChunkcePreGradPass(), fx_graph_cache=False):
        torch.compile(CheckpointedLoss(), backend="inductor")(x, labels)
    stats = counters["chunkce"]
    assert stats["sites_found"] == 2
    assert stats["sites_rewritten"] == 1
    assert stats["refused_subgraph_input"] == 1
    assert stats["refused_graph_break"] == 0


def test_a_malformed_chunk_size_variable_is_the_users_error_not_a_refused_site(monkeypatch):
    monkeypatch.setenv("CHUNKCE_CHUNK_SIZE", "abc")
    gm = _captured(Head())
    with pytest.raises(ValueError, match="CHUNKCE_CHUNK_SIZE to be a positive integer, got 'abc'"):
        fuse_linear_cross_entropy(gm.graph)
    assert counters["chunkce"]["refused_internal_error"] == 0
