"""The op's options, defined once, and their resolution for one call.

:class:`OpOptions` is the one list of what the three custom ops take besides their
tensors: names, types, defaults and order. From it come

* the ops' registered schemas (:func:`op_schema`): an op's leading tensors, the
  options without a default, the op's own arguments (``output_mask``), then the
  options with a default. A new option gets a default and goes last, so every call,
  traced graph and cache entry made before it keeps its meaning;
* the ops' bodies, fakes and ``setup_context``, which read the arguments after the
  leading tensors with :meth:`OpOptions.parse`;
* the ops' calls (:meth:`OpOptions.args`), made by
  :func:`compile_pass.op.function.chunked_cross_entropy`, which the public function
  and the graph pass's rewrite call with the options as keywords
  (:meth:`OpOptions.of`);
* :class:`ChunkPlan`: the options resolved for one call's tensors and environment.

The schema is generated as a string and given to ``torch.library.custom_op(...,
schema=...)``, rather than inferred from a generated Python signature: the string is
what torch registers, stores in graphs and hashes into cache keys, and it is written
here in plain sight (``tests/test_op.py`` pins it); a synthesised ``__signature__``
would hide it behind ``infer_schema``. The op bodies then take their options
positionally: the dispatcher passes every argument up to the last one that differs
from its default, and :meth:`OpOptions.parse` fills in the rest from the defaults.

Adding an option: a field here (with its default), its use in the loops or kernels,
and its argument in the public function (and in the rewrite, if the pass sets it).
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
from compile_pass.op.settings import settings

NAME = "chunkce.linear_cross_entropy"  # how the op names itself in messages
# the leading arguments of the forward ops (the backward op's, between grad_loss and the row statistics)
INPUTS = "Tensor hidden_states, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight"


@dataclass(frozen=True, eq=False)
class OpOptions:
    """What every custom op of the package takes besides its tensors, in schema order."""

    ignore_index: int  # the target value that has no loss and no gradient
    label_smoothing: float  # as F.cross_entropy's; <= 0 is none
    logits_dtype: torch.dtype  # the dtype the loss is computed in (resolved, never None)
    chunk_size: int | None  # tokens per tile; None = automatic (chunking.resolve_tiles)
    release_cache: bool | None  # empty the allocator's cache after the op; None = CHUNKCE_RELEASE_CACHE
    logit_scale: float | None = None  # a Python number's scale
    logit_scale_tensor: Tensor | None = None  # [] a 0-d tensor's scale (not differentiated)
    scale_divides: bool = False  # logits / scale, else logits * scale
    scale_dtype: torch.dtype | None = None  # the dtype it scales in; None = the projection's
    chunk_bytes: int | None = None  # the budget of one tile of logits in bytes; None = automatic

    @classmethod
    def of(cls, *, logit_scale: float | Tensor | None = None, **options: typing.Any) -> OpOptions:
        """The options of a call whose scale, if any, is a Python number or a 0-d tensor
        (or its FX proxy): a number goes to ``logit_scale``, a tensor to
        ``logit_scale_tensor``. Reads no tensor value, so it traces.

        Raises:
            TypeError: a keyword that is not an option's name.
        """
        number = isinstance(logit_scale, numbers.Real)
        return cls(logit_scale=float(logit_scale) if number else None,
                   logit_scale_tensor=None if number else logit_scale, **options)

    @classmethod
    def parse(cls, args: Sequence[typing.Any], extras: int = 0) -> tuple[tuple, OpOptions]:
        """``(the op's own arguments, the options)`` from an op's arguments after its
        leading tensors: the options without a default, ``extras`` arguments of the op's
        own, then the options with a default (trailing ones may be left out)."""
        required = len(_REQUIRED)
        return tuple(args[required:required + extras]), cls(*args[:required], *args[required + extras:])

    def args(self, *extras: typing.Any) -> tuple:
        """The options as an op takes them after its leading tensors, with the op's own
        arguments ``extras`` after those without a default."""
        values = [getattr(self, field.name) for field in _FIELDS]
        return (*values[:len(_REQUIRED)], *extras, *values[len(_REQUIRED):])

    @property
    def scale(self) -> float | Tensor | None:
        """The logits' scale, whichever of the two kinds was given."""
        return self.logit_scale if self.logit_scale_tensor is None else self.logit_scale_tensor

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The options that are tensors (autograd saves them: ``save_for_backward``)."""
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    def without_tensors(self) -> OpOptions:
        """These options with the tensors left out (what ``ctx`` may keep as attributes)."""
        return dataclasses.replace(self, **dict.fromkeys(_TENSOR_FIELDS))

    def with_tensors(self, tensors: Sequence[Tensor | None]) -> OpOptions:
        """These options with :meth:`tensors` put back (after ``ctx.saved_tensors``)."""
        return dataclasses.replace(self, **dict(zip(_TENSOR_FIELDS, tensors, strict=True)))


_FIELDS = dataclasses.fields(OpOptions)
_REQUIRED = [field for field in _FIELDS if field.default is dataclasses.MISSING]
_HINTS = typing.get_type_hints(OpOptions)
_TENSOR_FIELDS = [field.name for field in _FIELDS if Tensor in (_HINTS[field.name], *typing.get_args(_HINTS[field.name]))]
# the schema types of the options' Python types, as torch.library.infer_schema writes them
_SCHEMA_TYPES = {int: "SymInt", float: "float", bool: "bool", torch.dtype: "ScalarType", Tensor: "Tensor"}


def _schema_argument(field: dataclasses.Field) -> str:
    hint = _HINTS[field.name]
    inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    kind = _SCHEMA_TYPES[inner[0]] + "?" if inner else _SCHEMA_TYPES[hint]  # X | None -> X?
    default = "" if field.default is dataclasses.MISSING else f"={field.default!r}"
    return f"{kind} {field.name}{default}"


def op_schema(tensors: str, returns: str, extras: str = "") -> str:
    """A custom op's schema string: the leading arguments ``tensors``, the options without
    a default, the op's own arguments ``extras``, the options with a default, ``->
    returns`` (each in schema syntax, e.g. ``"Tensor grad_loss, Tensor? bias"``)."""
    options = [_schema_argument(field) for field in _FIELDS]
    arguments = [tensors, *options[:len(_REQUIRED)], *([extras] if extras else []), *options[len(_REQUIRED):]]
    return f"({', '.join(arguments)}) -> {returns}"


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """The options of one op call, resolved for its tensors and the environment."""

    options: OpOptions
    tiles: Tiles  # tokens and vocabulary columns a tile, resolved
    release_cache: bool  # resolved
    eager_kernels: bool  # CHUNKCE_EAGER_KERNELS
    # The logits' scaling (kernels.scale_logits): ``logits * scale`` or, with
    # ``options.scale_divides``, ``logits / scale``, in ``scale_dtype``; None: no scaling.
    scale_dtype: torch.dtype | None

    @staticmethod
    def resolve(hidden_states: Tensor, weight: Tensor, options: OpOptions,
                whole_rows: bool = False) -> ChunkPlan:
        """The plan of a call on ``hidden_states [N, H]`` and ``weight [V, H]``:
        the tiles (``chunk_size`` and ``chunk_bytes`` None are automatic; tiles of whole
        rows for the grads-in-forward op:
        :func:`~compile_pass.op.chunking.resolve_tiles`) and ``release_cache`` None
        (``CHUNKCE_*``) are resolved; ``scale_dtype`` None with a scale is the
        projection dtype (the hidden states').

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
            scale_dtype=None if options.scale is None else (options.scale_dtype or hidden_states.dtype),
        )

    @property
    def kernel_label_smoothing(self) -> float | None:
        """What the kernels take: the value, or None when there is no smoothing (a variant
        whose graph has no smoothing terms)."""
        smoothing = self.options.label_smoothing
        return smoothing if smoothing > 0.0 else None

    @property
    def kernel_scale(self) -> tuple:
        """The kernels' scaling arguments: ``(logit_scale, scale_divides, scale_dtype)``."""
        return self.options.scale, self.options.scale_divides, self.scale_dtype

    def variant(self, logits: Tensor, class_weight: Tensor | None) -> tuple:
        """The kernels' compile key: device type, projection dtype (``logits``: a chunk's
        projection, or the hidden states), logits dtype, class weights present, label
        smoothing present, the scaling's form (none, or multiply / divide, by a
        Python number or a tensor, in which dtype), never its value."""
        scale = self.options.scale
        form = None if scale is None else ("div" if self.options.scale_divides else "mul",
                                           "tensor" if isinstance(scale, Tensor) else "number",
                                           self.scale_dtype)
        return (logits.device.type, logits.dtype, self.options.logits_dtype,
                class_weight is not None, self.kernel_label_smoothing is not None, form)
