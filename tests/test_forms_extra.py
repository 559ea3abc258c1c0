"""Hand-written forms tests/test_pass.py does not cover: packed batches ([1, T, H] and
[T, H] hidden states, documents separated by -100 labels), the head under
``torch.autocast`` (bf16), and logits computed in bf16 then cast to fp32 through
Inductor.

Reference: the same model compiled by the stock backend (``compare_with_inductor``
fixture, tests/conftest.py): loss and every gradient equal, the pass fired.
bf16 matmuls are emulated on CPU: shapes stay tiny.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compile_pass
from compile_pass import linear_cross_entropy
from conftest import op_arguments, op_node

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

H, V = 16, 37
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


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_packed_single_row_batch(backend, compare_with_inductor):
    code = compare_with_inductor(Head(), *packed_batch(), backend=backend)
    assert backend != "inductor" or OP_NAME in code
    assert_rewritten()


def test_packed_flat_tokens(compare_with_inductor):
    """[T, H] hidden states (varlen packing without a batch dim): logits [T, V] straight into the loss."""
    def flat_loss(logits, labels):
        return F.cross_entropy(logits.float()[:-1], labels[1:], reduction="sum")

    compare_with_inductor(Head(loss=flat_loss), *packed_batch(flat=True), backend="aot_eager")
    assert_rewritten()


def test_packed_rows_of_new_lengths_do_not_recompile():
    model, reference = Head(), Head()
    counter = torch._dynamo.testing.CompileCounterWithBackend("chunkce")
    compiled = torch.compile(model, backend=counter)
    for lengths in ((3, 5, 4), (6, 2), (2, 2, 2, 7)):  # total 12, 8, 13 tokens
        h, labels = packed_batch(lengths)
        torch.testing.assert_close(compiled(h, labels), reference(h, labels))
    assert counter.frame_count == 2  # static, then dynamic from the second length on
    assert_rewritten(2)


class Autocast(nn.Module):
    """The model's forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as a training loop runs it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(*args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_head_under_autocast_bf16(backend, compare_with_inductor):
    """fp32 weights, bf16 autocast: the projection runs in bf16 and the loss in fp32, as torch's does."""
    h, labels = packed_batch()
    code = compare_with_inductor(Autocast(Head()), h, labels, backend=backend, atol=1e-2, rtol=1.6e-2)
    assert backend != "inductor" or OP_NAME in code
    assert_rewritten()


def test_under_autocast_the_op_upcasts_as_the_graph_did_and_matches_eager():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    h, labels = packed_batch()
    loss = torch.compile(Autocast(Head()), backend="chunkce", options={"inner_backend": capture})(h, labels)
    arguments = op_arguments(op_node(graphs[0]))
    assert arguments["logits_dtype"] is torch.float32  # the cast HF's .float() makes under autocast
    assert arguments["hidden_states"].meta["example_value"].dtype == torch.bfloat16  # the autocast dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = Head()(h, labels)
    torch.testing.assert_close(loss, expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("cast", ["float", "to_dtype", "type"])
def test_bf16_logits_cast_to_fp32_through_inductor(cast, compare_with_inductor):
    """bf16 weights: logits in bf16, then an fp32 upcast however it is spelled."""
    upcast = {"float": lambda x: x.float(), "to_dtype": lambda x: x.to(torch.float32),
              "type": lambda x: x.type(torch.float32)}[cast]

    def loss(logits, labels):
        return F.cross_entropy(upcast(logits)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))

    backend = "inductor" if cast == "float" else "aot_eager"
    code = compare_with_inductor(Head(torch.bfloat16, loss), *packed_batch(dtype=torch.bfloat16),
                                 backend=backend, atol=2e-2, rtol=2e-2)
    assert backend != "inductor" or OP_NAME in code
    assert_rewritten()
    record = compile_pass.last_report().records[0]
    # bf16 logits [1, 12, V] and their fp32 upcast; the loss's fp32 log-softmax and
    # gradient of the 11 shifted tokens
    assert record.logits_bytes_avoided == 12 * V * (2 + 4) + 11 * V * 2 * 4
