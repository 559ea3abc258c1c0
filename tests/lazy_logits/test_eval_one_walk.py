"""An evaluation step (no grad, labels given) walks the vocabulary once for its loss and the reads
of the logits it returns.

The loss site is replaced by one ``chunkce::linear_statistics`` walk (graph/plan.py) whose row
statistics the returned ``LazyLogits`` keeps: ``argmax(-1)``, ``logsumexp``, the entropy and a
log-prob gather afterwards walk no more (a gather is one op call without a walk). Proven on the graph
the inner backend got (the statistics op, no cross-entropy op, no ``[N, V]`` node), by the walks
counted (``statistics_walk`` calls and the kernels run), and against stock compile's values. Logits
sliced before the loss (``logits[:, :-1]``, older models' shift) walk every row once, the loss reading
its own. A loss the statistics cannot give (class weights, label smoothing) keeps today's path: the
cross-entropy op, and an argmax read that walks again.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import Recorder
from torch._dynamo.utils import counters

from compile_pass import LazyLogits
from compile_pass.op import kernel_runner, statistics_loops

B, T, H, V = 2, 8, 16, 97
N = B * T
STATISTICS = torch.ops.chunkce.linear_statistics.default
WALKS = ("statistics_forward", "maximum_forward", "chunk_forward")  # a walk's per-tile kernels
pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")


class EvalLM(torch.nn.Module):
    """HF's causal-LM forward: ``(loss, logits)``, the loss on the logits' fp32 upcast with the
    labels shifted (``shift="logits"``: the logits sliced instead, as older models do; ``"gather"``:
    per-token log-probabilities of the sliced logits instead of a loss)."""

    def __init__(self, dtype=torch.float32, reduction="mean", shift="labels", **loss_options):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(H, H, dtype=dtype)
        self.lm_head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
        with torch.no_grad():
            self.lm_head.weight.mul_(4)
        if "weight" in loss_options:
            self.register_buffer("class_weight", torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5)
        self.reduction, self.shift, self.loss_options = reduction, shift, loss_options

    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h)))  # [B, T, V]
        options = {**self.loss_options, "weight": self.class_weight} if "weight" in self.loss_options \
            else self.loss_options
        if self.shift == "labels":
            shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # [B, T]
            loss = F.cross_entropy(logits.float().reshape(-1, V), shifted.reshape(-1), ignore_index=-100,
                                   reduction=self.reduction, **options)
        elif self.shift == "logits":
            loss = F.cross_entropy(logits.float()[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                                   reduction=self.reduction, **options)
        else:  # "gather": a reference model's per-token log-probs [B, T - 1] (no ignore_index: labels clamped)
            log_probs = logits.float()[:, :-1].log_softmax(-1)
            loss = log_probs.gather(-1, labels[:, 1:, None].clamp(min=0)).squeeze(-1)
        return loss, logits


def batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=gen).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :3] = -100  # ignored
    return h, labels


@pytest.fixture
def walks(monkeypatch):
    """``{"walks": statistics_walk calls, "kernels": walk kernels run, by name}`` from now on."""
    seen = {"walks": 0, "kernels": []}
    real_walk, real_run = statistics_loops.statistics_walk, kernel_runner.run

    def walk(*args, **kwargs):
        seen["walks"] += 1
        return real_walk(*args, **kwargs)

    def run(name, *args):
        if name in WALKS:
            seen["kernels"].append(name)
        return real_run(name, *args)

    monkeypatch.setattr(statistics_loops, "statistics_walk", walk)
    monkeypatch.setattr(kernel_runner, "run", run)
    return seen


def evaluate(model, dtype=torch.float32):
    """(chunkce's (loss, logits), stock aot_eager's, the chunkce graphs' Recorder), under no_grad."""
    recorder = Recorder("aot_eager")
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": recorder})
    stock = torch.compile(copy.deepcopy(model), backend="aot_eager")
    h, labels = batch(dtype)
    with torch.no_grad():
        return compiled(h, labels), stock(h, labels), recorder


def reads(z, ids):
    """The reads an evaluation loop or an RL metric makes of the logits."""
    return {"argmax": z.argmax(-1), "max": z.max(-1).values, "logsumexp": z.logsumexp(-1),
            "entropy": -(z.softmax(-1) * z.log_softmax(-1)).sum(-1),
            "log_probs": z.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)}


@pytest.mark.parametrize("dtype, reduction, shift", [
    (torch.float32, "mean", "labels"), (torch.float32, "sum", "labels"), (torch.float32, "none", "labels"),
    (torch.bfloat16, "mean", "labels"), (torch.float32, "mean", "logits"), (torch.float32, "none", "logits"),
    (torch.bfloat16, "sum", "logits"), (torch.float32, "none", "gather")],
    ids=["fp32-mean", "fp32-sum", "fp32-none", "bf16-mean", "sliced-fp32-mean", "sliced-fp32-none",
         "sliced-bf16-sum", "gathered-log-probs"])
def test_eval_loss_and_reads_of_the_returned_logits_take_one_walk(walks, dtype, reduction, shift):
    """The step walks once (the statistics op, no cross-entropy op, no [N, V] node in its graph);
    argmax, max, logsumexp and entropy reads walk no more, a log-prob gather gathers without a walk;
    loss and reads equal stock's (bf16: the argmax's column holds stock's maximum), and the kept
    statistics are bit for bit those a fresh read of the logits computes. Logits sliced before the
    loss too: the walk covers every row (the loss reads the first T - 1 of each sequence), and per-token
    log-probs gathered from them. Failed before: a cross-entropy op in the graph and a second walk
    (maximum only) for the argmax."""
    (loss, logits), (expected_loss, expected_logits), recorder = evaluate(EvalLM(dtype, reduction, shift), dtype)
    assert isinstance(logits, LazyLogits) and not logits.is_computed
    nodes = [fact.target for graph in recorder.graphs for fact in graph]
    assert nodes.count(STATISTICS) == 1 and recorder.op_count() == 0 and F.cross_entropy not in nodes
    assert recorder.logits_like(N, V) == []
    assert (walks["walks"], set(walks["kernels"])) == (1, {"statistics_forward"})
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["logits_lazy"] == 1
    (node,) = [fact for graph in recorder.graphs for fact in graph if fact.target is STATISTICS]
    assert node.site == (N, V)  # every head row walked
    tolerance = {} if dtype == torch.float32 else {"atol": 1e-4, "rtol": 1e-4}  # the fp32 loss of bf16 logits
    assert loss.shape == expected_loss.shape
    torch.testing.assert_close(loss, expected_loss, **tolerance)

    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    kernels = len(walks["kernels"])
    with torch.no_grad():
        got, expected = reads(logits, ids), reads(expected_logits, ids)
    assert walks["walks"] == 1 and len(walks["kernels"]) == kernels, walks
    assert not logits.is_computed
    stock_max = expected_logits.max(-1).values
    assert torch.equal(expected_logits.gather(-1, got["argmax"][..., None]).squeeze(-1), stock_max)
    if dtype == torch.float32:
        assert torch.equal(got["argmax"], expected["argmax"])
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # stock's bf16 reads round each step
    for name in ("max", "logsumexp", "entropy", "log_probs"):
        torch.testing.assert_close(got[name], expected[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")

    key = logits.root_storage.keys[0]  # the kept statistics are what the logits' own walk gives
    key.cache = None
    with torch.no_grad():
        logits.logsumexp(-1)  # a walk of every statistic first (argmax alone would walk for the maximum)
        fresh = reads(logits, ids)
    assert walks["walks"] == 2
    for name in ("argmax", "max", "logsumexp", "entropy"):
        assert torch.equal(got[name], fresh[name]), name


@pytest.mark.parametrize("model", [EvalLM(label_smoothing=0.1), EvalLM(weight=True),
                                   EvalLM(shift="logits", label_smoothing=0.1)],
                         ids=["label_smoothing", "class_weight", "sliced_logits_label_smoothing"])
def test_eval_loss_the_statistics_cannot_give_keeps_the_cross_entropy_op(walks, model):
    """Class weights or label smoothing (the loss reads more than one column per row): the
    cross-entropy op as before, and the argmax read walks for the maximum; loss and argmax equal
    stock's."""
    (loss, logits), (expected_loss, expected_logits), recorder = evaluate(model)
    nodes = [fact.target for graph in recorder.graphs for fact in graph]
    assert recorder.op_count() == 1 and STATISTICS not in nodes and recorder.logits_like(N, V) == []
    torch.testing.assert_close(loss, expected_loss)
    with torch.no_grad():
        assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
    assert walks["kernels"].count("maximum_forward") >= 1 and walks["walks"] == 1


def test_training_step_keeps_the_cross_entropy_op():
    """With grad the loss is the cross-entropy op's (its backward recomputes), as before."""
    recorder = Recorder("aot_eager")
    model = EvalLM()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": recorder})
    loss, logits = compiled(*batch())
    loss.backward()
    nodes = [fact.target for graph in recorder.graphs for fact in graph]
    assert recorder.op_count() == 1 and STATISTICS not in nodes
    assert isinstance(logits, LazyLogits)
