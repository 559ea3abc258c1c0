"""The op against torch's unfused F.linear + F.cross_entropy: loss and every gradient."""

import pytest
import torch
import torch.nn.functional as F

from compile_pass import linear_cross_entropy
from compile_pass.memory import measure_peak_bytes
from compile_pass.op import kernel_runner

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float64: {"atol": 1e-10, "rtol": 1e-10}}


def make_inputs(n=37, h=16, v=51, dtype=torch.float32, bias=False, ignored=5, seed=0, lead=(),
                ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, n, h, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, v, (*lead, n), generator=gen)
    target.view(-1)[:ignored] = ignore_index
    b = (torch.randn(v, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None)
    return hidden, weight, target, b


def reference(hidden, lm_weight, target, bias=None, logits_dtype=None, **kwargs):
    logits = F.linear(hidden, lm_weight, bias)
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    loss = F.cross_entropy(logits.flatten(0, -2), target.flatten(), **kwargs)
    return loss.view(target.shape) if kwargs.get("reduction") == "none" else loss


def loss_and_grads(fn, hidden, lm_weight, target, bias, grad_seed=1, **kwargs):
    loss = fn(hidden, lm_weight, target, bias, **kwargs)
    grad_output = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_seed),
                              dtype=torch.float64).to(loss.dtype)
    params = [t for t in (hidden, lm_weight, bias) if t is not None]
    return (loss, *torch.autograd.grad(loss, params, grad_output))


def chunked(hidden, lm_weight, target, bias, **kwargs):
    return linear_cross_entropy(hidden, lm_weight, target, linear_bias=bias, **kwargs)


def unfused(hidden, lm_weight, target, bias, chunk_size=None, **kwargs):
    return reference(hidden, lm_weight, target, bias, **kwargs)


def assert_matches(tol=None, **case):
    inputs = make_inputs(**case.pop("shape", {}), ignore_index=case.get("ignore_index", -100))
    ours = loss_and_grads(chunked, *inputs, **case)
    theirs = loss_and_grads(unfused, *inputs, **case)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL[torch.float32]))
    return ours


CLASS_WEIGHT = torch.rand(51, generator=torch.Generator().manual_seed(3)) + 0.1
ARGUMENTS = {
    "plain": {},
    "ignored": {"ignore_index": -100},
    "other_ignore_index": {"ignore_index": 7},
    "label_smoothing": {"label_smoothing": 0.2},
    "class_weight": {"weight": CLASS_WEIGHT},
    "smoothing_weight_ignored": {"weight": CLASS_WEIGHT, "label_smoothing": 0.3},
    "full_smoothing": {"label_smoothing": 1.0},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("arguments", ARGUMENTS)
@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_unfused(reduction, arguments, chunk_size, bias):
    assert_matches(shape={"bias": bias}, reduction=reduction, chunk_size=chunk_size,
                   **ARGUMENTS[arguments])


@pytest.mark.parametrize("n,h,v,chunk_size", [(252, 123, 507, 100), (1, 3, 2, 1), (64, 8, 5, 64), (65, 8, 97, 64)])
def test_odd_shapes(n, h, v, chunk_size):
    assert_matches(shape={"n": n, "h": h, "v": v, "ignored": n // 4, "bias": True},
                   chunk_size=chunk_size, label_smoothing=0.1)


def test_three_dim_input_and_none_reduction_shape():
    hidden, weight, target, _ = make_inputs(n=9, lead=(3,), ignored=4)
    loss = linear_cross_entropy(hidden, weight, target, reduction="none", chunk_size=4)
    assert loss.shape == (3, 9)
    assert_matches(shape={"n": 9, "lead": (3,), "ignored": 4}, reduction="none", chunk_size=4)
    assert_matches(shape={"n": 9, "lead": (3,), "ignored": 4}, chunk_size=5, weight=CLASS_WEIGHT)


def test_chunk_with_every_token_ignored():
    # Tokens 0..15 ignored: with chunk_size 8 the first two chunks hold no valid token.
    for reduction in ("mean", "sum", "none"):
        assert_matches(shape={"n": 30, "ignored": 16}, reduction=reduction, chunk_size=8,
                       label_smoothing=0.1, weight=CLASS_WEIGHT)


@pytest.mark.parametrize("arguments", ["plain", "class_weight", "smoothing_weight_ignored"])
def test_batch_with_every_token_ignored(arguments):
    hidden, weight, target, _ = make_inputs(n=12, ignored=12)
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=5, **ARGUMENTS[arguments])
    expected = reference(hidden, weight, target, **ARGUMENTS[arguments])
    assert torch.isnan(expected) and torch.isnan(loss)
    for reduction in ("sum", "none"):
        assert_matches(shape={"n": 12, "ignored": 12}, reduction=reduction, chunk_size=5,
                       **ARGUMENTS[arguments])


def test_no_tokens():
    hidden, weight, target, _ = make_inputs(n=0, ignored=0)
    assert torch.isnan(linear_cross_entropy(hidden, weight, target))
    assert_matches(shape={"n": 0, "ignored": 0}, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
@pytest.mark.parametrize("chunk_size", [7, 2])  # 2: several token chunks in each vocabulary block
def test_half_precision_error_no_worse_than_unfused(dtype, logits_dtype, chunk_size):
    # Tiny: half-precision matmul is emulated on this CPU.
    hidden, weight, target, bias = make_inputs(n=24, h=16, v=40, dtype=dtype, bias=True, ignored=3)
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    truth = loss_and_grads(unfused, exact[0], exact[1], target, exact[2], label_smoothing=0.1)
    ours = loss_and_grads(chunked, hidden, weight, target, bias, chunk_size=chunk_size,
                          logits_dtype=logits_dtype, label_smoothing=0.1)
    theirs = loss_and_grads(unfused, hidden, weight, target, bias, logits_dtype=logits_dtype,
                            label_smoothing=0.1)
    assert ours[0].dtype == (logits_dtype or dtype)
    for name, o, t, x in zip(("loss", "hidden", "weight", "bias"), ours, theirs, truth):
        assert o.dtype == t.dtype, name
        our_error = (o.double() - x).abs().max().item()
        their_error = (t.double() - x).abs().max().item()
        scale = x.abs().max().item()
        assert our_error <= their_error + 2e-3 * scale, (name, our_error, their_error)


@pytest.mark.slow
def test_gradcheck_float64():
    hidden, weight, target, bias = make_inputs(n=11, h=5, v=7, dtype=torch.float64, bias=True, ignored=2)
    for kwargs in ({}, {"reduction": "none", "label_smoothing": 0.2},
                   {"reduction": "sum", "weight": CLASS_WEIGHT[:7].double(), "label_smoothing": 0.3}):
        torch.autograd.gradcheck(
            lambda h, w, b, kwargs=kwargs: linear_cross_entropy(h, w, target, linear_bias=b, chunk_size=4,
                                                                **kwargs),
            (hidden, weight, bias),
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3))
def test_opcheck(case):
    hidden, weight, target, bias = make_inputs(n=[13, 16, 5][case], h=8, v=[11, 17, 3][case],
                                               bias=case != 1, ignored=case)
    class_weight = torch.rand(weight.shape[0]) if case == 2 else None
    args = (hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias, class_weight, None)
    options = {"ignore_index": -100, "label_smoothing": [0.0, 0.1, 0.5][case], "logits_dtype": torch.float32,
               "chunk_size": [4, None, 2][case]}
    torch.library.opcheck(torch.ops.chunkce.linear_cross_entropy.default, args, options)


# The registered schemas, written out: a graph, a cache entry or a caller relies on them. The
# tensors are positional, the options keyword-only (compile_pass.op.schema generates them; the
# forward op returns the row max and log-sum that backward takes).
_INPUTS = ("Tensor hidden_states, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, "
           "Tensor? logit_scale_tensor")
_OPTIONS = ("SymInt ignore_index, float label_smoothing, ScalarType logits_dtype, SymInt? chunk_size=None, "
            "SymInt? chunk_bytes=None, float? logit_scale=None, bool scale_divides=False, ScalarType? scale_dtype=None")
SCHEMAS = {
    "linear_cross_entropy": f"({_INPUTS}, *, {_OPTIONS}) -> (Tensor, Tensor, Tensor)",
    "linear_cross_entropy_backward": f"(Tensor grad_loss, {_INPUTS}, Tensor row_max, Tensor row_log_sum, "
                                     f"*, bool[] output_mask, {_OPTIONS}) -> (Tensor, Tensor, Tensor)",
    "linear_cross_entropy_grads_in_forward": f"({_INPUTS}, *, bool[] output_mask, {_OPTIONS}) "
                                             "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_registered_schemas_are_unchanged(name):
    assert str(getattr(torch.ops.chunkce, name).default._schema) == f"chunkce::{name}{SCHEMAS[name]}"


def test_an_op_function_that_differs_from_its_schema_is_refused():
    """An op's schema is one OpSchema: its function must take the schema's tensors in order and
    only the schema's keywords, else registering it raises, naming the op (nothing is registered)."""
    from compile_pass.op.schema import INPUTS, OpSchema

    schema = OpSchema("chunkce::never_registered", INPUTS, returns=1)
    assert schema.text() == f"({_INPUTS}, *, {_OPTIONS}) -> Tensor"

    def swapped(weight, hidden_states, target, bias, class_weight, logit_scale_tensor, **options):
        return hidden_states

    def unknown_keyword(hidden_states, weight, target, bias, class_weight, logit_scale_tensor, *, output_mask,
                        **options):
        return hidden_states

    for function in (swapped, unknown_keyword):
        with pytest.raises(TypeError, match=r"chunkce::never_registered: expected .* to take \['hidden_states'"):
            schema.custom_op(function)
    assert not hasattr(torch.ops.chunkce, "never_registered")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_no_schema_carries_an_allocator_policy(name):
    """``release_cache`` is the environment's (``CHUNKCE_RELEASE_CACHE``), in no op's schema."""
    assert "release_cache" not in str(getattr(torch.ops.chunkce, name).default._schema)


def test_options_are_keywords_and_the_transform_round_trips():
    """The options travel by name: the op refuses them by position and an unknown name; the head
    transform is flattened into the schema's arguments (a tensor scale positional, a number the
    float ``logit_scale``) and rebuilt."""
    from compile_pass.op.schema import LOSS_DEFAULTS, loss_inputs
    from compile_pass.op.kernels import HeadScale

    scale = torch.tensor(2.0)
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    *_, tensor, keywords = loss_inputs(hidden, weight, None, transform=HeadScale.of(scale, divides=True),
                                       ignore_index=-1, label_smoothing=0.1, logits_dtype=torch.float32, chunk_size=8)
    assert tensor is scale
    assert keywords == {"ignore_index": -1, "label_smoothing": 0.1, "logits_dtype": torch.float32, "chunk_size": 8,
                        "chunk_bytes": None, "logit_scale": None, "scale_divides": True, "scale_dtype": None}
    rebuilt = HeadScale.from_op_arguments(tensor, keywords)
    assert rebuilt.tensor is scale and rebuilt.number is None and rebuilt.divides and rebuilt.dtype is None
    assert HeadScale.from_op_arguments(None, LOSS_DEFAULTS) == HeadScale()
    assert HeadScale.from_op_arguments(None, LOSS_DEFAULTS).is_identity
    number, keywords = HeadScale(3, dtype=torch.bfloat16).op_arguments()
    assert number is None
    assert (keywords["logit_scale"], keywords["scale_divides"], keywords["scale_dtype"]) == (3.0, False, torch.bfloat16)
    assert HeadScale.from_op_arguments(None, keywords) == HeadScale(3.0, dtype=torch.bfloat16)
    hidden, weight, target, _ = make_inputs(n=5, h=4, v=7)
    forward = torch.ops.chunkce.linear_cross_entropy.default
    with pytest.raises(RuntimeError, match="takes 6 positional argument"):
        forward(hidden, weight, target, None, None, None, -100, 0.0, torch.float32)
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'release_cache'"):
        forward(hidden, weight, target, None, None, None, ignore_index=-100, label_smoothing=0.0,
                logits_dtype=torch.float32, release_cache=True)
    loss = forward(hidden.detach(), weight.detach(), target, None, None, None, ignore_index=-100, label_smoothing=0.0,
                   logits_dtype=torch.float32)[0]
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight), target, reduction="none"))


def test_removed_arguments_are_unknown_keywords():
    """An argument the public function does not take (``release_cache`` is the environment's) is
    Python's own ``TypeError``, as any unknown keyword."""
    hidden, weight, target, _ = make_inputs()
    with pytest.raises(TypeError, match="unexpected keyword argument 'release_cache'"):
        linear_cross_entropy(hidden, weight, target, release_cache=True)


def test_inputs_not_modified():
    hidden, weight, target, bias = make_inputs(bias=True)
    class_weight = CLASS_WEIGHT.clone()
    before = [t.detach().clone() for t in (hidden, weight, target, bias, class_weight)]
    versions = [t._version for t in (hidden, weight, target, bias, class_weight)]
    loss = linear_cross_entropy(hidden, weight, target, linear_bias=bias, weight=class_weight,
                                label_smoothing=0.1, chunk_size=8)
    loss.backward()
    for old, new, version in zip(before, (hidden, weight, target, bias, class_weight), versions):
        torch.testing.assert_close(new.detach(), old, atol=0, rtol=0)
        assert new._version == version


def test_second_backward_with_retain_graph():
    hidden, weight, target, bias = make_inputs(bias=True)
    loss = linear_cross_entropy(hidden, weight, target, linear_bias=bias, reduction="none", chunk_size=8)
    ref = reference(hidden, weight, target, bias, reduction="none")
    for seed in (1, 2):
        grad_output = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed))
        ours = torch.autograd.grad(loss, (hidden, weight, bias), grad_output, retain_graph=True)
        theirs = torch.autograd.grad(ref, (hidden, weight, bias), grad_output, retain_graph=True)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_double_backward_refused():
    hidden, weight, target, _ = make_inputs()
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=8)
    (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad_hidden.sum().backward()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bad_class", [51, -1, 10**6])
def test_target_out_of_range_raises(label_smoothing, bad_class):
    hidden, weight, target, _ = make_inputs()
    target[3] = bad_class
    with pytest.raises(RuntimeError, match=r"chunkce.linear_cross_entropy: expected every target in \[0, 51\)"):
        linear_cross_entropy(hidden, weight, target, label_smoothing=label_smoothing, chunk_size=8)


def test_class_weights_requiring_grad_refused():
    hidden, weight, target, _ = make_inputs()
    class_weight = CLASS_WEIGHT.clone().requires_grad_()
    with pytest.raises(RuntimeError):  # torch refuses them too
        reference(hidden, weight, target, weight=class_weight).backward()
    with pytest.raises(NotImplementedError, match="class weights .* require grad"):
        linear_cross_entropy(hidden, weight, target, weight=class_weight)
    with torch.no_grad():  # nothing to differentiate: accepted
        linear_cross_entropy(hidden, weight, target, weight=class_weight)


BAD_ARGUMENTS = [
    ({"target": torch.rand(37, 51)}, NotImplementedError, "probability"),
    ({"target": torch.zeros(37, dtype=torch.int32)}, TypeError, "target of dtype torch.int64"),
    ({"target": torch.zeros(36, dtype=torch.int64)}, ValueError, "target of shape"),
    ({"input": torch.tensor(1.0)}, ValueError, "input of shape"),  # 0-d; [H] is one unbatched token
    ({"linear_weight": torch.randn(51, 15)}, ValueError, "linear_weight of shape"),
    ({"linear_weight": torch.randn(51, 16, dtype=torch.float64)}, TypeError, "linear_weight of dtype"),
    ({"linear_bias": torch.randn(50)}, ValueError, "linear_bias of shape"),
    ({"weight": torch.ones(50)}, ValueError, "weight of shape"),
    ({"weight": torch.ones(51, dtype=torch.int64)}, TypeError, "floating-point weight"),
    ({"reduction": "batchmean"}, ValueError, "reduction"),
    ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"logits_dtype": torch.int32}, TypeError, "logits_dtype"),
    ({"target": torch.zeros(37, dtype=torch.int64, device="meta")}, ValueError, "target on cpu"),
    ({"linear_bias": torch.zeros(51, device="meta")}, ValueError, "linear_bias on cpu"),
]


@pytest.mark.parametrize("override,error,match", BAD_ARGUMENTS)
def test_bad_arguments_are_named(override, error, match):
    hidden, weight, target, _ = make_inputs()
    arguments = {"input": hidden, "linear_weight": weight, "target": target} | override
    positional = [arguments.pop(k) for k in ("input", "linear_weight", "target")]
    with pytest.raises(error, match=f"chunkce.linear_cross_entropy: .*{match}"):
        linear_cross_entropy(*positional, **arguments)


def test_chunk_size_from_environment(monkeypatch):
    calls = []
    real_run = kernel_runner.run
    monkeypatch.setattr(kernel_runner, "run", lambda name, *a: calls.append(name) or real_run(name, *a))
    hidden, weight, target, _ = make_inputs(n=37)
    monkeypatch.setenv("CHUNKCE_CHUNK_SIZE", "10")
    linear_cross_entropy(hidden, weight, target).backward()
    assert calls.count("chunk_forward") == 4 and calls.count("chunk_backward") == 4
    calls.clear()
    linear_cross_entropy(hidden, weight, target, chunk_size=20)  # the argument wins
    assert calls.count("chunk_forward") == 2


def test_kernels_compiled_and_no_recompile_for_new_lengths(monkeypatch):
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    for n in (37, 50, 81):
        hidden, weight, target, _ = make_inputs(n=n, v=53)
        linear_cross_entropy(hidden, weight, target, chunk_size=16, label_smoothing=0.1).backward()
    # One compiled graph for each of the two per-chunk functions: the ragged last chunks
    # (5 and 2 tokens; 81 = 5 x 16 + 1 joins its one-token tail to the chunk before,
    # since Dynamo would specialise a size-1 dim) and the new lengths reused them.
    assert kernel_runner.compiled.cache_info().currsize == 2
    assert counters["chunkce"]["kernel_graphs"] == 2, dict(counters["chunkce"])


def test_eager_kernels_equal_compiled(monkeypatch):
    inputs = make_inputs(bias=True)
    compiled = loss_and_grads(chunked, *inputs, chunk_size=8, label_smoothing=0.2, weight=CLASS_WEIGHT)
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")
    eager = loss_and_grads(chunked, *inputs, chunk_size=8, label_smoothing=0.2, weight=CLASS_WEIGHT)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_half_precision_weight_gradient_accumulator_is_one_vocabulary_block():
    # A bf16 head over several token chunks accumulates its gradient in fp32 one
    # vocabulary block at a time: the backward never holds a [V, H] fp32 buffer.
    n, h, v = 256, 128, 4096
    hidden, weight, target, _ = make_inputs(n=n, h=h, v=v, dtype=torch.bfloat16, ignored=0)
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=16)
    _, peak = measure_peak_bytes(torch.autograd.backward, loss)
    # A whole-vocabulary fp32 accumulator and its bf16 cast alive together: 6 V H bytes.
    # Blocked: the bf16 gradient (2 V H), one fp32 block (V H / 2) and, on CPU, one
    # upcast weight block (V H / 2), plus chunk-sized buffers.
    whole_vocabulary = v * h * (4 + 2)
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    assert peak < whole_vocabulary * 5 / 6, (peak, whole_vocabulary)
    assert peak > v * h * 2  # the bf16 gradient itself is counted


def test_peak_memory_far_below_logits():
    # 2048 tokens x 8192 vocab: one fp32 logits tensor is 64 MiB; the unfused step
    # holds several. The chunked op with 256-token chunks should hold a few 8 MiB chunks.
    n, h, v = 2048, 64, 8192
    hidden, weight, target, _ = make_inputs(n=n, h=h, v=v, ignored=0)
    logits_bytes = n * v * 4

    def step(fn, **kwargs):
        fn(hidden, weight, target, None, **kwargs).backward()
        hidden.grad = weight.grad = None

    step(chunked, chunk_size=256)  # compile the kernels outside the measurement
    _, ours = measure_peak_bytes(step, chunked, chunk_size=256)
    _, theirs = measure_peak_bytes(step, unfused)
    assert theirs >= 2 * logits_bytes
    assert ours < logits_bytes / 2, (ours, theirs)
