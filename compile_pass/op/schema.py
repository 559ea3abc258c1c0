"""The ops' schemas, each from one Python definition (OpSchema), and the options of one call resolved.

Every custom op takes its tensors positionally and its options keyword-only, under the same names
from the public function to the kernels. Each argument is one :class:`Argument` (name, schema type,
default) and each op one :class:`OpSchema` (its tensors, its own keywords, the options, the tensors
it returns): the registered schema's text, the check of the op's function and the defaults the ops
fill in (:func:`option_defaults`) are all read from it, never parsed back from a string
(:data:`LOSS_OPTIONS`; the row-statistics op's in :mod:`compile_pass.op.statistics`). The head's
:class:`~compile_pass.op.kernels.HeadScale` names its own arguments (``HeadScale.TENSOR_ARGUMENT``,
``HeadScale.KEYWORD_ARGUMENTS``), gives and reads them. :class:`ResolvedCall` is the options of one
call resolved. ``tests/op/test_op.py`` pins the registered schema strings (they are hashed into cache keys).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op.kernels import HeadScale, KernelArgs
from compile_pass.op.tiling import Tiles, resolve_tiles, settings, walk_threads

LOSS_NAME = "chunkce.linear_cross_entropy"  # how the op names itself in messages
REQUIRED = object()  # an Argument without a default


class Argument(NamedTuple):
    """One argument of a custom op's schema: its name, schema type and default (:data:`REQUIRED`: none)."""

    name: str
    type: str  # schema syntax: "Tensor?", "SymInt", "float?", "ScalarType", ...
    default: Any = REQUIRED

    def schema(self) -> str:
        """As a schema writes it: ``"SymInt? chunk_size=None"``."""
        return f"{self.type} {self.name}" + ("" if self.default is REQUIRED else f"={self.default!r}")


def option_defaults(options: tuple[Argument, ...]) -> dict[str, Any]:
    """The defaults of the options that have one."""
    return {o.name: o.default for o in options if o.default is not REQUIRED}


# the leading tensors of the loss ops (the backward ops', between grad_loss and the row statistics)
INPUTS = (
    Argument("hidden_states", "Tensor"), Argument("weight", "Tensor"), Argument("target", "Tensor"),
    Argument("bias", "Tensor?"), Argument("class_weight", "Tensor?"), Argument(*HeadScale.TENSOR_ARGUMENT),
)
SCALE_OPTIONS = tuple(Argument(*argument) for argument in HeadScale.KEYWORD_ARGUMENTS)  # the head's scale
ROW_LOG_SUM_EXP = (Argument("row_max", "Tensor"), Argument("row_log_sum", "Tensor"))  # the forward's, [N] each
OUTPUT_MASK = Argument("output_mask", "bool[]")  # [grad_hidden_states, grad_weight, grad_bias] wanted
GROUP_NAME = Argument("group_name", "str")  # a vocabulary-parallel op's process group
# the keyword-only options of every recompute-family op (torch refuses keyword-only tensors: the
# scale's 0-d tensor is the positional logit_scale_tensor)
LOSS_OPTIONS = (
    Argument("ignore_index", "SymInt"), Argument("label_smoothing", "float"), Argument("logits_dtype", "ScalarType"),
    Argument("chunk_size", "SymInt?", None), Argument("chunk_bytes", "SymInt?", None), *SCALE_OPTIONS,
)
LOSS_DEFAULTS = option_defaults(LOSS_OPTIONS)


@dataclass(frozen=True)
class OpSchema:
    """One custom op's whole schema: ``tensors`` positional, then keyword-only its ``own`` arguments
    and the ``options``; it returns ``returns`` tensors (one: a Tensor, more: a tuple)."""

    name: str  # "chunkce::<op>"
    tensors: tuple[Argument, ...]
    returns: int
    own: tuple[Argument, ...] = ()
    options: tuple[Argument, ...] = LOSS_OPTIONS

    def text(self) -> str:
        """The schema as ``torch.library`` takes it: ``"(Tensor hidden_states, ..., *, ...) -> (Tensor, ...)"``."""
        positional = ", ".join(a.schema() for a in self.tensors)
        keywords = ", ".join(a.schema() for a in (*self.own, *self.options))
        returns = "Tensor" if self.returns == 1 else f"({', '.join(['Tensor'] * self.returns)})"
        return f"({positional}, *, {keywords}) -> {returns}"

    def custom_op(self, function: Callable[..., Any]) -> Any:
        """``function`` registered as this op (``torch.library.custom_op``). Its parameters name the
        schema's tensors in order (or a first few, then ``*tensors``), any keyword-only ones are the
        schema's keywords and the rest arrive in ``**options``.

        Raises:
            TypeError: ``function``'s parameters are not the schema's.
        """
        parameters = inspect.signature(function).parameters.values()
        named = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        rest = any(p.kind is p.VAR_POSITIONAL for p in parameters)
        keywords = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
        tensors = [a.name for a in self.tensors]
        known = {a.name for a in (*self.own, *self.options)}
        if named != (tensors[:len(named)] if rest else tensors) or not keywords <= known:
            raise TypeError(f"{self.name}: expected {function.__name__} to take {tensors} positionally and "
                            f"keywords of the schema, got {inspect.signature(function)}")
        return torch.library.custom_op(self.name, function, mutates_args=(), schema=self.text())


def loss_inputs(hidden_states: Tensor, weight: Tensor, bias: Tensor | None, *, ignore_index: int,
                label_smoothing: float, logits_dtype: Any, chunk_size: int | None = None,
                chunk_bytes: int | None = None, transform: HeadScale | None = None,
                projection_dtype: Any = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, dict[str, Any]]:
    """``(hidden_states, weight, bias, logit_scale_tensor, keywords)`` as a loss op takes them: the
    tensors cast to ``projection_dtype`` (None: no cast). Raises TypeError: an unknown keyword."""
    scale_tensor, scale_options = (HeadScale() if transform is None else transform).op_arguments()
    options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, logits_dtype=logits_dtype,
                   chunk_size=chunk_size, chunk_bytes=chunk_bytes, **scale_options)
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    return hidden_states, weight, bias, scale_tensor, options


@dataclass(frozen=True, eq=False)
class ResolvedCall:
    """The options of one op call, resolved for its tensors and the environment."""

    options: Mapping[str, Any]  # the op's keyword arguments, every default filled in
    tiles: Tiles  # tokens and vocabulary columns a tile, resolved
    release_cache: bool  # CHUNKCE_RELEASE_CACHE: empty the allocator's cache after the op
    eager_kernels: bool  # CHUNKCE_EAGER_KERNELS, or casts to half precision Inductor would drop (_drops_half_casts)
    transform: HeadScale  # the head's scale, its dtype resolved (HeadScale.resolve)
    vocab_size: int  # V (the whole vocabulary's, for a shard)
    vocab_offset: int = 0  # a shard's first column: the kernels see a tile at its global columns
    threads: int = 1  # the walk threads its tiles are split over (tiling.walk_threads)

    @staticmethod
    def resolve(hidden_states: Tensor, weight: Tensor, scale_tensor: Tensor | None, options: Mapping[str, Any],
                *, option_defaults: Mapping[str, Any] = LOSS_DEFAULTS, whole_rows: bool = False,
                vocab_offset: int = 0, vocab_size: int | None = None) -> ResolvedCall:
        """The resolved options of a call on ``hidden_states [N, H]`` and ``weight [V, H]`` with the keyword
        ``options``: the tiles (:func:`~compile_pass.op.tiling.resolve_tiles`), the
        environment's flags, the transform's dtype resolved; ``vocab_offset`` / ``vocab_size``
        place a shard (default: the whole head).

        Raises:
            ValueError: a ``CHUNKCE_*`` variable holds a bad value.
        """
        env = settings()
        options = {**option_defaults, **options}
        transform = HeadScale.from_op_arguments(scale_tensor, options).resolve(hidden_states.dtype)
        threads = 1 if whole_rows else walk_threads(hidden_states.device.type)
        return ResolvedCall(
            options=options,
            tiles=resolve_tiles(options.get("chunk_size"), hidden_states.shape[0], weight.shape[0],
                                hidden_states.element_size(), hidden_states.device.type,
                                chunk_bytes=options.get("chunk_bytes"), whole_rows=whole_rows, parts=threads),
            release_cache=env.release_cache,
            eager_kernels=env.eager_kernels or _drops_half_casts(hidden_states, options, transform),
            transform=transform,
            vocab_size=weight.shape[0] if vocab_size is None else vocab_size,
            vocab_offset=vocab_offset,
            threads=threads,
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
        logits dtype, class weights and smoothing present, the transform's variant."""
        return (logits.device.type, logits.dtype, self.options["logits_dtype"],
                class_weight is not None, self.kernel_label_smoothing is not None, self.transform.variant())


def _drops_half_casts(hidden_states: Tensor, options: Mapping[str, Any], transform: HeadScale) -> bool:
    """Whether the kernels round a value they computed in float32 to half precision (a half-precision
    dtype among the projection's, the logits', the statistics' and the scale's where they differ, or
    under a scale or a statistics op's temperature) and Inductor would drop that rounding on this device."""
    dtypes = {hidden_states.dtype, options["logits_dtype"], options.get("statistics_dtype") or options["logits_dtype"],
              transform.dtype or hidden_states.dtype}
    rounds = len(dtypes) > 1 or not transform.is_identity or "temperature_value" in options
    return (rounds and not dtypes.isdisjoint((torch.float16, torch.bfloat16))
            and not internals.inductor_keeps_half_casts(hidden_states.device.type))
