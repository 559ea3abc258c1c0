"""The recompute op's options as its schemas hold them, and :class:`ChunkPlan`, the options of
one op call resolved.

Every custom op takes its tensors positionally and its options keyword-only (:data:`OPTIONS`),
under the same names from the public function to the kernels. The head's
:class:`~compile_pass.op.transform.HeadTransform` is several schema arguments:
:func:`op_arguments` flattens it, :func:`head_transform` rebuilds it. ``tests/op/test_op.py``
pins the schema strings (they are hashed into cache keys).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op.chunking import Tiles, resolve_tiles
from compile_pass.op.kernels import KernelArgs
from compile_pass.op.settings import settings
from compile_pass.op.transform import HeadTransform

NAME = "chunkce.linear_cross_entropy"  # how the op names itself in messages
# the leading arguments of the forward ops (the backward ops', between grad_loss and the row statistics)
INPUTS = ("Tensor hidden_states, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, "
          "Tensor? logit_scale_tensor")
# the keyword-only options of every recompute-family op (torch refuses keyword-only tensors: the
# scale's 0-d tensor is the positional logit_scale_tensor)
OPTIONS = ("SymInt ignore_index, float label_smoothing, ScalarType logits_dtype, SymInt? chunk_size=None, "
           "SymInt? chunk_bytes=None, float? logit_scale=None, bool scale_divides=False, "
           "ScalarType? scale_dtype=None")


def op_schema(tensors: str, returns: str, own: str = "", options: str = OPTIONS) -> str:
    """A custom op's schema string: the positional ``tensors``, then keyword-only the op's
    ``own`` arguments and the ``options``, ``-> returns`` (schema syntax each)."""
    keywords = f"{own}, {options}" if own else options
    return f"({tensors}, *, {keywords}) -> {returns}"


def defaults(options: str) -> dict[str, Any]:
    """The defaults of the options (schema syntax) that have one."""
    arguments = internals.parse_schema(f"options(*, {options}) -> ()").arguments
    return {argument.name: argument.default_value for argument in arguments if argument.has_default_value()}


DEFAULTS = defaults(OPTIONS)


def op_arguments(transform: HeadTransform = HeadTransform(), **options: Any) -> tuple[Tensor | None, dict[str, Any]]:
    """``(logit_scale_tensor, keywords)``: the options as the ops take them, ``transform``'s scale
    a float ``logit_scale`` when it is a Python number, else the 0-d tensor."""
    number = isinstance(transform.scale, numbers.Real)
    keywords = {**options, "logit_scale": float(transform.scale) if number else None,
                "scale_divides": transform.divides, "scale_dtype": transform.dtype}
    return None if number else transform.scale, keywords


def loss_inputs(hidden_states: Tensor, weight: Tensor, bias: Tensor | None, *, ignore_index: int,
                label_smoothing: float, logits_dtype: Any, chunk_size: int | None = None,
                chunk_bytes: int | None = None, transform: HeadTransform | None = None,
                projection_dtype: Any = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, dict[str, Any]]:
    """``(hidden_states, weight, bias, logit_scale_tensor, keywords)`` as a loss op takes them: the
    tensors cast to ``projection_dtype`` (None: no cast). Raises TypeError: an unknown keyword."""
    scale_tensor, options = op_arguments(
        HeadTransform() if transform is None else transform, ignore_index=ignore_index,
        label_smoothing=label_smoothing, logits_dtype=logits_dtype, chunk_size=chunk_size, chunk_bytes=chunk_bytes)
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    return hidden_states, weight, bias, scale_tensor, options


def head_transform(scale_tensor: Tensor | None, options: Mapping[str, Any]) -> HeadTransform:
    """The transform of :func:`op_arguments` (at most one of the two scales is given)."""
    scale = options.get("logit_scale") if scale_tensor is None else scale_tensor
    return HeadTransform(scale=scale, divides=options.get("scale_divides", False), dtype=options.get("scale_dtype"))


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """The options of one op call, resolved for its tensors and the environment."""

    options: Mapping[str, Any]  # the op's keyword arguments, every default filled in
    tiles: Tiles  # tokens and vocabulary columns a tile, resolved
    release_cache: bool  # CHUNKCE_RELEASE_CACHE: empty the allocator's cache after the op
    eager_kernels: bool  # CHUNKCE_EAGER_KERNELS
    transform: HeadTransform  # the head's transform, its dtype resolved (HeadTransform.resolve)
    vocab_size: int  # V (the whole vocabulary's, for a shard)
    vocab_offset: int = 0  # a shard's first column: the kernels see a tile at its global columns

    @staticmethod
    def resolve(hidden_states: Tensor, weight: Tensor, scale_tensor: Tensor | None, options: Mapping[str, Any],
                *, option_defaults: Mapping[str, Any] = DEFAULTS, whole_rows: bool = False,
                vocab_offset: int = 0, vocab_size: int | None = None) -> ChunkPlan:
        """The plan of a call on ``hidden_states [N, H]`` and ``weight [V, H]`` with the keyword
        ``options``: the tiles (:func:`~compile_pass.op.chunking.resolve_tiles`), the
        environment's flags, the transform's dtype resolved; ``vocab_offset`` / ``vocab_size``
        place a shard (default: the whole head).

        Raises:
            ValueError: a ``CHUNKCE_*`` variable holds a bad value.
        """
        env = settings()
        options = {**option_defaults, **options}
        return ChunkPlan(
            options=options,
            tiles=resolve_tiles(options.get("chunk_size"), hidden_states.shape[0], weight.shape[0],
                                hidden_states.element_size(), hidden_states.device.type,
                                chunk_bytes=options.get("chunk_bytes"), whole_rows=whole_rows),
            release_cache=env.release_cache,
            eager_kernels=env.eager_kernels,
            transform=head_transform(scale_tensor, options).resolve(hidden_states.dtype),
            vocab_size=weight.shape[0] if vocab_size is None else vocab_size,
            vocab_offset=vocab_offset,
        )

    @property
    def kernel_label_smoothing(self) -> float | None:
        """The smoothing the kernels take: None when there is none (a variant without its terms)."""
        smoothing = self.options["label_smoothing"]
        return smoothing if smoothing > 0.0 else None

    def kernel_args(self, vocab_start: int) -> KernelArgs:
        """The kernels' constants for the tile whose first vocabulary column (in ``weight``) is
        ``vocab_start``."""
        return KernelArgs(self.options["ignore_index"], self.kernel_label_smoothing, self.options["logits_dtype"],
                          vocab_start + self.vocab_offset, self.vocab_size, self.transform)

    def variant(self, logits: Tensor, class_weight: Tensor | None) -> tuple:
        """The kernels' compile key (never a value): device type, projection dtype (of ``logits``),
        logits dtype, class weights and smoothing present, the transform's form."""
        return (logits.device.type, logits.dtype, self.options["logits_dtype"],
                class_weight is not None, self.kernel_label_smoothing is not None, self.transform.form())
