"""Tiny models of every causal LM transformers registers, and their training batches.

    model = build_model("llama")                       # tiny, seed 0, training mode
    model = build_model("cohere", {"logit_scale": 0.25})   # fields set on its config
    batch = batch_for("llama", model, VOCAB_SIZE)      # input_ids, labels [BATCH, SEQ]

The registry is the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
(:func:`causal_lm_architectures`). Each model is built from its config class with
tiny sizes (:func:`tiny_config`: generic size overrides, the config's per-layer lists
cut to one layer of each kind, and :data:`OVERRIDES` for the few that need more; no
network, no weights, the model's own init). Used by ``sweep_models`` (every
architecture) and ``coverage_table`` (the documented dozen).
"""

from __future__ import annotations

import re
from typing import Any

VOCAB_SIZE = 2053  # odd, a few thousand
BATCH, SEQ = 2, 16
MAX_LAYERS = 4  # one layer of each kind a per-layer list names, at most this many

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


def tiny_overrides(config, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The constructor arguments that make ``config``'s class tiny (only the changed fields,
    so the class derives the rest), recursively for its sub-configs (as dicts); ``sizes``
    (default :data:`SIZES`): the generic fields."""
    import transformers

    sizes = SIZES if sizes is None else sizes
    defaults = config.to_dict()
    kwargs: dict[str, Any] = {k: v for k, v in sizes.items() if k in defaults}
    if "num_key_value_heads" in kwargs and defaults["num_key_value_heads"] == defaults.get("num_attention_heads"):
        kwargs["num_key_value_heads"] = sizes["num_attention_heads"]  # multi-head stays multi-head
    if "qk_rope_head_dim" in defaults and defaults.get("head_dim") == defaults["qk_rope_head_dim"]:
        kwargs["head_dim"] = sizes["qk_rope_head_dim"]  # latent attention: head_dim is the rope part
    for key, value in defaults.items():
        if isinstance(value, float) and NO_NOISE.search(key):
            kwargs[key] = 0.0
    count_key, lists = _per_layer_lists(defaults)
    if lists:  # one layer of each kind (the first of each distinct combination), in order
        kinds = [tuple(map(repr, kind)) for kind in zip(*(defaults[k] for k in lists))]  # lists of lists too
        keep = [kinds.index(kind) for kind in dict.fromkeys(kinds)][:MAX_LAYERS]
        kwargs[count_key] = len(keep)
        kwargs.update({k: [sizes[k] if k in sizes else defaults[k][i] for i in keep] for k in lists})
    free = iter(range(VOCAB_SIZE - 1, 0, -1))  # special ids past the vocabulary: the top ids
    for key, value in defaults.items():
        if TOKEN_ID.search(key):
            if isinstance(value, int) and value >= VOCAB_SIZE:
                kwargs[key] = next(free)
            elif isinstance(value, list) and any(isinstance(v, int) and v >= VOCAB_SIZE for v in value):
                kwargs[key] = [next(free) if isinstance(v, int) and v >= VOCAB_SIZE else v for v in value]
    for name, sub in vars(config).items():
        if isinstance(sub, transformers.PreTrainedConfig):
            kwargs[name] = {"model_type": sub.model_type, **tiny_overrides(sub, sizes)} if sub.model_type else \
                tiny_overrides(sub, sizes)
    return kwargs


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key),
                                                                                           dict) else value
    return merged


def tiny_config(model_type: str, fields: dict[str, Any] | None = None, sizes: dict[str, Any] | None = None):
    """The tiny config of ``model_type``: its config class with :func:`tiny_overrides` (of
    ``sizes``), :data:`OVERRIDES` and then ``fields`` (e.g. ``{"logit_scale": 0.25}``). Raises
    whatever the config class raises for them."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    extra = _merge(OVERRIDES.get(model_type, {}), fields or {})
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001 - a class whose defaults do not validate: with the overrides
        defaults = config_class(**extra)
    kwargs = _merge(tiny_overrides(defaults, sizes), extra)
    return config_class(**kwargs)


# After construction: what a model needs before its first forward.
PREPARE = {"xmod": lambda model: model.set_default_language("en_XX")}


def build_model(model_type: str, fields: dict[str, Any] | None = None, model_class: str | None = None,
                sizes: dict[str, Any] | None = None):
    """The tiny model of ``model_type`` in training mode (seed 0, the class's own init),
    ``fields`` set on its config (:func:`tiny_config`); its class from the causal-LM registry,
    or the transformers class named ``model_class``.

    Where the registry's class takes one part of a composite config (``Emu3ForCausalLM``
    takes an ``Emu3TextConfig``), it gets that part. Raises whatever the class raises."""
    import torch
    import transformers

    model_class = getattr(transformers, model_class or causal_lm_architectures()[model_type])
    config = tiny_config(model_type, fields, sizes)
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
