"""The op is hook-compatible — saved-tensor hooks, checkpointing, transforms.

Each scenario runs in two forms (the ``form`` parameter) against the unfused
``F.linear`` + ``F.cross_entropy`` run eagerly under the same conditions, comparing the
loss and every gradient: ``eager_op``, the op called directly
(:func:`compile_pass.linear_cross_entropy`), and ``compiled``, the unfused function
compiled with ``torch.compile(..., backend="chunkce")`` (Inductor inside), whose
rewrite is proven on the graph Inductor got. A tiny Llama with gradient
checkpointing closes the file.

Pack hooks record every tensor they receive, so the tests prove what reaches a
user's activation-offload hooks: only the op's long-lived inputs and the fp32
log-sum-exp, never a ``[tokens, vocab]`` tensor.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import Recorder as GraphRecorder
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from compile_pass.op import loops
from compile_pass import linear_cross_entropy

B, T, H, V = 2, 19, 16, 96  # N = 38 tokens
N = B * T
CHUNK = 8  # 5 chunks, the last ragged


# --- spies ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """What a pack hook received."""

    shape: tuple
    dtype: torch.dtype
    storage: int  # data_ptr of the underlying storage: identifies the tensor saved

    @classmethod
    def of(cls, tensor):
        return cls(tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().data_ptr())

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


class _Counting:
    def _count(self, pack, unpack):
        self.packed, self.unpacked = [], 0

        def counting_pack(tensor):
            self.packed.append(Saved.of(tensor))
            return pack(tensor)

        def counting_unpack(packed):
            self.unpacked += 1
            return unpack(packed)

        self.pack_hook, self.unpack_hook = counting_pack, counting_unpack

    def packed_bytes(self):
        return sum(s.nbytes for s in self.packed)


class Recorder(_Counting, torch.autograd.graph.saved_tensors_hooks):
    """A user's pair of saved-tensor hooks that records every pack and counts every unpack."""

    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)
        self._count(self.pack_hook, self.unpack_hook)


class CountingSaveOnCpu(_Counting, torch.autograd.graph.save_on_cpu):
    """``torch.autograd.graph.save_on_cpu`` with the same records."""

    def __init__(self):
        super().__init__()
        self._count(self.pack_hook, self.unpack_hook)


def assert_no_logits_saved(packed, allowed):
    """No packed tensor is logits-shaped: a dim of size V and numel a multiple of V (whole
    [N, V], a chunk [n, V], [B, T, V]) — except the storages in ``allowed`` (the lm_head
    weight [V, H], bias and class weights [V])."""
    allowed = {t.untyped_storage().data_ptr() for t in allowed}
    vocab_sized = [s for s in packed if s.storage not in allowed and V in s.shape
                   and math.prod(s.shape) % V == 0]
    assert vocab_sized == [], f"logits-shaped tensors reached the pack hook: {vocab_sized}"


@dataclass
class BackwardCall:
    output_mask: list
    outputs: tuple


class backward_op_calls(TorchDispatchMode):
    """Records each ``chunkce::linear_cross_entropy_backward`` call: its output_mask and outputs."""

    def __enter__(self):
        self.calls = []
        super().__enter__()
        return self.calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.chunkce.linear_cross_entropy_backward.default:
            self.calls.append(BackwardCall(list(kwargs["output_mask"]), out))
        return out


class weight_grad_matmuls:
    """Profiles the block; ``spy(rows, cols)`` lists the matrix products that produced a
    [rows, cols] result (aten::mm, addmm, addmm_), with their input shapes."""

    _PRODUCTS = {"aten::mm": 0, "aten::addmm": 1, "aten::addmm_": 1}  # name -> first factor

    def __enter__(self):
        self._profile = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)

    def __call__(self, rows, cols):
        found = []
        for event in self._profile.events():
            if event.name in self._PRODUCTS:
                first = self._PRODUCTS[event.name]
                a, b = event.input_shapes[first:first + 2]
                if len(a) == 2 and len(b) == 2 and (a[0], b[1]) == (rows, cols):
                    found.append(event.input_shapes)
        return found


def make_inputs(bias=False, class_weight=False, seed=0, ignored=5):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen).requires_grad_()  # [B, T, H]
    weight = (torch.randn(V, H, generator=gen) / H**0.5).requires_grad_()  # [V, H]
    target = torch.randint(0, V, (B, T), generator=gen)  # [B, T]
    target.view(-1)[torch.randperm(N, generator=gen)[:ignored]] = -100
    linear_bias = torch.randn(V, generator=gen).requires_grad_() if bias else None
    cw = torch.rand(V, generator=gen) + 0.5 if class_weight else None
    return dict(input=hidden, linear_weight=weight, target=target, linear_bias=linear_bias, weight=cw)


def fused(input, linear_weight, target, linear_bias=None, **kwargs):
    return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias,
                                chunk_size=CHUNK, **kwargs)


def unfused(input, linear_weight, target, linear_bias=None, reduction="mean", **kwargs):
    logits = F.linear(input, linear_weight, linear_bias)  # [B, T, V]
    loss = F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction=reduction, **kwargs)
    return loss.view(target.shape) if reduction == "none" else loss


def differentiable(inputs):
    return [inputs[k] for k in ("input", "linear_weight", "linear_bias")
            if inputs[k] is not None and inputs[k].requires_grad]


def loss_and_grads(fn, inputs, grad_output=None, **kwargs):
    loss = fn(**inputs, **kwargs)
    grads = torch.autograd.grad(loss, differentiable(inputs), grad_output)
    return loss, grads


def assert_same(ours, theirs, **tol):
    (loss, grads), (ref_loss, ref_grads) = ours, theirs
    assert_close(loss, ref_loss, **tol)
    assert len(grads) == len(ref_grads)
    for grad, ref_grad in zip(grads, ref_grads):
        assert_close(grad, ref_grad, **tol)


def backward_grads(loss, params):
    """``loss.backward()`` (reentrant checkpoint refuses autograd.grad); the grads, then cleared."""
    loss.backward()
    grads = tuple(p.grad for p in params)
    for p in params:
        p.grad = None
    return grads


def expected_saved(inputs, reduction):
    """The exact (shape, dtype) multiset the eager call hands to pack hooks."""
    saved = [(N, H), (V, H), (N,)]  # hidden [N, H], weight [V, H], target [N]
    dtypes = [torch.float32, torch.float32, torch.int64]
    for name in ("linear_bias", "weight"):  # bias [V], class weight [V]
        if inputs[name] is not None:
            saved.append((V,))
            dtypes.append(torch.float32)
    saved += [(N,), (N,)]  # the log-sum-exp in two parts: row max [N] and row log-sum [N], fp32
    dtypes += [torch.float32, torch.float32]
    if reduction == "mean":  # the 0-d denominator, saved by the division
        saved.append(())
        dtypes.append(torch.int64 if inputs["weight"] is None else torch.float32)
    return Counter(zip(saved, dtypes))


def long_lived(inputs):
    return [inputs[k] for k in ("linear_weight", "linear_bias", "weight") if inputs[k] is not None]


# --- the two forms -------------------------------------------------------------------------------


class Form:
    """How a scenario computes its loss: ``build(make)`` turns ``make(loss_fn)`` (a function
    that computes the loss with ``loss_fn``, :func:`fused`'s signature) into what the test
    runs; calling the form computes the loss itself."""

    def __init__(self, inner: str | None):
        self.compiled = inner is not None
        self.inner = inner
        self.recorders: list[GraphRecorder] = []  # the inner backend of each compiled function
        self._loss = self.build(lambda fn: fn)

    def build(self, make):
        if not self.compiled:
            return make(fused)
        self.recorders.append(GraphRecorder(self.inner))
        return torch.compile(make(unfused), backend="chunkce",
                             options={"chunk_size": CHUNK, "inner_backend": self.recorders[-1]})

    def __call__(self, *args, **kwargs):
        return self._loss(*args, **kwargs)

    def assert_rewritten(self, tokens=N, vocab=V):
        """Compiled: the site was rewritten in every graph the function compiled to: counted,
        the op's node in the graph Inductor got and no [N, V] logits node beside it."""
        if not self.compiled:
            return
        stats = counters["chunkce"]
        assert stats["sites_rewritten"] >= 1 and stats["sites_refused"] == 0, dict(stats)
        recorder = next(r for r in reversed(self.recorders) if r.graphs)
        assert recorder.op_count() == len(recorder.graphs) >= 1
        assert recorder.logits_like(tokens, vocab) == [] and stats["logits_kept"] == 0


EAGER_OP = pytest.param(None, id="eager_op")
COMPILED = pytest.param("inductor", id="compiled", marks=pytest.mark.slow)  # Inductor compiles: slow


@pytest.fixture(params=[EAGER_OP, COMPILED])
def form(request):
    """The op called eagerly, or the unfused function compiled by chunkce (the parameter: its
    inner backend, None for eager). Compiled, Dynamo is reset and the counters cleared around
    the test; eagerly, the op's kernels stay compiled from one test to the next, as in a process."""
    compiled = request.param is not None
    if compiled:
        torch._dynamo.reset()
        counters.clear()
    yield Form(request.param)
    if compiled:
        torch._dynamo.reset()


def forms(*cases, compiled=None):
    """Parameters ``(form, *case)``: every case eagerly, ``compiled`` (default: all) compiled,
    with the form's marks (compiled: slow); ids ``form-case`` (a class by its name)."""
    compiled = cases if compiled is None else compiled
    return [pytest.param(form.values[0], *case, marks=form.marks,
                         id="-".join([form.id, *(getattr(c, "__name__", str(c)) for c in case)]))
            for form, group in ((EAGER_OP, cases), (COMPILED, compiled)) for case in group]


# --- saved-tensor hooks ------------------------------------------------------------------


PACKS = forms(*[(hooks, bias, class_weight, reduction) for hooks in (Recorder, CountingSaveOnCpu)
                for bias, class_weight in ((False, False), (True, True)) for reduction in ("mean", "sum", "none")],
              compiled=[(hooks, True, False, "mean") for hooks in (Recorder, CountingSaveOnCpu)])


@pytest.mark.parametrize("form, hooks, bias, class_weight, reduction", PACKS, indirect=["form"])
def test_pack_hooks_see_only_long_lived_tensors(form, hooks, bias, class_weight, reduction):
    inputs = make_inputs(bias=bias, class_weight=class_weight)
    grad_output = torch.rand(B, T) if reduction == "none" else None  # non-uniform
    recorder = hooks()
    with recorder:
        loss = form(**inputs, reduction=reduction)
    grads = torch.autograd.grad(loss, differentiable(inputs), grad_output)
    assert_same((loss, grads), loss_and_grads(unfused, inputs, grad_output, reduction=reduction))
    form.assert_rewritten()
    assert recorder.unpacked == len(recorder.packed)  # backward read every one back
    assert_no_logits_saved(recorder.packed, long_lived(inputs))
    assert [s.shape for s in recorder.packed if s.dtype == torch.float32].count((N,)) == 2  # row max, log-sum
    ref_recorder = hooks()
    with ref_recorder:
        unfused(**inputs, reduction=reduction)
    # The detector does fire: the unfused graph saves [N, V] tensors (log-softmax).
    with pytest.raises(AssertionError, match="logits-shaped"):
        assert_no_logits_saved(ref_recorder.packed, long_lived(inputs))
    assert recorder.packed_bytes() < ref_recorder.packed_bytes()
    if form.compiled:
        return
    assert Counter((s.shape, s.dtype) for s in recorder.packed) == expected_saved(inputs, reduction)
    # Saved by reference, never copied: the packed tensors are the caller's own storage.
    storages = {s.storage for s in recorder.packed}
    for tensor in (inputs["input"], inputs["target"], *long_lived(inputs)):
        assert tensor.untyped_storage().data_ptr() in storages
    # hidden + weight + target + bias + class weight + row max + row log-sum, + the 0-d denominator for mean
    expected_bytes = 4 * N * H + 4 * V * H + 8 * N + 4 * V * (bias + class_weight) + 2 * 4 * N
    assert recorder.packed_bytes() == expected_bytes + {"mean": 8 - 4 * class_weight}.get(reduction, 0)


def test_hooks_that_replace_the_saved_tensors_are_honoured():
    """An offload hook hands back a different tensor; backward must use it, not the original."""
    inputs = make_inputs(bias=True)
    expected = loss_and_grads(unfused, inputs)

    def pack(tensor):
        return tensor.detach().clone()  # a copy, as an offload to host would make

    def unpack(copy):
        return copy

    originals = {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = fused(**inputs)
    with torch.no_grad():  # clobber the originals: only the packed copies hold the right values
        for name in ("input", "linear_weight", "linear_bias"):
            inputs[name].zero_()
    grads = torch.autograd.grad(loss, differentiable(inputs))
    assert_same((loss, grads), expected)
    with torch.no_grad():
        for name, value in originals.items():
            inputs[name].copy_(value)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_saves_nothing(form, mode):
    inputs = make_inputs(bias=True, class_weight=True)
    recorder = Recorder()
    with recorder, mode():
        loss = form(**inputs)
    with torch.no_grad():
        expected = unfused(**inputs)
    form.assert_rewritten()
    assert_close(loss, expected)
    assert not loss.requires_grad and loss.grad_fn is None
    assert recorder.packed == [] and recorder.unpacked == 0


# --- checkpointing -------------------------------------------------------------------------


def body(hidden, body_weight):
    return torch.tanh(hidden @ body_weight)  # [B, T, H]: an activation checkpoint would drop


def body_weight_of(seed=7):
    return (torch.randn(H, H, generator=torch.Generator().manual_seed(seed)) / H**0.5).requires_grad_()


CHECKPOINTS = forms(*[(reentrant, hooks) for reentrant in (False, True) for hooks in (None, Recorder, CountingSaveOnCpu)],
                    compiled=[(reentrant, Recorder) for reentrant in (False, True)])


@pytest.mark.parametrize("form, use_reentrant, hooks", CHECKPOINTS, indirect=["form"])
def test_checkpoint(form, use_reentrant, hooks):
    """Body, head and loss recomputed under one checkpoint (a whole-model checkpoint),
    optionally inside a user's saved-tensor hooks; compiled, the pass enters the region's body."""
    inputs = make_inputs(bias=True)
    params = [inputs["input"], body_weight_of(), inputs["linear_weight"], inputs["linear_bias"]]

    def checkpointed(fn):
        def region(hidden, body_weight, weight, bias):
            return fn(body(hidden, body_weight), weight, inputs["target"], bias)
        return lambda *a: checkpoint(region, *a, use_reentrant=use_reentrant)

    recorder = hooks() if hooks else contextlib.nullcontext()
    with recorder:
        loss = form.build(checkpointed)(*params)
    ours = loss, backward_grads(loss, params)
    plain = unfused(body(*params[:2]), params[2], inputs["target"], params[3])
    assert_same(ours, (plain, backward_grads(plain, params)))
    form.assert_rewritten()
    if hooks:
        # Inside the region checkpoint's own hooks take precedence; nothing logits-shaped
        # reaches the user's either way, and whatever was packed was unpacked.
        assert_no_logits_saved(recorder.packed, long_lived(inputs))
        assert recorder.unpacked == len(recorder.packed)


@pytest.mark.parametrize("form, use_reentrant", forms((False,), compiled=[(False,), (True,)]), indirect=["form"])
def test_checkpointed_body_then_op_under_save_on_cpu(form, use_reentrant):
    """The common layout: checkpointed layers, the head and loss outside, all under save_on_cpu."""
    inputs = make_inputs(bias=True)
    body_weight = body_weight_of()
    params = [inputs["input"], body_weight, inputs["linear_weight"], inputs["linear_bias"]]

    def layout(fn):
        def step(hidden, body_weight, weight, bias):
            hidden = checkpoint(body, hidden, body_weight, use_reentrant=use_reentrant)
            return fn(hidden, weight, inputs["target"], bias)
        return step

    recorder = CountingSaveOnCpu()
    with recorder:
        loss = form.build(layout)(*params)
    ours = loss, backward_grads(loss, params)
    plain = unfused(body(inputs["input"], body_weight), *params[2:3], inputs["target"], params[3])
    assert_same(ours, (plain, backward_grads(plain, params)))
    form.assert_rewritten()
    assert_no_logits_saved(recorder.packed, long_lived(inputs))
    assert recorder.unpacked == len(recorder.packed)
    if form.compiled:
        return
    # The op's own (hidden [N, H] is the checkpoint's output), plus what checkpoint itself
    # keeps for its recompute: the region's inputs (and, in some torch versions, empty
    # placeholders).
    region_inputs = {t.untyped_storage().data_ptr() for t in (inputs["input"], body_weight)}
    checkpoints = [s for s in recorder.packed if s.storage in region_inputs or s.nbytes == 0]
    op_saved = [s for s in recorder.packed if s not in checkpoints]
    assert Counter((s.shape, s.dtype) for s in op_saved) == expected_saved(inputs, "mean")


# --- gradient accumulation, reductions, retained graphs ---------------------------------


def test_gradient_accumulation_matches_one_full_batch(form):
    """Micro-batches of 1, 12 and 36 valid tokens; each loss = sum / the window's num_items_in_batch."""
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).requires_grad_()
    linear_bias = torch.randn(V, generator=gen).requires_grad_()
    micro = []
    for valid in (1, 12, 36):
        hidden = torch.randn(B, T, H, generator=gen).requires_grad_()
        target = torch.randint(0, V, (B, T), generator=gen)
        target.view(-1)[torch.randperm(N, generator=gen)[valid:]] = -100
        micro.append((hidden, target))
    num_items_in_batch = sum((t != -100).sum() for _, t in micro)  # 0-d tensor: 49

    for hidden, target in micro:
        loss = form(hidden, weight, target, linear_bias, reduction="sum") / num_items_in_batch
        loss.backward()
    form.assert_rewritten()
    full_hidden = torch.cat([h.detach() for h, _ in micro]).requires_grad_()
    full_target = torch.cat([t for _, t in micro])
    ref_weight = weight.detach().clone().requires_grad_()
    ref_bias = linear_bias.detach().clone().requires_grad_()
    unfused(full_hidden, ref_weight, full_target, ref_bias).backward()  # mean over all 49

    assert_close(weight.grad, ref_weight.grad)
    assert_close(linear_bias.grad, ref_bias.grad)
    assert_close(torch.cat([h.grad for h, _ in micro]), full_hidden.grad)


@pytest.mark.parametrize("class_weight", [False, True])
def test_reduction_none_retain_graph_twice(form, class_weight):
    inputs = make_inputs(bias=True, class_weight=class_weight)
    params = differentiable(inputs)
    gen = torch.Generator().manual_seed(5)
    first, second = torch.rand(B, T, generator=gen), torch.randn(B, T, generator=gen)
    loss = form(**inputs, reduction="none")
    ref = unfused(**inputs, reduction="none")
    assert_close(loss, ref)
    assert loss.shape == (B, T)
    grads_1 = torch.autograd.grad(loss, params, first, retain_graph=True)
    grads_2 = torch.autograd.grad(loss, params, second)
    ref_1 = torch.autograd.grad(ref, params, first, retain_graph=True)
    ref_2 = torch.autograd.grad(ref, params, second)
    for ours, theirs in zip(grads_1 + grads_2, ref_1 + ref_2):
        assert_close(ours, theirs)
    form.assert_rewritten()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, params, first)  # freed after the non-retained backward


# --- frozen parameters ------------------------------------------------------------------------


# the backward op's call in Inductor's code, its output_mask (the one list of three bools)
_BACKWARD_CALL = re.compile(r"chunkce\.linear_cross_entropy_backward\.default\(.*?\[(True|False), (True|False), (True|False)\]")


@pytest.mark.parametrize("frozen", ["linear_weight", "input"])
def test_frozen_head_or_input(form, frozen):
    """A frozen head asks the backward op for no weight gradient, and none is computed.

    (Compiled, a TorchDispatchMode would make Dynamo run the frame eagerly, so the
    output_mask is read from the compiled backward's code instead.)
    """
    inputs = make_inputs(bias=True)
    inputs[frozen].requires_grad_(False)
    expected = loss_and_grads(unfused, inputs)
    code = []
    if form.compiled:  # compiled (forward and backward) outside the profiled region
        _, code = run_and_get_code(loss_and_grads, form, inputs)
    with contextlib.ExitStack() as stack:
        calls = [] if form.compiled else stack.enter_context(backward_op_calls())
        matmuls = stack.enter_context(weight_grad_matmuls())
        ours = loss_and_grads(form, inputs)
    assert_same(ours, expected)
    form.assert_rewritten()
    assert len(ours[1]) == 2  # (weight, bias) or (input, bias)
    wants_weight = frozen != "linear_weight"
    if form.compiled:
        masks = [m.groups() for m in _BACKWARD_CALL.finditer("\n".join(code))]
        assert masks == [(str(frozen != "input"), str(wants_weight), "True")]
    else:
        assert [c.output_mask for c in calls] == [[frozen != "input", wants_weight, True]]
        grad_hidden, grad_weight, _ = calls[0].outputs
        assert (grad_weight if frozen == "linear_weight" else grad_hidden).numel() == 0  # not produced
    products = matmuls(V, H)  # [V, n] @ [n, H]: weight-gradient work
    assert len(products) == (-(-N // CHUNK) if wants_weight else 0), products  # one a chunk, or none


def test_fully_frozen_call_builds_no_graph():
    inputs = make_inputs(bias=True)
    for name in ("input", "linear_weight", "linear_bias"):
        inputs[name].requires_grad_(False)
    recorder = Recorder()
    with recorder:
        loss = fused(**inputs)
    assert loss.grad_fn is None and recorder.packed == []
    assert_close(loss, unfused(**inputs))


# --- hooks on tensors and parameters --------------------------------------------------------


def test_tensor_and_post_accumulate_hooks_fire_once(form):
    inputs = make_inputs(bias=True)
    expected = loss_and_grads(unfused, inputs)
    leaf_hidden = inputs["input"]
    hidden = leaf_hidden * 1.0  # a non-leaf, as a model's final hidden states are
    seen_hidden, seen_weight = [], []
    hidden.register_hook(lambda grad: seen_hidden.append(grad.clone()))
    weight = inputs["linear_weight"]
    weight.register_post_accumulate_grad_hook(lambda p: seen_weight.append(p.grad.clone()))
    loss = form(hidden, weight, inputs["target"], inputs["linear_bias"])
    loss.backward()
    form.assert_rewritten()
    assert len(seen_hidden) == 1 and len(seen_weight) == 1
    assert_close(loss, expected[0])
    assert_close(seen_hidden[0], expected[1][0])
    assert_close(seen_weight[0], expected[1][1])
    assert_close(leaf_hidden.grad, expected[1][0])


# --- torch.func and double backward ------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_func_grad_and_vjp(reduction):
    inputs = make_inputs(bias=True, class_weight=True)
    args = [inputs[k].detach() for k in ("input", "linear_weight", "linear_bias")]
    rest = dict(target=inputs["target"], weight=inputs["weight"], reduction=reduction)

    def with_(fn):
        return lambda x, w, b: fn(x, w, linear_bias=b, **rest)

    cotangent = torch.rand(B, T) if reduction == "none" else torch.tensor(1.5)
    out, vjp_fn = torch.func.vjp(with_(fused), *args)
    ref_out, ref_vjp_fn = torch.func.vjp(with_(unfused), *args)
    assert_close(out, ref_out)
    for ours, theirs in zip(vjp_fn(cotangent), ref_vjp_fn(cotangent)):
        assert_close(ours, theirs)
    if reduction == "mean":
        grads = torch.func.grad_and_value(with_(fused), argnums=(0, 1, 2))(*args)
        ref_grads = torch.func.grad_and_value(with_(unfused), argnums=(0, 1, 2))(*args)
        assert_close(grads, ref_grads)


def test_func_vmap_per_sample_grads():
    """vmap runs the op once per sample (torch's batching fallback), under grad too."""
    inputs = make_inputs(bias=True)
    hidden = torch.randn(3, N, H, generator=torch.Generator().manual_seed(9))  # 3 samples
    weight, bias, target = (inputs[k].detach() for k in ("linear_weight", "linear_bias", "target"))

    def per_sample(fn):
        loss = lambda x, w: fn(x, w, target.flatten(), bias)  # noqa: E731
        return torch.func.vmap(torch.func.grad_and_value(loss, argnums=(0, 1)), in_dims=(0, None))

    with pytest.warns(UserWarning, match="batching rule for chunkce::linear_cross_entropy"):
        ours = per_sample(fused)(hidden, weight)
    assert_close(ours, per_sample(unfused)(hidden, weight))


def test_func_second_order_is_refused():
    inputs = make_inputs()
    target = inputs["target"]
    weight = inputs["linear_weight"].detach()

    def loss_of(x):
        return fused(x, weight, target)

    with pytest.raises(NotImplementedError, match="chunkce.linear_cross_entropy: double backward"):
        torch.func.grad(lambda x: torch.func.grad(loss_of)(x).sum())(inputs["input"].detach())


def test_double_backward_is_refused(form):
    inputs = make_inputs(bias=True)
    loss = form(**inputs)
    if form.compiled:
        # AOTAutograd refuses it before the op's own refusal is reached: with its double-backward
        # message, or, when the compiled backward donates buffers, with that one.
        with pytest.raises(RuntimeError, match="aot_autograd does not currently support double backward|"
                                               "compiled with non-empty donated buffers"):
            grad, = torch.autograd.grad(loss, inputs["linear_weight"], create_graph=True)
            grad.pow(2).sum().backward()
        return
    grad_hidden, = torch.autograd.grad(loss, inputs["input"], create_graph=True)
    assert_close(grad_hidden, torch.autograd.grad(unfused(**inputs), inputs["input"])[0])
    with pytest.raises(NotImplementedError,
                       match=r"chunkce.linear_cross_entropy: double backward .*not supported"):
        grad_hidden.pow(2).sum().backward()


# --- autocast --------------------------------------------------------------------------------


def test_autocast_bf16_projection_fp32_loss(form):
    """bf16 matmul is emulated on CPU: tiny shapes (16 tokens, H=16, V=64)."""
    gen = torch.Generator().manual_seed(3)
    inputs = dict(input=torch.randn(16, 16, generator=gen).requires_grad_(),
                  linear_weight=(torch.randn(64, 16, generator=gen) / 4).requires_grad_(),
                  target=torch.randint(0, 64, (16,), generator=gen),
                  linear_bias=torch.randn(64, generator=gen).requires_grad_())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(inputs["input"], inputs["linear_weight"]).dtype == torch.bfloat16
        ours = loss_and_grads(form, inputs)
        theirs = loss_and_grads(unfused, inputs)
    form.assert_rewritten(tokens=16, vocab=64)
    assert ours[0].dtype == theirs[0].dtype == torch.float32  # the loss in fp32, as autocast does
    assert [g.dtype for g in ours[1]] == [torch.float32] * 3  # leaves stay fp32
    # Same bf16 logits, fp32 loss: the loss agrees to fp32 rounding; gradients go
    # through bf16 matmuls on both sides (the weight gradient summed in another order).
    assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    for ours_grad, ref_grad in zip(ours[1], theirs[1]):
        assert_close(ours_grad, ref_grad, atol=1e-2, rtol=1.6e-2)


# --- release_cache ---------------------------------------------------------------------------


@pytest.fixture
def cache_spy(monkeypatch):
    """Records every loops.release_cache decision and every torch.accelerator.empty_cache call."""
    decisions, emptied = [], []
    real = loops.release_cache

    def spy(device, enabled):
        decisions.append((device.type, enabled))
        real(device, enabled)

    monkeypatch.setattr(loops, "release_cache", spy)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: emptied.append(True))
    monkeypatch.delenv("CHUNKCE_RELEASE_CACHE", raising=False)
    return decisions, emptied


def test_release_cache_is_resolved_per_call(cache_spy, monkeypatch):
    """The allocator policy is the environment's, read by each op call (no argument, no schema
    argument carries it: ``release_cache=`` is an unknown keyword, ``tests/op/test_op.py``)."""
    decisions, emptied = cache_spy
    inputs = make_inputs()
    fused(**inputs).backward()
    monkeypatch.setenv("CHUNKCE_RELEASE_CACHE", "1")  # seen by the very next call
    fused(**inputs).backward()
    monkeypatch.setenv("CHUNKCE_RELEASE_CACHE", "0")
    fused(**inputs).backward()
    monkeypatch.setenv("CHUNKCE_RELEASE_CACHE", "yes")
    loss = fused(**inputs)
    monkeypatch.delenv("CHUNKCE_RELEASE_CACHE")  # backward reads it again when it runs
    loss.backward()
    # forward, backward for each of the four calls
    assert decisions == [("cpu", False)] * 2 + [("cpu", True)] * 2 + [("cpu", False)] * 2 + [("cpu", True),
                                                                                             ("cpu", False)]
    assert emptied == []  # CPU: nothing to release


def test_release_cache_applies_to_the_statistics_op(cache_spy, monkeypatch):
    from compile_pass import linear_statistics

    decisions, _ = cache_spy
    inputs = make_inputs()
    monkeypatch.setenv("CHUNKCE_RELEASE_CACHE", "1")
    linear_statistics(inputs["input"].reshape(-1, inputs["input"].shape[-1]), inputs["linear_weight"]).lse.sum().backward()
    assert decisions == [("cpu", True)] * 2  # forward, backward


def test_release_cache_empties_an_accelerator(cache_spy, monkeypatch):
    _, emptied = cache_spy
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    loops.release_cache(torch.device("cpu"), True)
    loops.release_cache(torch.device("meta"), False)
    assert emptied == []
    loops.release_cache(torch.device("meta"), True)  # any non-CPU device
    assert emptied == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_release_cache_on_device(monkeypatch):
    device = torch.accelerator.current_accelerator()
    emptied = []
    real = torch.accelerator.empty_cache
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: (emptied.append(True), real()))
    inputs = {k: (v.detach().to(device).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
              for k, v in make_inputs(bias=True).items()}
    expected = loss_and_grads(unfused, inputs)
    monkeypatch.setenv("CHUNKCE_RELEASE_CACHE", "1")
    assert_same(loss_and_grads(fused, inputs), expected, atol=1e-4, rtol=1e-4)
    assert emptied == [True, True]  # after forward and after backward


@pytest.mark.parametrize("form", [COMPILED], indirect=True)
def test_release_cache_env_is_read_per_call(form, monkeypatch):
    """Compiled, the variable is read at run time: no recompile when it changes."""
    decisions = []
    real = loops.release_cache
    monkeypatch.setattr(loops, "release_cache",
                        lambda device, enabled: (decisions.append(enabled), real(device, enabled)))
    monkeypatch.delenv("CHUNKCE_RELEASE_CACHE", raising=False)
    inputs = make_inputs()
    for _ in range(2):  # (the first run of a compiled graph analyses custom ops under a
        form(**inputs).backward()  # dispatch mode, so the per-chunk kernels compile again)
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setenv("CHUNKCE_RELEASE_CACHE", "1")
    form(**inputs).backward()
    form.assert_rewritten()
    # forward, backward of each call; the third call sees the variable
    assert decisions == [False, False] * 2 + [True, True]
    assert counters["stats"]["unique_graphs"] == graphs  # read at run time: no recompile


# --- a real model ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
def test_llama_gradient_checkpointing_under_save_on_cpu():
    torch._dynamo.reset()
    counters.clear()
    import transformers  # a test dependency: missing, the test fails
    config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference.train()
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 500, (2, 24), generator=gen)
    labels = input_ids.clone()
    labels[0, :5] = -100
    graphs = GraphRecorder("inductor")
    # the logits kept in the graph for the output ("keep"): still none of them is saved for backward
    compiled = torch.compile(model, backend="chunkce",
                             options={"chunk_size": 16, "inner_backend": graphs, "returned_logits": "keep"})

    recorder = CountingSaveOnCpu()
    with recorder:
        loss = compiled(input_ids=input_ids, labels=labels).loss
    loss.backward()
    stats = counters["chunkce"]  # rewritten in every graph; outputs.logits kept
    assert stats["sites_rewritten"] >= 1 and stats["sites_refused"] == 0, dict(stats)
    assert graphs.op_count() == 1 <= len(graphs.graphs)  # the loss's graph (checkpointed layers may break apart)
    assert graphs.logits_like(2 * 24, 500) != [] and stats["logits_kept"] == stats["sites_rewritten"]
    vocab_params = [p for p in model.parameters() if 500 in p.shape]
    # V = 500 here, not the toy V: check by hand.
    logits_like = [s for s in recorder.packed if 500 in s.shape and s.storage not in
                   {p.untyped_storage().data_ptr() for p in vocab_params}]
    assert logits_like == []
    assert recorder.unpacked == len(recorder.packed)

    ref_loss = reference(input_ids=input_ids, labels=labels).loss
    ref_loss.backward()
    assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
