"""Pixel and audio inputs for the tiny vision-language and speech models.

    candidates = media_candidates(model)        # [{"pixel_values": ..., ...}, ...] or [] (text only)

What a model takes is read from its forward's parameters and its config: Qwen-VL-style
flattened patches with ``image_grid_thw``, images ``[BATCH, C, S, S]`` (``image_sizes``, a
pixel mask, a per-sample image dim where the class takes them), Whisper-style
``input_features [BATCH, mel, frames]``, ``input_values [BATCH, samples]``, each in the
layouts it may take. The placeholder tokens that go with them: :mod:`benchmarks.tiny_placeholders`.
"""

from __future__ import annotations

import inspect
from typing import Any

from benchmarks.tiny_models import BATCH

# Tower sizes: 32 x 32 images in 8 x 8 patches (16 per image), 100 audio frames of 16 mel bins.
SIZES: dict[str, Any] = {
    "image_size": 32, "patch_size": 8, "num_mel_bins": 16, "max_source_positions": 50,
    "vision_hidden_size": 64, "mm_hidden_size": 64, "projector_hidden_size": 64, "encoder_hidden_size": 64,
    "embed_dim": 64, "out_hidden_size": 64, "text_hidden_size": 64, "vision_output_dim": 64, "projector_input_dim": 64,
    "projector_output_dim": 64,
}
GRID = 4  # patches a side of a Qwen-VL-style image (image_grid_thw [1, GRID, GRID])
FRAMES = 100  # audio frames (Whisper's: 2 * max_source_positions)
SAMPLES = 4000  # raw audio samples (input_values)


def forward_parameters(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def config_field(config, *names: str, default: Any = None) -> Any:
    """The first of ``names`` set on ``config`` or one of its sub-configs (text, vision, audio)."""
    configs = [config, *(sub for sub in vars(config).values() if hasattr(sub, "to_dict"))]
    for cfg in configs:
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return default


def _vision(config):
    """The vision tower's config (an encoder-decoder's encoder's, or the encoder itself), or None."""
    encoder = getattr(config, "encoder", None)
    for cfg in (config, encoder):
        if getattr(cfg, "vision_config", None) is not None:
            return cfg.vision_config
    return encoder if getattr(encoder, "image_size", None) is not None else None


def _side(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _images(params: set[str], config, gen) -> list[dict[str, Any]]:
    """The image inputs ``params`` name, in each layout they may take (first the likelier)."""
    import torch

    if "flattened_patches" in params:  # Pix2Struct: GRID x GRID patches, each (row, column, pixels)
        vision = _vision(config)
        patch = _side(getattr(vision, "patch_size", 16))
        rows = torch.arange(GRID).repeat_interleave(GRID) + 1.0
        cols = torch.arange(GRID).repeat(GRID) + 1.0
        pixels = torch.randn(BATCH, GRID * GRID, 3 * patch * patch, generator=gen)
        place = torch.stack([rows, cols], -1).expand(BATCH, -1, -1)
        return [{"flattened_patches": torch.cat([place, pixels], -1),
                 "attention_mask": torch.ones(BATCH, GRID * GRID, dtype=torch.long)}]
    if "pixel_values" not in params:
        return []
    vision = _vision(config)
    if vision is None:
        return []
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or \
        getattr(vision, "num_channels", 3) or 3
    if "image_grid_thw" in params:  # Qwen-VL-style: flattened patches of GRID x GRID-patch images
        patch = _side(getattr(vision, "patch_size", 14))
        temporal = getattr(vision, "temporal_patch_size", None)
        n = BATCH * GRID * GRID
        grid = {"image_grid_thw": torch.tensor([[1, GRID, GRID]] * BATCH)}
        layouts = [(n, channels * t * patch * patch) for t in dict.fromkeys(x for x in (temporal, 2, 1) if x)]
        layouts += [(n, channels, patch, patch), (1, n, channels, patch, patch)]
        return [{"pixel_values": torch.randn(shape, generator=gen), **grid} for shape in layouts]
    side = _side(getattr(vision, "image_size", None) or SIZES["image_size"])
    pixels = torch.randn(BATCH, channels, side, side, generator=gen)
    extra: dict[str, Any] = {}
    if "aspect_ratio_ids" in params:  # Mllama: one image a sample, its first tile used (aspect ratio 1:1)
        tiles = getattr(vision, "max_num_tiles", 4)
        pixels = pixels[:, None, None].expand(BATCH, 1, tiles, channels, side, side).contiguous()
        mask = torch.zeros(BATCH, 1, tiles, dtype=torch.long)
        mask[..., 0] = 1
        return [{"pixel_values": pixels, "aspect_ratio_ids": torch.ones(BATCH, 1, dtype=torch.long),
                 "aspect_ratio_mask": mask}]
    if "pixel_attention_mask" in params:  # a dim of images per sample, and their valid pixels
        pixels = pixels[:, None]
        extra["pixel_attention_mask"] = torch.ones(BATCH, 1, side, side, dtype=torch.bool)
    if "high_res_pixel_values" in params:
        high = _side(getattr(getattr(config, "high_res_vision_config", None), "image_size", side))
        extra["high_res_pixel_values"] = torch.randn(BATCH, channels, high, high, generator=gen)
    if "qformer_input_ids" in params:
        extra["qformer_input_ids"] = torch.arange(3, 7).repeat(BATCH, 1)
    candidates = [{"pixel_values": pixels, **extra}]
    if "pixel_attention_mask" not in params:  # a dim of images (or frames) per sample
        candidates.append({"pixel_values": pixels[:, None], **extra})
    if "image_sizes" in params:  # anyres (LLaVA-NeXT): the base image and one crop of a side x side pinpoint
        sizes = {"image_sizes": torch.tensor([[side, side]] * BATCH)}
        crops = pixels[:, None].expand(BATCH, 2, *pixels.shape[1:]).contiguous()
        candidates = [{**candidates[0], **sizes}, {"pixel_values": crops, **extra, **sizes}, *candidates]
    return candidates


def _audio(params: set[str], config, gen) -> list[dict[str, Any]]:
    """The audio inputs ``params`` name, in each layout they may take (first the likelier)."""
    import torch

    if getattr(config, "audio_config", True) is None:  # a tower the config leaves out
        return []
    if "input_features" in params:
        widths = [config_field(config, name) for name in ("num_mel_bins", "feature_projection_input_dim", "input_dim",
                                                     "feature_size", "input_feat_per_channel")]
        stacked = config_field(config, "num_stacked_frames")  # frames stacked into one feature vector
        if isinstance(stacked, int) and isinstance(widths[0], int):
            widths.append(widths[0] * stacked)
        layouts = []
        for width in dict.fromkeys(w for w in (*widths, 80, 128, config_field(config, "d_model")) if isinstance(w, int)):
            layouts += [(BATCH, width, FRAMES), (BATCH, FRAMES, width)]
        masks = {mask: torch.ones(BATCH, FRAMES, dtype=torch.long)
                 for mask in ("input_features_mask", "feature_attention_mask") if mask in params}
        candidates = [{"input_features": torch.randn(shape, generator=gen), **masks} for shape in layouts]
    else:
        candidates = []
    if "input_values" in params:
        masks = {"padding_mask": torch.ones(BATCH, SAMPLES, dtype=torch.long)} if "padding_mask" in params else {}
        values = torch.randn(BATCH, SAMPLES, generator=gen)
        candidates += [{"input_values": values, **masks}, {"input_values": values[:, None], **masks}]
    return candidates


def media_candidates(model) -> list[dict[str, Any]]:
    """The pixel / audio inputs ``model``'s forward takes, tiny, one dict for each layout
    they may take (audio: mel bins first or last, a channel dim or not); [] when it takes neither."""
    import torch

    params, config = forward_parameters(model), model.config
    gen = torch.Generator().manual_seed(1)
    images = _images(params, config, gen) or [{}]
    audio = _audio(params, config, gen) or [{}]
    return [media for media in ({**i, **a} for i in images for a in audio) if media]
