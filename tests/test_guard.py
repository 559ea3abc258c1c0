"""One test per refusal: the site is left as is (op absent, refused counter moved,
reason logged) and the results equal stock compile's."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compile_pass

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 23
OP_NAME = "chunkce.linear_cross_entropy"


def make_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=gen).requires_grad_(), torch.randint(0, V, (B, T), generator=gen)


class Head(nn.Module):
    def __init__(self, transform):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lora_a = nn.Linear(H, 4, bias=False)
        self.lora_b = nn.Linear(4, V, bias=False)
        self.transform = transform

    def forward(self, h, labels):
        logits = self.transform(self, h, self.lm_head(h))
        vocab = logits.shape[-1]
        return F.cross_entropy(logits.reshape(-1, vocab), labels.clamp(max=vocab - 1).reshape(-1))


def soft_cap(m, h, logits):  # Gemma 2
    return torch.tanh(logits / 30.0) * 30.0


def scaled(m, h, logits):  # a per-class multiplier: not a scale the op takes (a constant one is)
    return logits * torch.linspace(0.5, 1.5, logits.shape[-1])


def lora(m, h, logits):
    return logits + m.lora_b(m.lora_a(h)) * 2.0


def lossy_cast(m, h, logits):
    return logits.bfloat16().float()


def in_place(m, h, logits):
    logits.mul_(2.0)
    return logits


def vocab_slice(m, h, logits):
    return logits[..., : V - 3].contiguous()


def autocast_head(m, h, logits):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        other = m.lm_head(h)
    return other.float()


REFUSALS = [
    # (transform, counter key, words in the reason, inner backend)
    (soft_cap, "soft_cap", "`tanh` between projection and loss", "inductor"),
    (scaled, "scale_operand", "a multiplier of shape (23,), broadcast over the logits", "aot_eager"),
    (lora, "op_add", "`add` between projection and loss is not shape/dtype-only (an added tensor, e.g. LoRA",
     "inductor"),
    (lossy_cast, "lossy_cast", "float32 -> bfloat16 -> float32", "aot_eager"),
    (in_place, "mutation", "in-place `mul_`", "aot_eager"),
    (vocab_slice, "vocab_dim", "`getitem` on the vocab dim", "aot_eager"),
    (autocast_head, "mode_switch", "`_exit_autocast`", "aot_eager"),
]


def assert_refused(key, words, logs, code=""):
    stats = counters["chunkce"]
    assert (stats["sites_found"], stats["sites_rewritten"], stats["sites_refused"]) == (1, 0, 1)
    assert stats[f"refused_{key}"] == 1, dict(stats)
    assert OP_NAME not in code
    messages = [r.getMessage() for r in logs.records if r.name.startswith("compile_pass")]
    assert any(words in m for m in messages), messages
    assert words in compile_pass.last_report().records[0].reason


@pytest.mark.parametrize("transform, key, words, backend", REFUSALS, ids=[r[1] for r in REFUSALS])
def test_refused_head_is_left_as_stock_compile_leaves_it(transform, key, words, backend,
                                                          compare_with_inductor, chunkce_logs):
    code = compare_with_inductor(Head(transform), *make_inputs(), backend=backend)
    assert_refused(key, words, chunkce_logs, code)


def test_integer_weight_is_refused(compare_with_inductor, chunkce_logs):
    def int_head(h, weight, labels):
        return F.cross_entropy((h @ weight.t()).float().view(-1, V), labels.view(-1))

    gen = torch.Generator().manual_seed(0)
    h, weight = torch.randint(-3, 4, (B, T, H), generator=gen), torch.randint(-3, 4, (V, H), generator=gen)
    compare_with_inductor(int_head, h, weight, make_inputs()[1], backend="aot_eager")
    assert_refused("weight_dtype", "weight is of dtype torch.int64, not a plain floating dtype", chunkce_logs)


def test_tensor_subclass_weight_is_refused(compare_with_inductor, chunkce_logs):
    from torch.testing._internal.two_tensor import TwoTensor

    weight = torch.randn(V, H)
    weight = TwoTensor(weight, weight.clone())

    def subclass_head(h, labels):
        return F.cross_entropy(F.linear(h, weight).view(-1, V), labels.view(-1))

    compare_with_inductor(subclass_head, *make_inputs(), backend="aot_eager")
    assert_refused("subclass", "weight is a tensor subclass (TwoTensor)", chunkce_logs)


def test_probability_targets_are_refused(compare_with_inductor, chunkce_logs):
    class SoftTargets(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, h, probs):
            return F.cross_entropy(self.lm_head(h).view(-1, V), probs.view(-1, V))

    probs = torch.softmax(torch.randn(B, T, V), -1)
    compare_with_inductor(SoftTargets(), make_inputs()[0], probs, backend="aot_eager")
    assert_refused("probability_target", "probability (floating) targets", chunkce_logs)


def test_class_dim_1_logits_not_from_a_transpose_are_refused(compare_with_inductor, chunkce_logs):
    class ClassDim1(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, h, labels):
            return F.cross_entropy(self.lm_head(h).permute(0, 2, 1).contiguous(), labels)

    compare_with_inductor(ClassDim1(), *make_inputs(), backend="aot_eager")
    assert_refused("class_dim_1", "with the class dim at 1", chunkce_logs)


def test_loss_in_a_checkpoint_region_with_the_head_outside_is_refused(compare_with_inductor, chunkce_logs):
    class LossInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, h, labels):
            loss = lambda logits: F.cross_entropy(logits.view(-1, V), labels.view(-1))  # noqa: E731
            return torch.utils.checkpoint.checkpoint(loss, self.lm_head(h), use_reentrant=False)

    compare_with_inductor(LossInside(), *make_inputs(), backend="aot_eager")
    assert_refused("subgraph_input", "logits enter this higher-order op's body", chunkce_logs)


def test_strict_raises_with_the_reason():
    model = torch.compile(Head(soft_cap), backend="chunkce", options={"strict": True, "inner_backend": "eager"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match="soft-capped logits: `tanh` between projection and loss") as info:
        model(*make_inputs())
    assert isinstance(info.value.inner_exception, NotImplementedError)
    assert "strict=True" in str(info.value)


@pytest.mark.parametrize("broken", ["compile_pass.graph.sites.match_site", "compile_pass.graph.guard.check"])
def test_a_bug_in_the_pass_refuses_the_site_instead_of_failing_the_compile(broken, monkeypatch, chunkce_logs):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(broken, boom)
    model, reference = Head(scaled), Head(scaled)
    loss = torch.compile(model, backend="chunkce", options={"inner_backend": "eager"})(*make_inputs())
    torch.testing.assert_close(loss, reference(*make_inputs()))
    assert_refused("internal_error", "chunkce could not analyse this site (RuntimeError: boom)", chunkce_logs)
