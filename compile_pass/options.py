"""Options of the chunkce pass and backend, as one small frozen dataclass.

    torch.compile(model, backend="chunkce", options={"chunk_size": 1024, "strict": True})
    torch.compile(model, backend="chunkce", options={"chunk_bytes": 8 << 20, "grads_in_forward": True})
    torch.compile(model, backend="chunkce", options=Options(chunk_size=1024))  # checked here, not at the first call
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

_INNER_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class Options:
    """What the pass and the backend take from the user.

    Attributes:
        chunk_size: tokens per chunk given to every rewritten site; None lets the
            op choose (``CHUNKCE_CHUNK_SIZE`` or the automatic size).
        chunk_bytes: the byte budget of one chunk's logits at every rewritten site
            (:func:`compile_pass.op.chunking.choose_chunk_size`); None = the op's
            default (``CHUNKCE_CHUNK_BYTES``, else ``DEFAULT_CHUNK_BYTES`` with the
            device's full-speed floor). ``chunk_size`` wins when both are given.
        grads_in_forward: opt-in. Rewritten sites with a ``"mean"`` or ``"sum"``
            reduction compute their gradients during forward
            (:mod:`compile_pass.op.grads_in_forward`: three matmuls a chunk instead of
            four) and hold ``[N, H] + [V, H]`` gradients from forward to backward;
            ``"none"`` keeps the recompute op. Not with activation offloading or
            pipeline parallelism (``docs/op.md``).
        strict: raise ``NotImplementedError`` with the guard's reason when a
            cross-entropy site cannot be rewritten, instead of leaving it unfused.
        inner_backend: what compiles the rewritten graph: ``"inductor"`` (default),
            ``"aot_eager"`` or ``"eager"`` for debugging, any other name
            registered with Dynamo, or a backend callable.
        inductor_config: Inductor config patches, forwarded to ``compile_fx`` as
            ``config_patches`` when the inner backend is Inductor.
        drop_unused_logits: backend only, opt-in. In a training graph (logits
            require grad) whose loss was rewritten, logits that are returned but
            read by nothing else in the graph (HF's ``outputs.logits``, also
            through dtype casts, copies and absorbed scales that only the output
            reads, as accelerate's mixed-precision ``.float()`` on outputs) are not
            computed; the step returns a :class:`compile_pass.graph.logits_drop.DroppedLogits`
            in their place, which has their shape, dtype and device and raises on
            any read of values. See ``docs/models.md``.
    """

    chunk_size: int | None = None
    strict: bool = False
    inner_backend: str | Callable[..., Any] = "inductor"
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    drop_unused_logits: bool = False
    chunk_bytes: int | None = None
    grads_in_forward: bool = False

    def __post_init__(self) -> None:
        for name in ("chunk_size", "chunk_bytes"):
            size = getattr(self, name)
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
                raise ValueError(f"chunkce: expected option {name} to be a positive int or None, got {size!r}")
        for name in ("strict", "drop_unused_logits", "grads_in_forward"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"chunkce: expected option {name} to be a bool, got {type(value).__name__}")
        if self.inner_backend == "chunkce":
            raise ValueError("chunkce: expected option inner_backend to be another backend, got 'chunkce' itself; "
                             "use 'inductor', 'aot_eager' or 'eager'")
        if not (isinstance(self.inner_backend, str) or callable(self.inner_backend)):
            raise TypeError(
                "chunkce: expected option inner_backend to be a backend name "
                f"(e.g. {', '.join(_INNER_BACKENDS)}) or a callable, got {type(self.inner_backend).__name__}"
            )
        if not isinstance(self.inductor_config, Mapping):
            raise TypeError(
                f"chunkce: expected option inductor_config to be a mapping, got {type(self.inductor_config).__name__}"
            )

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | Options | None) -> Options:
        """Options from the ``options=`` dict torch.compile passes on.

        Raises:
            ValueError: a key that is not an option (the message names it), or a bad value.
            TypeError: a value of the wrong type.
        """
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
        """A stable text of every option that changes the rewritten graph or its compilation."""
        inner = self.inner_backend if isinstance(self.inner_backend, str) else getattr(
            self.inner_backend, "__qualname__", repr(self.inner_backend)
        )
        config = ",".join(f"{k}={self.inductor_config[k]!r}" for k in sorted(self.inductor_config))
        return (f"chunk_size={self.chunk_size};strict={self.strict};inner={inner};inductor_config={config};"
                f"drop_unused_logits={self.drop_unused_logits};chunk_bytes={self.chunk_bytes};"
                f"grads_in_forward={self.grads_in_forward}")
