"""The op's options, defined once, and their resolution for one call.

:class:`OpOptions` is what the three custom ops take besides their tensors, and
:data:`SCHEMA_OPTIONS` the same options as the schemas hold them (flat torch types: names,
types, defaults and order; the head's transform, one field of :class:`OpOptions`, is several
arguments there, flattened and rebuilt here only). From them come

* the ops' registered schemas (:func:`op_schema`): an op's leading tensors, the
  options without a default, the op's own arguments (``output_mask``), then the
  options with a default. A new option gets a default and goes last, so every call,
  traced graph and cache entry made before it keeps its meaning;
* the ops' bodies, fakes and ``setup_context``, which read the arguments after the
  leading tensors with :meth:`OpOptions.parse`;
* the ops' calls (:meth:`OpOptions.args`), made by
  :func:`compile_pass.op.function.chunked_cross_entropy`, which the public function
  and the graph pass's rewrite call with the options as keywords;
* :class:`ChunkPlan`: the options resolved for one call's tensors and environment.

The schema is generated as a string and given to ``torch.library.custom_op(...,
schema=...)``, rather than inferred from a generated Python signature: the string is
what torch registers, stores in graphs and hashes into cache keys, and it is written
here in plain sight (``tests/test_op.py`` pins it); a synthesised ``__signature__``
would hide it behind ``infer_schema``. The op bodies then take their options
positionally: the dispatcher passes every argument up to the last one that differs
from its default, and :meth:`OpOptions.parse` fills in the rest from the defaults.

Adding an option: a field here and its schema argument (with its default), its use in the
loops or kernels, and its argument in the public function (and in the rewrite, if the pass
sets it). Adding a head transform: :mod:`compile_pass.op.transform`, and its arguments in
:func:`_transform_arguments` / :func:`_transform_of`.
"""

from __future__ import annotations

import dataclasses
import numbers
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from compile_pass.op.chunking import Tiles, resolve_tiles
from compile_pass.op.kernels import KernelArgs
from compile_pass.op.settings import settings
from compile_pass.op.transform import HeadTransform

NAME = "chunkce.linear_cross_entropy"  # how the op names itself in messages
# the leading arguments of the forward ops (the backward op's, between grad_loss and the row statistics)
INPUTS = "Tensor hidden_states, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight"


# The options as the ops' schemas hold them, in order: flat torch types, written out as torch
# registers them. Those without a default come first (an op's own arguments follow them: see
# op_schema); a new one gets a default and goes last. Each is the OpOptions field of its name,
# but for the head's transform, one field flattened into several (_TRANSFORM_ARGUMENTS).
SCHEMA_OPTIONS = (
    "SymInt ignore_index", "float label_smoothing", "ScalarType logits_dtype", "SymInt? chunk_size",
    "bool? release_cache",
    "float? logit_scale=None", "Tensor? logit_scale_tensor=None", "bool scale_divides=False",
    "ScalarType? scale_dtype=None",
    "SymInt? chunk_bytes=None",
)
_ARGUMENTS = torch._C.parse_schema(f"options({', '.join(SCHEMA_OPTIONS)}) -> ()").arguments
_NAMES = [argument.name for argument in _ARGUMENTS]
_REQUIRED = [argument.name for argument in _ARGUMENTS if not argument.has_default_value()]
_DEFAULTS = {argument.name: argument.default_value for argument in _ARGUMENTS if argument.has_default_value()}
_TENSORS = [argument.name for argument in _ARGUMENTS if "Tensor" in str(argument.type)]


def _transform_arguments(transform: HeadTransform) -> dict[str, typing.Any]:
    """The transform as the schema holds it: its scale as a float when it is a Python
    number (``logit_scale``), else as a tensor (``logit_scale_tensor``)."""
    number = isinstance(transform.scale, numbers.Real)
    return {"logit_scale": float(transform.scale) if number else None,
            "logit_scale_tensor": None if number else transform.scale,
            "scale_divides": transform.divides, "scale_dtype": transform.dtype}


def _transform_of(arguments: typing.Mapping[str, typing.Any]) -> HeadTransform:
    """The transform of :func:`_transform_arguments`' arguments (at most one scale is given)."""
    tensor = arguments["logit_scale_tensor"]
    return HeadTransform(scale=arguments["logit_scale"] if tensor is None else tensor,
                         divides=arguments["scale_divides"], dtype=arguments["scale_dtype"])


_TRANSFORM_ARGUMENTS = list(_transform_arguments(HeadTransform()))


@dataclass(frozen=True, eq=False)
class OpOptions:
    """What every custom op of the package takes besides its tensors (schema:
    :data:`SCHEMA_OPTIONS`, where ``transform`` is several flat arguments)."""

    ignore_index: int  # the target value that has no loss and no gradient
    label_smoothing: float  # as F.cross_entropy's; <= 0 is none
    logits_dtype: torch.dtype  # the dtype the loss is computed in (resolved, never None)
    chunk_size: int | None  # tokens per tile; None = automatic (chunking.resolve_tiles)
    release_cache: bool | None  # empty the allocator's cache after the op; None = CHUNKCE_RELEASE_CACHE
    transform: HeadTransform = HeadTransform()  # what the logits go through before the loss
    chunk_bytes: int | None = None  # the budget of one tile of logits in bytes; None = automatic

    @classmethod
    def parse(cls, args: Sequence[typing.Any], extras: int = 0) -> tuple[tuple, OpOptions]:
        """``(the op's own arguments, the options)`` from an op's arguments after its
        leading tensors: the options without a default, ``extras`` arguments of the op's
        own, then the options with a default (trailing ones may be left out)."""
        required = len(_REQUIRED)
        values = [*args[:required], *args[required + extras:]]
        return tuple(args[required:required + extras]), cls._of_arguments({**_DEFAULTS, **dict(zip(_NAMES, values))})

    def args(self, *extras: typing.Any) -> tuple:
        """The options as an op takes them after its leading tensors, with the op's own
        arguments ``extras`` after those without a default."""
        arguments = self._arguments()
        values = [arguments[name] for name in _NAMES]
        return (*values[:len(_REQUIRED)], *extras, *values[len(_REQUIRED):])

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The options' tensors (autograd saves them: ``save_for_backward``)."""
        arguments = self._arguments()
        return tuple(arguments[name] for name in _TENSORS)

    def without_tensors(self) -> OpOptions:
        """These options with the tensors left out (what ``ctx`` may keep as attributes)."""
        return self.with_tensors([None] * len(_TENSORS))

    def with_tensors(self, tensors: Sequence[Tensor | None]) -> OpOptions:
        """These options with :meth:`tensors` put back (after ``ctx.saved_tensors``)."""
        return self._of_arguments({**self._arguments(), **dict(zip(_TENSORS, tensors, strict=True))})

    def _arguments(self) -> dict[str, typing.Any]:
        """The options by schema argument name: the one place the transform is flattened."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        transform = fields.pop("transform")
        return {**fields, **_transform_arguments(transform)}

    @classmethod
    def _of_arguments(cls, arguments: dict[str, typing.Any]) -> OpOptions:
        """The options of schema arguments by name (:meth:`_arguments` reversed)."""
        fields = {name: value for name, value in arguments.items() if name not in _TRANSFORM_ARGUMENTS}
        return cls(**fields, transform=_transform_of(arguments))


def op_schema(tensors: str, returns: str, extras: str = "") -> str:
    """A custom op's schema string: the leading arguments ``tensors``, the options without
    a default, the op's own arguments ``extras``, the options with a default, ``->
    returns`` (each in schema syntax, e.g. ``"Tensor grad_loss, Tensor? bias"``)."""
    required = len(_REQUIRED)
    arguments = [tensors, *SCHEMA_OPTIONS[:required], *([extras] if extras else []), *SCHEMA_OPTIONS[required:]]
    return f"({', '.join(arguments)}) -> {returns}"


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """The options of one op call, resolved for its tensors and the environment."""

    options: OpOptions
    tiles: Tiles  # tokens and vocabulary columns a tile, resolved
    release_cache: bool  # resolved
    eager_kernels: bool  # CHUNKCE_EAGER_KERNELS
    transform: HeadTransform  # options.transform with its dtype resolved (HeadTransform.resolve)
    vocab_size: int  # V

    @staticmethod
    def resolve(hidden_states: Tensor, weight: Tensor, options: OpOptions,
                whole_rows: bool = False) -> ChunkPlan:
        """The plan of a call on ``hidden_states [N, H]`` and ``weight [V, H]``:
        the tiles (``chunk_size`` and ``chunk_bytes`` None are automatic; tiles of whole
        rows for the grads-in-forward op:
        :func:`~compile_pass.op.chunking.resolve_tiles`) and ``release_cache`` None
        (``CHUNKCE_*``) are resolved; the transform's dtype None is the projection dtype
        (the hidden states').

        Raises:
            ValueError: a ``CHUNKCE_*`` variable holds a bad value.
        """
        env = settings()
        return ChunkPlan(
            options=options,
            tiles=resolve_tiles(options.chunk_size, hidden_states.shape[0], weight.shape[0],
                                hidden_states.element_size(), hidden_states.device.type,
                                chunk_bytes=options.chunk_bytes, whole_rows=whole_rows),
            release_cache=env.release_cache if options.release_cache is None else options.release_cache,
            eager_kernels=env.eager_kernels,
            transform=options.transform.resolve(hidden_states.dtype),
            vocab_size=weight.shape[0],
        )

    @property
    def kernel_label_smoothing(self) -> float | None:
        """What the kernels take: the value, or None when there is no smoothing (a variant
        whose graph has no smoothing terms)."""
        smoothing = self.options.label_smoothing
        return smoothing if smoothing > 0.0 else None

    def kernel_args(self, vocab_start: int) -> KernelArgs:
        """The kernels' constants for the tile whose first vocabulary column is ``vocab_start``."""
        return KernelArgs(self.options.ignore_index, self.kernel_label_smoothing, self.options.logits_dtype,
                          vocab_start, self.vocab_size, self.transform)

    def variant(self, logits: Tensor, class_weight: Tensor | None) -> tuple:
        """The kernels' compile key: device type, projection dtype (``logits``: a chunk's
        projection, or the hidden states), logits dtype, class weights present, label
        smoothing present, the head transform's form (:meth:`HeadTransform.form`: what it
        does, in which dtype), never a value."""
        return (logits.device.type, logits.dtype, self.options.logits_dtype,
                class_weight is not None, self.kernel_label_smoothing is not None, self.transform.form())
