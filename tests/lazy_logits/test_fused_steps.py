"""Fused reads of the logits a compiled step returns: GRPO, DPO and evaluation steps as TRL writes
them (:mod:`rl_steps`) on ``torch.compile(model, backend="chunkce")``'s ``LazyLogits``, against the
same steps on stock compile's logits: the loss, the metrics and every parameter's gradient equal
(``torch.testing.assert_close``), the op called and the recipe (which computes ``[N, V]``) never
run. The head descriptions the pass reads (bias, an absorbed scale, casts, autocast) are each
fused. The tiny model of ``test_lazy_logits`` on ``aot_eager`` here; a Llama on Inductor (slow).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from lazy_reads import counting, leaves, make_lazy
from test_lazy_logits import LM, B, T, assert_same_grads, batch, compiled_pair
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from benchmarks.rl_steps import dpo_loss, eval_argmax, grpo_loss, token_log_probs
from compile_pass import LazyLogits
from compile_pass.graph.returned_logits import STAND_IN
from compile_pass.memory import PeakMemory

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")


def rl_inputs(seed=0, dtype=torch.float32):
    """Advantages ``[B]``, a completion mask ``[B, T - 1]``, a per-token temperature ``[B, T - 1]``."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T - 1, dtype=torch.bool)
    mask[0, :3] = False  # the prompt
    return torch.randn(B, generator=gen), mask, (torch.rand(B, T - 1, generator=gen) + 0.5).to(dtype)


def grpo_step(compiled, h, labels, temperature):
    """An old-policy forward under no_grad, then the policy's: the loss, backward."""
    advantages, mask, _ = rl_inputs()
    with torch.no_grad():
        old_logps = token_log_probs(compiled(h, labels)[1], labels, temperature)
    _, logits = compiled(h, labels)
    loss = grpo_loss(logits, labels, old_logps, advantages, mask, temperature)
    loss.backward()
    return loss.detach(), old_logps, logits


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, "number"), (torch.float32, "per_row"),
                                               (torch.bfloat16, "per_row")], ids=["fp32", "fp32_per_row", "bf16_per_row"])
def test_a_grpo_step_reads_through_the_op_and_gets_stocks_loss_and_gradients(dtype, temperature):
    compiled, stock, model, reference = compiled_pair(LM(bias=True).to(dtype))
    h, labels = batch()
    h = h.to(dtype)
    t = 0.7 if temperature == "number" else rl_inputs(dtype=dtype)[2]
    with counting() as calls:
        loss, old_logps, logits = grpo_step(compiled, h, labels, t)
    expected_loss, expected_old, _ = grpo_step(stock, h, labels, t)
    assert type(logits) is LazyLogits and not logits.is_computed
    assert (calls.recipes, calls.walks, calls.walk_backwards) == (0, 2, 1)  # old policy, policy; its backward
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(old_logps, expected_old, **tolerance)
    torch.testing.assert_close(loss, expected_loss, **tolerance)
    if dtype == torch.float32:
        assert_same_grads(model, reference)
    else:  # bf16: stock's bf16 gradients differ from fp32 by rounding; chunkce's by no more
        fp32 = copy.deepcopy(reference).float()
        grpo_step(torch.compile(fp32, backend="aot_eager"), h.float(), labels, t.float())
        for (name, p), (_, q), (_, r) in zip(model.named_parameters(), reference.named_parameters(),
                                             fp32.named_parameters()):
            err, stock_err = ((g.float() - r.grad).norm() / r.grad.norm() for g in (p.grad, q.grad))
            assert err <= max(2 * stock_err, 2 ** -7), (name, err, stock_err)


def test_a_dpo_step_gets_stocks_loss_metrics_and_gradients():
    compiled, stock, model, reference = compiled_pair(LM(bias=True))
    h, labels = batch()
    h = torch.cat([h, h.flip(1)])  # chosen, rejected
    labels = torch.cat([labels, labels.flip(1)])
    mask = torch.ones(2 * B, T - 1, dtype=torch.bool)
    mask[:, :2] = False
    results = {}
    for name, step in (("lazy", compiled), ("stock", stock)):
        with torch.no_grad():
            reference_logits = step(h, labels)[1]
        with counting() as calls:
            loss, metrics = dpo_loss(step(h, labels)[1], reference_logits, labels, mask)
            loss.backward()
        results[name] = (loss.detach(), metrics, calls)
    torch.testing.assert_close(results["lazy"][:2], results["stock"][:2])
    assert_same_grads(model, reference)
    calls = results["lazy"][2]
    # the policy's log-probs; the reference's gather the statistics its no-grad step's loss walk kept (the
    # sliced logits' loss walks every row: graph/plan.py), and argmax shares the policy's
    assert calls.walks == 1 and calls.walk_backwards == 1
    assert calls.recipes == 0  # logits[mask].mean(): the policy walk's row sums of the masked rows


def test_an_eval_metric_under_no_grad_computes_no_logits():
    compiled, stock, _, _ = compiled_pair(LM())
    h, labels = batch()
    with torch.no_grad(), counting() as calls:
        _, logits = compiled(h, labels)
        predicted = eval_argmax(logits)
    with torch.no_grad():
        expected = eval_argmax(stock(h, labels)[1])
    assert torch.equal(predicted, expected) and not logits.is_computed
    # the argmax reads the statistics the step's one walk kept (its loss over the sliced logits walks every
    # row: graph/plan.py); was a maximum walk at the read
    assert (calls.walks, calls.maximum_walks, calls.recipes) == (0, 0, 0)


class AutocastLM(LM):
    def forward(self, h, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(h, labels)


HEADS = {
    "plain": lambda: LM(), "bias": lambda: LM(bias=True), "tensor_scale": lambda: LM(scale=torch.tensor(0.5)),
    "float_scale": lambda: LM(scale=2.0), "cast_fp64": lambda: LM(returned_dtype=torch.float64),
    "bf16_float": lambda: LM(bias=True, returned_dtype=torch.float32).to(torch.bfloat16),
    "bf16_scale": lambda: LM(scale=torch.tensor(0.5)).to(torch.bfloat16),
    "autocast": lambda: AutocastLM(bias=True),
}


@pytest.mark.parametrize("head", HEADS)
def test_every_head_the_pass_reads_is_fused(head):
    """The pass's description of each head (graph/returned_logits.py): reads go through the op, equal to stock's."""
    model = HEADS[head]()
    compiled, stock, model, reference = compiled_pair(model)
    h, labels = batch()
    h = h.to(model.body.weight.dtype)

    def reads(logits):
        z = logits[:, :-1] / 0.9
        return selective_log_softmax(z, labels[:, 1:]), entropy_from_logits(z), logits.argmax(-1)

    with counting() as calls:
        loss, logits = compiled(h, labels)
        got = reads(logits)
        (loss + got[0].float().sum() + got[1].float().sum()).backward()
    assert logits._source.recipe.head is not None
    expected_loss, expected_logits = stock(h, labels)
    expected = reads(expected_logits)
    (expected_loss + expected[0].float().sum() + expected[1].float().sum()).backward()
    assert (calls.recipes, calls.walks) == (0, 2)  # the tempered rows, the logits themselves (argmax)
    if model.body.weight.dtype == torch.float32 and head != "autocast":
        torch.testing.assert_close(got, expected)
        assert_same_grads(model, reference)
        return
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)  # bf16 math: close in norm, bf16's rounding
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad.float() - q.grad.float()).norm() <= 2 ** -6 * q.grad.float().norm(), name


def test_fused_reads_and_their_backward_build_no_logits_sized_tensor(monkeypatch):
    """TRL's log-probs and entropy of lazy logits, forward and backward, peak under a quarter of one
    ``[N, V]`` fp32 tensor and do not grow with V (measured; 256 KiB tiles, eager kernels)."""
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", str(256 << 10))
    n, peaks = 256, {}
    for vocab in (32768, 131072):
        side, _ = leaves((1, n, 16, vocab), bias=False)
        logits = make_lazy(side)
        labels = torch.randint(0, vocab, (1, n))
        with PeakMemory() as mem:
            z = logits / 0.7
            (selective_log_softmax(z, labels).sum() + entropy_from_logits(z).sum()).backward()
        peaks[vocab] = mem.peak_bytes
        assert mem.peak_bytes < n * vocab * 4 // 4, (vocab, mem.peak_bytes)
    assert peaks[131072] - peaks[32768] < 2 * (131072 - 32768) * 16 * 4, peaks  # grows by the weight's gradients only


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad_metric", "with_grad"])
def test_a_masked_mean_of_lazy_logits_builds_no_logits_sized_tensor(monkeypatch, grad):
    """TRL DPO's metric ``logits[:half, :-1][mask].mean()`` on lazy logits nothing was read of: one
    walk for the row sums of the masked rows (and its backward), stock's value (and gradients),
    peaking under a tenth of one ``[N, V]`` fp32 tensor (measured; 256 KiB tiles, eager kernels)."""
    monkeypatch.setenv("CHUNKCE_CHUNK_BYTES", str(256 << 10))
    n, vocab = 256, 32768
    lazy_side, stock_side = leaves((2, n, 16, vocab), bias=True)
    mask = torch.rand(1, n - 1, generator=torch.Generator().manual_seed(0)) > 0.3

    def metric(logits):
        return logits[:1, :-1][mask].mean()

    logits = make_lazy(lazy_side)
    with counting() as calls, PeakMemory() as mem, torch.set_grad_enabled(grad):
        got = metric(logits)
        if grad:
            got.backward()
    assert (calls.recipes, calls.walks, calls.walk_backwards) == (0, 1, int(grad))
    assert mem.peak_bytes < 2 * n * vocab * 4 // 10, mem.peak_bytes
    with torch.set_grad_enabled(grad):
        expected = metric(F.linear(stock_side.hidden, stock_side.weight, stock_side.bias))
        if grad:
            expected.backward()
    torch.testing.assert_close(got, expected)
    for name, a, b in (("hidden", lazy_side.hidden, stock_side.hidden), ("weight", lazy_side.weight, stock_side.weight),
                       ("bias", lazy_side.bias, stock_side.bias)):
        if grad:
            torch.testing.assert_close(a.grad, b.grad, msg=lambda m, name=name: f"d {name}: {m}")


@pytest.mark.slow
def test_a_llama_grpo_step_on_inductor_gets_stocks_loss_and_every_gradient():
    """A Llama from a config, the whole model compiled with chunkce (Inductor inside) and with stock
    Inductor, called with labels: the GRPO step's loss and every parameter gradient equal, fused."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 257, (B, T), generator=torch.Generator().manual_seed(1))
    advantages, mask, _ = rl_inputs()
    results = []
    for net, backend in ((model, "chunkce"), (reference, "inductor")):
        compiled = torch.compile(net, backend=backend)
        with counting() as calls:
            with torch.no_grad():
                old_logps = token_log_probs(compiled(input_ids=ids, labels=ids).logits, ids, 0.7)
            logits = compiled(input_ids=ids, labels=ids).logits
            loss = grpo_loss(logits, ids, old_logps, advantages, mask, 0.7)
            loss.backward()
        results.append((loss.detach(), old_logps, calls))
    assert (results[0][2].walks, results[0][2].recipes) == (2, 0)
    torch.testing.assert_close(results[0][:2], results[1][:2])
    assert_same_grads(model, reference)


def tiny_llama(vocab=2048):
    """A one-layer Llama from a config; its vocabulary a vocabulary's (no_site.is_vocabulary)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def test_a_grpo_step_without_labels_gets_lazy_logits_stocks_loss_and_every_gradient():
    """The policy and old-policy forwards called without labels (no loss in the graph): the logits
    are returned lazy, the step reads them through the op, and the captured graph computes no
    ``[N, V]`` value; loss, old log-probs and every gradient equal stock aot_eager's."""
    graphs = []
    compiled, stock, model, reference = compiled_pair(tiny_llama(), graphs=graphs)
    ids = torch.randint(0, 2048, (B, T), generator=torch.Generator().manual_seed(1))
    advantages, mask, _ = rl_inputs()
    results = []
    for step in (compiled, stock):
        with counting() as calls:
            with torch.no_grad():
                old_logps = token_log_probs(step(input_ids=ids).logits, ids, 0.7)
            logits = step(input_ids=ids).logits
            loss = grpo_loss(logits, ids, old_logps, advantages, mask, 0.7)
            loss.backward()
        results.append((loss.detach(), old_logps, calls, type(logits)))
    (loss, old, calls, kind), (expected_loss, expected_old, _, _) = results
    assert kind is LazyLogits and (calls.walks, calls.walk_backwards, calls.recipes) == (2, 1, 0)
    torch.testing.assert_close((loss, old), (expected_loss, expected_old))
    assert_same_grads(model, reference)
    assert graphs, "the pass ran"
    for graph in graphs:  # the stand-in aside, no value of the logits' size
        wide = [n for n in graph.nodes if isinstance(v := n.meta.get("example_value"), torch.Tensor)
                and v.shape[-1:] == (2048,) and v.numel() >= B * T * 2048 and not n.meta.get(STAND_IN)]
        assert wide == [], wide


def test_a_decode_steps_logits_stay_real_and_an_eval_forward_without_labels_is_lazy():
    """``[B, 1, V]`` logits (a decode step, or HF's ``logits_to_keep=1``) are computed in the step;
    a forward without labels under no_grad returns lazy logits whose argmax is stock's."""
    compiled, stock, _, _ = compiled_pair(tiny_llama().eval())
    ids = torch.randint(0, 2048, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        decode = compiled(input_ids=ids[:, :1]).logits
        assert type(decode) is torch.Tensor
        torch.testing.assert_close(decode, stock(input_ids=ids[:, :1]).logits)
        kept = compiled(input_ids=ids, logits_to_keep=1).logits
        assert type(kept) is torch.Tensor and kept.shape == (B, 1, 2048)
        with counting() as calls:
            logits = compiled(input_ids=ids).logits
            predicted = eval_argmax(logits)
        assert type(logits) is LazyLogits and (calls.walks, calls.maximum_walks, calls.recipes) == (1, 1, 0)
        assert torch.equal(predicted, eval_argmax(stock(input_ids=ids).logits))


def test_a_loss_computed_outside_from_logits_without_labels_is_fused_in_every_reduction():
    """``F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction=r)`` in eager code after a
    forward without labels (ignored rows included): stock's loss and gradients, no recipe run."""
    compiled, stock, model, reference = compiled_pair(tiny_llama())
    ids = torch.randint(0, 2048, (B, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    for reduction in ("mean", "sum", "none"):
        losses = []
        for step in (compiled, stock):
            with counting() as calls:
                logits = step(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits.view(-1, 2048), labels.view(-1), reduction=reduction)
                loss.sum().backward()
            losses.append((loss.detach(), calls.recipes))
        torch.testing.assert_close(losses[0][0], losses[1][0])
        assert losses[0][1] == 0, reduction
    assert_same_grads(model, reference)
    with counting():
        logits = compiled(input_ids=ids).logits
        everything_ignored = torch.full_like(labels, -100).view(-1)
        assert torch.isnan(torch.nn.functional.cross_entropy(logits.view(-1, 2048), everything_ignored))
