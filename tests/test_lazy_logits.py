"""Returned logits are lazy by default: not computed in the step, exact when read, never stale.

``torch.compile(model, backend="chunkce")`` with no options: a training graph's logits
that only the graph output reads leave the graph (proven on the graph the inner backend
got), and the step returns a ``LazyLogits``. Every read here is compared with stock
compile's logits (``aot_eager``), every gradient of a loss that reads them with stock's,
and each way the tensors they are computed from can change makes the read raise.
"""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from compile_pass.graph.lazy_tensor import LazyLogits, StaleLogitsError
from compile_pass.graph.logits_drop import DROPPED
from compile_pass.memory import PeakMemory

B, T, H, V = 2, 8, 16, 96
OP = torch.ops.chunkce.linear_cross_entropy.default
pytestmark = pytest.mark.usefixtures("fresh_compile")


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


def assert_no_logits_in(graph):
    """The op computes the loss, and no value of the logits' size is computed (the stand-in aside)."""
    assert [n.target for n in graph.nodes if n.target == OP] == [OP]
    logits_like = [n for n in graph.nodes if isinstance(v := n.meta.get("example_value"), torch.Tensor)
                   and v.numel() == B * T * V and n.op != "placeholder" and not n.meta.get(DROPPED)]
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
    torch.testing.assert_close(logits.argmax(-1), expected_logits.argmax(-1), rtol=0, atol=0)  # after backward
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


def test_no_grad_graphs_return_real_logits():
    compiled, _, model, _ = compiled_pair(LM())
    h, labels = batch()
    with torch.no_grad():
        _, logits = compiled(h, labels)
    assert type(logits) is torch.Tensor
    torch.testing.assert_close(logits, model(h, labels)[1].detach())


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
    removed = "option drop_unused_logits was removed; pass returned_logits='drop'"
    for given in (True, False):  # the removed spelling, either value, in both ways of giving options
        with pytest.raises(ValueError, match=removed):
            Options(drop_unused_logits=given)
        with pytest.raises(ValueError, match=removed):
            Options.from_mapping({"drop_unused_logits": given, "returned_logits": "drop"})
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=removed):
            torch.compile(LM(), backend="chunkce", options={"drop_unused_logits": given})(h, labels)


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
