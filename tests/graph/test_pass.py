"""The pass rewrites every hand-written lm_head -> cross_entropy form.

Reference: the same model compiled with the stock inner backend (torch's unfused path;
:func:`rewrite_proof.compare_with_stock`); loss, outputs and every gradient must match.
The pass fired: counters, the op's node and no ``[N, V]`` logits in the recorded graph,
and, under Inductor, the op's name in the code it generated.
"""

import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from builders import OP, op_arguments, op_node, reduction_of
from rewrite_proof import Recorder, compare_with_stock
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import compile_pass

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 7, 16, 37  # odd vocab, N = 14 tokens
OP_NAME = "chunkce.linear_cross_entropy"


def make_inputs(dtype=torch.float32, seq=T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, seq, H, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, seq), generator=gen)
    labels[0, :2] = -100
    return hidden, labels


class Head(nn.Module):
    """An lm_head and one hand-written form of the loss."""

    def __init__(self, form, bias=False, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=bias, dtype=dtype)
        self.form = form
        self.loss_fct = nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1, reduction="sum")
        self.register_buffer("class_weight", torch.rand(V, generator=torch.Generator().manual_seed(1)) + 0.5)

    def forward(self, h, labels):
        W, b = self.lm_head.weight, self.lm_head.bias
        return FORMS[self.form](self, h, labels, W, b)


FORMS = {
    "view": lambda m, h, y, W, b: F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1)),
    "shift": lambda m, h, y, W, b: F.cross_entropy(
        m.lm_head(h)[..., :-1, :].contiguous().view(-1, V), y[..., 1:].contiguous().view(-1)),
    "module": lambda m, h, y, W, b: m.loss_fct(m.lm_head(h).reshape(-1, V), y.reshape(-1)),
    "matmul_t": lambda m, h, y, W, b: F.cross_entropy((h @ W.t()).flatten(0, 1), y.flatten()),
    "torch_matmul_T": lambda m, h, y, W, b: F.cross_entropy(torch.matmul(h, W.T).view(-1, V), y.view(-1)),
    "f_linear": lambda m, h, y, W, b: F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1), reduction="sum"),
    "f_linear_bias": lambda m, h, y, W, b: F.cross_entropy(F.linear(h, W, b).view(-1, V), y.view(-1)),
    "matmul_plus_bias": lambda m, h, y, W, b: F.cross_entropy((h @ W.t() + b).view(-1, V), y.view(-1)),
    "class_weight": lambda m, h, y, W, b: F.cross_entropy(
        m.lm_head(h).view(-1, V), y.view(-1), weight=m.class_weight, label_smoothing=0.2),
    "class_dim_1": lambda m, h, y, W, b: F.cross_entropy(m.lm_head(h).transpose(1, 2), y, reduction="none"),
    "time_major": lambda m, h, y, W, b: F.cross_entropy(
        m.lm_head(h).transpose(0, 1)[1:].reshape(-1, V), y.t()[1:].reshape(-1)),
}
BIASED = {"f_linear_bias", "matmul_plus_bias"}
# Through Inductor (op name in the generated code); the rest through aot_eager
# against stock aot_eager, to keep the file fast on CPU.
INDUCTOR_FORMS = {"shift", "f_linear_bias", "class_dim_1"}  # "view": test_backend's toy model


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_is_rewritten_and_matches_stock_compile(form):
    model = Head(form, bias=form in BIASED)
    backend = "inductor" if form in INDUCTOR_FORMS else "aot_eager"
    recorder, code = compare_with_stock(model, *make_inputs(), inner=backend)
    assert backend != "inductor" or OP_NAME in code
    recorder.assert_rewritten(B * T, V)  # the op's node in the graph, no [N, V] logits node
    stats = counters["chunkce"]
    assert (stats["sites_found"], stats["sites_rewritten"], stats["sites_refused"]) == (1, 1, 0)
    assert stats["logits_kept"] == 0 and stats["logits_bytes_avoided"] > 0


class ReturnsLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, h, labels):
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return loss, logits


@pytest.mark.slow
def test_logits_with_other_users_are_kept_and_the_loss_still_rewritten():
    """Returned logits kept in the graph (``returned_logits="keep"``; the default makes them lazy)."""
    recorder, code = compare_with_stock(ReturnsLogits(), *make_inputs(), inner="inductor",
                                        options={"returned_logits": "keep"})
    assert OP_NAME in code and recorder.op_count() == 1
    assert recorder.logits_like(B * T, V) != []  # returned: kept
    assert counters["chunkce"]["sites_rewritten"] == 1 and counters["chunkce"]["logits_kept"] == 1
    record = compile_pass.last_report().records[0]
    assert record.decision == "rewritten" and "logits still materialized for other users" in record.reason


class HalfHead(nn.Module):
    """HF style: logits in bf16, ``.float()`` before the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False, dtype=torch.bfloat16)

    def forward(self, h, labels):
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, V), labels[..., 1:].contiguous().view(-1))


def test_bf16_logits_cast_to_float():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    recorder, _ = compare_with_stock(HalfHead(), *make_inputs(torch.bfloat16), atol=2e-2, rtol=2e-2)
    recorder.assert_rewritten(B * T, V)
    assert counters["chunkce"]["sites_rewritten"] == 1
    torch._dynamo.reset()
    torch.compile(HalfHead(), backend="chunkce", options={"inner_backend": capture})(*make_inputs(torch.bfloat16))
    assert op_arguments(op_node(graphs[0]))["logits_dtype"] is torch.float32


def _rewritten_graph(model, *inputs, **options):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(model, backend="chunkce", options={"inner_backend": capture, **options})(*inputs)
    return graphs[0], out


def test_projection_gone_and_division_after_the_loss_untouched():
    def hf_style(h, weight, labels, num_items_in_batch):
        logits = F.linear(h, weight).float()
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="sum")
        return loss / num_items_in_batch

    h, labels = make_inputs()
    weight = torch.randn(V, H, requires_grad=True)
    gm, out = _rewritten_graph(hf_style, h, weight, labels, 12)
    targets = [n.target for n in gm.graph.nodes]
    assert OP in targets and operator.truediv in targets
    assert reduction_of(op_node(gm)) == "sum"  # the division is the caller's, after the loss
    assert torch._C._nn.linear not in targets and F.cross_entropy not in targets
    torch.testing.assert_close(out, hf_style(h, weight, labels, 12))


def test_legacy_size_average_is_mapped_onto_reduction():
    def legacy(h, weight, labels):
        return F.cross_entropy(F.linear(h, weight).view(-1, V), labels.view(-1), size_average=False)

    h, labels = make_inputs()
    weight = torch.randn(V, H, requires_grad=True)
    with pytest.warns(UserWarning, match="size_average"):
        gm, out = _rewritten_graph(legacy, h, weight, labels)
    assert reduction_of(op_node(gm)) == "sum"
    torch.testing.assert_close(out, F.cross_entropy(F.linear(h, weight).view(-1, V), labels.view(-1),
                                                    reduction="sum"))


def test_shift_is_replayed_on_the_hidden_states():
    gm, _ = _rewritten_graph(Head("shift"), *make_inputs(), chunk_size=4)
    call = op_node(gm)
    hidden = op_arguments(call)["hidden_states"]
    assert tuple(hidden.meta["example_value"].shape) == (B * (T - 1), H)
    sliced = hidden.args[0]
    assert sliced.target is operator.getitem and sliced.args[1][1] == slice(None, -1, None)
    assert op_arguments(call)["chunk_size"] == 4
    assert compile_pass.last_report().records[0].chunk_size == 4


def test_no_recompile_for_a_new_sequence_length():
    model = Head("shift")
    recorder = Recorder()
    chunkce = torch._dynamo.lookup_backend("chunkce")
    counter = CompileCounterWithBackend(functools.partial(chunkce, options={"inner_backend": recorder}))
    compiled = torch.compile(model, backend=counter, dynamic=None)
    for seq in (5, 6, 9):
        h, labels = make_inputs(seq=seq)
        loss = compiled(h, labels)
    assert counter.frame_count == 2  # static, then dynamic from the 2nd length on
    assert counters["chunkce"]["sites_rewritten"] == 2
    assert recorder.op_count() == len(recorder.graphs) == 2
    assert recorder.logits_like(B * 5, V) == [] and recorder.logits_like(B * 6, V) == []  # each graph's size
    torch.testing.assert_close(loss, model(h, labels))


def test_token_slicing_after_a_reshape_is_replayed_with_dynamic_shapes():
    def flat_then_slice(h, weight, labels):
        logits = F.linear(h, weight).reshape(-1, V)  # [B*T, V], symbolic once T is dynamic
        return F.cross_entropy(logits[1:], labels.reshape(-1)[1:])

    weight = torch.randn(V, H, requires_grad=True)
    recorder = Recorder()
    compiled = torch.compile(flat_then_slice, backend="chunkce", options={"inner_backend": recorder})
    for seq in (5, 6, 9):
        h, labels = make_inputs(seq=seq)
        torch.testing.assert_close(compiled(h, weight, labels), flat_then_slice(h, weight, labels))
    assert (counters["chunkce"]["sites_rewritten"], counters["chunkce"]["sites_refused"]) == (2, 0)
    assert recorder.op_count() == len(recorder.graphs) == 2
    assert recorder.logits_like(B * 5, V) == [] and recorder.logits_like(B * 6, V) == []


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_head_inside_a_checkpoint_region_is_rewritten(use_reentrant):
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(H, H)
            self.lm_head = nn.Linear(H, V, bias=False)

        def head(self, h, labels):
            return F.cross_entropy(self.lm_head(torch.relu(self.body(h))).view(-1, V), labels.view(-1))

        def forward(self, h, labels):
            return torch.utils.checkpoint.checkpoint(self.head, h, labels, use_reentrant=use_reentrant)

    recorder, _ = compare_with_stock(Checkpointed(), *make_inputs())
    recorder.assert_rewritten(B * T, V)  # in the checkpoint body's graph
    assert counters["chunkce"]["sites_rewritten"] == 1


def test_every_site_of_a_graph_is_rewritten():
    def two_losses(h, weight, labels):
        logits = F.linear(h, weight)
        return (F.cross_entropy(logits.view(-1, V), labels.view(-1))
                + F.cross_entropy(logits[:, 1:].reshape(-1, V), labels[:, :-1].reshape(-1), reduction="sum"))

    h, labels = make_inputs()
    weight = torch.randn(V, H, requires_grad=True)
    gm, out = _rewritten_graph(two_losses, h, weight, labels)
    assert counters["chunkce"]["sites_rewritten"] == 2
    assert [n.target for n in gm.graph.nodes].count(OP) == 2
    assert torch._C._nn.linear not in [n.target for n in gm.graph.nodes]
    # the logits are gone once both losses are rewritten: neither record says they are kept
    assert counters["chunkce"]["logits_kept"] == 0
    assert [r.reason for r in compile_pass.last_report().records] == ["", ""]
    torch.testing.assert_close(out, two_losses(h, weight, labels))
