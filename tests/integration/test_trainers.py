"""Hugging Face's Trainer and TRL's SFTTrainer with a model compiled by chunkce (docs/trainers.md).

The Trainer route: ``model.compile(backend="chunkce")``, no options, before
``Trainer(model=model, ...)``. A training step never computes the logits (the op node is
in the training graph, the projection is not; the Trainer gets ``LazyLogits`` and never
reads them), the per-step losses and the trained parameters equal the same Trainer run
compiled with stock Inductor, and the evaluation loop (no grad) computes no logits in the
step either: it gets ``LazyLogits``, exact when the loop reads them (``compute_metrics``,
``preprocess_logits_for_metrics``), never computed when it does not (``evaluate()`` without
``compute_metrics``: ``prediction_loss_only``), whose measured peak is a fraction of Inductor's.
Under accelerate's mixed precision the returned logits are a cast of the projection: lazy
too, and exact when read. ``returned_logits="drop"`` still
drops them: ``test_returned_cast_of_the_logits_is_dropped_or_lazy_unless_the_graph_reads_it``.

TRL 1.16's SFTTrainer trains through its own fused LM head (``fused_lm_head=True``):
there is no ``cross_entropy`` in its graphs for chunkce to rewrite; chunkce changes
nothing, and the model's own forward (the plain Trainer's) is still rewritten.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import OP

STATISTICS_OP = torch.ops.chunkce.linear_statistics.default  # an evaluation step's loss: one walk with its reads
from datasets import Dataset
from rewrite_proof import assert_logits_lazy
from torch._dynamo.utils import counters
from transformers import (
    EvalPrediction,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

import compile_pass
from compile_pass.memory import PeakMemory
from compile_pass import DroppedLogits, LazyLogits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from corpus import EOS, encode, load_docs, load_tokenizer  # examples/corpus.py

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile", "eager_kernels")]

SEQ_LEN, MICRO_BATCH, ACCUMULATION, STEPS = 32, 2, 4, 2


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A byte-level BPE tokenizer (vocab 1024) trained on ~200 KB of the standard library, and its tokens."""
    docs = load_docs(max_bytes=200_000)
    tokenizer = load_tokenizer(docs, vocab_size=1024, cache_dir=tmp_path_factory.mktemp("tokenizer"))
    return tokenizer, encode(tokenizer, docs)


def tiny_llama(vocab_size, **config):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ_LEN, **config))


def padded_rows(ids, count, seed):
    """``count`` windows of the text, each with a random number of real tokens (the rest padding,
    label -100), so the micro-batches of one step hold different numbers of valid labels."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        start = int(torch.randint(0, ids.numel() - SEQ_LEN, (1,), generator=gen))
        real = int(torch.randint(4, SEQ_LEN + 1, (1,), generator=gen))
        input_ids = ids[start:start + SEQ_LEN].clone()  # [T], a fixed length: one graph per mode
        labels = input_ids.clone()
        labels[real:] = -100
        attention_mask = (torch.arange(SEQ_LEN) < real).long()
        rows.append({"input_ids": input_ids.tolist(), "labels": labels.tolist(),
                     "attention_mask": attention_mask.tolist()})
    return Dataset.from_list(rows)


def recording(graphs, backend):
    """An inner backend that keeps each graph it is given (and whether grad was on), then runs ``backend``."""

    def inner(gm, example_inputs):
        graphs.append((torch.is_grad_enabled(), copy.deepcopy(gm.graph)))
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    return inner


def head_readers(graph):
    """The targets of the nodes that compute with the lm_head weight (a placeholder of the Dynamo graph),
    through the ``.to(dtype)`` that autocast puts on it; not the graph output, which returns the
    weight for the lazy logits."""
    (weight,) = [n for n in graph.find_nodes(op="placeholder") if "lm_head" in n.name]
    readers, todo = [], list(weight.users)
    while todo:
        node = todo.pop()
        if node.target == "to":
            todo += node.users
        elif node.op != "output":
            readers.append(node.target)
    return readers


class RecordingTrainer(Trainer):
    """The stock Trainer; each training micro-batch's loss, ``num_items_in_batch`` and returned logits are
    kept (the logits object itself, to tell afterwards whether anything read it), and the type of the
    evaluation loop's logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            self.micro_batches.append({"loss": loss.detach().clone(), "num_items_in_batch": num_items_in_batch,
                                       "valid_labels": int((inputs["labels"][:, 1:] != -100).sum()),
                                       "logits": outputs.logits})
        else:
            self.evaluation_logits_types.add(type(outputs.logits))
        return (loss, outputs) if return_outputs else loss


def accuracy(prediction):
    """Next-token accuracy over valid labels, from the eval loop's logits."""
    logits, labels = prediction.predictions, prediction.label_ids  # [n, T, V], [n, T]
    valid = labels[:, 1:] != -100
    return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:])[valid].mean())}


def run_trainer(model, train, evaluation, tmp_path):
    """``STEPS`` optimizer steps of the stock Trainer (``RecordingTrainer``), then its prediction loop
    on ``evaluation`` (None: no evaluation)."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                             save_strategy="no", per_device_train_batch_size=MICRO_BATCH,
                             per_device_eval_batch_size=4, gradient_accumulation_steps=ACCUMULATION,
                             max_steps=STEPS, logging_steps=1, seed=0,
                             # SGD at lr 1: a parameter's difference is its gradients' (AdamW divides each by its
                             # own magnitude, so summation-order noise of a near-zero gradient would move it by ~lr)
                             optim="sgd", learning_rate=1.0, lr_scheduler_type="constant")
    trainer = RecordingTrainer(model=model, args=args, train_dataset=train, compute_metrics=accuracy)
    trainer.micro_batches, trainer.evaluation_logits_types = [], set()
    trainer.train()
    return trainer, (trainer.predict(evaluation) if evaluation is not None else None)


def eager_prediction(model, evaluation, batch_size=4):
    """What the Trainer's prediction loop computes, from the model's eager forward (``forward``, not
    the compiled ``__call__``): ``(logits [n, T, V], mean of the per-batch losses, accuracy)``."""
    columns = {k: torch.tensor(evaluation[k]) for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        outputs = [model.forward(**{k: v[i:i + batch_size] for k, v in columns.items()})
                   for i in range(0, len(evaluation), batch_size)]
    logits = torch.cat([o.logits for o in outputs])
    labels = columns["labels"].numpy()
    metrics = accuracy(EvalPrediction(predictions=logits.numpy(), label_ids=labels))
    return logits, torch.stack([o.loss for o in outputs]).mean().item(), metrics["accuracy"]


def test_trainer_with_no_options_matches_inductor_never_computes_training_logits_and_evaluates_real_ones(
        text, tmp_path):
    tokenizer, ids = text
    train, evaluation = padded_rows(ids, STEPS * ACCUMULATION * MICRO_BATCH, seed=0), padded_rows(ids, 8, seed=1)
    model = tiny_llama(tokenizer.get_vocab_size())
    reference = copy.deepcopy(model)
    graphs = []
    # no chunkce option but the inner backend: aot_eager, recorded (the Inductor inner backend on Llama:
    # tests/integration/test_models.py); the reference is the stock Inductor compile
    model.compile(backend="chunkce", options={"inner_backend": recording(graphs, "aot_eager")})
    reference.compile(backend="inductor")

    trainer, prediction = run_trainer(model, train, evaluation, tmp_path / "chunkce")
    ref_trainer, _ = run_trainer(reference, train, None, tmp_path / "inductor")

    # gradient accumulation over uneven micro-batches: the Trainer passed the step's label count
    steps = [trainer.micro_batches[i:i + ACCUMULATION] for i in range(0, STEPS * ACCUMULATION, ACCUMULATION)]
    for step in steps:
        counts = [m["valid_labels"] for m in step]
        assert len(set(counts)) > 1, counts
        for m in step:
            assert int(m["num_items_in_batch"]) == sum(counts)
    losses = torch.stack([m["loss"] for m in trainer.micro_batches])
    ref_losses = torch.stack([m["loss"] for m in ref_trainer.micro_batches])
    torch.testing.assert_close(losses, ref_losses)
    assert [h["loss"] for h in trainer.state.log_history[:STEPS]] == pytest.approx(
        [h["loss"] for h in ref_trainer.state.log_history[:STEPS]], rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")

    # the training step never computed the logits (lazy); the Trainer never read them
    assert {type(m["logits"]) for m in trainer.micro_batches} == {LazyLogits}
    assert not any(m["logits"].is_computed for m in trainer.micro_batches)
    assert {type(m["logits"]) for m in ref_trainer.micro_batches} == {torch.Tensor}
    training = [g for grad, g in graphs if grad]
    assert len(training) == 1 and head_readers(training[0]) == [OP]  # the op reads the head; no projection
    assert_logits_lazy(training[0], tokenizer.get_vocab_size())  # no [.., V] node but the lazy stand-in

    # evaluation (no grad): its own graph, rewritten with the logits lazy (no projection in the step; the
    # loss one statistics walk whose row statistics the lazy logits keep); read by the prediction loop,
    # they equal the eager forward's, and so do the loss and the metric
    evaluation_graphs = [g for grad, g in graphs if not grad]
    assert len(evaluation_graphs) == 1 and head_readers(evaluation_graphs[0]) == [STATISTICS_OP]
    assert_logits_lazy(evaluation_graphs[0], tokenizer.get_vocab_size())
    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["logits_lazy"], stats["logits_kept"]) == (2, 2, 0)
    assert trainer.evaluation_logits_types == {LazyLogits}
    logits, loss, expected_accuracy = eager_prediction(model, evaluation)
    assert prediction.predictions.shape == (8, SEQ_LEN, tokenizer.get_vocab_size())
    torch.testing.assert_close(torch.from_numpy(prediction.predictions), logits, rtol=1e-4, atol=1e-4)
    assert prediction.metrics["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert prediction.metrics["test_accuracy"] == expected_accuracy

    # prediction_loss_only: the loop keeps the loss alone (no logits gathered, no metric), same graph
    trainer.args.prediction_loss_only = True
    metrics = trainer.evaluate(evaluation)
    assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-5) and "eval_accuracy" not in metrics
    assert len(graphs) == 2  # no recompile


def argmax_logits(logits, labels):
    """The usual ``preprocess_logits_for_metrics``: predicted tokens ``[n, T]`` instead of ``[n, T, V]`` logits."""
    return logits.argmax(-1)


def token_accuracy(prediction):
    """Next-token accuracy over valid labels, from argmax predictions."""
    predicted, labels = prediction.predictions, prediction.label_ids  # [n, T], [n, T]
    valid = labels[:, 1:] != -100
    return {"accuracy": float((predicted[:, :-1] == labels[:, 1:])[valid].mean())}


def evaluate_with(model, evaluation, tmp_path, **trainer_kwargs):
    """``Trainer.evaluate`` of ``model`` on ``evaluation`` (batches of 4; it compiles), then
    ``Trainer.predict``: returns the latter's output (metrics and predictions) and the trainer."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                             per_device_eval_batch_size=4, seed=0)
    trainer = RecordingTrainer(model=model, args=args, **trainer_kwargs)
    trainer.micro_batches, trainer.evaluation_logits_types = [], set()
    trainer.evaluate(evaluation)
    return trainer.predict(evaluation), trainer


def test_evaluate_with_preprocess_logits_for_metrics_reads_lazy_logits_exactly(text, tmp_path):
    """``compute_metrics`` with the usual ``preprocess_logits_for_metrics`` (argmax): the loop gets
    LazyLogits, reads them through the argmax, and the loss and the accuracy equal stock's (the same
    model compiled with the eager backend); the evaluation graph holds the op and no projection."""
    tokenizer, ids = text
    evaluation = padded_rows(ids, 8, seed=4)
    model = tiny_llama(tokenizer.get_vocab_size())
    reference = copy.deepcopy(model)
    graphs = []
    model.compile(backend="chunkce", options={"inner_backend": recording(graphs, "aot_eager")})
    reference.compile(backend="eager")
    kwargs = dict(compute_metrics=token_accuracy, preprocess_logits_for_metrics=argmax_logits)
    prediction, trainer = evaluate_with(model, evaluation, tmp_path / "chunkce", **kwargs)
    expected, _ = evaluate_with(reference, evaluation, tmp_path / "eager", **kwargs)
    assert trainer.evaluation_logits_types == {LazyLogits}
    (graph,) = [g for grad, g in graphs if not grad]
    assert head_readers(graph) == [STATISTICS_OP]  # the loss's walk; the argmax reads its statistics
    assert_logits_lazy(graph, tokenizer.get_vocab_size())
    assert prediction.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-5)
    assert prediction.metrics["test_accuracy"] == expected.metrics["test_accuracy"]
    assert prediction.predictions.shape == (8, SEQ_LEN)  # the argmax's tokens, read from the lazy logits
    assert (prediction.predictions == expected.predictions).all()
    assert len(set(prediction.predictions.ravel().tolist())) > 1  # not a constant: a read of real values


def test_evaluate_without_metrics_reads_no_logits_and_peaks_below_a_quarter_of_inductors(text, tmp_path,
                                                                                            monkeypatch):
    """``Trainer.evaluate()`` with no ``compute_metrics`` (``prediction_loss_only``) never reads the logits:
    chunkce (no options but a 1 MiB tile, as a real vocabulary's logits dwarf the default tile; Inductor
    inner backend, the op's kernels compiled as by default) holds no [N, V] logits, so a warm
    ``evaluate()``'s measured peak is at most 0.25x stock Inductor's, and eval_loss is Inductor's. Size:
    4 x 32 tokens x a 32768 vocabulary, fp32: 16 MiB of logits a batch against a hidden size of 64."""
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS")  # eager per-tile math holds several tiles at once
    tokenizer, ids = text
    evaluation = padded_rows(ids, 8, seed=5)
    model = tiny_llama(32768)
    reference = copy.deepcopy(model)
    model.compile(backend="chunkce", options={"chunk_bytes": 1 << 20})
    reference.compile(backend="inductor")
    peaks, losses = {}, {}
    for name, module in (("chunkce", model), ("inductor", reference)):
        args = TrainingArguments(output_dir=str(tmp_path / name), use_cpu=True, report_to="none",
                                 disable_tqdm=True, per_device_eval_batch_size=4, seed=0)
        trainer = RecordingTrainer(model=module, args=args)
        trainer.micro_batches, trainer.evaluation_logits_types = [], set()
        trainer.evaluate(evaluation)  # compiles
        with PeakMemory("cpu") as mem:
            losses[name] = trainer.evaluate(evaluation)["eval_loss"]
        peaks[name] = mem.peak_bytes
        if name == "chunkce":
            assert trainer.evaluation_logits_types == {LazyLogits}
            assert counters["chunkce"]["logits_lazy"] == 1 and counters["chunkce"]["logits_kept"] == 0
    assert losses["chunkce"] == pytest.approx(losses["inductor"], rel=1e-5)
    assert peaks["inductor"] >= 16 * 2**20, peaks  # stock holds a batch's [128, 32768] fp32 logits
    assert peaks["chunkce"] <= 0.25 * peaks["inductor"], peaks


def test_under_accelerate_mixed_precision_the_casted_logits_are_lazy_too(text):
    """accelerate's bf16 mixed precision wraps the forward in autocast and ``convert_outputs_to_fp32``,
    as ``Accelerator.prepare_model`` does; Dynamo traces both into the graph, so the returned logits
    are the projection's ``.float()``: that cast is not computed in the step either (no options),
    and the logits read afterwards (the bf16 projection under the step's autocast, then the cast)
    are the eager model's."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    tokenizer, ids = text
    rows = padded_rows(ids, 2, seed=2)
    input_ids, labels = torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"])
    model = tiny_llama(tokenizer.get_vocab_size())
    reference = copy.deepcopy(model)
    graphs = []
    results = []
    for module, backend in ((model, "chunkce"), (reference, "eager")):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        module.forward = MethodType(autocast(type(module).forward), module)  # accelerate's prepare_model
        module.forward = MethodType(convert_outputs_to_fp32(module.forward.__func__), module)
        chunkce = {"inner_backend": recording(graphs, "eager")}
        options = chunkce if backend == "chunkce" else None
        module.compile(backend=backend, options=options)
        outputs = module(input_ids=input_ids, labels=labels)
        outputs.loss.backward()
        results.append(outputs)
    (outputs, expected) = results
    assert isinstance(outputs.logits, LazyLogits) and outputs.logits.dtype == expected.logits.dtype == torch.float32
    assert counters["chunkce"]["logits_lazy"] == 1 and counters["chunkce"]["logits_kept"] == 0
    assert head_readers(graphs[0][1]) == [OP]
    assert_logits_lazy(graphs[0][1], tokenizer.get_vocab_size())
    torch.testing.assert_close(outputs.loss, expected.loss, atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(outputs.logits.detach() * 1.0, expected.logits.detach(), atol=1e-2, rtol=1.6e-2)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-2, rtol=1.6e-2, msg=lambda m, name=name: f"{name}: {m}")


class ReturnsCastLogits(torch.nn.Module):
    """A head whose returned logits are a cast of the projection (as under accelerate's
    ``convert_outputs_to_fp32``), optionally also read in the graph."""

    def __init__(self, read_in_graph):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = torch.nn.Linear(16, 37, bias=False)
        self.read_in_graph = read_in_graph

    def forward(self, hidden_states, labels):
        logits = self.lm_head(hidden_states)  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        returned = logits.double()
        return (loss, returned, returned.argmax(-1)) if self.read_in_graph else (loss, returned)


@pytest.mark.parametrize("read_in_graph", [False, True])
@pytest.mark.parametrize("options", [{"returned_logits": "drop"}, {}], ids=["returned_logits_drop", "no_options"])
def test_returned_cast_of_the_logits_is_dropped_or_lazy_unless_the_graph_reads_it(options, read_in_graph):
    """The drop option drops a returned cast of the logits; no options leaves it lazy,
    exact when read; a cast the graph also reads is kept."""
    hidden_states, labels = torch.randn(2, 5, 16, requires_grad=True), torch.randint(0, 37, (2, 5))
    expected = ReturnsCastLogits(read_in_graph)(hidden_states, labels)
    compiled = torch.compile(ReturnsCastLogits(read_in_graph), backend="chunkce",
                             options={**options, "inner_backend": "aot_eager"})
    outputs = compiled(hidden_states, labels)
    torch.testing.assert_close(outputs[0], expected[0])
    if read_in_graph:  # the cast has another reader: kept, and right
        assert type(outputs[1]) is torch.Tensor and counters["chunkce"]["logits_kept"] == 1
        torch.testing.assert_close(outputs[1], expected[1])
        torch.testing.assert_close(outputs[2], expected[2])
        return
    assert compile_pass.last_report().records[0].logits_bytes_avoided >= 2 * 5 * 37 * (4 + 8)
    if options:
        assert isinstance(outputs[1], DroppedLogits) and outputs[1].dtype == torch.float64
        assert counters["chunkce"]["logits_dropped"] == 1
    else:
        assert isinstance(outputs[1], LazyLogits) and outputs[1].dtype == torch.float64
        assert counters["chunkce"]["logits_lazy"] == 1
        torch.testing.assert_close(outputs[1].detach() * 1.0, expected[1].detach())


# ---- TRL ---------------------------------------------------------------------------------------------------


def sft_rows(ids, count, seed):
    """Plain-text SFT examples of random lengths (the collator pads them to SEQ_LEN)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        start = int(torch.randint(0, ids.numel() - SEQ_LEN, (1,), generator=gen))
        length = int(torch.randint(6, SEQ_LEN + 1, (1,), generator=gen))
        rows.append({"input_ids": ids[start:start + length].tolist()})
    return Dataset.from_list(rows)


def run_sft(model, tokenizer, train, evaluation, tmp_path):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                     save_strategy="no", per_device_train_batch_size=MICRO_BATCH, per_device_eval_batch_size=4,
                     gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=1e-3,
                     logging_steps=1, seed=0, max_length=SEQ_LEN, pad_to_multiple_of=SEQ_LEN,
                     bf16=False, gradient_checkpointing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                         processing_class=tokenizer)
    trainer.train()
    return trainer, trainer.evaluate()


def test_sft_trainer_trains_through_trls_fused_head_with_nothing_for_chunkce_to_rewrite(text, tmp_path):
    """SFTTrainer (trl 1.16) patches the model with its fused LM head and trains through
    ``model(..., fused_lm_head=True)``: its loss and its entropy / token-accuracy metrics come
    from TRL's chunked kernel, never from logits. chunkce finds no cross-entropy to rewrite
    and the run equals the uncompiled one; the model's own forward is still rewritten."""
    tokenizer, ids = text
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    train, evaluation = sft_rows(ids, STEPS * ACCUMULATION * MICRO_BATCH, seed=0), sft_rows(ids, 4, seed=1)
    model = tiny_llama(tokenizer.get_vocab_size(), pad_token_id=hf_tokenizer.pad_token_id,
                       eos_token_id=hf_tokenizer.eos_token_id)
    reference = copy.deepcopy(model)
    graphs = []
    model.compile(backend="chunkce", options={"inner_backend": recording(graphs, "eager")})
    trainer, metrics = run_sft(model, hf_tokenizer, train, evaluation, tmp_path / "chunkce")
    ref_trainer, ref_metrics = run_sft(reference, hf_tokenizer, train, evaluation, tmp_path / "eager")

    assert graphs and counters["chunkce"]["sites_found"] == 0  # compiled through chunkce, no site in any graph
    logged = ("loss", "entropy", "mean_token_accuracy", "grad_norm")
    history = [[h[k] for k in logged] for h in trainer.state.log_history[:STEPS]]
    ref_history = [[h[k] for k in logged] for h in ref_trainer.state.log_history[:STEPS]]
    torch.testing.assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-6)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5), key
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")

    # the same patched model called as the plain Trainer calls it: its own loss, rewritten by chunkce
    batch = torch.tensor([train[0]["input_ids"][:8]])
    report = compile_pass.explain(model, input_ids=batch, labels=batch)
    assert [r.decision for r in report.records] == ["rewritten"]


def test_example_runs_offline_and_its_runs_agree(tmp_path):
    """examples/train_hf_trainer.py with tiny flags: both chunkce runs (the Inductor one is the
    first test's reference), losses within --tol (exit 0), the no-options (lazy logits) run's peak
    the lower."""
    example = Path(__file__).resolve().parents[2] / "examples" / "train_hf_trainer.py"
    tiny = ["--runs", "chunkce", "chunkce-keep-logits", "--steps", "2", "--accumulation", "2",
            "--batch-size", "2", "--seq-len", "32", "--eval-rows", "4", "--max-bytes", "200000",
            "--vocab-size", "600", "--hidden-size", "32", "--chunk-size", "16", "--output-dir", str(tmp_path)]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "CHUNKCE_EAGER_KERNELS": "1"}
    proc = subprocess.run([sys.executable, str(example), *tiny], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("chunkce", "chunkce-keep-logits")}
    assert rows.keys() == {"chunkce", "chunkce-keep-logits"}
    peak = {name: float(row[1]) for name, row in rows.items()}  # MiB, measured by the script
    assert peak["chunkce"] < peak["chunkce-keep-logits"]
    assert "'logits_lazy': 2" in proc.stdout  # the training graph's logits and the evaluation graph's


def test_torch_compile_backend_chunkce_is_accepted_by_the_arguments_and_rejected_by_the_trainer(tmp_path):
    """What docs/trainers.md says of ``TrainingArguments(torch_compile_backend="chunkce")``:
    the arguments take it (and turn ``torch_compile`` on); ``Trainer(...)`` raises, when it
    builds accelerate's ``TorchDynamoPlugin``, whose backend is a closed enum."""
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="chunkce", report_to=[],
                             use_cpu=True)
    assert args.torch_compile and args.torch_compile_backend == "chunkce"
    with pytest.raises(ValueError, match="'CHUNKCE' is not a valid DynamoBackend"):
        Trainer(model=tiny_llama(64), args=args)
