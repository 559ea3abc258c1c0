"""Scaled logits: ``logits * s`` (Cohere's ``logit_scale``) and ``logits / s`` (Granite's
``logits_scaling``, a temperature) absorbed into the op.

Op level: ``linear_cross_entropy(..., logit_scale= / logit_divisor=, scale_dtype=)``
against torch's unfused ``F.linear`` -> scale -> ``F.cross_entropy``, loss and every
gradient, for every reduction, with and without label smoothing, class weights and
ignored tokens, a Python number and a 0-d tensor, before and after ``.float()``; the
scaling's rounding against torch's own ``mul`` / ``div``. Pass level: each spelling
Dynamo emits rewritten (proved on the graph the inner backend got) and equal to stock
compile; what the op cannot take refused with its reason and bit for bit stock.
"""

from __future__ import annotations

import copy

import pytest
import rewrite_proof
import torch
import torch.nn.functional as F
from builders import OP, op_arguments, train_step
from rewrite_proof import Recorder, compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from compile_pass import linear_cross_entropy
from compile_pass.op.kernels import HeadScale

B, T, H, V = 2, 5, 16, 23


# --- the scaling's rounding: torch's own mul / div -------------------------------------------


# Python numbers and 0-d tensors of several dtypes: none promotes an [n, V] floating tensor.
SCALE_VALUES = [1.0 / 3.0, 7, torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64),
                torch.tensor(0.3, dtype=torch.bfloat16), torch.tensor(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("divides", [False, True], ids=["mul", "div"])
def test_scale_logits_rounds_as_torch_mul_and_div(dtype, divides):
    """``HeadScale.apply`` is bit for bit ``x * s`` / ``x / s`` in the logits' dtype, and its
    backward is autograd's ``mul`` / ``div`` backward (``grad * s``, ``grad / s``)."""
    x = (torch.randn(7, 37, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    for scale in SCALE_VALUES:
        expected = x / scale if divides else x * scale
        assert expected.dtype == dtype  # a number or a 0-d tensor does not promote the logits
        transform = HeadScale.of(scale, divides, dtype)
        got = transform.apply(x)
        torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=f"{scale!r}")
        leaf = x.detach().requires_grad_()
        (leaf / scale if divides else leaf * scale).backward(x)
        torch.testing.assert_close(transform.backward(x, x), leaf.grad, atol=0, rtol=0, msg=f"{scale!r}")


def test_division_is_not_multiplication_by_the_reciprocal():
    """``x / 3`` and ``x * (1 / 3)`` round differently: the op divides when the graph did."""
    x = torch.randn(64, 101, generator=torch.Generator().manual_seed(1))
    divided = HeadScale(3.0, divides=True, dtype=torch.float32).apply(x)
    assert torch.equal(divided, x / 3.0)
    assert not torch.equal(divided, x * (1.0 / 3.0))


def test_scale_in_a_wider_dtype_than_the_projection():
    """bf16 logits scaled after ``.float()``: rounded once to bf16 (the projection), then scaled in fp32."""
    x = torch.randn(5, 31, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = HeadScale(1.0 / 3.0, dtype=torch.float32).apply(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, x.float() * (1.0 / 3.0))
    assert not torch.equal(got, (x * (1.0 / 3.0)).float())


# --- op level: loss and gradients against the unfused reference ------------------------------


def make_inputs(n=11, h=8, v=17, dtype=torch.float32, seed=0, ignored=2):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.02 * 8).to(dtype).requires_grad_()  # logits ~ O(1)
    bias = (torch.randn(v, generator=gen) * 0.1).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    target[:ignored] = -100
    return hidden, weight, bias, target


def reference(hidden, linear_weight, linear_bias, target, scale, divides, after_float, logits_dtype,
              **loss_args):
    """The unfused graph: ``F.linear``, ``[.float()]``, ``* s`` or ``/ s``, ``[.to(logits_dtype)]``, loss."""
    logits = F.linear(hidden, linear_weight, linear_bias)
    if after_float:
        logits = logits.float()
    logits = logits / scale if divides else logits * scale
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    return F.cross_entropy(logits, target, **loss_args)


def fused(hidden, linear_weight, linear_bias, target, scale, divides, after_float, logits_dtype, chunk_size,
          **loss_args):
    keyword = "logit_divisor" if divides else "logit_scale"
    return linear_cross_entropy(hidden, linear_weight, target, linear_bias=linear_bias, logits_dtype=logits_dtype,
                                scale_dtype=torch.float32 if after_float else None, chunk_size=chunk_size,
                                **{keyword: scale}, **loss_args)


def loss_and_grads(loss_fn, inputs, upstream):
    hidden, weight, bias, _ = inputs
    loss = loss_fn()
    grads = torch.autograd.grad((loss.float() * upstream).sum(), (hidden, weight, bias))
    return loss.detach(), grads


def assert_matches_reference(inputs, scale, divides, after_float, logits_dtype, chunk_size, **loss_args):
    args = (*inputs, scale, divides, after_float, logits_dtype)
    gen = torch.Generator().manual_seed(3)
    upstream = 1.0 if loss_args.get("reduction") != "none" else torch.rand(inputs[3].shape, generator=gen)
    expected = loss_and_grads(lambda: reference(*args, **loss_args), inputs, upstream)
    got = loss_and_grads(lambda: fused(*args, chunk_size, **loss_args), inputs, upstream)
    torch.testing.assert_close(got[0], expected[0], msg=lambda m: f"loss: {m}")
    for name, a, b in zip(("hidden", "weight", "bias"), got[1], expected[1]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"grad {name}: {m}")
    return expected


SCALES = {"number": lambda s: s, "tensor": lambda s: torch.tensor(s)}


@pytest.mark.usefixtures("eager_kernels")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extras", ["plain", "smoothing_weights"])
@pytest.mark.parametrize("kind", sorted(SCALES))
@pytest.mark.parametrize("divides", [False, True], ids=["mul", "div"])
def test_fp32_op_matches_unfused(divides, kind, extras, reduction):
    inputs = make_inputs()
    loss_args = {"reduction": reduction}
    if extras == "smoothing_weights":
        loss_args |= {"label_smoothing": 0.1, "weight": torch.rand(17, generator=torch.Generator()
                                                                    .manual_seed(4)) + 0.5}
    scale = SCALES[kind](3.0 if divides else 0.3)
    expected = assert_matches_reference(inputs, scale, divides, False, None, 3, **loss_args)
    unscaled = reference(*inputs, 1.0, False, False, None, **loss_args)
    assert not torch.allclose(expected[0], unscaled)  # the scale matters: a dropped one would fail


@pytest.mark.usefixtures("eager_kernels")
@pytest.mark.parametrize("kind", sorted(SCALES))
@pytest.mark.parametrize("divides", [False, True], ids=["mul", "div"])
def test_fp32_op_with_a_float64_0d_scale_and_no_cast(divides, kind):
    """A 0-d fp64 scale of fp32 logits stays fp32 (type promotion); ``logits_dtype`` fp64 widens after."""
    scale = torch.tensor(2.5, dtype=torch.float64) if kind == "tensor" else 2.5
    assert_matches_reference(make_inputs(seed=1), scale, divides, False, None, 4, ignore_index=-100)
    assert_matches_reference(make_inputs(seed=2), scale, divides, True, torch.float64, 4)


@pytest.mark.usefixtures("eager_kernels")
@pytest.mark.parametrize("after_float", [False, True], ids=["scale_then_float", "float_then_scale"])
@pytest.mark.parametrize("kind", sorted(SCALES))
@pytest.mark.parametrize("divides", [False, True], ids=["mul", "div"])
def test_bf16_op_matches_unfused(divides, kind, after_float):
    """Tiny (bf16 matmul is emulated on CPU): the scale in bf16 (HF's ``lm_head(h) * s``) or in fp32."""
    inputs = make_inputs(n=6, h=8, v=13, dtype=torch.bfloat16)
    scale = SCALES[kind](3.0 if divides else 1.0 / 3.0)
    assert_matches_reference(inputs, scale, divides, after_float, torch.float32, 4, label_smoothing=0.05)


@pytest.mark.usefixtures("eager_kernels")
def test_bf16_scale_happens_where_the_graph_scales():
    """``(bf16 logits * s).float()`` and ``bf16 logits.float() * s`` differ; the op reproduces the
    one it is asked for, by far closer than the other."""
    inputs = make_inputs(n=32, h=16, v=64, dtype=torch.bfloat16, seed=5)
    scale = 1.0 / 3.0
    before = reference(*inputs, scale, False, False, torch.float32)
    after = reference(*inputs, scale, False, True, torch.float32)
    got_before = fused(*inputs, scale, False, False, torch.float32, 8)
    got_after = fused(*inputs, scale, False, True, torch.float32, 8)
    gap = (before - after).abs()
    assert gap > 0
    assert (got_before - before).abs() < gap / 10 and (got_after - after).abs() < gap / 10


@pytest.mark.usefixtures("eager_kernels")
def test_frozen_or_detached_tensor_scale_under_no_grad_and_autocast():
    inputs = make_inputs(seed=6)
    scale = nn.Parameter(torch.tensor(0.7), requires_grad=False)
    assert_matches_reference(inputs, scale, False, False, None, 5)
    with torch.no_grad():  # a scale that requires grad is accepted where nothing is differentiated
        hidden, weight, bias, target = inputs
        live = torch.tensor(0.7, requires_grad=True)
        torch.testing.assert_close(
            linear_cross_entropy(hidden, weight, target, linear_bias=bias, logit_scale=live),
            F.cross_entropy(F.linear(hidden, weight, bias) * live, target))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # scaled in the autocast dtype, the loss in fp32
        hidden, weight, bias, target = make_inputs(n=6, h=8, v=13, seed=7)
        expected = F.cross_entropy(F.linear(hidden, weight, bias) * 0.3, target)
        got = linear_cross_entropy(hidden, weight, target, linear_bias=bias, logit_scale=0.3)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"logit_scale": 2.0, "logit_divisor": 3.0}, ValueError, "expected at most one of logit_scale and logit_divisor"),
    ({"logit_scale": torch.ones(17)}, ValueError,
     r"expected logit_scale to be a number or a 0-d tensor, got a tensor of shape \(17,\)"),
    ({"logit_divisor": torch.tensor(2.0, requires_grad=True)}, NotImplementedError,
     "a logit_divisor that requires grad is not supported.*logit_divisor.detach()"),
    ({"logit_scale": True}, TypeError, "expected logit_scale to be a number or a 0-d tensor, got bool"),
    ({"logit_scale": "2"}, TypeError, "expected logit_scale to be a number or a 0-d tensor, got str"),
    ({"logit_scale": torch.tensor(1j)}, TypeError, "expected a real logit_scale"),
    ({"scale_dtype": torch.float32}, ValueError, "scale_dtype was given without logit_scale"),
    ({"logit_scale": 2.0, "scale_dtype": torch.int32}, TypeError, "expected scale_dtype to be a floating"),
    ({"chunk_bytes": 0}, ValueError, "expected chunk_bytes to be a positive int or None, got 0"),
])
def test_bad_scale_arguments_are_refused(kwargs, error, words):
    hidden, weight, bias, target = make_inputs()
    with pytest.raises(error, match=f"chunkce.linear_cross_entropy: {words}"):
        linear_cross_entropy(hidden, weight, target, **kwargs)


@pytest.mark.slow
def test_opcheck_with_a_scale():
    hidden, weight, bias, target = (x.detach() for x in make_inputs(n=7, h=4, v=9))
    forward = torch.ops.chunkce.linear_cross_entropy.default
    backward = torch.ops.chunkce.linear_cross_entropy_backward.default
    for scale, tensor, divides in ((0.5, None, False), (None, torch.tensor(3.0), True)):
        options = {"ignore_index": -100, "label_smoothing": 0.1, "logits_dtype": torch.float32, "chunk_size": 3,
                   "logit_scale": scale, "scale_divides": divides, "scale_dtype": torch.float32}
        torch.library.opcheck(forward, (hidden, weight, target, bias, None, tensor), options)
        _, row_max, row_log_sum = forward(hidden, weight, target, bias, None, tensor, **options)
        grad_loss = torch.rand(7, generator=torch.Generator().manual_seed(0))
        torch.library.opcheck(backward, (grad_loss, hidden, weight, target, bias, None, tensor, row_max, row_log_sum),
                              {**options, "output_mask": [True, True, True]},
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("kind", SCALES)
def test_compiled_kernels_take_the_scale_as_an_input(kind):
    """The compiled kernels (not eager) give the unfused result for each scale value, a Python
    number or a 0-d tensor, and a new value does not recompile them (the value is a graph
    input, never branched on)."""
    hidden, weight, bias, target = make_inputs(n=10, h=8, v=17, seed=8)

    def step(scale):
        loss = linear_cross_entropy(hidden, weight, target, logit_scale=SCALES[kind](scale), chunk_size=4)
        return loss, torch.autograd.grad(loss, (hidden, weight))

    step(0.25)  # warm up: one compile per kernel
    with torch._dynamo.config.patch(error_on_recompile=True):
        for scale in (0.5, 3.0):
            loss, grads = step(scale)
            expected_loss = F.cross_entropy(F.linear(hidden, weight) * scale, target)
            torch.testing.assert_close(loss, expected_loss)
            torch.testing.assert_close(grads, torch.autograd.grad(expected_loss, (hidden, weight)))


# --- pass level: spellings rewritten, proved on the graph --------------------------------------


class Head(nn.Module):
    """An lm_head, a scale written by ``transform(module, logits, *extra)``, HF's ``.float()`` and loss."""

    def __init__(self, transform, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False, dtype=dtype)
        nn.init.normal_(self.lm_head.weight, std=0.02)
        self.logit_scale = nn.Parameter(torch.tensor(8.0))  # requires grad: refused unless detached
        self.frozen_scale = nn.Parameter(torch.tensor(6.0), requires_grad=False)
        self.register_buffer("temperature", torch.tensor(0.7))
        self.transform = transform

    def forward(self, h, labels, *extra):
        logits = self.transform(self, self.lm_head(h), *extra)
        return F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))


class ArgsRecorder(Recorder):
    """Also keeps the op nodes' arguments, by schema name: ``op_args`` of the last graph,
    ``op_args_by_graph`` of each."""

    def __call__(self, gm, example_inputs):
        self.op_args = [op_arguments(node) for node in gm.graph.nodes if node.target is OP]
        self.op_args_by_graph = [*getattr(self, "op_args_by_graph", []), self.op_args]
        return super().__call__(gm, example_inputs)


@pytest.fixture
def recorded_args(monkeypatch):
    monkeypatch.setattr(rewrite_proof, "Recorder", ArgsRecorder)


def inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, generator=gen).to(dtype).requires_grad_(),
            torch.randint(0, V, (B, T), generator=gen))


# (transform, scale as the op gets it: a number, or "tensor"; divides; scale dtype)
SPELLINGS = {
    "logits * s": (lambda m, z: z * 0.25, 0.25, False, torch.float32),
    "s * logits": (lambda m, z: 4 * z, 4.0, False, torch.float32),
    "logits / s": (lambda m, z: z / 3.0, 3.0, True, torch.float32),
    "torch.mul": (lambda m, z: torch.mul(z, 0.5), 0.5, False, torch.float32),
    "torch.div buffer": (lambda m, z: torch.div(z, m.temperature), "tensor", True, torch.float32),
    "Tensor.mul buffer": (lambda m, z: z.mul(m.temperature), "tensor", False, torch.float32),
    "Tensor.div": (lambda m, z: z.div(3), 3.0, True, torch.float32),
    "Tensor.true_divide": (lambda m, z: z.true_divide(3.0), 3.0, True, torch.float32),
    "detached parameter": (lambda m, z: z * m.logit_scale.detach(), "tensor", False, torch.float32),
    "frozen parameter": (lambda m, z: z / m.frozen_scale, "tensor", True, torch.float32),
    "after a cast to fp64": (lambda m, z: z.double() * 0.3, 0.3, False, torch.float64),
    "before a narrowing cast": (lambda m, z: z.to(torch.bfloat16) / 3.0, 3.0, True, torch.bfloat16),
}


@pytest.mark.usefixtures("fresh_compile", "eager_kernels", "recorded_args")
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_scaled_head_is_rewritten_and_matches_stock(spelling):
    transform, scale, divides, scale_dtype = SPELLINGS[spelling]
    recorder, _ = compare_with_stock(Head(transform), *inputs())
    recorder.assert_rewritten(B * T, V)
    (args,) = recorder.op_args
    if scale == "tensor":
        assert args["logit_scale"] is None and args["logit_scale_tensor"] is not None
    else:
        assert args["logit_scale"] == scale and args["logit_scale_tensor"] is None
    assert (args["scale_divides"], args["scale_dtype"]) == (divides, scale_dtype)
    assert counters["chunkce"]["sites_rewritten"] == 1


@pytest.mark.usefixtures("fresh_compile", "eager_kernels", "recorded_args")
@pytest.mark.parametrize("after_float", [False, True], ids=["scale_then_float", "float_then_scale"])
def test_bf16_scaled_head_matches_stock(after_float):
    """Tiny bf16 head: Cohere's ``(logits * s).float()``, and ``logits.float() * s``."""
    def transform(m, z):
        return z.float() / 3.0 if after_float else z / 3.0

    recorder, _ = compare_with_stock(Head(transform, dtype=torch.bfloat16), *inputs(torch.bfloat16))
    recorder.assert_rewritten(B * T, V)
    assert recorder.op_args[0]["scale_dtype"] == (torch.float32 if after_float else torch.bfloat16)


@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
def test_temperature_argument_made_dynamic_is_rewritten_for_every_value():
    """A float argument: constant in the first graph, then a 0-d tensor input read with
    ``.item()`` once Dynamo makes it dynamic; the op takes the tensor each time."""
    model = Head(lambda m, z, temperature: z / temperature)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    h, y = inputs()
    for temperature in (0.5, 0.7, 0.9):
        got = compiled(h, y, temperature)
        torch.testing.assert_close(got, model(h, y, temperature))
        assert compile_pass.last_report().records[0].decision == "rewritten"
    assert counters["chunkce"]["sites_rewritten"] >= 2 and counters["chunkce"]["sites_refused"] == 0


def _step_pair(compiled, stock, h, y, temperature):
    """One training step of each; loss and every gradient of the chunkce one equal to stock's."""
    got = train_step(compiled, [h.detach().clone().requires_grad_(), y, temperature])
    expected = train_step(stock, [h.detach().clone().requires_grad_(), y, temperature])
    torch.testing.assert_close(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name in got[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], msg=lambda m, name=name: f"{name}: {m}")


def _temperature_heads():
    """``lm_head(h) / temperature`` compiled by chunkce (recording the op's arguments) and by stock."""
    model = Head(lambda m, z, temperature: z / temperature)
    reference = copy.deepcopy(model)
    recorder = ArgsRecorder("aot_eager")
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": recorder})
    return compiled, torch.compile(reference, backend="aot_eager"), recorder


@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
def test_float_temperature_recompiles_no_more_than_stock():
    """``lm_head(h) / temperature`` with a Python float: stock compile compiles for the first
    value (a constant), then once more with the float dynamic, and never again. chunkce must
    too: once rewritten, the op's scale is the float's tensor, not a specialised number
    (AOTAutograd's tensorify pass would otherwise specialise it: a guard ``temperature ==
    0.9`` and a recompile for every value)."""
    compiled, stock, recorder = _temperature_heads()
    h, y = inputs()
    for temperature in (0.5, 0.7):  # the warm-up stock needs: a constant, then dynamic
        _step_pair(compiled, stock, h, y, temperature)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for temperature in (0.9, 1.3, 2.0, 0.25, 1.0):
            _step_pair(compiled, stock, h, y, temperature)
    assert len(recorder.graphs) == 2
    recorder.assert_rewritten(B * T, V, sites=2)
    (constant,), (dynamic,) = recorder.op_args_by_graph
    assert constant["logit_scale"] == 0.5 and constant["logit_scale_tensor"] is None
    assert dynamic["logit_scale"] is None and dynamic["logit_scale_tensor"] is not None
    assert counters["chunkce"]["sites_refused"] == 0


@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
def test_0d_tensor_temperature_compiles_once():
    compiled, stock, recorder = _temperature_heads()
    h, y = inputs()
    _step_pair(compiled, stock, h, y, torch.tensor(0.5))  # one compile each (they share forward's code)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for temperature in (0.7, 1.3, 2.0):
            _step_pair(compiled, stock, h, y, torch.tensor(temperature))
    assert len(recorder.graphs) == 1
    recorder.assert_rewritten(B * T, V)


REFUSED = {
    "scale_requires_grad": (lambda m, z: z * m.logit_scale,
                            "scales the logits by `l_self_parameters_logit_scale_`, which requires grad: the op "
                            "does not differentiate the scale. Fix: detach it"),
    "scale_operand": (lambda m, z: 1.0 / z, "the logits are the divisor: `s / logits`"),
    "scale_twice": (lambda m, z: z * 2.0 / 3.0, "scales the logits a second time"),
    "mutation": (lambda m, z: z.mul_(2.0), "in-place `mul_` between projection and loss (logits scaled in place"),
    "lossy_cast": (lambda m, z: z.to(torch.bfloat16).float() * 0.5,
                   "lossy intermediate dtype (float32 -> bfloat16 -> float32) before the scaling"),
    "soft_cap": (lambda m, z: torch.tanh(z / 30.0) * 30.0, "soft-capped logits: `tanh`"),
}


@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
@pytest.mark.parametrize("key", sorted(REFUSED))
def test_scaling_the_op_cannot_take_is_refused_and_exact(key, chunkce_logs):
    """Left as stock compile leaves it, bit for bit (the scale parameter's gradient included)."""
    transform, words = REFUSED[key]
    recorder, _ = compare_with_stock(Head(transform), *inputs(), exact=True)
    recorder.assert_untouched()
    (record,) = compile_pass.last_report().records
    assert (record.decision, record.reason_key) == ("refused", key), record.reason
    assert words in record.reason
    assert any(words in r.getMessage() for r in chunkce_logs.records if r.name.startswith("compile_pass"))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_compile", "eager_kernels")
def test_inductor_scaled_head_matches_stock_inductor():
    """Inductor end to end (Cohere's spelling, ``logit_scale`` 0.0625): the op in the generated code."""
    recorder, code = compare_with_stock(Head(lambda m, z: z * 0.0625), *inputs(), inner="inductor")
    recorder.assert_rewritten(B * T, V)
    assert "chunkce.linear_cross_entropy" in code and "linear_cross_entropy_backward" in code


def test_transform_variant_is_the_compile_key_never_the_value():
    """The kernels' compile key holds the transform's variant (multiply / divide, number / tensor,
    dtype), never its value: a new scale reuses the compiled kernels, another variant does not."""
    variant = HeadScale(0.5, dtype=torch.float32).variant()
    assert HeadScale(3.0, dtype=torch.float32).variant() == variant
    assert HeadScale.of(torch.tensor(0.5), dtype=torch.float32).variant() == HeadScale.of(
        torch.tensor(2.0), dtype=torch.float32).variant() != variant
    assert HeadScale(0.5, divides=True, dtype=torch.float32).variant() != variant
    assert HeadScale(0.5, dtype=torch.bfloat16).variant() != variant
    assert HeadScale().variant() is None and HeadScale().resolve(torch.bfloat16) == HeadScale()
    assert HeadScale(0.5).resolve(torch.bfloat16).dtype == torch.bfloat16
