"""The op's promises tried as a new user would: no recompile after warm-up, no
permanent fallback from a transient error, any device (meta, no accelerator),
bad input refused before any work, opcheck of both ops, numerics at the edges,
no host synchronisation."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from builders import RoundTo
from test_op import CLASS_WEIGHT, TOL, chunked, loss_and_grads, make_inputs, unfused
from torch._dynamo.utils import counters

from compile_pass import linear_cross_entropy
import compile_pass.torch_internals as internals
from compile_pass.op import kernel_runner, loops


def _assert_all_close(ours, theirs, **tolerances):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **(tolerances or TOL[torch.float32]))


# ---- no recompile after warm-up --------------------------------------------------------


def _step(dtype, n, reduction="mean", strided_target=False, chunk_size=8, columns=None, v=24):
    hidden, weight, target, _ = make_inputs(n=n, h=8, v=v, dtype=dtype, ignored=min(n, 3), seed=n)
    if strided_target:  # a view of every other label of a longer row
        target = torch.stack([target, target], 1).flatten()[::2]
    # columns: vocabulary columns a tile (the budget of chunk_size tokens of them); None: whole rows
    chunk_bytes = None if columns is None else chunk_size * columns * hidden.element_size()
    loss = linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk_size=chunk_size,
                                label_smoothing=0.1, chunk_bytes=chunk_bytes)
    loss.float().sum().backward()


# warm-up call, then calls that must reuse its graphs: every dtype, one chunk and
# several, ragged tails (37 = 4 x 8 + 5; 81's one-token tail joins its chunk), the
# one-token call, new N in either order, every reduction, a strided target. For a
# half-precision head, one chunk walks the whole vocabulary and several chunks walk
# it in blocks (N = 64: one 64-token backward chunk per block, the row statistics' length).
RECOMPILE_CASES = [
    (torch.float32, 1),
    (torch.float32, 80),
    (torch.bfloat16, 64),  # 64 then 80: no third graph
    (torch.bfloat16, 8),  # a single-chunk call first
    (torch.float16, 1),
]


@pytest.mark.parametrize("dtype,warm_up", RECOMPILE_CASES)
def test_no_recompile_after_warm_up(dtype, warm_up, monkeypatch):
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    _step(dtype, warm_up)
    graphs = counters["chunkce"]["kernel_graphs"]
    assert graphs == 2, dict(counters["chunkce"])  # chunk_forward, chunk_backward
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (64, 80, 8, 37, 1, 2, 81, 16, 9):
            _step(dtype, n)
        for reduction in ("sum", "none"):
            _step(dtype, 37, reduction=reduction)
        _step(dtype, 29, strided_target=True)
    assert counters["chunkce"]["kernel_graphs"] == graphs


# warm-up tiles (vocabulary columns a tile; None: whole rows), then tiles of every width: one
# block, several with a ragged last block (24 = 4 x 5 + 4; 23 columns: 22 + a one-column
# tail joined to it), two-column blocks, and a prime vocabulary
@pytest.mark.parametrize("dtype,warm_up_columns", [(torch.float32, None), (torch.float32, 5),
                                                   (torch.bfloat16, 7)])
def test_no_recompile_across_tile_edges(dtype, warm_up_columns, monkeypatch):
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    _step(dtype, 37, columns=warm_up_columns)
    graphs = counters["chunkce"]["kernel_graphs"]
    assert graphs == 2, dict(counters["chunkce"])  # chunk_forward, chunk_backward
    with torch._dynamo.config.patch(error_on_recompile=True):
        for columns in (None, 5, 23, 2, 3, 12, 7):
            for n in (37, 1, 8, 81):
                _step(dtype, n, columns=columns)
        for v in (29, 97):  # prime vocabularies, whole rows and tiles
            _step(dtype, 37, columns=None, v=v)
            _step(dtype, 37, columns=6, v=v)
    assert counters["chunkce"]["kernel_graphs"] == graphs


# ---- a downcast between head and loss is reproduced -----------------------------------


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.0)])
def test_downcast_to_half_precision_logits_is_reproduced(logits_dtype, reduction, label_smoothing,
                                                         monkeypatch):
    # An fp32 head whose logits are cast to bf16 / fp16 before the loss: with the
    # compiled kernels, every chunk's logits are rounded to logits_dtype and their
    # gradient is rounded to it before the fp32 matmuls, as F.linear(...).to(dtype)
    # does. The ground truth is that computation in fp64 with exactly those two
    # roundings; torch's own half-precision cross_entropy rounds more on the way
    # (its log-softmax output), so it is compared as no closer to the truth.
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    hidden, weight, target, _ = make_inputs(n=64, h=32, v=100, ignored=5)
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
    ours = loss_and_grads(chunked, hidden, weight, target, None, chunk_size=16,
                          logits_dtype=logits_dtype, **kwargs)
    theirs = loss_and_grads(unfused, hidden, weight, target, None, logits_dtype=logits_dtype, **kwargs)
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight)]

    def rounded(h, w, t, b, **kw):
        logits = RoundTo.apply(F.linear(h, w), logits_dtype)
        loss = F.cross_entropy(logits, t, **kw)
        return loss.to(logits_dtype).double()  # the loss is returned in logits_dtype

    truth = loss_and_grads(rounded, *exact, target, None, **kwargs)
    assert ours[0].dtype == theirs[0].dtype == logits_dtype
    ulp = torch.finfo(logits_dtype).eps * truth[0].abs().max().item()
    torch.testing.assert_close(ours[0].double(), truth[0], atol=ulp, rtol=0)  # the loss: one ulp
    for name, o, t, x in zip(("hidden", "weight"), ours[1:], theirs[1:], truth[1:], strict=True):
        scale = x.abs().max().item()
        our_error = (o.double() - x).abs().max().item()
        # a twentieth of an ulp of the largest gradient: fp32 against fp64 arithmetic
        # before the rounding flips an odd element; computed as if no cast: an ulp or so
        assert our_error <= 0.05 * torch.finfo(logits_dtype).eps * scale, (name, our_error / scale)
        assert our_error <= (t.double() - x).abs().max().item(), name


# ---- no permanent fallback from a transient error -----------------------------------


def test_mixed_precision_addmm_is_a_capability_rule():
    assert not loops.has_mixed_addmm("cpu", torch.bfloat16, torch.float32)
    assert not loops.has_mixed_addmm("meta", torch.bfloat16, torch.float32)
    assert not loops.has_mixed_addmm("no_such_device", torch.bfloat16, torch.float32)
    assert not loops.has_mixed_addmm("cuda", torch.float32, torch.float32)
    assert not loops.has_mixed_addmm("cuda", torch.bfloat16, torch.float16)
    assert loops.has_mixed_addmm("cuda", torch.bfloat16, torch.float32) == (
        torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CUDA"))


def _bf16_several_chunks():
    # A bf16 head over several token chunks: the backward sums into fp32 accumulators.
    return make_inputs(n=40, h=8, v=24, dtype=torch.bfloat16, ignored=3)


def test_out_of_memory_in_mixed_addmm_propagates_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")  # the matmul is what is tried here
    inputs = _bf16_several_chunks()
    expected = loss_and_grads(chunked, *inputs, chunk_size=8)
    # Pretend the device has the mixed-dtype kernel, and make it run out of memory once.
    calls = {"mixed": 0, "raised": False}
    real_upcast = torch.Tensor.addmm_

    def flaky_dtype_out(accumulator, a, b, dtype, out):
        calls["mixed"] += 1
        if not calls["raised"]:
            calls["raised"] = True
            raise torch.OutOfMemoryError("injected: out of memory")
        return real_upcast(out, a.to(dtype), b.to(dtype))

    monkeypatch.setattr(loops, "has_mixed_addmm", lambda *args: True)
    monkeypatch.setattr(torch.ops.aten.addmm, "dtype_out", flaky_dtype_out)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        loss_and_grads(chunked, *inputs, chunk_size=8)
    calls["mixed"] = 0
    again = loss_and_grads(chunked, *inputs, chunk_size=8)  # the normal (mixed) path again
    assert calls["mixed"] > 0
    _assert_all_close(again, expected, atol=0, rtol=0)


def test_out_of_memory_while_compiling_propagates_and_the_next_call_compiles(monkeypatch):
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    inputs = make_inputs(n=20)
    expected = loss_and_grads(chunked, *inputs, chunk_size=8)
    state = {"raised": False, "compiled_calls": 0}

    def flaky_compile(fn_name, variant):
        if not state["raised"]:
            state["raised"] = True
            raise torch.OutOfMemoryError("injected: out of memory while compiling")
        state["compiled_calls"] += 1

    with kernel_runner.hooked_runs(flaky_compile):
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            loss_and_grads(chunked, *inputs, chunk_size=8)
        again = loss_and_grads(chunked, *inputs, chunk_size=8)
    assert state["compiled_calls"] > 0  # compiled, not pinned to eager
    _assert_all_close(again, expected)


def test_eager_kernels_by_an_explicit_device_rule(monkeypatch):
    assert kernel_runner.inductor_compiles_for("cpu")  # this machine has a C++ compiler
    assert not kernel_runner.inductor_compiles_for("meta")
    assert not kernel_runner.inductor_compiles_for("no_such_device")
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    def no_compiler():
        raise InvalidCxxCompiler

    kernel_runner.inductor_compiles_for.cache_clear()
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    try:
        assert not kernel_runner.inductor_compiles_for("cpu")
        compiled = []
        inputs = make_inputs(n=20)
        with kernel_runner.hooked_runs(lambda *a: compiled.append(a)):
            _assert_all_close(loss_and_grads(chunked, *inputs, chunk_size=8),
                              loss_and_grads(unfused, *inputs))
        assert not compiled  # ran eagerly by the rule, no compile attempted
    finally:
        kernel_runner.inductor_compiles_for.cache_clear()


def test_kernels_rounding_to_half_precision_run_eagerly_where_inductor_would_drop_the_rounding(monkeypatch):
    """Where Inductor would serve a float32 value back for its cast to half precision and back (its C++
    code before torch 2.13), the kernels of an fp32 head with bf16 logits run eagerly, and round; a
    bf16 head's (no such cast) still compile."""
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    monkeypatch.setattr(internals, "inductor_keeps_half_casts", lambda device_type: False)
    hidden, weight, target, _ = make_inputs(n=24, h=16, v=40, ignored=3)
    compiled = []
    with kernel_runner.hooked_runs(lambda *a: compiled.append(a)):
        ours = loss_and_grads(chunked, hidden, weight, target, None, chunk_size=8, logits_dtype=torch.bfloat16)
    assert not compiled
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")  # the eager kernels, asked for
    _assert_all_close(ours, loss_and_grads(chunked, hidden, weight, target, None, chunk_size=8,
                                           logits_dtype=torch.bfloat16))
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS")
    with kernel_runner.hooked_runs(lambda *a: compiled.append(a)):
        loss_and_grads(chunked, *(t.bfloat16() for t in (hidden, weight)), target, None, chunk_size=8)
    assert compiled


# ---- any device ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_meta_device_forward_and_backward(dtype, reduction):
    # Shape logic is device-free: values are irrelevant, shapes and dtypes are not.
    hidden = torch.empty(3, 10, 8, device="meta", dtype=dtype, requires_grad=True)
    weight = torch.empty(13, 8, device="meta", dtype=dtype, requires_grad=True)
    bias = torch.empty(13, device="meta", dtype=dtype, requires_grad=True)
    target = torch.empty(3, 10, device="meta", dtype=torch.int64)
    class_weight = torch.empty(13, device="meta", dtype=dtype)
    loss = linear_cross_entropy(hidden, weight, target, linear_bias=bias, weight=class_weight,
                                reduction=reduction, chunk_size=4, label_smoothing=0.1)
    assert loss.device.type == "meta" and loss.dtype == dtype
    assert loss.shape == ((3, 10) if reduction == "none" else ())
    loss.sum().backward()
    for tensor in (hidden, weight, bias):
        assert tensor.grad.device.type == "meta"
        assert (tensor.grad.shape, tensor.grad.dtype) == (tensor.shape, tensor.dtype)


def test_op_runs_on_cpu_without_touching_cuda():
    inputs = make_inputs(n=20, bias=True)
    loss_and_grads(chunked, *inputs, chunk_size=8)
    assert not torch.cuda.is_initialized()


NO_ACCELERATOR_SCRIPT = """
import torch, torch.nn.functional as F
import compile_pass
from compile_pass import linear_cross_entropy
assert not torch.cuda.is_available()
hidden = torch.randn(20, 8, requires_grad=True)
weight = torch.randn(11, 8, requires_grad=True)
target = torch.randint(0, 11, (20,))
loss = linear_cross_entropy(hidden, weight, target, chunk_size=6)
loss.backward()
reference = F.cross_entropy(F.linear(hidden, weight), target)
torch.testing.assert_close(loss, reference)
assert not torch.cuda.is_initialized()
print("ok")
"""


@pytest.mark.slow
def test_imports_and_works_with_no_accelerator():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", CHUNKCE_EAGER_KERNELS="1",
               ASCEND_RT_VISIBLE_DEVICES="", ZE_AFFINITY_MASK="")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", NO_ACCELERATOR_SCRIPT], env=env, cwd=root,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_no_torch_cuda_in_library_code():
    root = Path(__file__).resolve().parents[2] / "compile_pass"
    offenders = [str(path) for path in root.rglob("*.py") if "torch.cuda" in path.read_text()]
    assert not offenders


# ---- bad input ----------------------------------------------------------------------


def test_class_weight_of_another_dtype_refused_as_torch_does():
    hidden, weight, target, _ = make_inputs()
    class_weight = CLASS_WEIGHT.double()
    with pytest.raises(RuntimeError, match="expected scalar type"):
        F.cross_entropy(F.linear(hidden, weight), target, weight=class_weight)
    with pytest.raises(TypeError, match=r"chunkce.linear_cross_entropy: expected weight \(class "
                                        r"weights\) of dtype torch.float32 \(the logits'\), got torch.float64"):
        linear_cross_entropy(hidden, weight, target, weight=class_weight)
    # half-precision logits want half-precision class weights, as torch
    with pytest.raises(TypeError, match="weight .* of dtype torch.bfloat16"):
        linear_cross_entropy(hidden, weight, target, weight=CLASS_WEIGHT, logits_dtype=torch.bfloat16)


@pytest.mark.parametrize("label_smoothing", [-0.1, -5.0, float("nan"), 0, 1])
def test_label_smoothing_that_torch_accepts_is_accepted_and_exact(label_smoothing):
    # torch 2.13 refuses only label_smoothing > 1; <= 0 and nan mean no smoothing
    inputs = make_inputs(bias=True)
    _assert_all_close(loss_and_grads(chunked, *inputs, chunk_size=8, label_smoothing=label_smoothing),
                      loss_and_grads(unfused, *inputs, label_smoothing=label_smoothing))


@pytest.mark.parametrize("label_smoothing", [1.5, float("inf")])
def test_label_smoothing_that_torch_refuses_is_refused(label_smoothing):
    hidden, weight, target, _ = make_inputs()
    with pytest.raises(RuntimeError, match="label_smoothing must be between"):
        F.cross_entropy(F.linear(hidden, weight), target, label_smoothing=label_smoothing)
    with pytest.raises(ValueError, match="chunkce.linear_cross_entropy: expected label_smoothing of at most 1.0"):
        linear_cross_entropy(hidden, weight, target, label_smoothing=label_smoothing)


def test_uint8_target_accepted_as_torch_does():
    hidden, weight, target, _ = make_inputs(v=51, ignored=0)
    target8 = target.to(torch.uint8)
    version = target8._version
    _assert_all_close(loss_and_grads(chunked, hidden, weight, target8, None, chunk_size=8),
                      loss_and_grads(unfused, hidden, weight, target8, None))
    assert target8._version == version


@pytest.mark.parametrize("bad", [
    {"reduction": "batchmean"}, {"label_smoothing": 2.0}, {"chunk_size": -1},
    {"weight": CLASS_WEIGHT.double()}, {"linear_bias": torch.zeros(50)},
])
def test_nothing_modified_on_error(bad):
    hidden, weight, target, bias = make_inputs(bias=True)
    arguments = {"linear_bias": bias} | bad
    tensors = [hidden, weight, target] + [v for v in arguments.values() if isinstance(v, torch.Tensor)]
    before = [(t.detach().clone(), t._version) for t in tensors]
    with pytest.raises((ValueError, TypeError), match="chunkce.linear_cross_entropy: expected"):
        linear_cross_entropy(hidden, weight, target, **arguments)
    for t, (value, version) in zip(tensors, before, strict=True):
        torch.testing.assert_close(t.detach(), value, atol=0, rtol=0)
        assert t._version == version and t.grad is None


# ---- opcheck of both ops ---------------------------------------------------------------


OPCHECK_CASES = [  # n, h, v, bias, class weights, ignored, label_smoothing, dtype, chunk_size
    (13, 8, 11, True, False, 2, 0.0, torch.float32, 4),
    (16, 8, 17, False, True, 0, 0.1, torch.float32, None),  # automatic
    (5, 4, 3, True, True, 5, 0.5, torch.float64, 2),
    (12, 4, 10, True, False, 3, 0.2, torch.bfloat16, 2),  # blocked vocabulary walk
]


@pytest.mark.slow
@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_forward_and_backward(case):
    n, h, v, bias, weighted, ignored, smoothing, dtype, chunk_size = case
    hidden, weight, target, b = make_inputs(n=n, h=h, v=v, dtype=dtype, bias=bias, ignored=ignored)
    class_weight = (torch.rand(v, generator=torch.Generator().manual_seed(5)) + 0.1).to(dtype) if weighted else None
    logits_dtype = dtype
    options = {"ignore_index": -100, "label_smoothing": smoothing, "logits_dtype": logits_dtype,
               "chunk_size": chunk_size}
    forward = torch.ops.chunkce.linear_cross_entropy.default
    torch.library.opcheck(forward, (hidden, weight, target, b, class_weight, None), options)
    with torch.no_grad():
        _, row_max, row_log_sum = forward(hidden, weight, target, b, class_weight, None, **options)
    grad_loss = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=row_max.dtype)
    backward = torch.ops.chunkce.linear_cross_entropy_backward.default
    for mask in ([True, True, True], [True, False, False], [False, True, bias]):
        args = (grad_loss, hidden.detach(), weight.detach(), target,
                None if b is None else b.detach(), class_weight, None, row_max, row_log_sum)
        # the backward op's autograd only refuses double backward: no autograd check
        torch.library.opcheck(backward, args, {**options, "output_mask": mask}, test_utils=("test_schema", "test_faketensor",
                                                          "test_aot_dispatch_static",
                                                          "test_aot_dispatch_dynamic"))


# ---- numerics at the edges -----------------------------------------------------------


def test_large_common_offset_is_shift_invariant():
    # cross-entropy is shift-invariant: a common offset of 1e4 on every logit (the bias)
    hidden, weight, target, _ = make_inputs(n=40, v=51, dtype=torch.float64, ignored=3)
    offset = torch.full((51,), 1e4, dtype=torch.float64, requires_grad=True)
    inputs = [t.detach().float().requires_grad_() for t in (hidden, weight, offset)]
    ours = loss_and_grads(chunked, inputs[0], inputs[1], target, inputs[2], chunk_size=8)
    theirs = loss_and_grads(unfused, inputs[0], inputs[1], target, inputs[2])
    _assert_all_close(ours, theirs, atol=2e-3, rtol=1e-3)  # both see logits rounded at 1e4 (ulp 1e-3)
    exact = loss_and_grads(unfused, hidden, weight, target, None)  # no offset, fp64
    for a, b in zip(ours[:3], exact, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-3, rtol=5e-3)  # no drift beyond that rounding


def test_fp16_sum_over_many_tokens_does_not_overflow(monkeypatch):
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")  # the reduction is what is tried here
    # 8192 tokens of loss ~ log(16) = 2.8 each: a sum of ~2.3e4, within fp16's 65504,
    # as torch's (fp32-accumulated) sum; each token's loss alone is tiny.
    hidden, weight, target, _ = make_inputs(n=8192, h=4, v=16, dtype=torch.float16, ignored=0)
    ours = linear_cross_entropy(hidden, weight, target, reduction="sum", chunk_size=2048)
    theirs = unfused(hidden, weight, target, None, reduction="sum")
    assert torch.isfinite(theirs) and torch.isfinite(ours)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=2e-3)


def test_bf16_logits_in_the_tens_of_thousands():
    hidden, weight, target, bias = make_inputs(n=24, h=8, v=40, dtype=torch.float64, bias=True, ignored=2)
    scaled = [(t.detach() * s).to(torch.bfloat16).requires_grad_()
              for t, s in ((hidden, 100.0), (weight, 100.0), (bias, 1e4))]
    truth = loss_and_grads(unfused, *[t.detach().double().requires_grad_() for t in scaled[:2]], target,
                           scaled[2].detach().double().requires_grad_(), label_smoothing=0.1)
    ours = loss_and_grads(chunked, scaled[0], scaled[1], target, scaled[2], chunk_size=5, label_smoothing=0.1)
    theirs = loss_and_grads(unfused, scaled[0], scaled[1], target, scaled[2], label_smoothing=0.1)
    for name, o, t, x in zip(("loss", "hidden", "weight", "bias"), ours, theirs, truth, strict=True):
        assert torch.isfinite(o).all(), name
        our_error = (o.double() - x).abs().max().item()
        their_error = (t.double() - x).abs().max().item()
        assert our_error <= their_error + 1e-2 * x.abs().max().item(), (name, our_error, their_error)


@pytest.mark.parametrize("where", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_nan_and_inf_propagate_as_torch(where, value, label_smoothing):
    hidden, weight, target, bias = make_inputs(n=12, h=4, v=9, bias=True, ignored=2)
    tensor = {"hidden": hidden, "weight": weight, "bias": bias}[where]
    with torch.no_grad():
        tensor.view(-1)[5] = value
    ours = loss_and_grads(chunked, hidden, weight, target, bias, chunk_size=4, reduction="none",
                          label_smoothing=label_smoothing)
    theirs = loss_and_grads(unfused, hidden, weight, target, bias, reduction="none",
                            label_smoothing=label_smoothing)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL[torch.float32])


# ---- no host synchronisation -----------------------------------------------------------


@pytest.mark.skipif(torch.__version__ < "2.12", reason="torch 2.11's Dynamo guards a kernel's specialized float "
                    "(label_smoothing) as ___as_tensor(x).item() == value: a CPU scalar read at each kernel call, no "
                    "device sync, that this profile cannot tell from one")
def test_no_host_sync_in_forward_or_backward():
    inputs = make_inputs(n=40, bias=True)
    loss_and_grads(chunked, *inputs, chunk_size=8, weight=CLASS_WEIGHT, label_smoothing=0.1)  # warm up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss_and_grads(chunked, *inputs, chunk_size=8, weight=CLASS_WEIGHT, label_smoothing=0.1)
    syncs = [e for e in profile.events() if e.name in ("aten::item", "aten::_local_scalar_dense",
                                                        "aten::nonzero")]

    def under_assert(event):
        while event is not None:
            if event.name == "aten::_assert_async":
                return True
            event = event.cpu_parent
        return False

    # The only scalar read is CPU's own check of the target range (torch._assert_async,
    # a device-side assert with no host sync on accelerators).
    assert syncs and all(under_assert(e) for e in syncs), [e.name for e in syncs if not under_assert(e)]


def test_weighted_smoothed_mean_over_zero_total_weight_is_nan_as_torch():
    # torch divides the nll and smoothing terms by the weight sum separately: 0 / 0 + x / 0 = nan
    # (one division of their total would give inf)
    hidden, weight, _, _ = make_inputs(n=6, h=8, v=10, ignored=0)
    class_weight = torch.rand(10)
    class_weight[:5] = 0
    target = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(0))
    kwargs = {"weight": class_weight, "label_smoothing": 0.5}
    expected = F.cross_entropy(F.linear(hidden, weight), target, **kwargs)
    assert expected.isnan()
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, target, chunk_size=4, **kwargs), expected,
                               equal_nan=True)
