"""Row statistics of the logits inside a compiled graph: the z-loss's ``logsumexp(z, -1)``, an
entropy (``-(softmax(z) * log_softmax(z)).sum(-1)``, ``logsumexp(z) - (softmax(z) * z).sum(-1)``)
and row sums and means (``z.sum(-1)``, ``z.mean()``: a metric of the logits), beside a cross-entropy or per-token log-probabilities of the same projection, are rewritten to
``chunkce::linear_statistics`` (compile_pass/graph/spellings/reductions.py, entropy.py): loss and every
gradient equal to eager's and stock compile's (fullgraph, static and dynamic shapes), the graph
holds the ops and no ``[N, V]`` node, and a step's measured peak stays under a quarter of one ``[N, V]``.
Labels edited in place between the projection and the loss (a clone's or the graph input's own,
``labels[labels == pad] = -100``, ``masked_fill_``) are rewritten too; an edit of the hidden states
stays refused (compile_pass/graph/guard.py).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from builders import OP, train_step
from rewrite_proof import Recorder
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from benchmarks.walks import counted_walks
from compile_pass.graph.report import Decision, PassReport, SiteRecord, kind_of
from compile_pass.memory import PeakMemory

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 1031  # V: a vocabulary's (graph/find.py: is_vocabulary), odd
STATISTICS_OP = torch.ops.chunkce.linear_statistics.default
PAD = 3


class Head(nn.Module):
    def __init__(self, loss, vocab=V, hidden=H, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter((torch.randn(vocab, hidden) * 0.3).to(dtype))
        self.bias = nn.Parameter((torch.randn(vocab) * 0.1).to(dtype))
        self.loss = loss

    def forward(self, h, y):
        return self.loss(self, h, y)


def inputs(tokens=T, vocab=V, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, (B, tokens), generator=gen)
    y[0, :2] = -100
    y[1, -1] = PAD
    return torch.randn(B, tokens, H, generator=gen).to(dtype).requires_grad_(), y


# -- the spellings ------------------------------------------------------------------------------

def z_loss(m, h, y):  # as OLMo-core: the CE and the squared lse of the fp32 logits, masked and averaged
    logits = F.linear(h, m.weight, m.bias)  # [B, T, V]
    ce = F.cross_entropy(logits.view(-1, V).float(), y.view(-1), ignore_index=-100)
    z_squared = torch.logsumexp(logits.float(), dim=-1).pow(2)  # [B, T]
    mask = y != -100
    return ce + 1e-4 * (z_squared * mask).sum() / mask.sum()


def z_loss_flat_keepdim(m, h, y):
    logits = (h @ m.weight.T).view(-1, V).float()  # [N, V]
    lse = logits.logsumexp(-1, keepdim=True)  # [N, 1]
    return F.cross_entropy(logits, y.view(-1), reduction="sum") + 1e-3 * lse.squeeze(-1).pow(2).mean()


def z_loss_scaled(m, h, y):
    logits = F.linear(h, m.weight, m.bias) / 2.0  # one scaling: the op's head transform, each site's
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 1e-2 * logits.logsumexp(-1).pow(2).mean()


def entropy_bonus(m, h, y):
    logits = F.linear(h, m.weight, m.bias).float()
    entropy = -(F.softmax(logits, dim=-1) * F.log_softmax(logits, dim=-1)).sum(-1)  # [B, T]
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) - 1e-2 * entropy.mean()


def entropy_bonus_lse(m, h, y):  # the two float() casts are two nodes: the same values
    logits = F.linear(h, m.weight, m.bias)
    z = logits.float()
    entropy = torch.logsumexp(z, -1) - torch.sum(logits.float().softmax(-1) * z, dim=-1)
    return F.cross_entropy(z.view(-1, V), y.view(-1)) - 1e-2 * entropy.mean()


def log_probs_and_entropy(m, h, y):  # RL: per-token log-probs and the entropy of one log_softmax
    log_probs = F.linear(h, m.weight, m.bias).float().log_softmax(-1)  # [B, T, V]
    token = log_probs.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(log_probs.exp() * log_probs).sum(-1, keepdim=True)  # [B, T, 1]
    mask = y != -100
    return -(token * mask).sum() / mask.sum() - 1e-2 * (entropy.squeeze(-1) * mask).mean()


def cross_entropy_none_and_entropy(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    token = -F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="none")  # [N] log-probs
    entropy = -(logits.log_softmax(-1) * logits.softmax(-1)).sum(-1)
    return -token.sum() + (entropy.detach().view(-1) * token).mean() - entropy.sum()


def logits_mean_and_row_sums(m, h, y):  # a metric of the logits (TRL DPO's mean) and a penalty on row sums
    logits = F.linear(h, m.weight, m.bias)
    ce = F.cross_entropy(logits.view(-1, V).float(), y.view(-1))
    return ce + 1e-2 * logits.mean() + 1e-3 * logits.float().sum(-1).pow(2).mean()


def row_means_keepdim_and_entropy_mean(m, h, y):
    logits = F.linear(h, m.weight, m.bias).float()
    entropy_over_v = (logits.softmax(-1) * logits.log_softmax(-1)).mean(-1)  # -entropy / V
    centred = logits.mean(-1, keepdim=True) * 0.1  # [B, T, 1]
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + (centred.squeeze(-1) - entropy_over_v).sum()


# name: (loss, loss sites, statistic sites, cross-entropy op nodes, statistics op nodes). A cross-entropy
# or per-token log-probabilities (a gather) and the statistics of the same values are one walk: one
# statistics op (graph/plan.py, _fold).
SPELLINGS = {
    "z_loss": (z_loss, 1, 1, 0, 1),
    "z_loss_flat_keepdim": (z_loss_flat_keepdim, 1, 1, 0, 1),
    "z_loss_scaled": (z_loss_scaled, 1, 1, 0, 1),
    "entropy_bonus": (entropy_bonus, 1, 1, 0, 1),
    "entropy_bonus_lse": (entropy_bonus_lse, 1, 2, 0, 1),
    "log_probs_and_entropy": (log_probs_and_entropy, 1, 1, 0, 1),
    "cross_entropy_none_and_entropy": (cross_entropy_none_and_entropy, 1, 1, 0, 1),
    "logits_mean_and_row_sums": (logits_mean_and_row_sums, 1, 2, 0, 1),
    "row_means_keepdim_and_entropy_mean": (row_means_keepdim_and_entropy_mean, 1, 2, 0, 1),
}


def _clone(args):
    return [x.detach().clone().requires_grad_(x.requires_grad) for x in args]


def compiled_and_references(model, calls, dynamic=False, **tolerances):
    """Train steps of ``model`` compiled with chunkce (fullgraph, inner backend recorded), of an
    eager copy and of a copy compiled with stock aot_eager, on every input tuple of ``calls``:
    outputs, every gradient and the inputs after the call (edited in place or not) asserted close.
    Returns the recorder."""
    recorder = Recorder()
    eager, stock = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(model, backend="chunkce", fullgraph=True, dynamic=dynamic,
                             options={"inner_backend": recorder})
    references = (eager, torch.compile(stock, backend="aot_eager", fullgraph=True, dynamic=dynamic))
    for args in calls:
        got_args = _clone(args)
        outputs, grads = train_step(compiled, got_args)
        for reference in references:
            ref_args = _clone(args)
            ref_outputs, ref_grads = train_step(reference, ref_args)
            torch.testing.assert_close(outputs, ref_outputs, **tolerances)
            assert grads.keys() == ref_grads.keys()
            for name in grads:
                torch.testing.assert_close(grads[name], ref_grads[name], **tolerances,
                                           msg=lambda message, name=name: f"{name}: {message}")
            for got, ref in zip(got_args, ref_args):
                torch.testing.assert_close(got.detach(), ref.detach(), atol=0, rtol=0)
        for module in (model, eager, stock):
            module.zero_grad(set_to_none=True)
    return recorder


def op_nodes(recorder, target):
    return sum(fact.target is target for graph in recorder.graphs for fact in graph)


def assert_statistics_rewritten(recorder, losses, statistics, tokens=B * T, vocab=V):
    assert op_nodes(recorder, OP) == losses * len(recorder.graphs), "cross-entropy op nodes"
    assert op_nodes(recorder, STATISTICS_OP) == statistics * len(recorder.graphs), "statistics op nodes"
    assert recorder.logits_like(tokens, vocab) == [], "[N, V] logits still in the rewritten graph"


@pytest.mark.parametrize("dynamic", [False, pytest.param(True, marks=pytest.mark.slow)],  # dynamic: a second length, twice the compiles
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_statistics_of_the_projection_are_rewritten_and_match_eager_and_stock(name, dynamic):
    loss, losses, statistics, loss_ops, statistics_ops = SPELLINGS[name]
    calls = [inputs(), inputs(tokens=7, seed=2)] if dynamic else [inputs()]
    before = Counter(counters["chunkce"])
    recorder = compiled_and_references(Head(loss), calls, dynamic=dynamic)
    assert len(recorder.graphs) == 1  # fullgraph; dynamic: no recompile for a new length
    assert_statistics_rewritten(recorder, loss_ops, statistics_ops)
    stats = Counter(counters["chunkce"]) - before
    assert stats["sites_rewritten"] == losses + statistics and stats["sites_refused"] == 0, dict(stats)
    recorder.assert_counted(stats)
    spellings = sorted(record.spelling for record in compile_pass.last_report().records)
    assert sum(spellings.count(name) for name in ("logsumexp", "entropy", "row_sum")) == statistics, spellings
    header = str(compile_pass.last_report()).splitlines()[0]  # each site named by its kind, not as a cross-entropy
    kinds = Counter(kind_of(spelling) for spelling in spellings)
    assert all(f"{n} {kind}" in header for kind, n in kinds.items()), header
    assert ("cross-entropy" in header) == bool({"cross_entropy", "nll_loss"} & set(spellings)), header


def test_the_report_names_each_site_by_its_kind():
    def record(spelling):
        return SiteRecord("loss.py:1 in forward: ...", "lm_head", Decision.REWRITTEN, "", spelling=spelling)
    one_kind = PassReport([record("cross_entropy"), record("nll_loss")])
    assert str(one_kind).splitlines()[0] == "chunkce: 2 cross-entropy site(s), 2 rewritten, 0 refused"
    mixed = PassReport([record("gather"), record("entropy"), record("logsumexp"), record("row_sum"), record("gather")])
    assert str(mixed).splitlines()[0] == (
        "chunkce: 5 sites (2 gather, 1 entropy, 1 logsumexp, 1 row-sum), 5 rewritten, 0 refused")
    assert "cross-entropy" not in str(mixed)


ONE_WALK = {"statistics_walk": 1, "statistics_gradients": 1}


@pytest.mark.parametrize("name", ["z_loss", "entropy_bonus", "entropy_bonus_lse", "log_probs_and_entropy"])
def test_a_loss_and_statistics_of_the_same_values_walk_once_forward_and_once_backward(name, monkeypatch):
    """The walks a training step runs, counted at the op's loops: a cross-entropy or per-token
    log-probs (a gather) with a z-loss or an entropy (written before or after it) is one statistics
    walk and one backward walk (were: the cross-entropy op's and the statistics op's, two of each)."""
    walks = counted_walks(monkeypatch.setattr)
    compiled_and_references(Head(SPELLINGS[name][0]), [inputs()])
    assert dict(walks) == ONE_WALK, dict(walks)
    assert counters["chunkce"]["statistics_folded"] == SPELLINGS[name][2]


# the gather spellings of per-token log-probabilities ([B, T] or [B, T - 1]) of log-probs ``lp`` [B, T, V]
# (graph/spellings/losses.py: read_gather), each beside an entropy of the same log-probs
GATHERS = {
    "take_along_dim_negated": lambda lp, y: -torch.take_along_dim(-lp, y[..., None], dim=-1).squeeze(-1),
    "shifted_flat": lambda lp, y: lp[:, :-1].reshape(-1, V).gather(1, y[:, 1:].reshape(-1, 1)).view(B, T - 1),
    "shifted_index": lambda lp, y: lp[:, :-1].gather(-1, y[:, 1:, None]).squeeze(-1),
    "index_itself": lambda lp, y: lp.gather(-1, y.unsqueeze(0).permute(1, 2, 0)).squeeze(-1),
}


@pytest.mark.parametrize("entropy_first", [False, True], ids=["entropy_after", "entropy_first"])
@pytest.mark.parametrize("form", list(GATHERS))
def test_log_probs_of_every_gather_spelling_and_an_entropy_are_one_walk(form, entropy_first, monkeypatch):
    """An RL step's per-token log-probs, gathered in any spelling (negated, wrapped, flat, of shifted
    rows, the index itself), and an entropy of the same log-probs: one statistics walk forward and
    one backward, no cross-entropy op, loss and every gradient those of eager and stock."""
    def loss(m, h, y):
        log_probs = F.linear(h, m.weight, m.bias).float().log_softmax(-1)  # [B, T, V]
        if entropy_first:
            entropy = -(log_probs.exp() * log_probs).sum(-1)  # [B, T]
        token = GATHERS[form](log_probs, y.clamp(min=0))
        if not entropy_first:
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        mask = (y != -100)[:, -token.shape[1]:]  # the labels' rows: [B, T - 1] for a shift
        return -(token * mask).sum() / mask.sum() - 1e-2 * entropy.mean()

    walks = counted_walks(monkeypatch.setattr)
    recorder = compiled_and_references(Head(loss), [inputs()])
    assert_statistics_rewritten(recorder, 0, 1)
    assert dict(walks) == ONE_WALK, dict(walks)
    assert counters["chunkce"]["statistics_folded"] == 1


def test_a_gathered_label_out_of_range_raises_in_the_one_walk_too():
    """The fold keeps the gather's check: a label outside ``[0, V)`` raises (stock: out of bounds)."""
    y = inputs()[1].clamp(min=0)
    y[1, 2] = V
    compiled = torch.compile(Head(log_probs_and_entropy), backend="chunkce", options={"inner_backend": "aot_eager"})
    with pytest.raises(RuntimeError, match=rf"expected every index in \[0, {V}\)"):
        compiled(inputs()[0], y)
    assert counters["chunkce"]["statistics_folded"] == 1


@pytest.mark.parametrize("loss", [z_loss, entropy_bonus, logits_mean_and_row_sums],
                         ids=["z_loss", "entropy_bonus", "logits_mean_and_row_sums"])
def test_bf16_statistics_of_fp32_logits_match_eager_and_stock(loss):
    """A bf16 head whose logits are cast to fp32 for the loss and the statistic (the op rounds the
    projection to bf16 once, as the graph): close to the unfused bf16 step."""
    h, y = inputs(dtype=torch.bfloat16)
    recorder = compiled_and_references(Head(loss, dtype=torch.bfloat16), [(h, y)], atol=2e-2, rtol=2e-2)
    # one walk for the loss and the statistics of its fp32 values; the mean of the bf16 logits
    # themselves reads other values (rounded to bf16): a walk of its own
    assert_statistics_rewritten(recorder, 0, 2 if loss is logits_mean_and_row_sums else 1)


# -- what is no statistic site, or stays refused --------------------------------------------------

def few_classes_z_loss(m, h, y):  # a router's or classifier's few classes: nothing to save
    logits = F.linear(h, m.weight)  # [B, T, 23]
    return F.cross_entropy(logits.view(-1, 23), y.view(-1) % 23) + logits.logsumexp(-1).pow(2).mean()


def logsumexp_over_tokens(m, h, y):  # over dim 1 (tokens): no row statistic
    logits = F.linear(h, m.weight)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 1e-3 * logits.logsumexp(1).mean()


def entropy_alone(m, h, y):  # no loss site reads the projection: the graph is one without a site
    logits = F.linear(h, m.weight).float()
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def test_a_statistic_with_no_loss_of_its_projection_is_no_site():
    before = compile_pass.last_report()  # a report is published only by a run that found a site
    recorder = compiled_and_references(Head(entropy_alone), [inputs()])
    recorder.assert_untouched()
    report = compile_pass.last_report()
    assert (report is before or report.records == []) and counters["chunkce"]["sites_found"] == 0


def test_a_statistic_of_few_classes_or_other_dims_is_no_site():
    recorder = compiled_and_references(Head(few_classes_z_loss, vocab=23), [inputs(vocab=23)])
    assert op_nodes(recorder, STATISTICS_OP) == 0
    assert [record.spelling for record in compile_pass.last_report().records] == ["cross_entropy"]
    torch._dynamo.reset()
    recorder = compiled_and_references(Head(logsumexp_over_tokens), [inputs()])
    assert (op_nodes(recorder, OP), op_nodes(recorder, STATISTICS_OP)) == (1, 0)
    assert [record.spelling for record in compile_pass.last_report().records] == ["cross_entropy"]


def logits_changed_before_the_statistic(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    ce = F.cross_entropy(logits.view(-1, V), y.view(-1))
    logits.mul_(0.5)  # the statistic reads the changed logits
    return ce + logits.logsumexp(-1).pow(2).mean()


def test_a_statistic_of_logits_changed_in_place_stays_refused():
    recorder = compiled_and_references(Head(logits_changed_before_the_statistic), [inputs()])
    assert (op_nodes(recorder, OP), op_nodes(recorder, STATISTICS_OP)) == (1, 0)  # the CE reads them before
    records = {record.spelling: record for record in compile_pass.last_report().records}
    assert (records["logsumexp"].decision, records["logsumexp"].reason_key) == ("refused", "mutation")


# -- labels edited in place between the projection and the loss -----------------------------------

def _dpo_log_probs(logits, labels):  # TRL's DPO: masked labels, clamped for the gather
    mask = labels != -100
    log_probs = torch.gather(logits.log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(2)).squeeze(2)
    return (log_probs * mask).sum(-1)


def labels_cloned_then_set(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    labels = y.clone()
    labels[labels == PAD] = -100
    return _dpo_log_probs(logits, labels)


def labels_cloned_then_masked_fill_(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    labels = y.clone()
    labels.masked_fill_(labels == PAD, -100)
    return _dpo_log_probs(logits, labels)


def input_labels_set(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    y[y == PAD] = -100  # the graph input itself
    return _dpo_log_probs(logits, y)


def input_labels_masked_fill_(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    y.masked_fill_(y == PAD, -100)
    return _dpo_log_probs(logits, y)


def input_labels_set_before_cross_entropy(m, h, y):
    logits = F.linear(h, m.weight, m.bias)
    y[:, 0] = -100
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 1e-4 * logits.logsumexp(-1).pow(2).mean()


@pytest.mark.parametrize("dynamic", [False, pytest.param(True, marks=pytest.mark.slow)],  # dynamic: a second length, twice the compiles
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("loss", [labels_cloned_then_set, labels_cloned_then_masked_fill_, input_labels_set,
                                  input_labels_masked_fill_, input_labels_set_before_cross_entropy],
                         ids=["clone_setitem", "clone_masked_fill_", "input_setitem", "input_masked_fill_",
                              "input_setitem_cross_entropy"])
def test_labels_edited_in_place_are_rewritten_and_match_eager_and_stock(loss, dynamic):
    calls = [inputs(), inputs(tokens=7, seed=2)] if dynamic else [inputs()]
    before = Counter(counters["chunkce"])
    recorder = compiled_and_references(Head(loss), calls, dynamic=dynamic)
    stats = Counter(counters["chunkce"]) - before
    assert stats["sites_refused"] == 0 and stats["sites_rewritten"] >= 1, dict(stats)
    assert len(recorder.sites()) == len(recorder.graphs)  # one op node: a z-loss reads the loss's walk
    assert recorder.logits_like(B * T, V) == []
    recorder.assert_counted(stats)


def labels_from_the_entropy(m, h, y):  # labels computed from a statistic written before the gather
    log_probs = F.linear(h, m.weight, m.bias).float().log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [B, T]
    labels = (entropy.detach() * 1000).long() % V
    token = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return -token.mean() - 0.01 * entropy.mean()


def labels_from_the_logsumexp(m, h, y):  # the same with a cross-entropy and a z-loss
    logits = F.linear(h, m.weight, m.bias).float()
    lse = logits.logsumexp(-1)  # [B, T]
    labels = (lse.detach() * 997).long() % V
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + 1e-3 * lse.pow(2).mean()


@pytest.mark.parametrize("loss", [labels_from_the_entropy, labels_from_the_logsumexp],
                         ids=["gather_entropy", "cross_entropy_logsumexp"])
def test_labels_made_from_the_statistic_before_the_loss_walk_on_their_own(loss, monkeypatch):
    """Labels computed from a statistic written before the loss cannot be made before that
    statistic: the statistic walks on its own, then the loss (the rewrite moved the labels above
    the statistic they read, and the compile failed: "used before it has been defined"); loss and
    every gradient those of eager and stock."""
    walks = counted_walks(monkeypatch.setattr)
    recorder = compiled_and_references(Head(loss), [inputs()])
    assert_statistics_rewritten(recorder, 1, 1)
    assert counters["chunkce"]["statistics_folded"] == 0 and counters["chunkce"]["sites_refused"] == 0
    assert dict(walks) == {"chunked_forward": 1, "chunked_backward": 1, **ONE_WALK}, dict(walks)


def hidden_states_edited(m, h, y):  # a frozen head: the op would read the doubled hidden states
    logits = F.linear(h, m.weight.detach())
    h.mul_(2.0)
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


def test_hidden_states_edited_in_place_stay_refused():
    h, y = inputs()
    recorder = compiled_and_references(Head(hidden_states_edited), [(h.detach(), y)], atol=0, rtol=0)
    recorder.assert_untouched()
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key) == ("refused", "mutation"), record.reason


# -- memory ---------------------------------------------------------------------------------------

def test_a_step_with_z_loss_and_entropy_peaks_under_a_quarter_of_one_logits(monkeypatch):
    """CE, z-loss and entropy of one projection, forward and backward (eager kernels, 256 KiB
    tiles): the measured peak stays under a quarter of one ``[N, V]`` fp32 tensor (6 MiB against 32:
    the three ops' weight gradients; stock aot_eager: 192 MiB)."""
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", str(256 << 10))
    n, vocab, hidden = 256, 32768, 16

    def loss(m, h, y):
        logits = F.linear(h, m.weight).float()
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        return (F.cross_entropy(logits.view(-1, vocab), y.view(-1)) + 1e-4 * logits.logsumexp(-1).pow(2).mean()
                - 1e-2 * entropy.mean())

    model = Head(loss, vocab=vocab, hidden=hidden)
    compiled = torch.compile(model, backend="chunkce", fullgraph=True, options={"inner_backend": "aot_eager"})
    h = torch.randn(1, n, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (1, n))
    compiled(h, y).backward()  # compiled outside the measurement
    model.zero_grad(set_to_none=True)
    h.grad = None
    with PeakMemory() as mem:
        compiled(h, y).backward()
    assert counters["chunkce"]["sites_rewritten"] == 3
    assert mem.peak_bytes < n * vocab * 4 // 4, mem.peak_bytes


@pytest.mark.slow
def test_z_loss_and_entropy_on_inductor_match_stock_inductor():
    """Inductor inside chunkce against stock Inductor: loss and every gradient, both ops in the graph."""
    calls = [inputs()]
    for loss in (z_loss, entropy_bonus_lse):
        torch._dynamo.reset()
        model = Head(loss)
        reference = copy.deepcopy(model)
        recorder = Recorder(inner="inductor")
        compiled = torch.compile(model, backend="chunkce", fullgraph=True, options={"inner_backend": recorder})
        stock = torch.compile(reference, backend="inductor", fullgraph=True)
        for args in calls:
            outputs, grads = train_step(compiled, _clone(args))
            ref_outputs, ref_grads = train_step(stock, _clone(args))
            torch.testing.assert_close(outputs, ref_outputs)
            for name in grads:
                torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")
        assert op_nodes(recorder, STATISTICS_OP) >= 1 and recorder.logits_like(B * T, V) == []
