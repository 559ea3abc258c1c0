"""The pass on real models: transformers causal LMs built from tiny configs.

Coverage is a tested property: every model in ``MODELS`` is compiled with
``backend="chunkce"`` and, as a deep copy, with the stock backend; one training
step each (``model(input_ids=..., labels=...)``, ``loss.backward()``), in three
forms — plain, with ``num_items_in_batch`` as HF's Trainer passes it, and with
activation checkpointing. Asserted: the outcome the registry states (rewritten,
or refused with its reason key), no graph break in the chunkce compile, and the
loss, the returned logits and every parameter gradient equal to stock compile's.

``docs/tables/coverage.md`` lists the same models and outcomes
(``python -m benchmarks.coverage_table --write`` writes it; a fast test here
checks the table against ``MODELS``).

Time: the inner backend is aot_eager against stock aot_eager (compiling is what
costs: ~2-4 s a compile on 2 CPU cores), and Inductor against stock Inductor for
the cases in ``INDUCTOR``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import compile_pass
from compile_pass import DroppedLogits, LazyLogits
from compile_pass.graph.report import LOGITS_DROPPED
from compile_pass.graph.returned_logits import STAND_IN
from compile_pass.options import ReturnedLogits
from builders import OP, op_node, reduction_of

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

V = 257  # odd vocabulary
B, T = 2, 8
OP_NAME = "chunkce.linear_cross_entropy"
TABLE = Path(__file__).resolve().parents[2] / "docs" / "tables" / "coverage.md"

# hidden 32, 1 layer, 4 heads / 2 kv heads; dropout off so both compiles see the same numbers
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, attention_dropout=0.0)


@dataclass(frozen=True)
class Model:
    """One row of the coverage table: a transformers class and what the pass does with it."""

    name: str
    model_class: str  # in ``transformers``
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    outcome: str = "rewritten"  # or "refused"
    reason_key: str = ""  # counter key of a refusal: counters["chunkce"][f"refused_{key}"]
    note: str = ""  # what the model does between lm_head and loss, for the docs


MODELS = [
    Model("Llama", "LlamaForCausalLM", "LlamaConfig", TINY),
    Model("Mistral", "MistralForCausalLM", "MistralConfig", TINY),
    Model("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", TINY),
    Model("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", {**TINY, "head_dim": 8}),
    Model("Phi-3", "Phi3ForCausalLM", "Phi3Config", {**TINY, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    Model("GPT-2", "GPT2LMHeadModel", "GPT2Config",
          dict(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
          note="tied embeddings; `logger.warning_once` in the loss path (skipped while tracing for chunkce)"),
    Model("Qwen2-MoE", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
          {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 32}, note="mixture of experts"),
    Model("Mixtral", "MixtralForCausalLM", "MixtralConfig",
          {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}, note="mixture of experts"),
    Model("Gemma 2", "Gemma2ForCausalLM", "Gemma2Config", {**TINY, "head_dim": 8},
          outcome="refused", reason_key="soft_cap", note="`final_logit_softcapping`: tanh(logits / c) * c"),
    Model("Gemma 3", "Gemma3ForCausalLM", "Gemma3TextConfig",
          {**TINY, "head_dim": 8, "final_logit_softcapping": 30.0},
          outcome="refused", reason_key="soft_cap", note="`final_logit_softcapping` (set; off by default)"),
    Model("Cohere", "CohereForCausalLM", "CohereConfig", {**TINY, "logit_scale": 0.25},
          note="`logit_scale`: logits * scale, absorbed into the op"),
    Model("Granite", "GraniteForCausalLM", "GraniteConfig", {**TINY, "logits_scaling": 3.0},
          note="`logits_scaling`: logits / scale, absorbed into the op"),
]
BY_NAME = {m.name: m for m in MODELS}
FORMS = ("plain", "num_items_in_batch", "checkpointing")
CASES = [(m.name, form) for m in MODELS for form in FORMS] + [("Llama", "packed")]
# (model, form) compiled by Inductor (the op's name in the generated code); the rest by aot_eager.
INDUCTOR = {("GPT-2", "plain"), ("Llama", "num_items_in_batch")}


def build(spec: Model, seed: int = 0) -> torch.nn.Module:
    import transformers
    config = getattr(transformers, spec.config_class)(**spec.config)
    torch.manual_seed(seed)
    return getattr(transformers, spec.model_class)(config).train()


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (B, T), generator=gen)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return input_ids, labels


def packed_batch(lengths=(3, 5, 4, 4), seed=0) -> dict[str, torch.Tensor]:
    """Documents in one row, as DataCollatorWithFlattening packs them: position_ids
    restart per document, each document's first label is -100."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (1, sum(lengths)), generator=gen)
    labels = input_ids.clone()
    labels[0, torch.tensor([0, *lengths[:-1]]).cumsum(0)] = -100
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def enable_checkpointing(model: torch.nn.Module) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # HF's default: torch.utils.checkpoint, use_reentrant=False


def train_step(model, form: str, seed: int = 0):
    """One training step as HF's Trainer runs it; returns (loss, logits)."""
    if form == "packed":
        batch = packed_batch(seed=seed)
    else:
        input_ids, labels = make_batch(seed)
        batch = {"input_ids": input_ids, "labels": labels}
    if form == "num_items_in_batch":  # the Trainer's gradient-accumulation-aware normalisation
        batch["num_items_in_batch"] = (labels[:, 1:] != -100).sum()
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach()


def assert_same_step(model, reference, got, expected):
    for name, a, b in (("loss", got[0], expected[0]), ("logits", got[1], expected[1])):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "form"), CASES)
def test_model_matches_stock_compile(name, form):
    spec = BY_NAME[name]
    model = build(spec)
    if form == "checkpointing":
        enable_checkpointing(model)
    reference = copy.deepcopy(model)
    backend = "inductor" if (name, form) in INDUCTOR else "aot_eager"

    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": backend})
    got, code = run_and_get_code(train_step, compiled, form)
    stats, breaks = dict(counters["chunkce"]), dict(counters["graph_break"])
    expected = train_step(torch.compile(reference, backend=backend), form)

    assert not breaks, f"graph breaks in the chunkce compile: {breaks}"
    if spec.outcome == "rewritten":
        assert (stats.get("sites_rewritten"), stats.get("sites_refused", 0)) == (1, 0), stats
        assert stats.get("logits_lazy") == 1 and not stats.get("logits_kept")  # HF returns them: lazy, exact
        assert backend != "inductor" or OP_NAME in "\n".join(code)
    else:
        assert (stats.get("sites_rewritten", 0), stats.get("sites_refused")) == (0, 1), stats
        assert stats.get(f"refused_{spec.reason_key}") == 1, stats
    assert_same_step(model, reference, got, expected)


@pytest.mark.slow
def test_tied_embedding_gradient_has_both_uses():
    """GPT-2's lm_head.weight is wte.weight: its gradient is the head's plus the embedding's."""
    model = build(BY_NAME["GPT-2"])
    assert model.lm_head.weight is model.transformer.wte.weight
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    train_step(compiled, "plain")
    assert counters["chunkce"]["sites_rewritten"] == 1
    train_step(reference, "plain")  # eager: both uses
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad)
    input_ids, labels = make_batch()  # the head's use alone: hidden states detached from the embedding
    hidden = reference.transformer(input_ids).last_hidden_state.detach()
    head_loss = reference.loss_function(reference.lm_head(hidden), labels, vocab_size=V)
    (head_grad,) = torch.autograd.grad(head_loss, reference.lm_head.weight)
    embedding_grad = reference.lm_head.weight.grad - head_grad
    assert head_grad.abs().sum() > 0 and embedding_grad.abs().sum() > 0


@pytest.mark.slow
def test_num_items_in_batch_division_stays_in_the_graph():
    """HF's fixed_cross_entropy: sum-reduced loss / num_items_in_batch, a tensor graph input."""
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

    model = build(BY_NAME["Llama"])
    train_step(torch.compile(model, backend="chunkce", options={"inner_backend": inner}), "num_items_in_batch")
    (gm,) = graphs
    call = op_node(gm)
    assert reduction_of(call) == "sum"
    (count,) = [n for n in gm.graph.find_nodes(op="placeholder") if "num_items_in_batch" in n.name]
    assert isinstance(count.meta["example_value"], torch.Tensor)
    divisions = [n for n in gm.graph.nodes if n.op == "call_function" and "truediv" in str(n.target)]
    assert any(call in _ancestors(d) and count in _ancestors(d) for d in divisions)  # op's sum / the count


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


@pytest.mark.slow
def test_transformers_one_shot_logging_is_skipped_only_when_tracing_for_chunkce():
    """GPT-2's loss path calls logger.warning_once: under stock compile the graph breaks
    there (logits reach the loss as a graph input); under chunkce the call is skipped."""
    from transformers.utils import logging as hf_logging
    logger = hf_logging.get_logger("compile_pass.tests")

    class WarnsBeforeLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lm_head = torch.nn.Linear(H_TOY, V, bias=False)

        def forward(self, h, labels):
            logits = self.lm_head(h)
            logger.warning_once("chunkce test: a one-shot advisory in the loss path")
            return torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1))

    h, labels = toy_batch()
    expected = WarnsBeforeLoss()(h, labels)
    stock = torch.compile(WarnsBeforeLoss(), backend="aot_eager")(h, labels)
    assert counters["graph_break"], "stock compile should still break at the logger call"
    counters.clear()
    loss = torch.compile(WarnsBeforeLoss(), backend="chunkce", options={"inner_backend": "aot_eager"})(h, labels)
    assert not counters["graph_break"] and counters["chunkce"]["sites_rewritten"] == 1
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(stock, expected)
    counters.clear()
    report = compile_pass.explain(WarnsBeforeLoss(), h, labels)  # explain traces as the backend does
    assert [r.decision for r in report.records] == ["rewritten"] and not report.graph_breaks
    # Outside a chunkce trace, the set is the one it was: nothing global added.
    ignored = torch._dynamo.config.ignore_logging_functions
    assert hf_logging.warning_once not in ignored and hf_logging.warning_once not in set(ignored)


@pytest.mark.slow
def test_explain_agrees_with_the_registry():
    """What benchmarks/coverage_table.py writes to docs/tables/coverage.md: explain's outcome per model."""
    for spec in MODELS:
        input_ids, labels = make_batch()
        report = compile_pass.explain(build(spec), input_ids=input_ids, labels=labels)
        (record,) = report.records
        assert (record.decision, record.reason_key) == (spec.outcome, spec.reason_key), (spec.name, str(report))
        assert not report.graph_breaks, (spec.name, report.graph_breaks)


def test_docs_table_lists_the_tested_models():
    """docs/tables/coverage.md has one row per MODELS entry, with its outcome."""
    rows = re.findall(r"^\| (.+?) \| `(\w+)` \| (rewritten|refused) \| `?([\w-]*)`? \|", TABLE.read_text(),
                      flags=re.MULTILINE)
    assert rows == [(m.name, m.model_class, m.outcome, m.reason_key or "-") for m in MODELS]


# ---- returned_logits="drop": HF returns logits a training step never reads ----------------------------

H_TOY = 16


class ReturnsLogits(torch.nn.Module):
    """HF's shape of a causal LM's forward: (loss, logits), the loss from the logits' fp32 upcast."""

    def __init__(self, use_logits_in_graph=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(H_TOY, H_TOY)
        self.lm_head = torch.nn.Linear(H_TOY, V, bias=False)
        self.use_logits_in_graph = use_logits_in_graph

    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h)))
        loss = torch.nn.functional.cross_entropy(logits.float()[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        if self.use_logits_in_graph:
            return loss, logits, logits.argmax(-1)
        return loss, logits


def toy_batch(seq=T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, seq, H_TOY, generator=gen), torch.randint(0, V, (B, seq), generator=gen)


DROP = {"returned_logits": "drop"}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_dropped_logits_are_not_computed_and_the_step_matches_stock(backend):
    model, reference = ReturnsLogits(), ReturnsLogits()
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(copy.deepcopy(gm.graph))
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(model, backend="chunkce", options={**DROP, "inner_backend": inner})
    stock = torch.compile(reference, backend=backend)
    for seq in (T, T + 3):  # the second length compiles with dynamic shapes: symbolic stand-in sizes
        h, labels = toy_batch(seq)
        loss, logits = compiled(h, labels)
        loss.backward()
        expected_loss, expected_logits = stock(h, labels)
        expected_loss.backward()
        torch.testing.assert_close(loss, expected_loss)
        assert isinstance(logits, DroppedLogits)
        assert (logits.shape, logits.dtype, logits.device) == (expected_logits.shape, torch.float32, h.device)
        assert not logits.requires_grad
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}")
    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["logits_dropped"], stats["logits_kept"]) == (2, 2, 0)
    record = compile_pass.last_report().records[0]
    assert record.reason == LOGITS_DROPPED
    assert record.logits_bytes_avoided >= B * T * V * 4
    for graph in graphs:  # no projection left: only the op reads the lm_head weight
        readers = [n for n in graph.nodes if any("lm_head" in a.name for a in n.all_input_nodes)]
        assert [n.target for n in readers] == [OP], readers


def recording(graphs):
    """An inner backend that keeps a copy of each graph it gets in ``graphs`` and runs it as is."""
    def inner(gm, example_inputs):
        graphs.append(copy.deepcopy(gm.graph))
        return gm.forward
    return inner


def assert_only_the_stand_in(graph, logits_numel):
    """One op node, and no computed value of the logits' size: only the dropped logits' stand-in."""
    assert [n.target for n in graph.nodes if n.target == OP] == [OP]
    logits_like = [n for n in graph.nodes if isinstance(v := n.meta.get("example_value"), torch.Tensor)
                   and v.numel() == logits_numel and n.op != "placeholder" and not n.meta.get(STAND_IN)]
    assert logits_like == [], logits_like


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Cohere", "Granite"])
def test_dropped_logits_through_an_absorbed_scale(name):
    """Cohere's ``logits * logit_scale`` and Granite's ``logits / logits_scaling`` return the
    scaled logits: the drop looks through the absorbed scale, and the step equals stock."""
    spec = next(m for m in MODELS if m.name == name)
    model = build(spec)
    reference = copy.deepcopy(model)
    graphs = []
    compiled = torch.compile(model, backend="chunkce", options={**DROP, "inner_backend": recording(graphs)})
    input_ids, labels = make_batch()
    out = compiled(input_ids=input_ids, labels=labels)
    out.loss.backward()
    expected = torch.compile(reference, backend="aot_eager")(input_ids=input_ids, labels=labels)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    assert isinstance(out.logits, DroppedLogits) and out.logits.shape == expected.logits.shape
    for (param, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, param=param: f"{param}.grad: {m}")
    assert counters["chunkce"]["logits_dropped"] == 1 and counters["chunkce"]["logits_kept"] == 0
    (graph,) = graphs  # no projection, no scaled logits
    assert_only_the_stand_in(graph, B * T * V)


class ContiguousHead(ReturnsLogits):
    """OPT's head: ``lm_head(h).contiguous()``, returned and read by the loss."""

    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h))).contiguous()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return loss, logits


class TypeAsHead(ReturnsLogits):
    """Returned logits cast with ``.type_as(other)``, a cast the matcher passes too
    (compile_pass.graph.nodes.CASTS): it reads only ``other``'s dtype."""

    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return loss, logits.type_as(h.double())


@pytest.mark.parametrize("head", [ContiguousHead, TypeAsHead], ids=["contiguous", "type_as"])
def test_dropped_logits_through_a_copy(head):
    model, reference = head(), head()
    graphs = []
    compiled = torch.compile(model, backend="chunkce", options={**DROP, "inner_backend": recording(graphs)})
    h, labels = toy_batch()
    loss, logits = compiled(h, labels)
    loss.backward()
    expected_loss, expected_logits = torch.compile(reference, backend="aot_eager")(h, labels)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss)
    assert isinstance(logits, DroppedLogits) and logits.dtype == expected_logits.dtype
    (graph,) = graphs
    assert_only_the_stand_in(graph, B * T * V)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert counters["chunkce"]["logits_dropped"] == 1


def test_dropped_logits_raise_on_any_read_and_allow_metadata_ops():
    compiled = torch.compile(ReturnsLogits(), backend="chunkce", options={**DROP, "inner_backend": "aot_eager"})
    _, logits = compiled(*toy_batch())
    assert repr(logits) == f"DroppedLogits(shape=({B}, {T}, {V}), dtype=torch.float32, device=cpu)"
    # what accelerate's mixed precision and the like do to every output: no value read
    for view in (logits.float(), logits.to(torch.bfloat16), logits.detach(), logits[:, -1], logits.view(-1, V),
                 logits.transpose(0, 1), logits.clone(), logits.contiguous()):
        assert isinstance(view, DroppedLogits)
    assert logits.to(torch.bfloat16).dtype is torch.bfloat16 and logits[:, -1].shape == (B, V)
    for read in (lambda x: x.argmax(-1), lambda x: x.sum(), lambda x: x[0, 0, 0].item(), lambda x: x.tolist(),
                 lambda x: x + 1, lambda x: torch.softmax(x, -1), lambda x: x.numpy(),
                 lambda x: torch.zeros(B, T, V).copy_(x), lambda x: str(x.exp())):
        with pytest.raises(RuntimeError, match="returned_logits': 'drop'"):
            read(logits)


def test_logits_are_lazy_without_grad_kept_when_read_in_graph_and_by_default():
    h, labels = toy_batch()
    eager_loss, eager_logits = ReturnsLogits()(h, labels)
    compiled = torch.compile(ReturnsLogits(), backend="chunkce", options={**DROP, "inner_backend": "aot_eager"})
    with torch.no_grad():  # evaluation reads the logits: a no-grad graph makes them lazy, not dropped
        loss, logits = compiled(h, labels)
    assert type(logits) is LazyLogits
    torch.testing.assert_close(logits * 1, eager_logits.detach())
    assert counters["chunkce"]["logits_lazy"] == 1 and counters["chunkce"]["logits_dropped"] == 0
    counters.clear()
    in_graph = torch.compile(ReturnsLogits(use_logits_in_graph=True), backend="chunkce",
                             options={**DROP, "inner_backend": "aot_eager"})
    _, logits, predicted = in_graph(h, labels)  # argmax reads them in the graph: kept
    assert type(logits) is torch.Tensor and counters["chunkce"]["logits_dropped"] == 0
    torch.testing.assert_close(predicted, eager_logits.argmax(-1))
    counters.clear()
    kept = torch.compile(ReturnsLogits(), backend="chunkce",
                         options={"inner_backend": "aot_eager", "returned_logits": "keep"})
    _, logits = kept(h, labels)  # computed in the step; the report says how to have them lazy
    assert type(logits) is torch.Tensor and counters["chunkce"]["logits_kept"] == 1
    assert "'returned_logits': 'lazy'" in compile_pass.last_report().records[0].fix


def test_pre_grad_pass_refuses_dropped_logits():
    with pytest.raises(ValueError, match="returned_logits='drop' needs the chunkce backend"):
        compile_pass.ChunkcePreGradPass(DROP)
    assert compile_pass.ChunkcePreGradPass().options.returned_logits is ReturnedLogits.KEEP  # lazy needs the wrapper
    with pytest.raises(ValueError, match="unknown option 'drop_unused_logits'"):
        compile_pass.ChunkcePreGradPass({"drop_unused_logits": True})


@pytest.mark.slow
def test_llama_with_dropped_logits_matches_stock_and_saves_two_logits_sizes():
    """Measured (CPU allocator events): with ``returned_logits="keep"`` the forward still holds
    the returned [N, V] logits and backward a zero [N, V] gradient for them; the default (lazy)
    and ``"drop"`` hold neither (lazy: the hidden states more, [N, H])."""
    from compile_pass.memory import PeakMemory

    vocab, seq = 8000, 64
    spec = BY_NAME["Llama"]
    spec = Model(spec.name, spec.model_class, spec.config_class, {**spec.config, "vocab_size": vocab})
    models = {"stock": build(spec), "kept": build(spec), "dropped": build(spec), "lazy": build(spec)}
    ids = torch.randint(3, vocab, (B, seq), generator=torch.Generator().manual_seed(0))
    options = {"inner_backend": "aot_eager", "chunk_size": 32}
    compiled = {"stock": torch.compile(models["stock"], backend="aot_eager"),
                "kept": torch.compile(models["kept"], backend="chunkce",
                                      options={**options, "returned_logits": "keep"}),
                "dropped": torch.compile(models["dropped"], backend="chunkce", options={**options, **DROP}),
                "lazy": torch.compile(models["lazy"], backend="chunkce", options=options)}
    peaks, losses = {}, {}
    for name, step in compiled.items():
        step(input_ids=ids, labels=ids).loss.backward()  # compile outside the measurement
        models[name].zero_grad(set_to_none=True)
        with PeakMemory("cpu") as mem:
            out = step(input_ids=ids, labels=ids)
            out.loss.backward()
        peaks[name], losses[name] = mem.peak_bytes, out.loss.detach()
        del out
    logits_bytes = B * seq * vocab * 4
    hidden_bytes = B * seq * spec.config["hidden_size"] * 4
    assert peaks["kept"] - peaks["dropped"] >= 1.9 * logits_bytes, peaks
    assert peaks["lazy"] - peaks["dropped"] <= hidden_bytes + 64 * 1024, peaks
    torch.testing.assert_close(losses["dropped"], losses["stock"])
    torch.testing.assert_close(losses["lazy"], losses["stock"])
    for (name, p), (_, q) in zip(models["dropped"].named_parameters(), models["stock"].named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}")
