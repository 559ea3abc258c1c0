"""Client code from the registry, imported and run unchanged, on the lazy logits of a model
compiled with chunkce (docs/reads.md#clients), against the same code on stock compile's logits:

- DPO as TRL computes it: ``CPOTrainer.get_batch_logps`` (TRL's ``selective_log_softmax`` with
  ``-100`` masking) of a forward without labels, the sigmoid loss, backward: stock's loss and every
  gradient, the logits never computed;
- ``Trainer.evaluate`` with ``preprocess_logits_for_metrics`` (argmax) and ``compute_metrics``:
  stock's metrics, a measured peak a fraction of stock's (no ``[N, V]``);
- TRL's ``GRPOTrainer``: two steps equal to the uncompiled run's (TRL computes the log-probs
  through its own fused LM head: nothing for chunkce to rewrite).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from lazy_reads import counting
from test_fused_steps import tiny_llama
from test_lazy_logits import assert_same_grads, compiled_pair
from test_trainers import RecordingTrainer, argmax_logits, padded_rows, token_accuracy
from test_trainers import tiny_llama as trainer_llama
from torch._dynamo.utils import counters
from transformers import TrainingArguments
from trl.experimental.cpo import CPOTrainer

import compile_pass
from compile_pass import LazyLogits
from compile_pass.memory import PeakMemory

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile", "eager_kernels")]

PAD = 0


def test_dpo_as_trl_computes_it_gets_stocks_loss_and_every_gradient_without_computing_the_logits():
    """Chosen and rejected rows concatenated (right padding, a prompt), a forward without labels;
    the labels masked in place as DPO code does, TRL's ``get_batch_logps`` on the returned logits
    for the policy and (under no_grad) the reference, the sigmoid DPO loss (TRL's
    ``-logsigmoid(beta * (chosen - rejected))``), backward."""
    compiled, stock, model, reference = compiled_pair(tiny_llama())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 2048, (4, 12), generator=gen)  # [chosen x 2, rejected x 2]
    for row, length in enumerate((12, 9, 10, 7)):
        ids[row, length:] = PAD
    mask, results = ids != PAD, []
    for step in (compiled, stock):
        labels = ids.clone()
        labels[labels == PAD] = -100
        labels[:, :3] = -100  # the prompt
        with counting() as calls:
            with torch.no_grad():
                reference_logps = CPOTrainer.get_batch_logps(step(input_ids=ids, attention_mask=mask).logits, labels)
            logits = step(input_ids=ids, attention_mask=mask).logits
            chosen, rejected = (CPOTrainer.get_batch_logps(logits, labels) - reference_logps).chunk(2)
            loss = -F.logsigmoid(0.1 * (chosen - rejected)).mean()
            loss.backward()
        results.append((loss.detach(), reference_logps, logits, calls))
    (loss, reference_logps, logits, calls), (expected_loss, expected_reference, _, _) = results
    assert type(logits) is LazyLogits and not logits.is_computed
    assert (calls.walks, calls.walk_backwards, calls.recipes) == (2, 1, 0)  # reference, policy; policy's backward
    torch.testing.assert_close((loss, reference_logps), (expected_loss, expected_reference))
    assert_same_grads(model, reference)


def metrics_of(prediction):
    """Next-token accuracy (of an untrained model: near 0) and the mean predicted token id."""
    return {**token_accuracy(prediction), "mean_predicted_id": float(prediction.predictions.mean())}


def test_trainer_evaluate_with_argmax_metrics_gets_stocks_metrics_at_a_fraction_of_its_peak(tmp_path):
    """The Trainer route (``model.compile(backend="chunkce")`` before ``Trainer``); stock the same model
    compiled with aot_eager. A warm ``evaluate()``: 4 x 32 tokens a batch, vocabulary 32768, so stock's
    ``[128, V]`` fp32 logits are 16 MiB a batch (and its loss's log-softmax as much); chunkce's loss (in
    the graph) and argmax (of the lazy logits) read the head through the ops: at most 0.35x stock's peak.

    The tile is the compile option ``chunk_bytes`` (1 MiB), which sizes the rewritten sites' tiles and
    the lazy logits' reads: at the default (7 MiB on CPU) the eager kernels' temporaries (a few tiles)
    would outweigh stock's 16 MiB logits at this size."""
    evaluation = padded_rows(torch.randint(0, 32768, (4096,), generator=torch.Generator().manual_seed(2)), 8, seed=3)
    model = trainer_llama(32768)
    reference = copy.deepcopy(model)
    model.compile(backend="chunkce", options={"inner_backend": "aot_eager", "chunk_bytes": 1 << 20})
    reference.compile(backend="aot_eager")
    peaks, metrics = {}, {}
    for name, module in (("chunkce", model), ("stock", reference)):
        args = TrainingArguments(output_dir=str(tmp_path / name), use_cpu=True, report_to=[], disable_tqdm=True,
                                 per_device_eval_batch_size=4, seed=0)
        trainer = RecordingTrainer(model=module, args=args, compute_metrics=metrics_of,
                                   preprocess_logits_for_metrics=argmax_logits)
        trainer.micro_batches, trainer.evaluation_logits_types = [], set()
        trainer.evaluate(evaluation)  # compiles
        with PeakMemory("cpu") as mem:
            metrics[name] = trainer.evaluate(evaluation)
        peaks[name] = mem.peak_bytes
        if name == "chunkce":
            assert trainer.evaluation_logits_types == {LazyLogits}
            assert counters["chunkce"]["logits_lazy"] == 1 and counters["chunkce"]["logits_kept"] == 0
    print(f"evaluate() peak MiB: chunkce {peaks['chunkce'] / 2**20:.1f}, stock {peaks['stock'] / 2**20:.1f}")
    assert metrics["chunkce"]["eval_loss"] == pytest.approx(metrics["stock"]["eval_loss"], rel=1e-5)
    for key in ("eval_accuracy", "eval_mean_predicted_id"):  # the argmax's tokens, read from the lazy logits
        assert metrics["chunkce"][key] == metrics["stock"][key], key
    assert peaks["stock"] >= 16 * 2**20, peaks
    assert peaks["chunkce"] <= 0.35 * peaks["stock"], peaks


def test_grpo_trainer_runs_two_steps_equal_to_the_uncompiled_run(tmp_path):
    """TRL 1.16's ``GRPOTrainer`` (generation by ``model.generate``, 4 completion tokens; a reward of
    the completion's length; gradient checkpointing off, which GRPOConfig turns on by default and under
    which Dynamo breaks the graph at the checkpointed layers) on a model compiled with chunkce, against
    the uncompiled model: the two steps' losses (near 0: the ratio is 1 and the advantages sum to 0),
    gradient norms, entropies and rewards, and the trained parameters, equal.

    What chunkce does there: nothing. TRL computes the per-token log-probs and entropies through
    its own fused LM head (``model(..., labels=labels, fused_lm_head=True)``, ``outputs.log_probs``):
    the model's forward is patched to a chunked head with no ``cross_entropy`` and no returned
    logits, so the compiled graphs have no site to rewrite and no vocabulary-sized logits to make
    lazy; generation's prefill and decode steps keep one position (``logits_to_keep=1``: ``[B, 1, V]``,
    computed, as stock). The run goes through chunkce (graphs compiled) and is stock's; the same
    model called with labels, as the plain Trainer calls it, is rewritten."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from test_trainers import recording
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    words = {w: i for i, w in enumerate(["<pad>", "<eos>", *(f"w{i}" for i in range(2046))])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                        padding_side="left")
    prompts = Dataset.from_dict({"prompt": [" ".join(f"w{j}" for j in range(i, i + 4)) for i in range(0, 32, 4)]})
    model = trainer_llama(len(words), pad_token_id=0, eos_token_id=1, bos_token_id=1)
    reference = copy.deepcopy(model)
    graphs = []
    model.compile(backend="chunkce", options={"inner_backend": recording(graphs, "aot_eager")})
    runs = []
    for module, name in ((model, "chunkce"), (reference, "uncompiled")):
        args = GRPOConfig(output_dir=str(tmp_path / name), use_cpu=True, report_to=[], disable_tqdm=True,
                          save_strategy="no", per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=4, max_steps=2, logging_steps=1, seed=0, bf16=False,
                          learning_rate=1e-2, gradient_checkpointing=False)
        trainer = GRPOTrainer(model=module, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              args=args, train_dataset=prompts, processing_class=tokenizer)
        trainer.train()
        runs.append([[h[k] for k in ("loss", "grad_norm", "entropy", "reward")] for h in trainer.state.log_history[:2]])
    assert graphs, "the model ran through chunkce"
    assert counters["chunkce"]["sites_found"] == 0 and counters["chunkce"]["logits_lazy"] == 0  # nothing rewritten
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])  # the same model called with labels (the plain Trainer's call): rewritten
    assert [r.decision for r in compile_pass.explain(model, input_ids=ids, labels=ids).records] == ["rewritten"]
