"""Tiny models of transformers' other vocabulary heads, and their training batches.

    model = build("seq2seq", "bart")                 # tiny BartForConditionalGeneration, training mode
    batch = batch_for("seq2seq", "bart", model)      # input_ids, labels (the model shifts them in)

Families (:data:`FAMILIES`): each the installed transformers' registry of one auto class.
The configs are the causal sweep's (:func:`benchmarks.tiny_models.tiny_config`) with
:data:`SIZES` for vision and audio towers and :data:`OVERRIDES` per model type.
Batches (:func:`batch_for`): seq2seq ``input_ids`` and ``labels`` (``decoder_input_ids`` where
the config has no start token); masked LM ``input_ids`` with every fourth token masked and
``labels`` -100 elsewhere; vision-language ``pixel_values`` (and the grid / size inputs the
class takes) with as many image tokens in ``input_ids`` as the vision tower yields
(:mod:`benchmarks.tiny_media`, :mod:`benchmarks.tiny_placeholders`); speech ``input_features`` / ``input_values``.
"""

from __future__ import annotations

from typing import Any

from benchmarks import tiny_media, tiny_placeholders
from benchmarks.tiny_models import BATCH, SEQ, SIZES as TEXT_SIZES, build_model, make_batch, tiny_overrides

FAMILIES = {  # family -> the transformers registry (model type -> class) it takes
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}

# Beside the text sizes, for the towers of the families other than causal LMs.
SIZES: dict[str, Any] = {**TEXT_SIZES, **tiny_media.SIZES}

# Per model type (in every family but causal_lm): fields merged over the causal sweep's overrides.
_GRANITE_SPEECH = {"encoder_config": {"hidden_dim": 64, "dim_head": 16}}
_MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}}  # head_dim 16
_MROPE_HALF = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]}}
_ANYRES = {"image_grid_pinpoints": [[32, 32]]}  # one crop of the 32 x 32 image
OVERRIDES: dict[str, dict[str, Any]] = {
    "glm46v": {"text_config": _MROPE},
    "glm4v": {"text_config": _MROPE},
    "glm4v_moe": {"text_config": _MROPE_HALF},  # partial rotary 0.5
    "glm_ocr": {"text_config": _MROPE},
    "glmga": {"text_config": _MROPE},
    "hunyuan_vl": {"text_config": _MROPE},
    "instructblip": {"image_token_index": 2040},
    "kosmos-2": {"image_token_id": 2040},
    "mllama": {"vision_config": {"intermediate_layers_indices": [0], "num_global_layers": 1,
                                 "vision_output_dim": 128}},  # hidden x (1 + intermediate layers)  # a stand-in: its placeholders are marked by a position mask
    "instructblipvideo": {"video_token_index": 2040},
    "paddleocr_vl": {"text_config": _MROPE},
    "qwen2_5_omni_thinker": {"vision_start_token_id": 2039, "text_config": _MROPE},  # read, not declared
    "qwen2_vl": {"text_config": _MROPE},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 2039},  # read, not declared, by its config class
    "t5gemma2": {"encoder": {"mm_tokens_per_image": 4}},
    "apertus1p5": {"audio_config": {"codebook_dim": 64}},
    "aria": {"projector_patch_to_query_dict": {16: 4}},
    "blip-2": {"image_token_index": 2040},
    "cohere_compass": {"text_config": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}}}},
    "cosmos3_edge": {"text_config": _MROPE},
    "ernie4_5_vl_moe": {"text_config": {"moe_intermediate_size": [32, 32]}},
    "gemma3": {"mm_tokens_per_image": 4},  # 2 x 2 pooled from the 4 x 4 patches
    "glm5_next": {"text_config": {"index_topk": 16}},
    "hy_v4_vl": {"text_config": _MROPE_HALF},  # qk_rope_head_dim 8
    "llava_next": _ANYRES,
    "llava_next_video": _ANYRES,
    "llava_onevision": _ANYRES,
    "qwen2_5_omni_thinker": {"text_config": _MROPE},
    "qwen2_5_vl": {"text_config": _MROPE},
    "shieldgemma2": {"mm_tokens_per_image": 4},
    "vipllava": {"vision_feature_layers": [-1]},
    "esm": {"pad_token_id": 1, "mask_token_id": 32},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}},
    "granite_speech": _GRANITE_SPEECH,
    "granite_speech_plus": _GRANITE_SPEECH,
    "moonshine": {"pad_token_id": 0, "decoder_start_token_id": 1},
    "nemo_speechlm": {"audio_config": {"diarization_config": {"head_config": {"audio_hidden_size": 64}}}},
    "qwen2_audio": {"ignore_index": -100},  # read by its legacy merge, not set by its config class
    "qwen3_asr": {"audio_config": {"output_dim": 64}},
    "perceiver": {"max_position_embeddings": SEQ, "num_latents": 16, "d_latents": 64,  # a query a position
                  "num_self_attends_per_block": 1, "num_self_attention_heads": 4, "num_cross_attention_heads": 4},
    "reformer": {"is_decoder": False},  # ReformerForMaskedLM
    "voxtral": {"audio_token_id": 2040},
    "voxtral_realtime": {"audio_token_id": 2040},
}


def architectures(family: str) -> dict[str, str]:
    """The installed transformers' registry of ``family``: model type -> class name."""
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, FAMILIES[family]))


def build(family: str, model_type: str):
    """The tiny model of ``model_type``'s class in ``family``, in training mode."""
    if family == "causal_lm":
        return build_model(model_type)
    return build_model(model_type, _with_towers(model_type), architectures(family)[model_type], SIZES)


def _with_towers(model_type: str) -> dict[str, Any] | None:
    """:data:`OVERRIDES` of ``model_type``, plus tiny vision / audio sub-configs where its
    config class declares them but leaves them out by default (Gemma 4's)."""
    from transformers import CONFIG_MAPPING

    fields = dict(OVERRIDES.get(model_type, {}))
    config_class = CONFIG_MAPPING[model_type]
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001 - no defaults to read: the overrides alone
        return fields or None
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if name in ("vision_config", "audio_config") and getattr(defaults, name, True) is None and name not in fields:
            fields[name] = tiny_overrides(sub_class(), SIZES)
    return fields or None


def batch_for(family: str, model_type: str, model, vocab: int) -> dict[str, Any]:
    """The training batch of ``model`` (of ``family``): the inputs its forward needs and ``labels``."""
    import torch

    from benchmarks.tiny_models import batch_for as causal_batch

    if family == "causal_lm":
        return causal_batch(model_type, model, vocab)
    masked = family == "masked_lm" and not _is_encoder_decoder(model)
    candidates = tiny_media.media_candidates(model)
    if not candidates:
        batch = masked_batch(model, vocab) if masked else seq2seq_batch(model, vocab)
        params = tiny_media.forward_parameters(model)
        if "bbox" in params:  # a box a token: embedded ids (LayoutLM), or UDOP's floats
            box = [0.0, 0.0, 0.1, 0.1] if "visual_bbox" in params else [0, 0, 10, 10]
            batch["bbox"] = torch.tensor(box).expand(*batch["input_ids"].shape, 4).contiguous()
        return batch
    input_ids, labels = make_batch(vocab)
    text = masked_batch(model, vocab) if masked else {"input_ids": input_ids, "labels": labels}
    decoder = None
    if _is_encoder_decoder(model):  # the labels are the decoder's
        decoder = {k: v for k, v in seq2seq_batch(model, vocab).items() if k != "input_ids"}
    return tiny_placeholders.calibrated(model, candidates, text, decoder)


def _is_encoder_decoder(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def masked_batch(model, vocab: int) -> dict[str, Any]:
    """``input_ids [BATCH, SEQ]`` with every fourth token (from the second) the mask token,
    ``labels`` the original ids there and -100 elsewhere."""
    import torch

    input_ids, _ = make_batch(vocab)
    labels = torch.full_like(input_ids, -100)
    labels[:, 1::4] = input_ids[:, 1::4]
    mask_id = getattr(model.config, "mask_token_id", None)
    input_ids[:, 1::4] = mask_id if isinstance(mask_id, int) and 0 <= mask_id < vocab else 4
    return {"input_ids": input_ids, "labels": labels}


def seq2seq_batch(model, vocab: int) -> dict[str, Any]:
    """Source ``input_ids [BATCH, SEQ]`` and target ``labels [BATCH, SEQ]`` (row 0 padded with
    -100); ``decoder_input_ids`` (the labels shifted right) when the config has no
    ``decoder_start_token_id`` to shift them with."""
    import torch

    input_ids, _ = make_batch(vocab)
    target, labels = make_batch(vocab, seed=1)
    labels = target.clone()
    labels[0, -3:] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None and hasattr(config, "get_text_config"):
        start = getattr(config.get_text_config(decoder=True), "decoder_start_token_id", None)
    if start is None:
        batch["decoder_input_ids"] = torch.cat([torch.zeros(BATCH, 1, dtype=target.dtype), target[:, :-1]], 1)
    assert labels.shape == (BATCH, SEQ)
    return batch
