"""Options of the chunkce pass and backend, one frozen dataclass.

    torch.compile(model, backend="chunkce", options={"chunk_size": 1024, "strict": True})
    torch.compile(model, backend="chunkce", options={"chunk_bytes": 8 << 20, "grads_in_forward": True})
    torch.compile(model, backend="chunkce", options={"returned_logits": "keep"})  # logits computed in the step
    torch.compile(model, backend="chunkce", options=Options(chunk_size=1024))  # checked here, not at the first call
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from compile_pass.op.checks import check_bool, check_chunking


class ReturnedLogits(Enum):
    """The option ``returned_logits``: what the step hands out for logits it need not compute
    (what became of them is :class:`compile_pass.graph.returned_logits.Fate`)."""

    LAZY = "lazy"  # a LazyLogits, computed when read
    KEEP = "keep"  # computed in the step
    DROP = "drop"  # a DroppedLogits


class InnerBackend(Enum):
    """The Dynamo backends chunkce names for compiling the rewritten graph (any other name or a
    callable is taken too)."""

    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"
    EAGER = "eager"


@dataclass(frozen=True)
class Options:
    """What the pass and the backend take from the user (each option in full: docs/api.md).

    Attributes:
        chunk_size: tokens a tile (``n`` of the op's ``[n, Vb]`` tiles) at every rewritten site;
            chunk_bytes: a tile's byte budget (sets ``Vb``). None: the op's
            (:func:`compile_pass.op.tiling.resolve_tiles`).
        grads_in_forward: ``"mean"`` / ``"sum"`` sites compute their gradients during forward
            and hold ``[N, H] + [V, H]`` until backward (docs/op.md, "Grads-in-forward mode").
        strict: raise ``NotImplementedError`` with the reason where a site cannot be rewritten.
        inner_backend: what compiles the rewritten graph: a Dynamo backend name or callable.
        inductor_config: Inductor config patches, for the Inductor inner backend.
        returned_logits: backend only: logits that fed a rewritten loss and that only the graph's
            output reads are ``"lazy"`` (the default; None means it; a :class:`ReturnedLogits`
            or its value): a
            :class:`compile_pass.LazyLogits` that computes them when read; ``"keep"``: computed
            in the step; ``"drop"``: a :class:`compile_pass.DroppedLogits` (docs/models.md).

    Raises:
        ValueError / TypeError: a bad value (the message names the option).
    """

    chunk_size: int | None = None
    strict: bool = False
    inner_backend: str | Callable[..., Any] = "inductor"
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    returned_logits: ReturnedLogits | str | None = ReturnedLogits.LAZY  # a ReturnedLogits once made
    chunk_bytes: int | None = None
    grads_in_forward: bool = False

    def __post_init__(self) -> None:
        check_chunking(self.chunk_size, self.chunk_bytes, self.grads_in_forward, where="chunkce", prefix="option ")
        check_bool("option strict", self.strict, where="chunkce")
        object.__setattr__(self, "returned_logits", _returned_logits(self.returned_logits))
        if self.inner_backend == "chunkce":
            raise ValueError("chunkce: expected option inner_backend to be another backend, got 'chunkce' itself; "
                             "use 'inductor', 'aot_eager' or 'eager'")
        if not (isinstance(self.inner_backend, str) or callable(self.inner_backend)):
            raise TypeError(
                "chunkce: expected option inner_backend to be a backend name "
                f"(e.g. {', '.join(b.value for b in InnerBackend)}) or a callable, got {type(self.inner_backend).__name__}"
            )
        if not isinstance(self.inductor_config, Mapping):
            raise TypeError(
                f"chunkce: expected option inductor_config to be a mapping, got {type(self.inductor_config).__name__}"
            )

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | Options | None) -> Options:
        """Options from the ``options=`` dict torch.compile passes on; ValueError names an unknown
        key, ValueError / TypeError a bad value."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"chunkce: expected options to be a dict, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"chunkce: unknown option {unknown[0]!r}; expected one of {', '.join(sorted(known))}"
            )
        return cls(**options)

    def __hash__(self) -> int:  # inductor_config is a dict: hash the options' text instead
        return hash(self.cache_key())

    def cache_key(self) -> str:
        """A stable text of every option, by name (a callable by its qualified name, a mapping
        sorted): equal options give equal keys in any process."""
        return ";".join(f"{f.name}={_key_text(getattr(self, f.name))}" for f in fields(self))

    @property
    def inductor(self) -> bool:
        """Whether Inductor compiles the rewritten graph."""
        return self.inner_backend == InnerBackend.INDUCTOR.value

    @property
    def tiles(self) -> tuple[int | None, int | None]:
        """``(chunk_size, chunk_bytes)``: the tiles the op walks, as lazy logits' fused reads take them."""
        return self.chunk_size, self.chunk_bytes

    def op_options(self) -> dict[str, Any]:
        """The keywords of :func:`compile_pass.op.loss.chunked_cross_entropy` every rewritten
        site passes from these options (the one conversion)."""
        return {"chunk_size": self.chunk_size, "chunk_bytes": self.chunk_bytes}


def _returned_logits(value: ReturnedLogits | str | None) -> ReturnedLogits:
    """The option as a :class:`ReturnedLogits` (None: ``LAZY``, one spelling: equal options, one cache key)."""
    if value is None:
        return ReturnedLogits.LAZY
    if isinstance(value, ReturnedLogits):
        return value
    try:
        return ReturnedLogits(value)
    except ValueError:
        raise ValueError(f"chunkce: expected option returned_logits to be one of "
                         f"{', '.join(repr(r.value) for r in ReturnedLogits)}, got {value!r}") from None


def _key_text(value: Any) -> str:
    if isinstance(value, Enum):
        return repr(value.value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}={value[k]!r}" for k in sorted(value)) + "}"
    if callable(value) and not isinstance(value, str):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)
