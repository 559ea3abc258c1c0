"""Returned logits are lazy by default: not computed in the step, exact when read, never stale.

``torch.compile(model, backend="chunkce")`` with no options: a training graph's logits
that only the graph output reads leave the graph (proven on the graph the inner backend
got), and the step returns a ``LazyLogits``. Every read here is compared with stock
compile's logits (``aot_eager``), every gradient of a loss that reads them with stock's,
and each way the tensors they are computed from can change makes the read raise. The op's
per-chunk math runs eagerly here (``eager_kernels``): the compiled kernels are
``test_op``'s and ``test_scale``'s (a 0-d tensor scale among them).
"""

import copy
import logging
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compile_pass
from compile_pass import LazyLogits, StaleLogitsError
from compile_pass.graph.report import NO_GRAD_LOGITS_READ, Decision
from compile_pass.graph.returned_logits import STAND_IN
from compile_pass.memory import PeakMemory

B, T, H, V = 2, 8, 16, 96
OP = torch.ops.chunkce.linear_cross_entropy.default
STATISTICS = torch.ops.chunkce.linear_statistics.default
pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")


class LM(torch.nn.Module):
    """HF's shape of a causal LM's forward: (loss, logits), the loss from the logits' fp32 upcast;
    optionally a bias, a scale (a 0-d buffer or a Python float) and a cast of the returned logits."""

    def __init__(self, bias=False, scale=None, returned_dtype=None):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V, bias=bias)
        with torch.no_grad():
            self.lm_head.weight.mul_(4)  # logits of a few units: softmax gradients well away from zero
        self.scale = scale
        if isinstance(scale, torch.Tensor):
            self.register_buffer("logit_scale", scale)
        self.returned_dtype = returned_dtype

    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h)))
        if self.scale is not None:
            logits = logits * (self.logit_scale if isinstance(self.scale, torch.Tensor) else self.scale)
        if self.returned_dtype is not None:
            logits = logits.to(self.returned_dtype)
        loss = F.cross_entropy(logits.float()[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return loss, logits


def batch(seed=0, seq=T):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, seq, H, generator=gen), torch.randint(0, V, (B, seq), generator=gen)


def recording(graphs):
    def inner(gm, example_inputs):
        graphs.append(copy.deepcopy(gm.graph))
        return gm.forward
    return inner


def compiled_pair(model, options=None, graphs=None):
    """(chunkce with no options but a recording inner backend, stock aot_eager) of two copies of ``model``."""
    reference = copy.deepcopy(model)
    inner = recording(graphs) if graphs is not None else "aot_eager"
    return (torch.compile(model, backend="chunkce", options={**(options or {}), "inner_backend": inner}),
            torch.compile(reference, backend="aot_eager"), model, reference)


def assert_no_logits_in(graph, op=OP):
    """``op`` computes the loss (the statistics op: an evaluation step's one walk for the loss and the
    returned logits' statistics), and no value of the logits' size is computed (the stand-in aside)."""
    assert [n.target for n in graph.nodes if n.target in (OP, STATISTICS)] == [op]
    logits_like = [n for n in graph.nodes if isinstance(v := n.meta.get("example_value"), torch.Tensor)
                   and v.numel() == B * T * V and n.op != "placeholder" and not n.meta.get(STAND_IN)]
    assert logits_like == [], logits_like


def assert_same_grads(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}")


@pytest.mark.parametrize("head", [
    LM(), LM(bias=True), LM(scale=torch.tensor(0.5)), LM(scale=2.0), LM(returned_dtype=torch.float64),
], ids=["plain", "bias", "tensor_scale", "float_scale", "cast"])
def test_the_step_computes_no_logits_and_a_loss_of_them_gets_stocks_gradients(head):
    graphs = []
    compiled, stock, model, reference = compiled_pair(head, graphs=graphs)
    h, labels = batch()
    loss, logits = compiled(h, labels)
    expected_loss, expected_logits = stock(h, labels)
    assert type(logits) is LazyLogits and not logits.is_computed
    assert (logits.shape, logits.dtype, logits.device, logits.requires_grad) == (
        expected_logits.shape, expected_logits.dtype, expected_logits.device, True)
    (graph,) = graphs
    assert_no_logits_in(graph)
    assert counters["chunkce"]["logits_lazy"] == 1 and counters["chunkce"]["logits_kept"] == 0

    def z_loss(x):
        return 1e-2 * torch.logsumexp(x.float(), -1).pow(2).mean()

    (loss + z_loss(logits)).backward()  # read outside the compiled region, into the step's backward
    (expected_loss + z_loss(expected_logits)).backward()
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(logits, expected_logits)
    assert_same_grads(model, reference)
    assert h.grad is None


def test_reads_after_backward_and_across_steps_equal_stock_until_the_weight_changes():
    compiled, stock, model, reference = compiled_pair(LM(bias=True))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    h, labels = batch()
    loss, logits = compiled(h, labels)
    expected_loss, expected_logits = stock(h, labels)
    loss.backward()
    expected_loss.backward()
    torch.testing.assert_close(logits.amax(-1), expected_logits.amax(-1))  # after backward; a read that computes
    opt.step()  # the values were read before the step: kept, so still the step's logits
    torch.testing.assert_close(logits, expected_logits)
    loss2, logits2 = compiled(*batch(1))  # the next step, the old output still held
    assert not logits2.is_computed
    torch.testing.assert_close(logits, expected_logits)
    ref_opt.step()
    torch.testing.assert_close(logits2, stock(*batch(1))[1])


def test_a_read_after_a_tensor_it_needs_changed_raises_and_says_how_to_keep_them():
    compiled, _, model, _ = compiled_pair(LM(bias=True, scale=torch.tensor(0.5)))
    original = copy.deepcopy(model.state_dict())
    changes = {
        "optimizer_step": lambda: torch.optim.SGD(model.parameters(), lr=0.1).step(),
        # fused kernels change the parameters without bumping their versions: the step itself is seen
        "fused_adamw": lambda: torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step(),
        "fused_sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1, fused=True).step(),
        "zero_": lambda: model.lm_head.weight.zero_(),
        "bias": lambda: model.lm_head.bias.add_(1),
        "scale": lambda: model.logit_scale.fill_(2.0),
        "load_state_dict": lambda: model.load_state_dict(original),
    }
    for change, apply in changes.items():
        loss, logits = compiled(*batch())  # one graph for every change: the same step each time
        loss.backward()
        view = logits[:, -1].float()  # metadata ops: still lazy, still checked
        with torch.no_grad():
            apply()
        for read in (lambda: logits.sum(), lambda: view.argmax(-1), lambda: logits.tolist()):
            with pytest.raises(StaleLogitsError, match="returned_logits': 'keep'") as raised:
                read()
            assert "before optimizer.step()" in str(raised.value), change
            if change.startswith("fused"):
                assert "an optimizer step" in str(raised.value)
        assert "not computed" in repr(logits), change  # printing does not raise; it says why
        model.load_state_dict(original)


def test_backward_through_the_logits_after_the_weight_changed_raises():
    compiled, _, model, _ = compiled_pair(LM())
    loss, logits = compiled(*batch())
    total = loss + logits.float().square().mean()  # the forward read is fine
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    with pytest.raises(StaleLogitsError, match="backpropagate through"):
        total.backward()


def test_metadata_ops_stay_lazy_and_reads_compute_once():
    compiled, stock, _, _ = compiled_pair(LM())
    h, labels = batch()
    _, logits = compiled(h, labels)
    expected = stock(h, labels)[1].detach()
    lazy = (logits.detach(), logits.float(), logits.to(torch.float64), logits.to("cpu"), logits[:, -1],
            logits.view(-1, V), logits.transpose(0, 1), logits.clone(), logits.contiguous(), logits.unsqueeze(0))
    assert all(type(x) is LazyLogits for x in lazy) and not logits.is_computed
    assert logits.shape == (B, T, V) and len(logits) == B and logits.size(-1) == V and logits.dim() == 3
    assert logits.to(torch.float64).dtype is torch.float64 and logits[:, -1].shape == (B, V)
    torch.testing.assert_close(lazy[4], expected[:, -1])  # a view's read computes the logits once
    assert logits.is_computed
    torch.testing.assert_close(lazy[2], expected.double())
    torch.testing.assert_close(lazy[6], expected.transpose(0, 1))
    torch.testing.assert_close(torch.tensor(logits.tolist()), expected)
    torch.testing.assert_close(torch.from_numpy(logits.detach().numpy()), expected)
    assert logits[0, 0, 0].item() == expected[0, 0, 0].item()
    assert torch.equal(pickle.loads(pickle.dumps(logits.detach())), expected)
    assert repr(logits.detach()) == repr(expected)
    assert f"{logits[0, 0, 0]:.4f}" == f"{expected[0, 0, 0]:.4f}"
    copied = copy.deepcopy(logits.detach())
    assert type(copied) is torch.Tensor and torch.equal(copied, expected)
    with pytest.raises(RuntimeError, match="graph leaves"):  # as stock's non-leaf logits
        copy.deepcopy(logits)
    assert logits.data_ptr() == logits.compute().data_ptr() != 0
    assert logits.untyped_storage().nbytes() == expected.numel() * 4
    with pytest.raises(RuntimeError, match="share logits.compute"):
        logits.share_memory_()
    logits.detach().add_(1)  # in place on the kept values, as on stock's logits
    torch.testing.assert_close(logits.detach(), expected + 1)


def test_a_lazy_step_leaves_no_weak_reference_to_the_head():
    """``torch.utils.swap_tensors`` (``module.to()`` with swapping on) refuses tensors with weak references."""
    compiled, _, model, _ = compiled_pair(LM())
    loss, logits = compiled(*batch())
    loss.backward()
    del loss, logits
    torch.utils.swap_tensors(model.lm_head.weight, torch.nn.Parameter(model.lm_head.weight.detach().clone()))


def test_a_read_in_the_next_graph_after_a_graph_break_is_exact():
    """The logits go from one graph to the next through a graph break; the next graph reads them."""
    model = LM()

    def step(h, labels):
        loss, logits = model(h, labels)
        torch._dynamo.graph_break()
        return loss, logits.argmax(-1), logits.float().softmax(-1)

    h, labels = batch()
    loss, predicted, probs = torch.compile(step, backend="chunkce", options={"inner_backend": "aot_eager"})(h, labels)
    expected_loss, expected_logits = model(h, labels)
    torch.testing.assert_close(loss, expected_loss)
    assert torch.equal(predicted, expected_logits.argmax(-1))
    torch.testing.assert_close(probs, expected_logits.softmax(-1))


@pytest.mark.parametrize("options", [{}, {"returned_logits": "drop"}], ids=["no_options", "drop"])
@pytest.mark.parametrize("head", [LM(bias=True), LM(returned_dtype=torch.float64)], ids=["bias", "cast"])
def test_no_grad_graphs_return_lazy_logits_exact_when_read(head, options):
    """An evaluation step (no grad) computes no [N, V] logits either: the graph holds the op and the
    lazy stand-in only, and the step returns a LazyLogits (under "drop" too: drop is for training
    logits, an evaluation loop reads them), exact when read. Failed before: a plain tensor, the
    projection kept in the graph beside the op (logits_kept)."""
    graphs = []
    compiled, stock, model, reference = compiled_pair(head, options, graphs=graphs)
    h, labels = batch()
    with torch.no_grad():
        loss, logits = compiled(h, labels)
        expected_loss, expected_logits = stock(h, labels)
    assert type(logits) is LazyLogits and not logits.is_computed and not logits.requires_grad
    (graph,) = graphs
    # the fp32 loss and the fp64 returned logits accumulate in different dtypes: the loss walks alone
    assert_no_logits_in(graph, OP if head.returned_dtype == torch.float64 else STATISTICS)
    stats = counters["chunkce"]
    assert (stats["logits_lazy"], stats["logits_kept"], stats["logits_dropped"]) == (1, 0, 0)
    torch.testing.assert_close(loss, expected_loss)
    assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
    torch.testing.assert_close(logits + 0, expected_logits)  # argmax is fused, `+ 0` computes the values
    assert logits.is_computed


class ReadsLogits(LM):
    """An evaluation step that reads the logits inside the compiled region (an argmax beside the loss)."""

    def forward(self, h, labels):
        loss, logits = super().forward(h, labels)
        return loss, logits, logits.argmax(-1)


def test_no_grad_graph_that_reads_its_logits_is_left_as_stock_with_the_reason(chunkce_logs):
    """Without grad, logits another reader needs are computed anyway, and stock Inductor fuses the
    upcast and log-softmax into reductions over them: the rewrite would only add a projection. The
    site is left as stock (no op node, the graph's projection read by the loss), said in the report
    and explain(), logged at INFO, never warned. Under grad the same model is rewritten (the
    rewrite saves the log-softmax kept for backward). Failed before: rewritten with the logits kept."""
    graphs = []
    compiled, stock, model, reference = compiled_pair(ReadsLogits(), graphs=graphs)
    h, labels = batch()
    with torch.no_grad():
        loss, logits, predicted = compiled(h, labels)
        expected = stock(h, labels)
    (graph,) = graphs
    assert not [n for n in graph.nodes if n.target is OP]
    assert any(n.op == "call_function" and n.target is F.cross_entropy for n in graph.nodes)
    assert type(logits) is torch.Tensor
    torch.testing.assert_close((loss, logits, predicted), expected)
    stats = counters["chunkce"]
    assert (stats["sites_found"], stats["sites_left"], stats["sites_rewritten"], stats["sites_refused"]) == (
        1, 1, 0, 0)
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason, record.reason_key) == (Decision.LEFT, NO_GRAD_LOGITS_READ, "no_grad_logits_read")
    assert not [r for r in chunkce_logs.records if r.levelno >= logging.WARNING and r.name.startswith("compile_pass")]
    assert any("left" in r.getMessage() and r.levelno == logging.INFO for r in chunkce_logs.records)
    with torch.no_grad():
        explained = str(compile_pass.explain(ReadsLogits(), h, labels))
    assert "left as stock" in explained and "computes no gradient" in explained

    counters.clear()
    torch._dynamo.reset()
    loss, logits, predicted = torch.compile(ReadsLogits(), backend="chunkce",
                                            options={"inner_backend": "aot_eager"})(h, labels)
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["sites_left"] == 0
    torch.testing.assert_close((loss, logits, predicted), tuple(t.detach() for t in expected))


def test_the_other_behaviours_are_one_option_away():
    h, labels = batch()
    _, kept = torch.compile(LM(), backend="chunkce", options={"returned_logits": "keep",
                                                               "inner_backend": "aot_eager"})(h, labels)
    assert type(kept) is torch.Tensor and counters["chunkce"]["logits_kept"] == 1
    _, dropped = torch.compile(LM(), backend="chunkce", options={"returned_logits": "drop",
                                                                  "inner_backend": "aot_eager"})(h, labels)
    with pytest.raises(RuntimeError, match="were not computed"):
        dropped.sum()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match="returned_logits to be one of 'lazy', 'keep', 'drop', got 'eager'"):
        torch.compile(LM(), backend="chunkce", options={"returned_logits": "eager"})(h, labels)
    from compile_pass import Options
    unknown = "unknown option 'drop_unused_logits'"
    for given in (True, False):  # a name that is no option, either value, in both ways of giving options
        with pytest.raises(TypeError, match="unexpected keyword argument 'drop_unused_logits'"):
            Options(drop_unused_logits=given)
        with pytest.raises(ValueError, match=unknown):
            Options.from_mapping({"drop_unused_logits": given, "returned_logits": "drop"})
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=unknown):
            torch.compile(LM(), backend="chunkce", options={"drop_unused_logits": given})(h, labels)


def test_options_has_its_fields_only():
    """``Options`` is a plain frozen dataclass: its signature is its fields', ``replace``, pickle
    and copy keep it, and a name that is no field is an unknown keyword."""
    import inspect
    from dataclasses import fields, replace

    from compile_pass import Options

    options = Options(returned_logits="drop")
    assert not hasattr(options, "drop_unused_logits") and not hasattr(Options, "drop_unused_logits")
    assert "drop_unused_logits" not in {f.name for f in fields(Options)}
    assert list(inspect.signature(Options).parameters) == [f.name for f in fields(Options)]
    assert replace(options, chunk_size=8) == Options(returned_logits="drop", chunk_size=8)
    assert pickle.loads(pickle.dumps(options)) == options and copy.copy(options) == options
    with pytest.raises(TypeError, match="unexpected keyword argument 'drop_unused_logits'"):
        replace(options, drop_unused_logits=True)


def test_holding_the_output_across_backward_and_the_next_step_keeps_only_the_hidden_states():
    """What a held LazyLogits keeps alive: the step's hidden states ``[N, H]`` (and references
    to the head's tensors); kept logits would keep ``[N, V]``. Measured as the bytes still live
    after a step, with and without the output held, then the next step's peak."""
    n, vocab = 256, 8192
    torch.manual_seed(0)

    class Wide(LM):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, vocab, bias=False)

        def forward(self, h, labels):
            logits = self.lm_head(torch.relu(self.body(h)))
            return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)), logits

    def held_bytes(options, hold):
        model = Wide()
        compiled = torch.compile(model, backend="chunkce", options={**options, "inner_backend": "aot_eager"})
        h, labels = torch.randn(1, n, H), torch.randint(0, vocab, (1, n))
        compiled(h, labels)[0].backward()  # warm-up: compiled, and the parameters' grads exist
        with PeakMemory() as step:
            out = compiled(h, labels)
            out[0].backward()
            held = out if hold else None
            del out
        with PeakMemory() as next_step:
            compiled(h, labels)[0].backward()
        del held
        return step.end_bytes, next_step.peak_bytes

    (lazy_end, lazy_next), (free_end, free_next) = held_bytes({}, True), held_bytes({}, False)
    kept_end, _ = held_bytes({"returned_logits": "keep"}, True)
    hidden_bytes, logits_bytes = n * H * 4, n * vocab * 4
    assert lazy_end - free_end <= hidden_bytes + 4096, (lazy_end, free_end)
    assert kept_end - free_end >= logits_bytes  # what the held logits cost when kept
    assert abs(lazy_next - free_next) <= hidden_bytes + 4096, (lazy_next, free_next)


GRAPH_PASSES = {
    "pre_grad": lambda graph: compile_pass.ChunkcePreGradPass()(graph),
    "pre_grad_lazy": lambda graph: compile_pass.ChunkcePreGradPass({"returned_logits": "lazy"})(graph),
    "fuse_linear_cross_entropy": lambda graph: compile_pass.fuse_linear_cross_entropy(graph),
}


@pytest.mark.parametrize("graph_pass", GRAPH_PASSES)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_pre_grad_pass_leaves_a_no_grad_site_whose_logits_it_must_return_as_stock(grad, graph_pass):
    """The pre-grad pass and the public graph pass cannot make returned logits lazy (they cannot
    wrap the compiled graph), so in a graph without grad they would keep them and project again:
    they leave that site as stock (the graph after the pass runs stock's ops, outputs exact),
    deciding the logits' fate as the backend does with what they can take out; in a training
    graph they rewrite the loss and keep the logits. The pass is run, as Inductor runs it, on the
    graph Dynamo captured. Failed before for ``fuse_linear_cross_entropy`` (``returned_logits``
    'lazy' by default): the site rewritten, the logits still computed (a second projection)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    model = LM(bias=True)
    h, labels = batch()
    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=capture)(h, labels)
        ((gm, example_inputs),) = captured
        GRAPH_PASSES[graph_pass](gm.graph)
        gm.recompile()
        got, expected = gm(*example_inputs), model(h, labels)
    (record,) = compile_pass.last_report().records
    ops = [n for n in gm.graph.nodes if n.target is OP]
    if grad:
        assert (record.decision, len(ops)) == ("rewritten", 1)
    else:
        assert (record.decision, record.reason_key, ops) == (Decision.LEFT, "no_grad_logits_read", [])
    torch.testing.assert_close(tuple(got), tuple(expected))


def test_a_moved_fsdp2_internal_makes_every_read_raise(monkeypatch):
    """Where a torch internal the staleness check needs is missing (FSDP2's registry of the modules
    ``fully_shard`` applies to, moved here through ``torch_internals``' seam), the step runs as stock's
    and every read of its lazy logits raises, naming torch's version and ``returned_logits``
    'keep': never values chunkce cannot vouch for."""
    import torch.distributed.fsdp  # noqa: F401 - FSDP2 loaded: the check looks for its unsharded parameters

    from compile_pass import torch_internals

    monkeypatch.setattr(torch_internals, "module_state", torch_internals.Private(
        "torch.distributed._composable_state:_moved_away", "a torch release that moved it"))
    compiled, reference, *_ = compiled_pair(LM())
    loss, logits = compiled(*batch())
    ref_loss, _ = reference(*batch())
    torch.testing.assert_close(loss, ref_loss)
    assert isinstance(logits, LazyLogits)
    for read in (lambda: logits.argmax(-1), lambda: logits.sum(), lambda: logits.tolist()):
        with pytest.raises(StaleLogitsError, match=rf"on torch {re.escape(torch.__version__)} chunkce cannot tell "
                                                   r"whether FSDP2 changed .*_moved_away.*returned_logits': 'keep'"):
            read()
