"""Every ``CHUNKCE_*`` environment variable, read in this one place.

Settings are read on each call of :func:`settings` (a handful of ``os.environ``
lookups), so a change made between two training steps is seen by the next op
call; nothing is cached at import time.

Variables:
    CHUNKCE_CHUNK_SIZE      tokens per chunk for every op call that does not pass
                            ``chunk_size`` (positive int; unset = automatic).
    CHUNKCE_EAGER_KERNELS   ``1`` runs the per-chunk math eagerly instead of
                            compiling it with Inductor (debugging; a device
                            Inductor cannot compile for runs it eagerly anyway,
                            by ``kernels.inductor_compiles_for``).
    CHUNKCE_RELEASE_CACHE   ``1`` returns the allocator's cached blocks to the
                            device after the op's forward and backward.
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
        eager_kernels: run the per-chunk math eagerly (no Inductor).
        release_cache: empty the device allocator's cache after forward and
            backward of the op (a no-op on CPU).
    """

    chunk_size: int | None = None
    eager_kernels: bool = False
    release_cache: bool = False


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def settings() -> Settings:
    """Read the ``CHUNKCE_*`` variables now.

    Raises:
        ValueError: ``CHUNKCE_CHUNK_SIZE`` is set but is not a positive integer.
    """
    raw = os.environ.get("CHUNKCE_CHUNK_SIZE", "").strip()
    chunk_size = None
    if raw:
        try:
            chunk_size = int(raw)
        except ValueError:
            chunk_size = -1
        if chunk_size <= 0:
            raise ValueError(
                f"chunkce: expected CHUNKCE_CHUNK_SIZE to be a positive integer, got {raw!r}"
            )
    return Settings(
        chunk_size=chunk_size,
        eager_kernels=_flag("CHUNKCE_EAGER_KERNELS"),
        release_cache=_flag("CHUNKCE_RELEASE_CACHE"),
    )
