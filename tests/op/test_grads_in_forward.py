"""The opt-in grads-in-forward mode against torch's unfused F.linear + F.cross_entropy.

Loss and every gradient, every scalar reduction (class weights, smoothing,
ignored targets, bias), fp32 and a tiny bf16 case; backward hands over the saved
gradients with no copy, and a second backward under ``retain_graph`` raises; what saved-tensor hooks see; the backend option, proven on
the graph; ``reduction="none"`` and no-grad calls fall back to the recompute op;
torch.func and double backward refused.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from builders import OP
from rewrite_proof import compare_with_stock
from torch.testing import assert_close

from compile_pass import linear_cross_entropy
from compile_pass.memory import measure_peak_bytes
from compile_pass.op import grads_in_forward

GIF_OP = torch.ops.chunkce.linear_cross_entropy_grads_in_forward.default
N, H, V = 37, 24, 123  # odd sizes: ragged last chunk with chunk_size 8
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float64: {"atol": 1e-10, "rtol": 1e-10}}


def make_inputs(dtype=torch.float32, bias=False, ignored=5, seed=0, n=N, h=H, v=V):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    target[:ignored] = -100
    b = torch.randn(v, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    return hidden, weight, target, b


def unfused(hidden, lm_weight, target, bias, **kwargs):
    kwargs.pop("chunk_size", None)
    return F.cross_entropy(F.linear(hidden, lm_weight, bias), target, **kwargs)


def gif(hidden, lm_weight, target, bias, **kwargs):
    return linear_cross_entropy(hidden, lm_weight, target, linear_bias=bias, grads_in_forward=True, **kwargs)


def loss_and_grads(fn, hidden, lm_weight, target, bias, grad_scale=0.7, **kwargs):
    loss = fn(hidden, lm_weight, target, bias, **kwargs)
    params = [t for t in (hidden, lm_weight, bias) if t is not None]
    return (loss, *torch.autograd.grad((loss * grad_scale).sum(), params))  # upstream gradient != 1


class gif_calls:
    """Counts the grads-in-forward loop's runs (the op's body calls its module's loop)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = grads_in_forward.chunked_grads_in_forward

        def counting(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(grads_in_forward, "chunked_grads_in_forward", counting)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", [
    {},
    {"bias": True},
    {"class_weight": True},
    {"label_smoothing": 0.1},
    {"class_weight": True, "label_smoothing": 0.2, "bias": True},
    {"ignore_index": 7},
    {"chunk_size": N},  # one chunk: the weight gradient written by out=
])
def test_matches_torch(monkeypatch, reduction, case):
    calls = gif_calls(monkeypatch)
    case = dict(case)
    hidden, weight, target, bias = make_inputs(bias=case.pop("bias", False))
    kwargs = {"reduction": reduction, "chunk_size": case.pop("chunk_size", 8), **case}
    if kwargs.pop("class_weight", False):
        kwargs["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.5
    if kwargs.get("ignore_index", -100) != -100:
        target = torch.where(target == -100, kwargs["ignore_index"], target)
    ours = loss_and_grads(gif, hidden, weight, target, bias, **kwargs)
    theirs = loss_and_grads(unfused, hidden, weight, target, bias, **kwargs)
    assert calls.count == 1
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b, **TOL[torch.float32])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float64_exact(reduction):
    inputs = make_inputs(dtype=torch.float64, bias=True)
    ours = loss_and_grads(gif, *inputs, reduction=reduction, chunk_size=8, label_smoothing=0.1)
    theirs = loss_and_grads(unfused, *inputs, reduction=reduction, label_smoothing=0.1)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b, **TOL[torch.float64])


def test_all_ignored():
    hidden, weight, target, _ = make_inputs(ignored=N)
    loss = gif(hidden, weight, target, None, chunk_size=8)  # mean over no tokens: nan, as torch's
    assert torch.isnan(loss) and torch.isnan(unfused(hidden, weight, target, None))
    loss = gif(hidden, weight, target, None, reduction="sum", chunk_size=8)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0 and all(bool((g == 0).all()) for g in grads)


def test_bfloat16_error_no_worse_than_unfused():
    # tiny: bf16 matmuls are emulated on CPU. Error against the fp64 truth, per output.
    inputs = make_inputs(dtype=torch.bfloat16, bias=True, n=20, h=16, v=40)
    truth_inputs = [t.detach().double().requires_grad_() if t is not None and t.is_floating_point()
                    else t for t in inputs]
    truth = loss_and_grads(unfused, *truth_inputs, label_smoothing=0.1)
    ours = loss_and_grads(gif, *inputs, chunk_size=8, label_smoothing=0.1, logits_dtype=torch.float32)
    theirs = loss_and_grads(lambda h, w, t, b, **k: unfused(h, w, t, b, **k).float(), *inputs,
                            label_smoothing=0.1)
    for name, a, b, t in zip(("loss", "hidden", "weight", "bias"), ours, theirs, truth, strict=True):
        assert a.dtype == b.dtype, name
        ours_error = (a.double() - t).abs().max().item()
        unfused_error = (b.double() - t).abs().max().item()
        # one more bf16 rounding (the saved gradient, then times the upstream gradient)
        assert ours_error <= 2 * unfused_error + 1e-3, (name, ours_error, unfused_error)


IDENTITY_HOOKS = ("no hooks", "identity hooks", "save_on_cpu")


def _saved_tensor_hooks(kind):
    if kind == "identity hooks":  # hands back the very tensors it was given: no version check by autograd
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    if kind == "save_on_cpu":  # on CPU, .cpu() and .to() hand back the same tensors
        return torch.autograd.graph.save_on_cpu()
    return contextlib.nullcontext()


@pytest.mark.parametrize("hooks", IDENTITY_HOOKS)
def test_retain_graph_second_backward_raises_never_wrong(hooks):
    # The first backward scales the saved gradients in place and hands them over (no copy),
    # so a second one through the same graph must raise, whatever saved-tensor hooks did
    # (a copying backward would give 2x the gradients; an unchecked in-place one would give
    # grad_total * (grad_total * saved): wrong, silently).
    hidden, weight, target, bias = make_inputs(bias=True)
    with _saved_tensor_hooks(hooks):
        loss = gif(hidden, weight, target, bias, chunk_size=8)
    (loss * 0.7).backward(retain_graph=True)
    reference = loss_and_grads(unfused, *[t.detach().requires_grad_() for t in (hidden, weight)], target,
                               bias.detach().requires_grad_(), grad_scale=0.7)
    for t, r in zip((hidden, weight, bias), reference[1:], strict=True):
        assert_close(t.grad, r, **TOL[torch.float32])
    with pytest.raises(NotImplementedError, match="expected one backward through a grads_in_forward=True "
                                                  "loss, got a second one .retain_graph=True.*grads_in_forward=False"):
        loss.backward()


def test_backward_hands_over_the_saved_gradients_with_no_copy():
    # The gradients computed in forward become .grad themselves: backward allocates nothing
    # gradient-sized (before: a new product of each, and zero gradients materialised for the
    # op's four non-differentiable outputs).
    n, h, v = 256, 64, 512
    hidden, weight, target, bias = make_inputs(bias=True, n=n, h=h, v=v)
    pointers = []
    real = grads_in_forward.chunked_grads_in_forward

    def recording(*args, **kwargs):
        outputs = real(*args, **kwargs)
        pointers.extend(t.data_ptr() for t in outputs[1:4])
        return outputs

    grads_in_forward.chunked_grads_in_forward = recording
    try:
        loss = gif(hidden, weight, target, bias)
    finally:
        grads_in_forward.chunked_grads_in_forward = real
    _, peak = measure_peak_bytes(loss.backward)
    assert [t.grad.data_ptr() for t in (hidden, weight, bias)] == pointers
    assert peak <= 64 * 1024, peak  # a few [N] / 0-d temporaries; one gradient is (N + V) H * 4 = 192 KiB
    reference = loss_and_grads(unfused, *[t.detach().requires_grad_() for t in (hidden, weight)], target,
                               bias.detach().requires_grad_(), grad_scale=1.0)
    for t, r in zip((hidden, weight, bias), reference[1:], strict=True):
        assert_close(t.grad, r, **TOL[torch.float32])


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_backend_retain_graph_second_backward_is_exact_or_raises(inner):
    # Compiled, AOTAutograd owns the backward graph: a second backward is either exact (its
    # graph computes the product out of place) or refused (its donated-buffer check), never wrong.
    torch._dynamo.reset()
    model = Head("mean")
    hidden = torch.randn(2, 9, H, requires_grad=True)
    labels = torch.randint(0, V, (2, 9))
    compiled = torch.compile(model, backend="chunkce",
                             options={"grads_in_forward": True, "chunk_size": 8, "inner_backend": inner})
    loss = compiled(hidden, labels)
    loss.backward(retain_graph=True)
    first = [hidden.grad.clone(), model.lm_head.weight.grad.clone()]
    reference = torch.autograd.grad(model(hidden, labels), (hidden, model.lm_head.weight))
    for g, r in zip(first, reference, strict=True):
        assert_close(g, r, **TOL[torch.float32])
    try:
        loss.backward()
    except (RuntimeError, NotImplementedError) as error:
        assert "retain_graph" in str(error), error
    else:
        for g, t in zip(first, (hidden, model.lm_head.weight), strict=True):
            assert_close(t.grad, 2 * g, **TOL[torch.float32])
    torch._dynamo.reset()


class PackRecorder(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that record the shape and dtype of every tensor packed."""

    def __init__(self):
        self.packed = []
        self.unpacked = 0

        def pack(tensor):
            self.packed.append((tuple(tensor.shape), tensor.dtype))
            return tensor

        def unpack(tensor):
            self.unpacked += 1
            return tensor

        super().__init__(pack, unpack)


def test_saved_gradients_reach_saved_tensor_hooks():
    hidden, weight, target, bias = make_inputs(bias=True)
    hooks = PackRecorder()
    with hooks:
        loss = gif(hidden, weight, target, bias, chunk_size=8)
    # exactly the three gradients, each once, and the [N] bool mask of counted tokens (and the
    # mean's 0-d denominator): no inputs, no logits
    big = sorted((shape, dtype) for shape, dtype in hooks.packed if math.prod(shape) > 1)
    assert big == sorted([((N, H), torch.float32), ((V, H), torch.float32), ((V,), torch.float32),
                          ((N,), torch.bool)]), hooks.packed
    packed_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in hooks.packed)
    assert packed_bytes <= (N * H + V * H + V) * 4 + N + 64
    loss.backward()
    assert hooks.unpacked == len(hooks.packed)
    reference = loss_and_grads(unfused, *[t.detach().requires_grad_() for t in (hidden, weight)], target,
                               bias.detach().requires_grad_(), grad_scale=1.0)
    for t, r in zip((hidden, weight, bias), reference[1:], strict=True):
        assert_close(t.grad, r, **TOL[torch.float32])


def test_frozen_weight_not_computed():
    hidden, weight, target, _ = make_inputs()
    weight.requires_grad_(False)
    hooks = PackRecorder()
    with hooks:
        loss = gif(hidden, weight, target, None, chunk_size=8)
    assert sorted(shape for shape, _ in hooks.packed if math.prod(shape) > 1) == [(N,), (N, H)]  # + the mask
    (grad,) = torch.autograd.grad(loss, hidden)
    assert_close(grad, torch.autograd.grad(unfused(hidden, weight, target, None), hidden)[0],
                 **TOL[torch.float32])


def test_reduction_none_and_no_grad_use_the_recompute_op(monkeypatch):
    calls = gif_calls(monkeypatch)
    hidden, weight, target, _ = make_inputs()
    ours = loss_and_grads(gif, hidden, weight, target, None, reduction="none", chunk_size=8)
    theirs = loss_and_grads(unfused, hidden, weight, target, None, reduction="none")
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b, **TOL[torch.float32])
    with torch.no_grad():
        assert_close(gif(hidden, weight, target, None, chunk_size=8), unfused(hidden, weight, target, None))
    assert calls.count == 0


def test_torch_func_and_double_backward_refused():
    hidden, weight, target, _ = make_inputs()
    with pytest.raises(NotImplementedError, match="grads_in_forward=True is not supported under torch.func"):
        torch.func.grad(lambda h: gif(h, weight.detach(), target, None, chunk_size=8))(hidden.detach())
    loss = gif(hidden, weight, target, None, chunk_size=8)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_bad_flag_type():
    hidden, weight, target, _ = make_inputs()
    with pytest.raises(TypeError, match="expected grads_in_forward to be a bool"):
        linear_cross_entropy(hidden, weight, target, grads_in_forward=1)


@pytest.mark.slow
def test_opcheck():
    hidden, weight, target, bias = make_inputs(bias=True)
    args = (hidden.detach(), weight.detach(), target, bias.detach(), None, None)
    options = {"ignore_index": -100, "label_smoothing": 0.1, "logits_dtype": torch.float32, "chunk_size": 8}
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        torch.library.opcheck(GIF_OP, args, {**options, "output_mask": mask})


class Head(torch.nn.Module):
    def __init__(self, reduction="mean", bias=True):
        super().__init__()
        self.lm_head = torch.nn.Linear(H, V, bias=bias)
        self.reduction = reduction

    def forward(self, hidden, labels):
        logits = self.lm_head(hidden).float()
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction=self.reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backend_option_rewrites_to_the_grads_in_forward_op(reduction):
    torch.manual_seed(0)
    model = Head(reduction)
    hidden = torch.randn(2, 9, H, requires_grad=True)
    labels = torch.randint(0, V, (2, 9))
    labels[0, :2] = -100
    recorder, _ = compare_with_stock(model, hidden, labels,
                                     options={"grads_in_forward": True, "chunk_size": 8},
                                     atol=2e-5, rtol=2e-5)
    gif_nodes = sum(fact.target is GIF_OP for graph in recorder.graphs for fact in graph)
    assert gif_nodes == 1 and recorder.op_count() == 0
    assert recorder.logits_like(18, V) == []


def test_backend_option_reduction_none_keeps_recompute():
    torch.manual_seed(0)
    recorder, _ = compare_with_stock(Head("none"), torch.randn(2, 9, H, requires_grad=True),
                                     torch.randint(0, V, (2, 9)),
                                     options={"grads_in_forward": True, "chunk_size": 8},
                                     atol=2e-5, rtol=2e-5)
    recorder.assert_rewritten(18, V)
    assert not any(fact.target is GIF_OP for graph in recorder.graphs for fact in graph)


@pytest.mark.slow
def test_backend_option_through_inductor():
    torch.manual_seed(0)
    model = Head("mean")
    hidden = torch.randn(2, 9, H, requires_grad=True)
    labels = torch.randint(0, V, (2, 9))
    recorder, code = compare_with_stock(model, hidden, labels, inner="inductor",
                                        options={"grads_in_forward": True, "chunk_size": 8},
                                        atol=2e-5, rtol=2e-5)
    assert "linear_cross_entropy_grads_in_forward" in code
    assert sum(fact.target is GIF_OP for graph in recorder.graphs for fact in graph) == 1


def test_warmed_up_model_never_recompiles_for_a_new_length():
    """grads_in_forward through the backend: after two lengths (the second makes Dynamo's
    shapes dynamic), no new length recompiles the model's frame or the per-chunk kernels."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(Head("mean"), backend="chunkce",
                             options={"grads_in_forward": True, "chunk_size": 8, "inner_backend": "aot_eager"})

    def step(tokens):
        hidden = torch.randn(2, tokens, H, requires_grad=True)
        compiled(hidden, torch.randint(0, V, (2, tokens))).backward()

    for tokens in (12, 20):
        step(tokens)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (5, 33, 9, 3, 64, 13):  # one chunk, several, ragged tails
            step(tokens)


@pytest.mark.parametrize("scale", [{"logit_scale": 0.5}, {"logit_divisor": 3.0}])
def test_scaled_logits(scale):
    hidden, weight, target, bias = make_inputs(bias=True)
    ours = loss_and_grads(gif, hidden, weight, target, bias, chunk_size=8, **scale)
    factor = scale.get("logit_scale", 1.0) / scale.get("logit_divisor", 1.0)
    theirs = loss_and_grads(lambda h, w, t, b: F.cross_entropy(F.linear(h, w, b) * factor, t),
                            hidden, weight, target, bias)
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b, **TOL[torch.float32])


# --- tokens that count for nothing -----------------------------------------------------
# A "mean" over no counted token is 0 / 0: the loss is nan, as torch's, and autograd hands the
# op grad_total = grad_loss / 0 = inf; torch's gradient of an ignored token is 0 whatever the
# upstream gradient, so the gradients must be zeros, not inf * 0 = nan.


def _zero_weight_for_targets(target):
    weight = torch.ones(V)
    weight[target[target != -100]] = 0.0  # every counted token's class weighs 0: total weight 0
    return weight


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["all_ignored", "ignored_chunk", "zero_total_weight"])
def test_tokens_that_count_for_nothing_match_torch(reduction, case):
    hidden, weight, target, bias = make_inputs(bias=True, ignored=N if case == "all_ignored" else 5)
    kwargs = {"reduction": reduction, "chunk_size": 8}
    if case == "ignored_chunk":
        target[8:24] = -100  # chunks 2 and 3 (chunk_size 8) hold only ignored tokens
    if case == "zero_total_weight":
        kwargs["weight"] = _zero_weight_for_targets(target)  # torch's mean: nan loss and gradients
    ours = loss_and_grads(gif, hidden, weight, target, bias, **kwargs)
    theirs = loss_and_grads(unfused, hidden, weight, target, bias, **kwargs)
    for name, a, b in zip(("loss", "hidden", "weight", "bias"), ours, theirs, strict=True):
        assert_close(a, b, **TOL[torch.float32], equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")
    if case != "zero_total_weight":
        assert all(bool(g.isfinite().all()) for g in ours[1:])


class TinyLM(torch.nn.Module):
    """Embedding, one body layer, an untied head: what an AdamW step on NaN gradients would poison."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.body = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        logits = self.lm_head(torch.tanh(self.body(self.embed(ids)))).float()
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["all_ignored", "ignored_chunk"])
def test_backend_tokens_that_count_for_nothing_match_stock(reduction, case):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, H, requires_grad=True)
    labels = torch.full((2, 9), -100) if case == "all_ignored" else torch.randint(0, V, (2, 9))
    if case == "ignored_chunk":
        labels[0, :8] = -100  # the first chunk of 8 tokens: only ignored tokens
    recorder, _ = compare_with_stock(Head(reduction), hidden, labels,
                                     options={"grads_in_forward": True, "chunk_size": 8},
                                     atol=2e-5, rtol=2e-5, equal_nan=True)
    gif_nodes = sum(fact.target is GIF_OP for graph in recorder.graphs for fact in graph)
    assert gif_nodes == (0 if reduction == "none" else 1)  # "none" keeps the recompute op
    assert recorder.logits_like(18, V) == []


def test_backend_adamw_step_on_an_all_ignored_batch_leaves_weights_finite():
    torch.manual_seed(0)
    model = TinyLM()
    reference = TinyLM()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="chunkce",
                             options={"grads_in_forward": True, "chunk_size": 8, "inner_backend": "aot_eager"})
    ids = torch.randint(0, V, (2, 9))
    labels = torch.full((2, 9), -100)  # an all-padding micro-batch
    for module, run in ((model, compiled), (reference, reference)):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        loss = run(ids, labels)
        assert torch.isnan(loss)  # torch's mean over no tokens
        loss.backward()
        optimizer.step()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert ours.isfinite().all(), name
        assert_close(ours, theirs, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("chunk_size", [8, 64], ids=["chunks", "one_chunk"])
def test_bfloat16_weight_gradient_rounded_once(chunk_size):
    """A bf16 head's weight and bias gradients are held in fp32 and rounded once (rounded in
    forward and again after backward's upstream gradient, their error against fp64 would be
    1.13x the unfused path's; once, 0.87x). Relative error of the gradient, averaged over four small draws (bf16 matmuls
    are emulated on CPU)."""
    errors = {"ours": [0.0, 0.0], "unfused": [0.0, 0.0]}
    for seed in range(4):
        inputs = make_inputs(dtype=torch.bfloat16, bias=True, ignored=3, seed=seed, n=64, h=64, v=256)
        truth_inputs = [t.detach().double().requires_grad_() if t is not None and t.is_floating_point()
                        else t for t in inputs]
        truth = loss_and_grads(unfused, *truth_inputs, grad_scale=1.0)[2:]  # weight, bias
        runs = {"ours": loss_and_grads(gif, *inputs, chunk_size=chunk_size, logits_dtype=torch.float32,
                                       grad_scale=1.0)[2:],
                "unfused": loss_and_grads(lambda h, w, t, b: F.cross_entropy(F.linear(h, w, b).float(), t),
                                          *inputs, grad_scale=1.0)[2:]}
        for who, grads in runs.items():
            for i, (g, t) in enumerate(zip(grads, truth, strict=True)):
                assert g.dtype == torch.bfloat16
                errors[who][i] += ((g.double() - t).norm() / t.norm()).item() / 4
    for name, ours, theirs in zip(("weight", "bias"), errors["ours"], errors["unfused"], strict=True):
        assert ours <= theirs, (name, ours, theirs)
