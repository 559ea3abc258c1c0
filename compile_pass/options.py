"""Options of the chunkce pass and backend, as one small frozen dataclass.

    torch.compile(model, backend="chunkce", options={"chunk_size": 1024, "strict": True})
    torch.compile(model, backend="chunkce", options={"chunk_bytes": 8 << 20, "grads_in_forward": True})
    torch.compile(model, backend="chunkce", options={"returned_logits": "keep"})  # logits computed in the step
    torch.compile(model, backend="chunkce", options=Options(chunk_size=1024))  # checked here, not at the first call
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from compile_pass.op.checks import check_bool, check_chunking

_INNER_BACKENDS = ("inductor", "aot_eager", "eager")
RETURNED_LOGITS = ("lazy", "keep", "drop")


@dataclass(frozen=True)
class Options:
    """What the pass and the backend take from the user.

    Attributes:
        chunk_size: tokens per tile (the ``n`` of the op's ``[n, Vb]`` tiles) given to
            every rewritten site; None lets the op choose (``CHUNKCE_CHUNK_SIZE`` or the
            automatic size, the device's full-speed floor).
        chunk_bytes: the byte budget of one ``[n, Vb]`` tile of logits at every
            rewritten site (:func:`compile_pass.op.chunking.resolve_tiles`: it sets the
            tile's vocabulary width ``Vb``); None = the op's default
            (``CHUNKCE_CHUNK_BYTES``, else ``DEFAULT_CHUNK_BYTES`` on CPU,
            ``DEFAULT_CHUNK_BYTES_ACCELERATOR`` elsewhere).
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
        returned_logits: backend only: what a step does with logits that fed a
            rewritten loss and that nothing in the graph reads but its output (HF's
            ``outputs.logits``, also through dtype casts, copies and an absorbed scale that
            only the output reads, as accelerate's mixed-precision ``.float()``):

            * ``"lazy"`` (the default; None means it, and becomes it): not computed in the
              step; the step returns a :class:`compile_pass.LazyLogits`, which computes
              them exactly (with autograd) when first read, and raises
              ``StaleLogitsError`` if the head or the hidden states changed since;
            * ``"keep"``: computed in the step and returned, as stock compile does (the
              ``[N, V]`` logits, and their zero gradient in backward);
            * ``"drop"``: not computed; the step returns a
              :class:`compile_pass.DroppedLogits`, which raises on any
              read of values.

            A graph without grad (evaluation) makes such logits lazy under ``"lazy"`` and
            ``"drop"`` alike (``"drop"`` drops training logits only); a site of such a graph whose
            logits are still computed (``"keep"``, another reader) is left as stock (the rewrite
            would only add a projection). ``generate()`` has no loss: real logits. The pre-grad
            pass cannot wrap the compiled graph: there ``"lazy"`` means ``"keep"``, and
            ``"drop"`` is refused. See ``docs/models.md``.
    """

    chunk_size: int | None = None
    strict: bool = False
    inner_backend: str | Callable[..., Any] = "inductor"
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    returned_logits: str | None = "lazy"
    chunk_bytes: int | None = None
    grads_in_forward: bool = False

    def __post_init__(self) -> None:
        check_chunking(self.chunk_size, self.chunk_bytes, self.grads_in_forward, where="chunkce", prefix="option ")
        check_bool("option strict", self.strict, where="chunkce")
        if self.returned_logits is None:
            object.__setattr__(self, "returned_logits", "lazy")  # one spelling: equal options, one cache key
        if self.returned_logits not in RETURNED_LOGITS:
            raise ValueError(f"chunkce: expected option returned_logits to be one of "
                             f"{', '.join(map(repr, RETURNED_LOGITS))}, got {self.returned_logits!r}")
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
        """A stable text of every option (each field, by name, in the class's order): equal
        options give equal keys, in any process. A callable inner backend is named by its
        module and qualified name, an Inductor config by its sorted items."""
        return ";".join(f"{f.name}={_key_text(getattr(self, f.name))}" for f in fields(self))

    def op_options(self) -> dict[str, Any]:
        """What every rewritten site passes the op from these options: the keywords of
        :func:`compile_pass.op.function.chunked_cross_entropy` (``chunk_size`` and
        ``chunk_bytes``, None = automatic, resolved by the op at run time:
        :func:`compile_pass.op.chunking.resolve_tiles`). The one place the pass turns ``Options`` into the op's options;
        ``grads_in_forward`` picks the op per site (:func:`compile_pass.graph.rewrite.rewrite_site`)."""
        return {"chunk_size": self.chunk_size, "chunk_bytes": self.chunk_bytes}


def _key_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}={value[k]!r}" for k in sorted(value)) + "}"
    if callable(value) and not isinstance(value, str):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)
