"""The lazy default on the routes a Hugging Face model is trained and used by, with no options.

``torch.compile(model, backend="chunkce")`` and nothing else (a recording inner backend
aside, to read the graph): a training step returns ``outputs.logits`` as a
:class:`compile_pass.LazyLogits`, and the graph the inner backend gets
holds the op and no ``[..., V]`` node but the lazy stand-in (``node.meta[STAND_IN]`` a
:class:`compile_pass.graph.returned_logits.TakenOut`). Each route is compared with the stock
backend on a deep copy: ``torch.testing.assert_close`` on the loss, the logits when read
and every trainable gradient.

Routes: gradient accumulation with ``num_items_in_batch`` (a micro-step's logits read
after the next micro-step's forward), activation checkpointing (HF's, and
``torch.utils.checkpoint`` around the compiled call) with ``fullgraph=True``,
evaluation under ``no_grad`` (lazy too), ``generate()`` (no loss: real tensors), a warmed-up model under
``error_on_recompile`` over several lengths, and a loss built from the logits outside
the compiled region (``(out.loss + z_loss(out.logits)).backward()``), aot_eager and Inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from builders import z_loss
from rewrite_proof import GraphCopies, assert_logits_lazy
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from compile_pass import LazyLogits

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile", "eager_kernels")]

V = 257  # odd vocabulary
B, T = 2, 8
# hidden 32, 1 layer, 4 heads / 2 kv heads; dropout off so both compiles see the same numbers
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, attention_dropout=0.0)


def build(**config) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **config})).train()


def batch(seed: int = 0, seq: int = T, masked: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, seq]`` input ids and labels, the first ``masked`` labels of row 0 ignored (-100)."""
    ids = torch.randint(3, V, (B, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :masked] = -100
    return ids, labels


def assert_grads_equal(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every trainable parameter has a gradient, equal to the reference's."""
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if p.requires_grad:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}")


def test_gradient_accumulation_with_num_items_in_batch_and_a_micro_steps_logits_read_later():
    """Two micro-steps with different numbers of valid labels, each normalised by the step's
    total (``num_items_in_batch``, as HF's Trainer passes it), no optimizer step between: the
    accumulated gradients are stock's; micro-step 1's logits, read after micro-step 2's forward,
    are stock's micro-step 1 logits (the head did not change, only its ``.grad``)."""
    model = build()
    reference = copy.deepcopy(model)
    graphs = GraphCopies()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": graphs})
    stock = torch.compile(reference, backend="aot_eager")
    micro_batches = [batch(0, masked=1), batch(1, masked=6)]
    num_items_in_batch = sum((labels[:, 1:] != -100).sum() for _, labels in micro_batches)
    outputs, expected = [], []
    for ids, labels in micro_batches:
        outputs.append(compiled(input_ids=ids, labels=labels, num_items_in_batch=num_items_in_batch))
        expected.append(stock(input_ids=ids, labels=labels, num_items_in_batch=num_items_in_batch))
        if len(outputs) == 2:
            assert not outputs[0].logits.is_computed  # its first read, after micro-step 2's forward:
            first = outputs[0].logits.detach() * 1.0
        outputs[-1].loss.backward()
        expected[-1].loss.backward()
    assert all(isinstance(out.logits, LazyLogits) and out.logits.requires_grad for out in outputs)
    torch.testing.assert_close(first, expected[0].logits.detach())
    torch.testing.assert_close(outputs[1].logits.detach() * 1.0, expected[1].logits.detach())
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out.loss, ref.loss)
    assert_grads_equal(model, reference)
    (graph,) = graphs.training()  # one graph for both micro-steps
    assert_logits_lazy(graph, V)
    assert counters["chunkce"]["logits_lazy"] == 1


@pytest.mark.parametrize("where", ["hf", "around_the_compiled_call"])
def test_activation_checkpointing_with_fullgraph(where):
    """``fullgraph=True`` with HF's activation checkpointing (decoder layers in checkpoint regions;
    ``use_cache=False`` in the config: with it on, HF's ``logger.warning_once`` that it turns it off
    is a graph break for the stock compile, which ``fullgraph`` refuses; chunkce skips it), or ``torch.utils.checkpoint`` (non-reentrant)
    around the whole compiled call: the logits are lazy; a loss read from them outside the graph
    (z-loss) and the model's loss backpropagate to stock's gradients."""
    model = build(use_cache=False)
    if where == "hf":
        model.activation_checkpointing_enable()
    reference = copy.deepcopy(model)
    graphs = GraphCopies()
    compiled = torch.compile(model, backend="chunkce", fullgraph=True, options={"inner_backend": graphs})
    stock = torch.compile(reference, backend="aot_eager", fullgraph=True)
    ids, labels = batch()

    def step(module):
        if where == "hf":
            out = module(input_ids=ids, labels=labels)
            loss, logits = out.loss, out.logits
        else:
            loss, logits = checkpoint(lambda i: tuple(module(input_ids=i, labels=labels).values()), ids,
                                      use_reentrant=False)
        (loss + z_loss(logits)).backward()
        return loss.detach(), logits

    (loss, logits), (ref_loss, ref_logits) = step(compiled), step(stock)
    assert isinstance(logits, LazyLogits)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(logits.detach() * 1.0, ref_logits.detach())
    assert_grads_equal(model, reference)
    graphs_with_grad = graphs.training()
    assert len(graphs_with_grad) == 1, graphs.graphs
    assert_logits_lazy(graphs_with_grad[0], V)


def test_no_grad_evaluation_gets_lazy_logits_and_generate_real_ones():
    """Under ``no_grad`` an evaluation step with labels computes no logits either: its graph holds the
    op and the lazy stand-in only (``assert_logits_lazy``), the step returns a LazyLogits equal to
    stock's when read. ``generate()`` passes no labels: no loss, nothing rewritten, real logits, its
    tokens and per-step logits equal to stock's."""
    model = build()
    reference = copy.deepcopy(model)
    graphs = GraphCopies()
    model.compile(backend="chunkce", options={"inner_backend": graphs})
    reference.compile(backend="aot_eager")
    ids, labels = batch()
    with torch.no_grad():
        out, expected = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert isinstance(out.logits, LazyLogits) and not out.logits.is_computed
    (evaluation,) = [graph for grad, graph in graphs.graphs if not grad]
    assert_logits_lazy(evaluation, V)
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.logits * 1, expected.logits)
    assert counters["chunkce"]["logits_kept"] == 0 and counters["chunkce"]["logits_lazy"] == 1
    counters.clear()
    settings = dict(max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
    generated, expected_generated = model.generate(ids[:, :4], **settings), reference.generate(ids[:, :4], **settings)
    torch.testing.assert_close(generated.sequences, expected_generated.sequences)
    assert all(type(step) is torch.Tensor for step in generated.logits)
    torch.testing.assert_close(generated.logits, expected_generated.logits)
    assert counters["chunkce"]["sites_found"] == 0 and not graphs.training()


def test_warmed_up_model_does_not_recompile_over_sequence_lengths():
    """Warmed up as stock needs (a second length makes the graph dynamic), then three new lengths under
    ``error_on_recompile``: no recompile, as many graphs as stock, each step exact, logits lazy."""
    model = build()
    reference = copy.deepcopy(model)
    graphs = GraphCopies()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": graphs})
    stock_graphs = CompileCounterWithBackend("aot_eager")
    stock = torch.compile(reference, backend=stock_graphs)

    def step(seq: int, seed: int):
        ids, labels = batch(seed, seq)
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
        out, expected = compiled(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
        out.loss.backward()
        expected.loss.backward()
        assert isinstance(out.logits, LazyLogits) and out.logits.shape == (B, seq, V)
        torch.testing.assert_close(out.loss, expected.loss)
        torch.testing.assert_close(out.logits.detach() * 1.0, expected.logits.detach())
        assert_grads_equal(model, reference)

    for seed, seq in enumerate((8, 11)):  # warm-up: static, then dynamic
        step(seq, seed)
    warmed = len(graphs.graphs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, seq in enumerate((6, 13, 9), start=2):
            step(seq, seed)
    assert len(graphs.graphs) == warmed == stock_graphs.frame_count == 2
    for graph in graphs.training():
        assert_logits_lazy(graph, V)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_loss_on_the_logits_outside_the_compiled_region_gets_stocks_gradients(inner):
    """``(out.loss + z_loss(out.logits)).backward()``: the z-loss reads the lazy logits outside the
    graph; its gradient reaches the head and, through the compiled step's own backward, the body.
    With ``inner="inductor"`` Inductor compiles the graph that returns the logits' inputs; the
    reference is stock aot_eager either way (Inductor against stock Inductor on Llama: test_models.py),
    and the Inductor model has no decoder layer (embedding, norm, head): a compile of seconds, not a minute."""
    model = build(num_hidden_layers=0 if inner == "inductor" else 1)
    reference = copy.deepcopy(model)
    graphs = GraphCopies(inner)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": graphs})
    stock = torch.compile(reference, backend="aot_eager")
    ids, labels = batch()
    out, expected = compiled(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
    assert isinstance(out.logits, LazyLogits) and not out.logits.is_computed
    total, expected_total = out.loss + z_loss(out.logits), expected.loss + z_loss(expected.logits)
    total.backward()
    expected_total.backward()
    torch.testing.assert_close(total, expected_total)
    assert_grads_equal(model, reference)
    (graph,) = graphs.training()
    assert_logits_lazy(graph, V)
