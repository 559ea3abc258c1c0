"""Placeholder tokens for the tiny vision-language and speech models' features.

    batch = calibrated(model, media_candidates(model), text)   # input_ids with the image / audio tokens

How many placeholder tokens the tower's features fill is read where the model checks them
(its ``get_placeholder_mask``: :class:`_FeatureCounts`) or from the ``tokens: n, features: m``
error it raises, as a processor would have counted them; the inputs that follow the tokens
(a cross-attention mask, an image-position mask, boxes) are made for them (:func:`_token_inputs`).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from benchmarks.tiny_media import config_field, forward_parameters
from benchmarks.tiny_models import BATCH, SEQ

_MISMATCH = re.compile(r"(image|video|audio|multimodal|placeholder)[^:]*?tokens?\D*(\d+)\D+?features?\D*(\d+)",
                       re.IGNORECASE)
_PLACEHOLDERS = {"image": ("image_token_id", "image_token_index", "video_token_id", "video_token_index"),
                 "audio": ("audio_token_id", "audio_token_index")}


def _placeholder_id(config, kind: str) -> int | None:
    value = config_field(config, *_PLACEHOLDERS.get(kind, ()))
    return value if isinstance(value, int) else None


def _with_placeholders(text: dict[str, Any], counts: dict[int, list[int]]) -> dict[str, Any]:
    """``text`` (``input_ids``, ``labels``) with, after its first two tokens, each placeholder id
    repeated its count in each row (rows padded with text to one length); ``labels`` -100 there."""
    import torch

    input_ids, labels = text["input_ids"], text["labels"]
    longest = sum(max(row) for row in counts.values())
    rows_ids, rows_labels = [], []
    for b in range(BATCH):
        ids = [input_ids[b, :2]]
        for token, row in counts.items():
            ids.append(torch.full((row[b],), token, dtype=input_ids.dtype))
        filler = longest - sum(row[b] for row in counts.values())
        ids.append(input_ids[b, 2:3].repeat(filler))
        ids.append(input_ids[b, 2:])
        ids = torch.cat(ids)
        rows_ids.append(ids)
        label = torch.full_like(ids, -100)
        label[:2], label[ids.shape[0] - (SEQ - 2):] = labels[b, :2], labels[b, 2:]
        rows_labels.append(label)
    return {"input_ids": torch.stack(rows_ids), "labels": torch.stack(rows_labels)}


def _split(total: int) -> list[int]:
    """``total`` placeholders over the rows, as evenly as they go (the first rows one more)."""
    return [total // BATCH + (b < total % BATCH) for b in range(BATCH)]


def calibrated(model, candidates: list[dict[str, Any]], text: dict[str, Any],
               decoder: dict[str, Any] | None = None) -> dict[str, Any]:
    """The first of the media ``candidates`` (:func:`media_candidates`) the model runs with,
    beside ``text`` (``input_ids``, ``labels``; an encoder-decoder's ``labels`` are
    ``decoder``'s), ``input_ids`` holding as many placeholder tokens as the model says its
    features fill (:func:`_settle`). Raises, when none runs, the error of the one that got
    furthest (the most module calls before it failed)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    furthest, depth = None, -1
    takes_ids = "input_ids" in forward_parameters(model)
    ids = [True, False] if decoder is not None and takes_ids else [decoder is None or takes_ids]
    for media, with_ids in ((media, with_ids) for media in candidates for with_ids in ids):
        calls = [0]
        hook = register_module_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
        try:
            return _settle(model, media, text, decoder, with_ids)
        except Exception as error:  # noqa: BLE001 - the next layout
            if calls[0] > depth:
                furthest, depth = error, calls[0]
        finally:
            hook.remove()
    raise furthest


class _FeatureCounts:
    """While entered: every module's ``get_placeholder_mask(input_ids, inputs_embeds, *_features)``
    (how HF's multimodal models check placeholders against features) notes, per kind, how many
    embedding rows the features it is given fill (``counts``), then runs as it would."""

    def __init__(self, model) -> None:
        self.owners = [m for m in model.modules() if hasattr(type(m), "get_placeholder_mask")]
        self.counts: dict[str, int] = {}

    def __enter__(self) -> _FeatureCounts:
        for owner in self.owners:
            original = type(owner).get_placeholder_mask
            signature = inspect.signature(original)

            def noting(*args, _original=original, _signature=signature, _owner=owner, **kwargs):
                bound = _signature.bind(_owner, *args, **kwargs).arguments
                embeds = bound.get("inputs_embeds")
                for name, value in bound.items():
                    if name.endswith("_features") and hasattr(value, "numel") and embeds is not None:
                        self.counts[name.split("_")[0]] = value.numel() // embeds.shape[-1]
                return _original(_owner, *args, **kwargs)

            owner.get_placeholder_mask = noting
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner in self.owners:
            del owner.get_placeholder_mask


def _token_inputs(model, input_ids, media: dict[str, Any]) -> dict[str, Any]:
    """The inputs the forward takes that follow ``input_ids [BATCH, T]``: masks of the
    placeholders, a tile cross-attention mask (Mllama's), a box a token (UDOP's)."""
    import torch

    params, config = forward_parameters(model), model.config
    image = input_ids == _placeholder_id(config, "image")
    inputs: dict[str, Any] = {}
    if "attention_mask" in params:  # some merge the features by it (Qwen2-Audio)
        inputs["attention_mask"] = torch.ones_like(input_ids)
    if "mm_token_type_ids" in params:  # M-RoPE's: 1 on image tokens
        inputs["mm_token_type_ids"] = image.long()
    if "image_embeds_position_mask" in params:
        inputs["image_embeds_position_mask"] = image.long()
    if "cross_attention_mask" in params and "aspect_ratio_mask" in media:  # every token sees the image's tiles
        tiles = media["aspect_ratio_mask"]  # [BATCH, 1, tiles]
        inputs["cross_attention_mask"] = tiles[:, None].expand(-1, input_ids.shape[1], -1, -1).contiguous()
    if "bbox" in params:
        inputs["bbox"] = torch.tensor([0, 0, 10, 10]).expand(*input_ids.shape, 4).contiguous()
    return inputs


def _settle(model, media: dict[str, Any], text: dict[str, Any], decoder: dict[str, Any] | None,
            with_ids: bool = True, attempts: int = 4) -> dict[str, Any]:
    """``media`` and ``text`` with the placeholder counts the model's features fill (one a
    sample to start, for each image / audio input whose token the config names), read where
    the model checks them (:class:`_FeatureCounts`) or from the ``tokens: n, features: m``
    error it raises, split over the samples. ``with_ids``: an encoder-decoder gets ``input_ids``."""
    import torch

    config = model.config
    kinds = [kind for kind, present in (("image", "pixel_values" in media),
                                        ("audio", "input_features" in media or "input_values" in media))
             if present and _placeholder_id(config, kind) is not None]
    counts = {_placeholder_id(config, kind): [1] * BATCH for kind in kinds}
    if "image_embeds_position_mask" in forward_parameters(model) and kinds:  # Kosmos-2: its latent queries
        counts[_placeholder_id(config, "image")] = [config.latent_query_num] * BATCH
    for _ in range(attempts):
        tokens = _with_placeholders(text, counts)
        tokens.update(_token_inputs(model, tokens["input_ids"], media))
        if decoder is not None:
            tokens = {**({"input_ids": tokens["input_ids"]} if with_ids else {}), **decoder}
        batch = {**media, **tokens}
        noted = _FeatureCounts(model)
        try:
            with torch.no_grad(), noted:
                model(**batch)
            return batch
        except Exception as error:  # noqa: BLE001 - a count the model reports is read, others raised
            found = {_placeholder_id(config, kind): _split(n) for kind, n in noted.counts.items()
                     if _placeholder_id(config, kind) in counts}
            match = _MISMATCH.search(str(error))
            if not found and match is not None and counts:
                kind = match.group(1).lower()
                token = _placeholder_id(config, kind) if kind in _PLACEHOLDERS else next(iter(counts))
                found = {token: _split(int(match.group(3)))} if token in counts else {}
            if not found or all(counts[token] == row for token, row in found.items()):
                raise
            counts.update(found)
    raise RuntimeError(f"placeholder counts not settled after {attempts} tries: {counts}")
