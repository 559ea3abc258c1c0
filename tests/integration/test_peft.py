"""PEFT LoRA models (peft's own ``get_peft_model``) through the pass.

A LoRA adapter on ``lm_head`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``:
the op has no low-rank branch, so the site must be refused (a fused loss that kept
only ``base`` would silently never train the adapter) with a reason that names LoRA
on the head and the fix, and every gradient -- the head's adapter, the base head,
the other adapters -- must equal stock compile's. LoRA on attention / MLP with the
head untouched, and ``modules_to_save=["lm_head"]`` (PEFT's trainable copy of a plain
``nn.Linear`` head), must be rewritten, proven on the graph, with every trainable
gradient equal to stock's.

Adapters are initialised with ``init_lora_weights=False`` (``lora_B`` non-zero), so
each branch changes the loss and every adapter weight gets a gradient.
"""

from __future__ import annotations

import copy

import peft  # in the test extra: pip install -e ".[test]"
import pytest
import torch
import transformers
from builders import train_step, z_loss
from rewrite_proof import GraphCopies, Recorder, assert_logits_lazy, compare_with_stock
from torch import nn
from torch._dynamo.utils import counters

import compile_pass
from compile_pass import LazyLogits

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile", "eager_kernels")]

V = 257  # odd vocabulary
B, T = 2, 8
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            attention_dropout=0.0)
ATTENTION_MLP = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


class CausalLMLoss(nn.Module):
    """``model(input_ids=..., labels=...).loss``: the function a training step compiles."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def lora_model(target_modules, *, dropout=0.0, modules_to_save=None) -> nn.Module:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    config = peft.LoraConfig(target_modules=target_modules, r=4, lora_alpha=8, lora_dropout=dropout,
                             init_lora_weights=False, modules_to_save=modules_to_save)
    return CausalLMLoss(peft.get_peft_model(base, config))


def batch(seed=0):
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :2] = -100  # a prompt
    return ids, labels


def trainable(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def assert_gradients_live(model, names):
    """Every named parameter got a non-zero gradient (the adapter branch reached the loss)."""
    params = dict(model.named_parameters())
    for name in names:
        grad = params[name].grad
        assert grad is not None and grad.abs().sum() > 0, f"{name}: no gradient"


def test_lora_on_the_head_is_refused_and_every_gradient_is_stock(chunkce_logs):
    model = lora_model(["lm_head", "q_proj", "v_proj"])
    head = model.model.base_model.model.lm_head
    assert isinstance(head, peft.tuners.lora.Linear)
    head.base_layer.weight.requires_grad_(True)  # the base head trains too: its gradient is compared as well
    names = trainable(model)
    prefix = "model.base_model.model.lm_head."
    assert {prefix + "lora_A.default.weight", prefix + "lora_B.default.weight",
            prefix + "base_layer.weight"} <= set(names)

    recorder, _ = compare_with_stock(model, *batch(), exact=True)
    recorder.assert_untouched()
    assert_gradients_live(model, names)
    stats = counters["chunkce"]
    assert stats["sites_refused"] == stats["refused_op_add"] == 1 and stats["sites_rewritten"] == 0, dict(stats)
    (record,) = compile_pass.last_report().records
    assert record.module == "model.base_model.model.lm_head"
    for words in ("`add` between projection and loss is not shape/dtype-only", "LoRA on the head",
                  "leave lm_head out of target_modules", "modules_to_save=['lm_head']", "merge_and_unload"):
        assert words in record.reason, record.reason
    assert any("LoRA on the head" in r.getMessage() for r in chunkce_logs.records if r.name.startswith("compile_pass"))


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]], ids=["frozen_head", "modules_to_save_head"])
def test_lora_elsewhere_is_rewritten_and_every_trainable_gradient_is_stock(modules_to_save):
    """LoRA on attention and MLP: the head is a frozen plain Linear, or PEFT's trainable copy of it
    (``ModulesToSaveWrapper``, whose active module is a plain Linear)."""
    model = lora_model(ATTENTION_MLP, modules_to_save=modules_to_save)
    names = trainable(model)
    head_names = [name for name in names if "lm_head" in name]
    assert head_names == (["model.base_model.model.lm_head.modules_to_save.default.weight"] if modules_to_save else [])

    recorder, _ = compare_with_stock(model, *batch())
    recorder.assert_rewritten(B * T, V)
    assert_gradients_live(model, names)
    (record,) = compile_pass.last_report().records
    assert record.decision == "rewritten"
    assert record.module == ("model.base_model.model.lm_head.modules_to_save.default" if modules_to_save
                             else "model.base_model.model.lm_head")


def test_lora_dropout_on_the_head_is_refused_and_exact():
    """``lora_dropout > 0`` on the head (and elsewhere): refused; the same random masks (same seed)
    give gradients bit for bit stock compile's."""
    model = lora_model(["lm_head", "q_proj", "v_proj"], dropout=0.25)
    _seeded_compare(model, inner="aot_eager", atol=0.0, rtol=0.0).assert_untouched()
    assert counters["chunkce"]["refused_op_add"] == 1


def test_lora_dropout_elsewhere_is_rewritten():
    model = lora_model(ATTENTION_MLP, dropout=0.25)
    _seeded_compare(model, inner="aot_eager").assert_rewritten(B * T, V)


def _seeded_compare(model, inner, **tolerances) -> Recorder:
    """``compare_with_stock`` with the global RNG seeded before each step (the dropout masks match)."""
    recorder = Recorder(inner)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": recorder})
    stock = torch.compile(reference, backend=inner)
    ids, labels = batch()
    torch.manual_seed(1)
    loss, grads = train_step(compiled, [ids, labels])
    torch.manual_seed(1)
    ref_loss, ref_grads = train_step(stock, [ids, labels])
    torch.testing.assert_close(loss, ref_loss, **tolerances)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tolerances, msg=lambda m, name=name: f"{name}: {m}")
    assert_gradients_live(model, trainable(model))
    return recorder


def test_lora_on_the_body_with_no_options_returns_lazy_logits_and_is_exact():
    """No options: the PEFT model (LoRA on attention and MLP, the head frozen) called as a training
    step returns ``outputs.logits`` lazy (not in the graph: only the op reads the head). A loss built
    from them outside the graph (a z-loss: autograd into the LoRA body through the step's hidden
    states, none into the frozen head) and the model's loss give stock's gradients; the logits, read
    after backward, are stock's."""
    model = lora_model(ATTENTION_MLP).model  # the PeftModel itself: it returns loss and logits
    reference = copy.deepcopy(model)
    graphs = GraphCopies()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": graphs})
    stock = torch.compile(reference, backend="aot_eager")
    ids, labels = batch()
    out, expected = compiled(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
    assert isinstance(out.logits, LazyLogits) and out.logits.requires_grad
    (out.loss + z_loss(out.logits)).backward()
    (expected.loss + z_loss(expected.logits)).backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.logits.detach() * 1.0, expected.logits.detach())
    names = trainable(model)
    assert names and not any("lm_head" in name for name in names)
    params, ref_params = dict(model.named_parameters()), dict(reference.named_parameters())
    for name in names:
        torch.testing.assert_close(params[name].grad, ref_params[name].grad, msg=lambda m, name=name: f"{name}: {m}")
    assert_gradients_live(model, names)
    assert model.base_model.model.lm_head.weight.grad is None
    (graph,) = graphs.training()
    assert_logits_lazy(graph, V)
    assert counters["chunkce"]["logits_lazy"] == 1
