"""Every causal LM transformers registers, through the pass: the sweep of docs/models.md.

    python -m benchmarks.sweep_models                      # every architecture; print the table
    python -m benchmarks.sweep_models --only llama gpt2    # re-run a few, merged into the saved results
    python -m benchmarks.sweep_models --inductor-subset    # also Inductor vs Inductor on a few
    python -m benchmarks.sweep_models --write              # and rewrite the section of docs/models.md

The registry is the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
(model type -> class). Each architecture is built from its config class with tiny
sizes (:func:`tiny_config`: generic size overrides, the config's per-layer lists cut
to one layer of each kind, and :data:`OVERRIDES` for the few that need more; no
network, no weights, the model's own init), and one training step,
``model(input_ids=..., labels=...).loss.backward()``, is run three ways from the same
weights: eagerly (must work, or the architecture is ``not_built``), compiled by stock
``aot_eager``, and compiled by ``backend="chunkce"`` with ``aot_eager`` inside
(``drop_unused_logits``, so a rewritten graph holds no ``[N, V]`` node at all). One
outcome per architecture (:data:`OUTCOMES`); "rewritten" means the op's node is in the
graph the inner backend was given, no ``[N, V]`` node is, and the loss and every
parameter gradient equal stock's (``torch.testing.assert_close``, fp32).

Architectures run in worker subprocesses (one ``import transformers`` per worker, a
per-architecture timeout, a crashed or hung worker replaced), with
``CHUNKCE_EAGER_KERNELS=1`` for the aot_eager runs (the op's per-chunk math runs
eagerly: compiling it would dominate). Results are kept in
``benchmarks/results/sweep_models.json``; ``--only`` re-runs some and merges them in.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sweep_models.json"
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- sweep_models: begin -->", "<!-- sweep_models: end -->"

VOCAB_SIZE = 2053  # odd, a few thousand
BATCH, SEQ = 2, 16
TIMEOUT_S = 180
MAX_LAYERS = 4  # one layer of each kind a per-layer list names, at most this many

OUTCOMES = ("rewritten", "differs", "refused", "graph_break", "no_site", "error", "not_built")
INDUCTOR_SUBSET = ("llama", "gpt2", "qwen2_moe", "gemma2", "cohere")

# ---- tiny configs ---------------------------------------------------------------------------------

# Applied to every config (and sub-config) that has the field. Sizes: hidden 64, 4 heads of 16,
# 2 kv heads, 1 layer (more where per-layer lists hold several kinds), MoE 4 experts, top 2.
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "decoder_vocab_size": VOCAB_SIZE,
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 128, "num_hidden_layers": 1,
    "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 128, "n_ctx": 128, "n_inner": 128,
    "d_model": 64, "d_ff": 128, "ffn_dim": 128, "num_layers": 1, "n_layers": 1, "num_heads": 4, "n_heads": 4,
    "decoder_layers": 1, "encoder_layers": 1, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "embedding_size": 64, "kv_channels": 16,
    "num_kv_heads": 2, "attention_head_dim": 16, "ffn_hidden_size": 128,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "dense_intermediate_size": 128,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "first_k_dense_replace": 0, "decoder_sparse_step": 1, "num_dense_layers": 0,
    # multi-head latent attention, sparse indexers
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 8,
    # linear attention, state-space layers
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_d_state": 8, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_headdim": 16, "mamba_ngroups": 1, "n_mamba_heads": 8,
    "mamba_dt_rank": 8, "mamba_d_ssm": 128, "state_size": 8, "ssm_state_size": 8, "time_step_rank": 8,
    "rotary_dim": 8, "hidden_size_global": 64, "lru_width": 64,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "vocab_size_per_layer_input": VOCAB_SIZE, "hidden_size_per_layer_input": 16,
}
NO_NOISE = re.compile(r"dropout|pdrop|drop_prob|layerdrop|jitter")  # float fields set to 0.0
TOKEN_ID = re.compile(r"token_id$|token_index$|_token_ids?$")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")

# Per model type: fields the generic sizes get wrong (merged over them; a dict value for a
# sub-config name is merged into that sub-config's overrides).
_MAMBA_HYBRID = {"num_hidden_layers": 2, "use_mamba_kernels": False}
_QWEN4_EXP_TEXT = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                   "indexer_compress_ratio": 2, "hc_lowrank": 16, "ple_embed_dim": 64,
                   "ngram_vocab_size_base": 1000, "split_ngram_parts": 4}
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},
    "blt": {"use_cache": False, "encoder_hash_byte_group_vocab": 1000,
            "encoder_config": {"hidden_size_global": 64}, "decoder_config": {"hidden_size_global": 64}},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},  # clip None: clamp() fails
             "ffn_config": {"ffn_hidden_size": 128, "moe_top_k": 2}},
    "dory": {"num_hidden_layers": 3, "layer_types": None, "n_input_layers": 1, "n_recurrent_layers": 1,
             "n_output_layers": 1, "n_recurrent_loops": 1},
    "dots3_note": {"vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64},
                   "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64}},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "git": {"vision_config": {"image_size": 32, "patch_size": 16}},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    "inkling2_loop_text": {"vocab_size": 2112, "unpadded_vocab_size": VOCAB_SIZE},  # padded to 64s, as shipped
    "inkling2_text": {"vocab_size": 2112, "unpadded_vocab_size": VOCAB_SIZE},
    "inkling_text": {"vocab_size": 2112, "unpadded_vocab_size": VOCAB_SIZE},
    "jamba": {**_MAMBA_HYBRID, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "recurrent_gemma": {"num_hidden_layers": 2, "block_types": ["recurrent", "attention"], "lru_width": 64,
                        "attention_window_size": 16},
    "reformer": {"is_decoder": True, "attn_layers": ["local"], "num_hidden_layers": 1, "attention_head_size": 16,
                 "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32], "local_attn_chunk_length": 8,
                 "lsh_attn_chunk_length": 8, "feed_forward_size": 128, "max_position_embeddings": 16},
    "rwkv": {"num_hidden_layers": 2, "attention_hidden_size": 64, "context_length": 128},
    "xlstm": {"embedding_dim": 64, "qk_dim_factor": 1.0, "num_blocks": 1, "chunk_size": 16, "use_cache": False},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 128, "attention_head_dim": 32, "n_mamba_heads": 2, "use_mamba_kernels": False},
    "zaya": {"num_experts_per_tok": 1},
}


def _per_layer_lists(defaults: dict[str, Any]) -> tuple[str | None, list[str]]:
    count_key = next((k for k in LAYER_COUNT_KEYS if isinstance(defaults.get(k), int)), None)
    if count_key is None:
        return None, []
    n = defaults[count_key]
    return count_key, [k for k, v in defaults.items() if isinstance(v, list) and len(v) == n and n > 1]


def tiny_overrides(config) -> dict[str, Any]:
    """The constructor arguments that make ``config``'s class tiny (only the changed fields,
    so the class derives the rest), recursively for its sub-configs (as dicts)."""
    import transformers

    defaults = config.to_dict()
    kwargs: dict[str, Any] = {k: v for k, v in SIZES.items() if k in defaults}
    if "num_key_value_heads" in kwargs and defaults["num_key_value_heads"] == defaults.get("num_attention_heads"):
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]  # multi-head stays multi-head
    if "qk_rope_head_dim" in defaults and defaults.get("head_dim") == defaults["qk_rope_head_dim"]:
        kwargs["head_dim"] = SIZES["qk_rope_head_dim"]  # latent attention: head_dim is the rope part
    for key, value in defaults.items():
        if isinstance(value, float) and NO_NOISE.search(key):
            kwargs[key] = 0.0
    count_key, lists = _per_layer_lists(defaults)
    if lists:  # one layer of each kind (the first of each distinct combination), in order
        kinds = list(zip(*(defaults[k] for k in lists)))
        keep = [kinds.index(kind) for kind in dict.fromkeys(kinds)][:MAX_LAYERS]
        kwargs[count_key] = len(keep)
        kwargs.update({k: [SIZES[k] if k in SIZES else defaults[k][i] for i in keep] for k in lists})
    free = iter(range(VOCAB_SIZE - 1, 0, -1))  # special ids past the vocabulary: the top ids
    for key, value in defaults.items():
        if TOKEN_ID.search(key):
            if isinstance(value, int) and value >= VOCAB_SIZE:
                kwargs[key] = next(free)
            elif isinstance(value, list) and any(isinstance(v, int) and v >= VOCAB_SIZE for v in value):
                kwargs[key] = [next(free) if isinstance(v, int) and v >= VOCAB_SIZE else v for v in value]
    for name, sub in vars(config).items():
        if isinstance(sub, transformers.PreTrainedConfig):
            kwargs[name] = {"model_type": sub.model_type, **tiny_overrides(sub)} if sub.model_type else \
                tiny_overrides(sub)
    return kwargs


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key),
                                                                                           dict) else value
    return merged


def tiny_config(model_type: str):
    """The tiny config of ``model_type``: its config class with :func:`tiny_overrides` and
    :data:`OVERRIDES`. Raises whatever the config class raises for them."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    extra = OVERRIDES.get(model_type, {})
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001 - a class whose defaults do not validate: with the overrides
        defaults = config_class(**extra)
    kwargs = _merge(tiny_overrides(defaults), extra)
    return config_class(**kwargs)


# After construction: what a model needs before its first forward.
PREPARE = {"xmod": lambda model: model.set_default_language("en_XX")}


def build_model(model_type: str):
    """The tiny model of ``model_type`` in training mode (seed 0, the class's own init).

    Where the registry's class takes one part of a composite config (``Emu3ForCausalLM``
    takes an ``Emu3TextConfig``), it gets that part. Raises whatever the class raises."""
    import torch
    import transformers

    model_class = getattr(transformers, causal_lm_architectures()[model_type])
    config = tiny_config(model_type)
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        config = next((sub for sub in vars(config).values() if isinstance(sub, wanted)), config)
    torch.manual_seed(0)
    model = model_class(config).train()
    if model_type in PREPARE:
        PREPARE[model_type](model)
    return model


def causal_lm_architectures() -> dict[str, str]:
    """The installed transformers' causal-LM registry: model type -> model class name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ---- one architecture -----------------------------------------------------------------------------


@dataclass
class Step:
    loss: Any
    grads: dict[str, Any]


def make_batch(vocab: int, seed: int = 0):
    """``input_ids, labels`` of ``[BATCH, SEQ]``, ids in ``[3, vocab - 64)`` (clear of the
    special ids :func:`tiny_overrides` moved to the top), a masked prompt (-100) in row 0."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab - 64, (BATCH, SEQ), generator=gen)
    labels = input_ids.clone()
    labels[0, :3] = -100
    return input_ids, labels


def _codebook_batch(model, vocab: int) -> dict[str, Any]:
    """Musicgen's decoder: ``input_ids [BATCH * num_codebooks, SEQ]``, ``labels [BATCH, SEQ, num_codebooks]``."""
    codebooks = model.config.num_codebooks
    input_ids, labels = make_batch(vocab)
    input_ids = input_ids.repeat_interleave(codebooks, 0)
    return {"input_ids": input_ids, "labels": input_ids.view(BATCH, codebooks, SEQ).transpose(1, 2).contiguous()}


def _with_pixels(model, vocab: int) -> dict[str, Any]:
    """GIT's loss skips the image tokens' logits: it needs ``pixel_values`` beside the text."""
    import torch

    vision = model.config.vision_config
    input_ids, labels = make_batch(vocab)
    pixels = torch.randn(BATCH, vision.num_channels, vision.image_size, vision.image_size,
                         generator=torch.Generator().manual_seed(1))
    return {"input_ids": input_ids, "labels": labels, "pixel_values": pixels}


# Model types whose training step takes other inputs than ``input_ids, labels [BATCH, SEQ]``.
BATCHES = {"musicgen": _codebook_batch, "musicgen_melody": _codebook_batch, "git": _with_pixels}


def batch_for(model_type: str, model, vocab: int) -> dict[str, Any]:
    if model_type in BATCHES:
        return BATCHES[model_type](model, vocab)
    input_ids, labels = make_batch(vocab)
    return {"input_ids": input_ids, "labels": labels}


def train_step(model, batch: dict[str, Any]) -> Step:
    import torch

    torch.manual_seed(0)
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss for labels=")
    loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad for name, p in model.named_parameters() if p.grad is not None}
    return Step(loss.detach(), grads)


def _exception(error: BaseException) -> str:
    text = " ".join(str(error).split())  # a validation error's cause is on its second line
    return f"{type(error).__name__}: {text[:300]}".rstrip(": ")


def _max_abs_diff(got: Step, expected: Step) -> float:
    diffs = [(got.loss - expected.loss).abs().max().item()]
    diffs += [(got.grads[n] - expected.grads[n]).abs().max().item() for n in expected.grads if n in got.grads]
    return max(diffs)


def _fp64_error(step: Step, truth: Step) -> float:
    """Max abs difference of the loss and every gradient from the float64 run's."""
    errors = [(step.loss.double() - truth.loss).abs().item()]
    errors += [(step.grads[n].double() - truth.grads[n]).abs().max().item() for n in truth.grads if n in step.grads]
    return max(errors)


def _compare(got: Step, expected: Step) -> str:
    """'' when loss and every gradient are close (torch's fp32 tolerances), else what differs."""
    import torch

    if got.grads.keys() != expected.grads.keys():
        return f"gradients of different parameters: {sorted(got.grads.keys() ^ expected.grads.keys())[:5]}"
    try:
        torch.testing.assert_close(got.loss, expected.loss, msg=lambda m: f"loss: {m}")
        for name in expected.grads:
            torch.testing.assert_close(got.grads[name], expected.grads[name],
                                       msg=lambda m, name=name: f"{name}.grad: {m}")
    except AssertionError as error:
        return " ".join(str(error).split())[:400]
    return ""


LOSS_OPS = re.compile(r"nll_loss|log_softmax|logsumexp|cross_entropy|CrossEntropyLoss")


class GraphRecorder:
    """An inner backend: notes what each graph holds (op nodes, ``[N, V]`` nodes, loss-like
    calls) and the pass's report for it, then compiles it with ``inner``."""

    def __init__(self, inner: str, tokens: int, vocab: int) -> None:
        import compile_pass

        self.inner, self.tokens, self.vocab = inner, tokens, vocab
        self.graphs = 0
        self.op_nodes = 0
        self.logits_nodes: list[str] = []
        self.loss_calls: list[str] = []
        self.reports: list[Any] = []
        self._seen = compile_pass.last_report()

    def __call__(self, gm, example_inputs):
        import torch
        from torch._dynamo.backends.registry import lookup_backend
        from torch.fx import GraphModule

        import compile_pass

        self.graphs += 1
        report = compile_pass.last_report()  # the pass ran on this graph just before
        if report is not None and report is not self._seen and all(report is not r for r in self.reports):
            self.reports.append(report)
        op = torch.ops.chunkce.linear_cross_entropy.default
        for module in gm.modules():
            if not isinstance(module, GraphModule):
                continue
            for node in module.graph.nodes:
                self.op_nodes += node.target is op
                target = str(getattr(node.target, "__name__", node.target))
                if node.op in ("call_function", "call_method", "call_module") and LOSS_OPS.search(target):
                    self.loss_calls.append(target)
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor) and self._is_logits(value):
                    self.logits_nodes.append(f"{node.name} {tuple(value.shape)}")
        return lookup_backend(self.inner)(gm, example_inputs)

    def _is_logits(self, value) -> bool:
        from compile_pass.graph.nodes import size_hint

        shape = [size_hint(s) for s in value.shape]
        if not shape or shape[-1] != self.vocab:
            return False
        if any(size_hint(st) == 0 and size > 1 for st, size in zip(value.stride(), shape)):
            return False  # a broadcast stand-in (dropped logits): no memory
        numel = 1
        for size in shape:
            numel *= size
        return numel >= BATCH * (SEQ - 1) * self.vocab  # the logits or their shifted part


def run_architecture(model_type: str, inner: str = "aot_eager", progress=lambda stage: None) -> dict[str, Any]:
    """One training step of ``model_type``'s tiny model: eager, stock ``inner`` and chunkce
    (``inner`` inside); returns the result row (``outcome`` one of :data:`OUTCOMES`, with the
    fields that explain it). Never raises for a model's failure: that is the row."""
    import torch
    import transformers
    from torch._dynamo.utils import counters

    started = time.perf_counter()
    model_class = causal_lm_architectures()[model_type]
    row: dict[str, Any] = {"model_type": model_type, "model_class": model_class, "inner": inner}

    def done(outcome: str, **fields: Any) -> dict[str, Any]:
        row.update(outcome=outcome, seconds=round(time.perf_counter() - started, 1), **fields)
        return row

    torch._dynamo.reset()
    counters.clear()
    progress("build")
    try:
        model = build_model(model_type)
    except Exception as error:  # noqa: BLE001 - the row says why
        return done("not_built", detail=f"build: {_exception(error)}")
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None and hasattr(head, "weight") else VOCAB_SIZE
    row["parameters"] = sum(p.numel() for p in model.parameters())
    batch = batch_for(model_type, model, min(vocab, VOCAB_SIZE))
    stock_model, chunkce_model = copy.deepcopy(model), copy.deepcopy(model)
    progress("eager step")
    try:
        eager = train_step(model, batch)
    except Exception as error:  # noqa: BLE001
        return done("not_built", detail=f"eager step: {_exception(error)}")

    progress(f"stock {inner}")
    stock_recorder = GraphRecorder(inner, BATCH * SEQ, vocab)
    try:
        stock = train_step(torch.compile(stock_model, backend=stock_recorder), batch)
        stock_error = ""
    except Exception as error:  # noqa: BLE001
        stock, stock_error = None, _exception(error)
    stock_breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    counters.clear()

    progress(f"chunkce ({inner} inside)")
    recorder = GraphRecorder(inner, BATCH * SEQ, vocab)
    options = {"inner_backend": recorder, "drop_unused_logits": True}
    try:
        got = train_step(torch.compile(chunkce_model, backend="chunkce", options=options), batch)
    except Exception as error:  # noqa: BLE001
        if stock_error:
            return done("error", stock_fails=True, detail=f"stock {inner}: {stock_error}; chunkce: "
                                                          f"{_exception(error)}")
        return done("error", stock_fails=False, detail=f"only chunkce fails: {_exception(error)}",
                    traceback=traceback.format_exc()[-3000:])
    if stock_error:
        return done("error", stock_fails=True, detail=f"only stock {inner} fails: {stock_error}")
    stats = dict(counters["chunkce"])
    breaks = [f"{reason} (x{n})" for reason, n in counters["graph_break"].items()]
    records = [record for report in recorder.reports for record in report.records]
    row.update(sites=len(records), graph_breaks=breaks, stock_graph_breaks=stock_breaks,
               eager_vs_stock=_max_abs_diff(stock, eager), max_abs_diff=_max_abs_diff(got, stock))
    rewritten = [r for r in records if r.decision == "rewritten"]
    refused = [r for r in records if r.decision != "rewritten"]
    mismatch = _compare(got, stock)
    if (len(rewritten), len(refused)) != (stats.get("sites_rewritten", 0), stats.get("sites_refused", 0)):
        return done("differs", detail=f"the reports ({len(rewritten)} rewritten, {len(refused)} refused) "
                                      f"disagree with counters {stats}")
    if mismatch:  # summation order inside the op can be amplified by the model: measure against float64
        progress("float64 eager step")
        truth = train_step(build_model(model_type).double(),
                           {k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
        chunkce_error, stock_error64 = _fp64_error(got, truth), _fp64_error(stock, truth)
        row.update(fp64_error={"chunkce": chunkce_error, "stock": stock_error64})
        if chunkce_error > 2 * stock_error64 + 1e-7:
            return done("differs", detail=f"not equal to stock {inner} and farther from the float64 run "
                                          f"({chunkce_error:.1e} vs stock's {stock_error64:.1e}): {mismatch}",
                        reason_key=",".join(sorted({r.reason_key for r in refused})))
        row["note"] = (f"not within assert_close of stock (max diff {row['max_abs_diff']:.1e}) but as close to "
                       f"the float64 run as stock ({chunkce_error:.1e} vs {stock_error64:.1e})")
    if refused:
        keys = sorted({r.reason_key for r in refused})
        outcome = "graph_break" if "graph_break" in keys else "refused"
        if recorder.op_nodes != len(rewritten):
            return done("differs", detail=f"{recorder.op_nodes} op node(s) for {len(rewritten)} rewritten site(s)")
        return done(outcome, reason_key=",".join(keys), reason=" | ".join(dict.fromkeys(r.reason for r in refused)),
                    fix=" | ".join(dict.fromkeys(r.fix for r in refused if r.fix)),
                    rewritten_sites=len(rewritten))
    if not records:
        calls = sorted(set(recorder.loss_calls))
        return done("no_site", detail=f"loss-like calls in the graph: {', '.join(calls) or 'none'}")
    if recorder.op_nodes != len(rewritten):
        return done("differs", detail=f"{recorder.op_nodes} op node(s) in the graph for {len(rewritten)} "
                                      f"rewritten site(s)")
    if stats.get("logits_dropped", 0) == len(rewritten) and len(recorder.logits_nodes) >= len(
            stock_recorder.logits_nodes):  # other [N, V] tensors (e.g. BLT's patcher logits) may remain
        return done("differs", detail=f"as many [N, V] nodes as stock's after the rewrite: {recorder.logits_nodes[:3]}")
    if recorder.logits_nodes:
        row["other_logits_nodes"] = recorder.logits_nodes[:4]
    logits = "dropped" if stats.get("logits_dropped", 0) == len(rewritten) else "kept"
    return done("rewritten", logits=logits,
                reason=" | ".join(dict.fromkeys(r.reason for r in rewritten if r.reason)))


# ---- workers --------------------------------------------------------------------------------------


def _worker(conn, inner: str, log_path: str) -> None:
    """A worker process: runs the architectures it is sent, one at a time, and sends back
    ``("stage", name)`` before each stage and ``("row", row)`` at the end."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if inner == "aot_eager":
        os.environ["CHUNKCE_EAGER_KERNELS"] = "1"
    import warnings

    warnings.filterwarnings("ignore")
    import transformers  # noqa: F401 - paid once per worker

    import compile_pass  # noqa: F401

    while True:
        model_type = conn.recv()
        if model_type is None:
            return
        print(f"==== {model_type} ({inner})", flush=True)
        conn.send(("row", run_architecture(model_type, inner, progress=lambda s: conn.send(("stage", s)))))


class Worker:
    def __init__(self, inner: str, log_path: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, inner, log_path), daemon=True)
        self.process.start()
        self.model_type: str | None = None
        self.stage, self.since = "", 0.0

    def send(self, model_type: str) -> None:
        self.model_type, self.stage = model_type, "start"
        self.started = self.since = time.perf_counter()
        self.conn.send(model_type)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def run_all(model_types: list[str], inner: str, workers: int, timeout_s: float, log_path: str,
            echo=print, on_row=lambda row: None) -> dict[str, dict[str, Any]]:
    """Every model type through :func:`run_architecture` in ``workers`` subprocesses; a worker
    that crashes, or spends over ``timeout_s`` in one stage (build, eager, stock, chunkce) of an
    architecture, is replaced (that row: ``error``, stock's fault if it was in stock's stage)."""
    from multiprocessing.connection import wait

    queue, rows = list(model_types), {}
    pool = [Worker(inner, log_path) for _ in range(min(workers, len(queue)))]
    for worker in pool:
        worker.send(queue.pop(0))
    while any(w.model_type for w in pool):
        busy = [w for w in pool if w.model_type]
        ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=5)
        for i, worker in enumerate(pool):
            if not worker.model_type:
                continue
            failed = None
            try:
                while worker.conn in ready and worker.conn.poll():
                    kind, value = worker.conn.recv()
                    if kind == "stage":  # the timeout is per stage: stock and chunkce each get it
                        worker.stage, worker.since = value, time.perf_counter()
                    else:
                        rows[worker.model_type] = value
                        on_row(value)
                        echo(f"{worker.model_type:28s} {value['outcome']:11s} {value.get('reason_key') or ''} "
                             f"{value.get('detail', '')[:110]} ({value['seconds']} s)")
                        worker.model_type = None
                        break
            except (EOFError, OSError):
                pass
            if worker.model_type is None:
                if queue:
                    worker.send(queue.pop(0))
                continue
            if not worker.process.is_alive():
                failed = f"worker died (exit code {worker.process.exitcode}) in stage '{worker.stage}'"
            elif time.perf_counter() - worker.since > timeout_s:
                failed = f"timed out: over {timeout_s:.0f} s in stage '{worker.stage}'"
            if failed:
                stock_fails = worker.stage.startswith("stock") or None
                rows[worker.model_type] = {"model_type": worker.model_type, "inner": inner, "outcome": "error",
                                           "model_class": causal_lm_architectures()[worker.model_type],
                                           "detail": failed, "stock_fails": bool(stock_fails),
                                           "seconds": round(time.perf_counter() - worker.started, 1)}
                echo(f"{worker.model_type:28s} error       {failed}")
                on_row(rows[worker.model_type])
                worker.stop()
                pool[i] = Worker(inner, log_path)
                if queue:
                    pool[i].send(queue.pop(0))
    for worker in pool:
        worker.conn.send(None)
        worker.process.join(timeout=10)
        worker.stop()
    return rows


# ---- results and the table ------------------------------------------------------------------------


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    """The saved results: ``{"meta": {...}, "aot_eager": {model_type: row}, "inductor": {...}}``."""
    if path.exists():
        return json.loads(path.read_text())
    return {"meta": {}, "aot_eager": {}, "inductor": {}}


def _cell(text: Any, width: int = 160) -> str:
    text = " ".join(str(text or "").split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


def _what(row: dict[str, Any]) -> str:
    """The row's explanation column: why, where, how much."""
    outcome = row["outcome"]
    if outcome == "rewritten":
        logits = {"dropped": "logits dropped", "kept": "logits KEPT (computed although drop_unused_logits is on)"}
        notes = [f"max abs diff {row['max_abs_diff']:.1e}", logits.get(row.get("logits"), "logits ?")]
        if row.get("note"):
            notes.append(row["note"])
        if row.get("other_logits_nodes"):
            notes.append(f"other [N, V] nodes left: {len(row['other_logits_nodes'])}")
        if row.get("sites", 1) > 1:
            notes.append(f"{row['sites']} sites")
        if row.get("graph_breaks"):
            notes.append(f"{len(row['graph_breaks'])} graph break(s) elsewhere")
        return "; ".join(notes)
    if outcome in ("refused", "graph_break"):
        text = row.get("reason", "")
        if row.get("rewritten_sites"):
            text += f" ({row['rewritten_sites']} other site(s) rewritten)"
        if outcome == "graph_break" and row.get("graph_breaks"):
            text += f"; Dynamo: {row['graph_breaks'][0]}"
        return text
    if outcome == "error":
        return ("stock compile fails too: " if row.get("stock_fails") else "ONLY CHUNKCE FAILS: ") + row["detail"]
    return row.get("detail", "")


PENDING = "pending"  # in the registry, not in the results yet (an interrupted sweep: --resume)


def with_pending(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``rows`` plus a ``pending`` row for every registered architecture that has none."""
    pending = {model_type: {"model_type": model_type, "model_class": model_class, "outcome": PENDING,
                            "detail": "not run yet: python -m benchmarks.sweep_models --resume"}
               for model_type, model_class in causal_lm_architectures().items() if model_type not in rows}
    return {**rows, **pending}


def totals(rows: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Count of rows per outcome, and per refusal key (``refused:<key>``)."""
    counts: dict[str, int] = {outcome: 0 for outcome in (*OUTCOMES, PENDING)}
    for row in rows.values():
        counts[row["outcome"]] += 1
        if row["outcome"] == "refused":
            counts[f"refused:{row['reason_key']}"] = counts.get(f"refused:{row['reason_key']}", 0) + 1
    return counts


def totals_line(rows: dict[str, dict[str, Any]]) -> str:
    counts = totals(rows)
    built = len(rows) - counts["not_built"] - counts[PENDING]
    keys = ", ".join(f"`{k.split(':', 1)[1]}` {n}" for k, n in sorted(counts.items()) if k.startswith("refused:"))
    errors = [r for r in rows.values() if r["outcome"] == "error"]
    stock = sum(bool(r.get("stock_fails")) for r in errors)
    return (f"**Totals**: {len(rows)} architectures, {built} built; rewritten {counts['rewritten']}, "
            f"differs {counts['differs']}, refused {counts['refused']} ({keys or 'none'}), "
            f"graph break {counts['graph_break']}, no site {counts['no_site']}, error {counts['error']} "
            f"(stock compile fails too: {stock}, only chunkce: {len(errors) - stock}), "
            f"not built {counts['not_built']}" + (f", PENDING {counts[PENDING]} (not run yet)." if counts[PENDING]
                                                 else "."))


def _table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| model type | class | outcome | reason key | what |", "| --- | --- | --- | --- | --- |"]
    for model_type in sorted(rows):
        row = rows[model_type]
        key = f"`{row['reason_key']}`" if row.get("reason_key") else "-"
        lines.append(f"| {model_type} | `{row['model_class']}` | {row['outcome']} | {key} | {_cell(_what(row))} |")
    return lines


def _minutes(seconds: float | None) -> str:
    return f"{seconds / 60:.0f} min" if seconds else "not measured"


def render(results: dict[str, Any]) -> str:
    """The generated part of docs/models.md, from the saved results alone (no model is run)."""
    meta, rows = results["meta"], with_pending(results["aot_eager"])
    lines = [
        BEGIN,
        f"Generated by `python -m benchmarks.sweep_models --write` (torch {meta.get('torch')}, transformers "
        f"{meta.get('transformers')}; {meta.get('cpus')} CPU cores, {meta.get('workers')} worker(s); full sweep "
        f"wall time {_minutes(meta.get('wall_s'))}). Tiny configs: hidden 64, 4 heads of 16 / 2 kv heads, "
        f"1 layer (one per layer kind of hybrids), vocab {VOCAB_SIZE}, MoE 4 experts top 2, fp32, batch "
        f"{BATCH} x {SEQ} tokens; chunkce with `aot_eager` inside and `drop_unused_logits` vs stock "
        f"`aot_eager`, `CHUNKCE_EAGER_KERNELS=1`.",
        "",
        totals_line(rows),
        "",
        *_table(rows),
        "",
    ]
    inductor = results.get("inductor") or {}
    if inductor:
        lines += ["Inductor inside chunkce vs stock Inductor (`--inductor-subset`, the op's kernels compiled):", "",
                  *_table(inductor), ""]
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="re-run these; merge into the results")
    parser.add_argument("--inductor-subset", action="store_true",
                        help=f"also Inductor vs Inductor on {', '.join(INDUCTOR_SUBSET)} (or on --only's)")
    parser.add_argument("--skip-aot-eager", action="store_true", help="with --inductor-subset: only that")
    parser.add_argument("--resume", action="store_true",
                        help="skip the architectures an interrupted run already finished (its .partial.jsonl)")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: merge an interrupted run's finished rows into the results")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per architecture")
    parser.add_argument("--write", action="store_true", help=f"rewrite the generated part of {DOC.name}")
    parser.add_argument("--render", action="store_true", help="only regenerate the table from the results")
    args = parser.parse_args(argv)

    import torch
    import transformers

    registry = causal_lm_architectures()
    unknown = sorted(set(args.only or ()) - set(registry))
    if unknown:
        parser.error(f"not causal-LM model types of transformers {transformers.__version__}: {unknown}")
    results = load_results()
    partial = RESULTS.with_suffix(".partial.jsonl")
    if args.collect and partial.exists():
        rows = map(json.loads, partial.read_text().splitlines())
        results["aot_eager"].update({row["model_type"]: row for row in rows})
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    elif not args.render:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        log_path = str(RESULTS.with_suffix(".log"))
        if not args.resume:
            Path(log_path).write_text("")
        print(f"worker output: {log_path}")
        if not args.skip_aot_eager:
            model_types = args.only or list(registry)
            started = time.perf_counter()
            done_before = {}
            if args.resume and partial.exists():  # rows an interrupted run finished
                done_before = {row["model_type"]: row for row in map(json.loads, partial.read_text().splitlines())}
                started -= sum(row["seconds"] for row in done_before.values()) / args.workers
                model_types = [m for m in model_types if m not in done_before]
            else:
                partial.write_text("")

            def keep(row: dict[str, Any]) -> None:  # a crash of this process loses nothing finished
                with partial.open("a") as f:
                    f.write(json.dumps(row) + "\n")

            rows = run_all(model_types, "aot_eager", args.workers, args.timeout, log_path, on_row=keep)
            results["aot_eager"].update({**done_before, **rows})
            results["meta"]["workers"] = args.workers
            if not args.only:
                results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
        if args.inductor_subset:
            subset = [m for m in (args.only or INDUCTOR_SUBSET)]
            results["inductor"].update(run_all(subset, "inductor", args.workers, args.timeout * 2, log_path))
        results["aot_eager"] = {k: v for k, v in sorted(results["aot_eager"].items()) if k in registry}
        results["meta"].update(torch=torch.__version__, transformers=transformers.__version__,
                               cpus=os.cpu_count())
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    text = render(results)
    if args.write:
        doc = DOC.read_text()
        if BEGIN in doc:
            start, end = doc.index(BEGIN), doc.index(END) + len(END)
            DOC.write_text(doc[:start] + text + doc[end:])
        else:
            DOC.write_text(doc.rstrip("\n") + "\n\n## Every causal LM in transformers\n\n" + text + "\n")
    else:
        print(text)
    bad = [r for r in results["aot_eager"].values() if r["outcome"] == "differs"
           or (r["outcome"] == "error" and not r.get("stock_fails"))]
    for row in bad:
        print(f"BUG {row['model_type']}: {row['outcome']}: {_what(row)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
