"""Every ``CHUNKCE_*`` environment variable, read in this one place.

Settings are read on each call of :func:`settings` (a handful of ``os.environ``
lookups), so a change made between two training steps is seen by the next op
call; nothing is cached at import time.

Variables:
    CHUNKCE_CHUNK_SIZE      tokens a tile (``n``) for every op call that passes no
                            ``chunk_size`` (positive int; unset = automatic).
    CHUNKCE_CHUNK_BYTES     the byte budget of one tile of logits (it sets the tile's
                            vocabulary width ``Vb``) for every op call that passes no
                            ``chunk_bytes`` (positive int; unset = the device's
                            default, ``chunking.default_chunk_bytes``).
                            Each size: the argument, else its variable, else the
                            default (``chunking.resolve_tiles``).
    CHUNKCE_EAGER_KERNELS   ``1`` runs the per-chunk math eagerly instead of
                            compiling it with Inductor (debugging; a device
                            Inductor cannot compile for runs it eagerly anyway,
                            by ``kernel_runner.inductor_compiles_for``).
    CHUNKCE_RELEASE_CACHE   ``1`` returns the allocator's cached blocks to the
                            device after each op call's forward and backward (an
                            allocator policy: no op's schema or argument carries it;
                            ``loops.op_body`` applies it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Settings:
    """Process-wide defaults taken from the environment.

    Attributes:
        chunk_size: tokens per chunk, or ``None`` for the automatic choice.
        chunk_bytes: the byte budget of one chunk's logits, or ``None`` for the default.
        eager_kernels: run the per-chunk math eagerly (no Inductor).
        release_cache: empty the device allocator's cache after forward and
            backward of the op (a no-op on CPU).
    """

    chunk_size: int | None = None
    chunk_bytes: int | None = None
    eager_kernels: bool = False
    release_cache: bool = False


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _positive_int(name: str) -> int | None:
    """The value of ``name`` as a positive int, None when unset or blank.

    Raises:
        ValueError: set but not a positive integer.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"chunkce: expected {name} to be a positive integer, got {raw!r}")
    return value


def settings() -> Settings:
    """Read the ``CHUNKCE_*`` variables now.

    Raises:
        ValueError: ``CHUNKCE_CHUNK_SIZE`` or ``CHUNKCE_CHUNK_BYTES`` is set but is not a
            positive integer.
    """
    return Settings(
        chunk_size=_positive_int("CHUNKCE_CHUNK_SIZE"),
        chunk_bytes=_positive_int("CHUNKCE_CHUNK_BYTES"),
        eager_kernels=_flag("CHUNKCE_EAGER_KERNELS"),
        release_cache=_flag("CHUNKCE_RELEASE_CACHE"),
    )
