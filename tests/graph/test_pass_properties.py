"""Through the backend: a hypothesis search of toy training steps compiled with
``backend="chunkce"`` against the same step compiled by stock aot_eager (loss and
every gradient), each proven rewritten on the graph; and the compiled model, warmed
up, never recompiles (its frame or the op's kernels) for a new sequence length.

The default run is small (a compile per example); ``CHUNKCE_HYPOTHESIS_EXAMPLES=<n>``
runs ``n`` examples instead.
"""

import copy
import os

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rewrite_proof import Recorder

EXAMPLES = max(1, int(os.environ.get("CHUNKCE_HYPOTHESIS_EXAMPLES", "30")) // 3)
# derandomize: CI draws the same examples every run (a longer search: CHUNKCE_HYPOTHESIS_EXAMPLES, or
# CHUNKCE_HYPOTHESIS_RANDOM=1 for fresh draws)
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize=not os.environ.get("CHUNKCE_HYPOTHESIS_RANDOM"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Toy(torch.nn.Module):
    """A body, a head (bias optional) and one of the losses a user writes."""

    def __init__(self, hidden_size, vocab_size, bias, form, reduction, ignore_index, label_smoothing):
        super().__init__()
        self.body = torch.nn.Linear(hidden_size, hidden_size)
        self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=bias)
        torch.nn.init.normal_(self.lm_head.weight, std=0.02)
        self.form, self.reduction = form, reduction
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, x, labels):
        logits = self.lm_head(torch.tanh(self.body(x)))  # [B, T, V]
        kwargs = {"ignore_index": self.ignore_index, "label_smoothing": self.label_smoothing}
        if self.form == "shifted":  # HF's causal-LM loss: upcast, shift, flatten
            logits, labels = logits.float()[:, :-1, :], labels[:, 1:]
        if self.form == "class_dim_1":
            loss = F.cross_entropy(logits.transpose(1, 2), labels, reduction=self.reduction, **kwargs)
        else:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   reduction=self.reduction, **kwargs)
        return loss.sum() if self.reduction == "none" else loss


@st.composite
def steps(draw):
    # vocab_size above every hidden size and at least 2 tokens a row after the shift, so
    # that no other node of the graph looks like [N, V] logits to the proof on the graph
    vocab_size = draw(st.one_of(st.integers(25, 200), st.sampled_from([257, 1009])))
    batch, tokens = draw(st.integers(1, 3)), draw(st.integers(3, 24))
    ignore_index = draw(st.sampled_from([-100, 0, vocab_size - 1]))
    model = Toy(draw(st.integers(1, 24)), vocab_size, draw(st.booleans()),
                draw(st.sampled_from(["flat", "shifted", "class_dim_1"])),
                draw(st.sampled_from(["mean", "sum", "none"])), ignore_index,
                draw(st.sampled_from([0.0, 0.1])))
    seed = draw(st.integers(0, 99))
    labels = torch.randint(0, vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    ignored = draw(st.sampled_from(["none", "some", "all"]))
    if ignored == "all":
        labels.fill_(ignore_index)
    elif ignored == "some":
        labels[:, ::3] = ignore_index
    chunk_size = draw(st.sampled_from([None, 1, 5, 16]))
    return model, labels, chunk_size


@pytest.mark.slow
@SETTINGS
@given(steps())
def test_compiled_step_matches_stock_compile(monkeypatch, step):
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")  # the search is over graphs, not kernel compiles
    model, labels, chunk_size = step
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    x = torch.randn(*labels.shape, model.body.in_features)
    recorder = Recorder("aot_eager")
    loss = torch.compile(model, backend="chunkce",
                         options={"inner_backend": recorder, "chunk_size": chunk_size})(x, labels)
    loss.backward()
    expected = torch.compile(reference, backend="aot_eager")(x, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected, equal_nan=True)  # every label ignored: a mean of nothing
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")
    tokens = labels.numel() - (labels.shape[0] if model.form == "shifted" else 0)
    recorder.assert_rewritten(tokens, model.lm_head.out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warmed_up_model_never_recompiles_for_a_new_length(dtype):
    """After two lengths (the second makes Dynamo's shapes dynamic), no length recompiles
    anything: the model's frame or the op's compiled per-chunk kernels. (The kernels'
    first run happens under AOTAutograd's aliasing-check dispatch mode: that once
    recompiled them.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Toy(16, 96, False, "shifted", "mean", -100, 0.0).to(dtype)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager", "chunk_size": 8})

    def step(tokens):
        x = torch.randn(2, tokens, 16, dtype=dtype)
        labels = torch.randint(0, 96, (2, tokens))
        compiled(x, labels).backward()

    for tokens in (12, 20):
        step(tokens)
    with torch._dynamo.config.patch(error_on_recompile=True):
        # 8, 64, 16, 4, 126, 24 shifted tokens: one chunk, several, ragged tails. (A row of
        # one shifted token is a size-1 dim, which Dynamo specialises for any backend.)
        for tokens in (5, 33, 9, 3, 64, 13):
            step(tokens)
