"""A copy of lazy logits is a copy, a view is a view: the same user code on a ``LazyLogits``
from a real compiled step and on stock logits gives the same values, the same aliasing and
the same gradients.

In torch, ``clone``, ``contiguous`` of a non-contiguous view, ``.to()`` / ``.float()`` that
change the dtype or device (or ``copy=True``), a ``reshape`` that cannot view, and ``copy_``
into another tensor are copies: they hold the values of the moment they were made, whatever
happens to the source later (an in-place edit, ``optimizer.step()``). Views (``detach``,
indexing, ``view``, ``transpose``, ...) share the values: a write through either side is
seen by the other. Each case runs on the chunkce step's ``LazyLogits`` and on the same
model's stock logits (eager), and every value read is compared with
``torch.testing.assert_close``. ``repr`` computes the values for the text and keeps none:
measured with :class:`compile_pass.memory.PeakMemory`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from builders import z_loss
from test_lazy_logits import LM, B, T, V, batch

from compile_pass import LazyLogits
from compile_pass.memory import PeakMemory

pytestmark = pytest.mark.usefixtures("eager_kernels")


def _model_and_compile(dtype):
    torch._dynamo.reset()
    model = LM(bias=True).to(dtype)
    original = copy.deepcopy(model.state_dict())
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    yield model, compiled, original
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def steps():
    """One bf16 model (bf16 logits, so ``.float()`` is a copy; the loss upcasts them) and its
    chunkce compile, shared by the module's cases: each case restores the weights first."""
    yield from _model_and_compile(torch.bfloat16)


@pytest.fixture(scope="module")
def steps32():
    """The same in fp32, for gradients (bf16 gradients of the fused loss differ from stock's by rounding)."""
    yield from _model_and_compile(torch.float32)


def step(steps, kind, grad_h=False):
    """``(model, h, loss, logits)`` of one training step's forward: ``kind`` "lazy" (the chunkce
    compile: a LazyLogits, not computed) or "stock" (the same model, eager)."""
    model, compiled, original = steps
    with torch.no_grad():
        model.load_state_dict(original)
    model.zero_grad(set_to_none=True)
    h, labels = batch()
    h = h.to(model.body.weight.dtype).requires_grad_(grad_h)
    loss, logits = (compiled if kind == "lazy" else model)(h, labels)
    assert (type(logits) is LazyLogits and not logits.is_computed) if kind == "lazy" else type(logits) is torch.Tensor
    return model, h, loss, logits


def values(t):
    """What a read of ``t`` gives, as a plain tensor (a meta tensor: its metadata)."""
    if t.device.type == "meta":
        return (t.shape, t.stride(), t.dtype, t.sum().device.type)
    return t.detach().add(0)  # an op that reads: a plain tensor (`* 1` would be a lazy temperature)


def assert_same(got, expected):
    """``got`` and ``expected``: what :func:`values` read."""
    if isinstance(expected, tuple):
        assert got == expected
    else:
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


COPIES = {
    "clone": lambda x: x.clone(),
    "detach_clone": lambda x: x.detach().clone(),
    "to_dtype": lambda x: x.to(torch.float64),
    "float": lambda x: x.float(),
    "to_meta": lambda x: x.to("meta"),
    "to_cpu_copy": lambda x: x.to("cpu", copy=True),
    "contiguous_of_transpose": lambda x: x.transpose(0, 1).contiguous(),
    "reshape_of_transpose": lambda x: x.transpose(0, 1).reshape(T, -1),
    "copy_into_plain": lambda x: torch.empty(x.shape, dtype=x.dtype).copy_(x),
    "clone_of_a_clone": lambda x: x.clone().clone(),
    "clone_of_a_row": lambda x: x[:, -1].clone(),
    "view_of_a_clone": lambda x: x.clone()[:, 1:3],
}


def _optimizer_step(model, loss, logits):
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()


def _read_then_edit(model, loss, logits):
    logits.argmax(-1)
    logits.detach().add_(1)


THEN = {
    "nothing": lambda model, loss, logits: None,
    "edit_the_source": lambda model, loss, logits: logits.detach().mul_(2),
    "edit_through_a_view": lambda model, loss, logits: logits.detach()[:, 1:].zero_(),
    "read_then_edit": _read_then_edit,
    "optimizer_step": _optimizer_step,
}


@pytest.mark.parametrize("then", THEN)
@pytest.mark.parametrize("make", COPIES)
def test_a_copy_holds_the_values_of_when_it_was_made(steps, make, then):
    seen = {}
    for kind in ("stock", "lazy"):
        model, _, loss, logits = step(steps, kind)
        made = COPIES[make](logits)
        THEN[then](model, loss, logits)
        seen[kind] = (made, values(made), values(made))  # read twice: the same both times
        if then != "optimizer_step":  # (lazy logits cannot be read after one: tested elsewhere)
            seen[kind] += (values(logits),)
    (stock_made, *stock_reads), (lazy_made, *lazy_reads) = seen["stock"], seen["lazy"]
    assert (lazy_made.shape, lazy_made.stride(), lazy_made.dtype, lazy_made.device, lazy_made.requires_grad) == (
        stock_made.shape, stock_made.stride(), stock_made.dtype, stock_made.device, stock_made.requires_grad)
    for got, expected in zip(lazy_reads, stock_reads, strict=True):
        assert_same(got, expected)


def test_a_copy_of_logits_not_read_keeps_them_lazy_and_costs_one_copy():
    """Reading ``logits.detach().clone()`` of logits nobody read computes the values once, for
    the copy: the source stays lazy (it keeps nothing), and no second ``[N, V]`` is made.
    ``repr`` and ``copy_`` into a plain tensor compute the values for their use and keep none.
    The copy taken before ``optimizer.step()`` is still the step's logits after it."""
    n, vocab = 256, 8192

    class Wide(LM):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(16, vocab, bias=False)

        def forward(self, h, labels):
            logits = self.lm_head(torch.relu(self.body(h)))
            return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)), logits

    model = Wide()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    h, labels = torch.randn(1, n, 16), torch.randint(0, vocab, (1, n))
    loss, logits = compiled(h, labels)
    expected = model(h, labels)[1].detach()
    logits_bytes = n * vocab * 4
    with PeakMemory() as shown:  # repr: the values computed for the text, none kept
        text = repr(logits.detach())
    assert text == repr(expected) and not logits.is_computed
    assert logits_bytes <= shown.peak_bytes <= logits_bytes + 65536, shown.peak_bytes
    assert shown.end_bytes <= 4096, shown.end_bytes

    snap = logits.detach().clone()
    with PeakMemory() as read:
        total = snap.amax()  # a read that computes (a sum would be fused)
    assert not logits.is_computed and snap.is_computed
    assert logits_bytes <= read.peak_bytes <= logits_bytes + 65536, read.peak_bytes
    assert logits_bytes <= read.end_bytes <= logits_bytes + 4096, read.end_bytes  # the copy's values, no more
    torch.testing.assert_close(total, expected.amax())
    into = torch.empty(expected.shape)
    with PeakMemory() as copied:  # copy_ into a plain tensor: the values computed for it, none kept
        into.copy_(logits)
    assert not logits.is_computed and torch.equal(into, expected)
    assert copied.peak_bytes <= logits_bytes + 65536 and copied.end_bytes <= 4096, (copied.peak_bytes,
                                                                                   copied.end_bytes)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.testing.assert_close(snap, expected)


VIEWS = {
    "detach": lambda x: x.detach(),
    "alias": lambda x: torch.ops.aten.alias(x),
    "select": lambda x: x[:, -1],
    "slice": lambda x: x[:, 1:3],
    "view": lambda x: x.view(-1, V),
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(2, 0, 1),
    "unsqueeze": lambda x: x.unsqueeze(0),
    "squeeze": lambda x: x.unsqueeze(0).squeeze(0),
    "expand": lambda x: x[:, :1].expand(B, T, V),
}
EDITS = {
    "through_the_view": lambda logits, view: view.mul_(2),
    "through_the_base": lambda logits, view: logits.add_(1),
    "through_a_second_view": lambda logits, view: logits.detach()[:, -1].fill_(3),
}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("make", VIEWS)
def test_a_view_shares_the_values_both_ways(steps, make, edit):
    if make == "expand" and edit == "through_the_view":
        pytest.skip("torch refuses in-place writes to an expanded view: checked below")
    seen = {}
    for kind in ("stock", "lazy"):
        _, _, _, logits = step(steps, kind)
        view = VIEWS[make](logits)
        root = logits if logits._base is None else logits._base  # stock's logits are a view of F.linear's output
        meta = (view.shape, view.stride(), view._is_view(), view._base is root,
                torch._C._is_alias_of(view, logits), view.requires_grad, type(view.grad_fn).__name__)
        with torch.no_grad():
            EDITS[edit](logits, view)
        seen[kind] = (meta, values(view), values(logits))
    assert seen["lazy"][0] == seen["stock"][0]
    assert_same(seen["lazy"][1], seen["stock"][1])
    assert_same(seen["lazy"][2], seen["stock"][2])


def test_an_in_place_write_to_an_expanded_view_is_refused_as_stock(steps):
    for kind in ("stock", "lazy"):
        _, _, _, logits = step(steps, kind)
        with torch.no_grad(), pytest.raises(RuntimeError, match="single memory location"):
            logits[:, :1].expand(B, T, V).mul_(2)


GRAD_COPIES = {**{name: COPIES[name] for name in ("clone", "to_dtype", "to_cpu_copy", "contiguous_of_transpose",
                                                   "reshape_of_transpose", "copy_into_plain", "clone_of_a_row",
                                                   "view_of_a_clone")},
               "bfloat16": lambda x: x.bfloat16()}  # fp32 logits here: a cast to bf16 copies


@pytest.mark.parametrize("make", GRAD_COPIES)
def test_a_loss_of_a_copy_backpropagates_into_the_hidden_states_and_head_as_stock(steps32, make):
    grads = {}
    for kind in ("stock", "lazy"):
        model, h, loss, logits = step(steps32, kind, grad_h=True)
        made = GRAD_COPIES[make](logits)
        assert made.requires_grad
        (loss + z_loss(made)).backward()
        grads[kind] = {"h": h.grad, **{name: p.grad.clone() for name, p in model.named_parameters()}}
    # a cast to bf16 rounds the logits' gradient to bf16; the z-loss of it is a fused read (the op's
    # softmax, not stock's): equal up to one bf16 rounding of some of its elements
    tolerance = {"rtol": 2 ** -7, "atol": 1e-4} if make == "bfloat16" else {}
    for name, expected in grads["stock"].items():
        torch.testing.assert_close(grads["lazy"][name], expected, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("where", ["view", "base_after_a_copy"])
def test_in_place_writes_under_autograd_get_stocks_gradients(steps32, where):
    """A write through a view of the logits (autograd rebases the base's history onto the
    view's), and a write to the logits after a copy was taken (the copy keeps the old values
    and its own gradient path), then a loss of everything."""
    grads = {}
    for kind in ("stock", "lazy"):
        model, h, loss, logits = step(steps32, kind, grad_h=True)
        if where == "view":
            logits[:, -1].mul_(2)
            total = loss + z_loss(logits)
        else:
            made = logits.clone()
            logits.mul_(2)
            total = loss + z_loss(logits) + z_loss(made)
        total.backward()
        grads[kind] = {"total": total.detach(), "h": h.grad,
                       **{name: p.grad.clone() for name, p in model.named_parameters()}}
    for name, expected in grads["stock"].items():
        torch.testing.assert_close(grads["lazy"][name], expected, msg=lambda m, name=name: f"{name}: {m}")


def test_in_place_shape_changes_are_refused_rather_than_wrong(steps):
    """``unsqueeze_`` / ``t_`` / ``resize_`` change a tensor's metadata in place; a LazyLogits' views
    read their values through it, so it refuses them (else it would keep its old shape and answer
    with values of the new one). ``detach_`` changes nothing but autograd's view of it."""
    _, _, _, logits = step(steps, "lazy")
    for name, op in {"unsqueeze_": lambda x: x.unsqueeze_(0), "t_": lambda x: x[0].t_(),
                     "resize_": lambda x: x.resize_(4)}.items():
        with pytest.raises(RuntimeError, match=f"{name}\\(\\) would change the shape"):
            op(logits.detach())
    detached = logits.detach()
    assert detached.detach_() is detached and detached.shape == (B, T, V)
    got = values(detached)
    _, _, _, expected = step(steps, "stock")
    torch.testing.assert_close(got, values(expected), rtol=0, atol=0)


# --- a new user's first reads -------------------------------------------------------------------------


def test_a_computed_copy_keeps_neither_its_source_values_nor_its_inputs(steps32):
    """An evaluation loop keeping a small copy per batch (``out.logits[:, -1].clone()``) and
    reading the logits (``argmax``) keeps, as stock does, only the copies: once computed, a copy
    holds its own values, not a reference to the source logits (whose [N, V] values the read
    kept) nor to the step's hidden states. Failed before: every batch's [N, V] values stayed
    alive through the copies."""
    import gc
    import weakref

    model, compiled, original = steps32
    kept, sources = [], []
    with torch.no_grad():
        model.load_state_dict(original)
        for seed in range(3):
            h, labels = batch(seed)
            _, logits = compiled(h, labels)
            _, expected = model(h, labels)
            assert type(logits) is LazyLogits
            last = logits[:, -1].clone()  # a lazy copy of a view
            # a read that computes and keeps the source (argmax or a sum would be fused: no values, the copy stays lazy)
            torch.testing.assert_close(logits.amax(-1), expected.amax(-1))
            kept.append((last, expected[:, -1].clone()))
            sources.append(weakref.ref(logits))
            del logits, h
    gc.collect()
    assert [ref() for ref in sources] == [None, None, None]  # no source logits (nor their values) alive
    for last, expected_last in kept:
        assert last._copy_of is None
        torch.testing.assert_close(values(last), expected_last)


def test_the_pending_lazy_copies_stay_bounded(steps32):
    """Each lazy copy is listed, by a weak reference, on the inputs it reads (computed before an
    optimizer step changes them). An evaluation loop taking a copy per step from logits it never
    reads leaves at most 64 entries (dropped copies are pruned as the list grows), and a read of
    the logits computes the copies still held and empties the list."""
    model, compiled, original = steps32
    with torch.no_grad():
        model.load_state_dict(original)
        h, labels = batch(0)
        _, logits = compiled(h, labels)
        _, expected = model(h, labels)
        inputs = logits.inputs()
        for _ in range(1000):
            logits[:, -1].clone()  # a lazy copy, dropped unread
        assert len(inputs.pending) <= 64
        held = [logits[:, t].clone() for t in range(T)]  # lazy copies, held
        assert all(kept._value is None for kept in held) and len(inputs.pending) <= 64 + T
        logits.compute()  # the read: the held copies are computed, the list emptied
        assert inputs.pending == []
        for t, kept in enumerate(held):
            torch.testing.assert_close(values(kept), expected[:, t])


def test_inference_mode_evaluation_returns_exact_lazy_logits():
    """``torch.inference_mode()`` with labels (a perplexity script): the step's hidden states are
    inference tensors, which have no version counter. Failed before: the step raised
    ``RuntimeError: Inference tensors do not track version counter``."""
    torch._dynamo.reset()
    model = LM(bias=True)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    h, labels = batch()
    with torch.inference_mode():
        loss, logits = compiled(h, labels)
        expected_loss, expected = model(h, labels)
        assert type(logits) is LazyLogits and not logits.is_computed
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(values(logits), expected)
    torch._dynamo.reset()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_step_of_an_optimizer_that_skips_the_frozen_head_leaves_the_logits_readable(fused):
    """A frozen head (``requires_grad_(False)``) left in ``AdamW(model.parameters())``: the step
    skips it (no gradient), so the logits computed from it stay readable and exact, as stock's.
    Failed before: the optimizer pre-hook marked them stale for any parameter in the optimizer."""
    torch._dynamo.reset()
    model = LM()
    model.lm_head.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    h, labels = batch()
    loss, logits = compiled(h, labels)
    loss.backward()
    assert model.lm_head.weight.grad is None
    optimizer.step()
    torch.testing.assert_close(model.lm_head.weight, reference.lm_head.weight, rtol=0, atol=0)
    with torch.no_grad():
        expected = reference.lm_head(torch.relu(reference.body(h)))
    torch.testing.assert_close(values(logits), expected)
    torch._dynamo.reset()
