"""Hand-written forms tests/graph/test_pass.py does not cover: packed batches ([1, T, H] and
[T, H] hidden states, documents separated by -100 labels), the head under
``torch.autocast`` (bf16), and logits computed in bf16 then cast to fp32 through
Inductor.

Reference: the same model compiled by the stock backend
(:func:`rewrite_proof.compare_with_stock`): loss and every gradient equal. The pass
fired: counted, and on the graph the inner backend got (the op's node present, no
``[N, V]`` logits node), and for Inductor the op's name in the generated code.
bf16 matmuls are emulated on CPU: shapes stay tiny.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from builders import RoundTo, op_arguments, op_node
from rewrite_proof import Recorder, compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

H, V = 16, 37
TOKENS = 12  # packed_batch()'s 3 + 5 + 4
OP_NAME = "chunkce.linear_cross_entropy"


def hf_causal_loss(logits, labels):
    """transformers' ForCausalLMLoss: upcast, pad-and-shift the labels, flatten."""
    logits = logits.float()
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, V), shift_labels.view(-1), ignore_index=-100)


class Head(nn.Module):
    def __init__(self, dtype=torch.float32, loss=hf_causal_loss):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(H, H, dtype=dtype)
        self.lm_head = nn.Linear(H, V, bias=False, dtype=dtype)
        self.loss = loss

    def forward(self, h, labels):
        return self.loss(self.lm_head(torch.relu(self.body(h))), labels)


def packed_batch(lengths=(3, 5, 4), flat=False, dtype=torch.float32, seed=0):
    """Documents packed into one row, as DataCollatorWithFlattening does: each
    document's first label is -100 (no token predicts across a boundary)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    hidden = torch.randn(total, H, generator=gen).to(dtype)
    labels = torch.randint(0, V, (total,), generator=gen)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[starts] = -100
    if not flat:
        hidden, labels = hidden.unsqueeze(0), labels.unsqueeze(0)  # [1, T, H], [1, T]
    return hidden.requires_grad_(), labels


def assert_rewritten(n=1):
    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["sites_refused"]) == (n, 0), dict(stats)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_packed_single_row_batch(backend):
    recorder, code = compare_with_stock(Head(), *packed_batch(), inner=backend)
    assert backend != "inductor" or OP_NAME in code
    recorder.assert_rewritten(TOKENS, V)
    assert_rewritten()


def test_packed_flat_tokens():
    """[T, H] hidden states (varlen packing without a batch dim): logits [T, V] straight into the loss."""
    def flat_loss(logits, labels):
        return F.cross_entropy(logits.float()[:-1], labels[1:], reduction="sum")

    recorder, _ = compare_with_stock(Head(loss=flat_loss), *packed_batch(flat=True))
    recorder.assert_rewritten(TOKENS, V)
    assert_rewritten()


def test_packed_rows_of_new_lengths_do_not_recompile():
    model, reference = Head(), Head()
    recorder = Recorder()
    counter = torch._dynamo.testing.CompileCounterWithBackend(
        functools.partial(torch._dynamo.lookup_backend("chunkce"), options={"inner_backend": recorder}))
    compiled = torch.compile(model, backend=counter)
    for lengths in ((3, 5, 4), (6, 2), (2, 2, 2, 7)):  # total 12, 8, 13 tokens
        h, labels = packed_batch(lengths)
        torch.testing.assert_close(compiled(h, labels), reference(h, labels))
    assert counter.frame_count == 2  # static, then dynamic from the second length on
    assert_rewritten(2)
    assert recorder.op_count() == len(recorder.graphs) == 2
    assert recorder.logits_like(TOKENS, V) == [] and recorder.logits_like(8, V) == []  # each graph's size


class Autocast(nn.Module):
    """The model's forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as a training loop runs it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(*args)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_head_under_autocast_bf16(backend):
    """fp32 weights, bf16 autocast: the projection runs in bf16 and the loss in fp32, as torch's does."""
    h, labels = packed_batch()
    recorder, code = compare_with_stock(Autocast(Head()), h, labels, inner=backend, atol=1e-2, rtol=1.6e-2)
    assert backend != "inductor" or OP_NAME in code
    recorder.assert_rewritten(TOKENS, V)
    assert_rewritten()


def test_under_autocast_the_op_upcasts_as_the_graph_did_and_matches_eager():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    h, labels = packed_batch()
    loss = torch.compile(Autocast(Head()), backend="chunkce", options={"inner_backend": capture})(h, labels)
    arguments = op_arguments(op_node(graphs[0]))
    assert not [n for n in graphs[0].graph.nodes if n.op != "placeholder"  # no [N, V] logits
                and isinstance(n.meta.get("example_value"), torch.Tensor)
                and tuple(n.meta["example_value"].shape) in ((1, TOKENS, V), (TOKENS, V))]
    assert arguments["logits_dtype"] is torch.float32  # the cast HF's .float() makes under autocast
    assert arguments["hidden_states"].meta["example_value"].dtype == torch.bfloat16  # the autocast dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = Head()(h, labels)
    torch.testing.assert_close(loss, expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.slow
@pytest.mark.parametrize("cast", ["float", "to_dtype", "type"])
def test_bf16_logits_cast_to_fp32_through_inductor(cast):
    """bf16 weights: logits in bf16, then an fp32 upcast however it is spelled."""
    upcast = {"float": lambda x: x.float(), "to_dtype": lambda x: x.to(torch.float32),
              "type": lambda x: x.type(torch.float32)}[cast]

    def loss(logits, labels):
        return F.cross_entropy(upcast(logits)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))

    backend = "inductor" if cast == "float" else "aot_eager"
    recorder, code = compare_with_stock(Head(torch.bfloat16, loss), *packed_batch(dtype=torch.bfloat16),
                                        inner=backend, atol=2e-2, rtol=2e-2)
    assert backend != "inductor" or OP_NAME in code
    recorder.assert_rewritten(TOKENS, V)
    assert_rewritten()
    record = compile_pass.last_report().records[0]
    # bf16 logits [1, 12, V] and their fp32 upcast; the loss's fp32 log-softmax and
    # gradient of the 11 shifted tokens
    assert record.logits_bytes_avoided == 12 * V * (2 + 4) + 11 * V * 2 * 4


def _downcast_step(narrow):
    """fp32 head, logits cast to ``narrow`` for the loss: (loss, grads) compiled by chunkce and
    by stock aot_eager, and the op's logits_dtype in the rewritten graph."""
    def loss(logits, labels):
        return F.cross_entropy(logits.to(narrow).view(-1, V), labels.view(-1))

    recorder = Recorder()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return recorder(gm, example_inputs)

    model = Head(loss=loss)
    reference = copy.deepcopy(model)
    h, labels = packed_batch()
    ref_h = h.detach().clone().requires_grad_()
    out = torch.compile(model, backend="chunkce", options={"inner_backend": capture})(h, labels)
    out.backward()
    expected = torch.compile(reference, backend="aot_eager")(ref_h, labels)
    expected.backward()
    recorder.assert_rewritten(TOKENS, V)
    assert_rewritten()
    grads = {"h": h.grad, **{name: p.grad for name, p in model.named_parameters()}}
    ref_grads = {"h": ref_h.grad, **{name: p.grad for name, p in reference.named_parameters()}}
    return (out, grads), (expected, ref_grads), op_arguments(op_node(graphs[0]))["logits_dtype"]


DOWNCASTS = pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@DOWNCASTS
def test_fp32_head_downcast_before_the_loss_is_rewritten(narrow):
    """Rewritten with logits_dtype the narrow dtype (the last of the chain), and the loss in it;
    results within the narrow dtype's rounding of stock compile's (exactness: next test)."""
    (out, grads), (expected, ref_grads), logits_dtype = _downcast_step(narrow)
    assert logits_dtype is narrow
    assert out.dtype == expected.dtype == narrow
    tolerance = {"atol": 2e-2, "rtol": 1e-2} if narrow is torch.bfloat16 else {"atol": 1e-3, "rtol": 1e-3}
    torch.testing.assert_close(out, expected, **tolerance)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@DOWNCASTS
def test_fp32_head_downcast_before_the_loss_is_as_exact_as_stock(narrow, monkeypatch):
    """Against the fp64 computation with exactly the graph's two roundings (the logits to
    ``narrow``, and their gradient), chunkce's loss is within an ulp and its gradients no
    further off than stock compile's. (Bitwise equality with stock cannot hold: torch's
    half-precision cross_entropy rounds its log-softmax too, about an ulp.)"""
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)  # the compiled kernels must round as well
    (out, grads), (expected, ref_grads), _ = _downcast_step(narrow)
    model = Head().double()  # the same seeded initialisation
    h, labels = packed_batch()
    h = h.detach().double().requires_grad_()
    logits = RoundTo.apply(model.lm_head(torch.relu(model.body(h))), narrow)
    truth = F.cross_entropy(logits.view(-1, V), labels.view(-1))
    truth.backward()
    truth_grads = {"h": h.grad, **{name: p.grad for name, p in model.named_parameters()}}
    eps = torch.finfo(narrow).eps
    assert abs(out.double() - truth).item() <= eps * abs(truth.item())
    for name, grad in grads.items():
        scale = truth_grads[name].abs().max().item()
        ours = (grad.double() - truth_grads[name]).abs().max().item()
        stock = (ref_grads[name].double() - truth_grads[name]).abs().max().item()
        assert ours <= stock + 0.05 * eps * scale, (name, ours / scale, stock / scale)
