"""Every ``CHUNKCE_*`` environment variable, read in this one place at each call of
:func:`settings` (nothing cached). What each does: docs/api.md, "Environment variables".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Settings:
    """Process-wide defaults from the environment; ``None``: the variable is unset."""

    chunk_size: int | None = None
    chunk_bytes: int | None = None
    eager_kernels: bool = False
    release_cache: bool = False


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _positive_int(name: str) -> int | None:
    """``name`` as a positive int, None when unset or blank; ValueError when set otherwise."""
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
    """The ``CHUNKCE_*`` variables now. Raises ValueError: ``CHUNKCE_CHUNK_SIZE`` or
    ``CHUNKCE_CHUNK_BYTES`` set but not a positive integer."""
    return Settings(
        chunk_size=_positive_int("CHUNKCE_CHUNK_SIZE"),
        chunk_bytes=_positive_int("CHUNKCE_CHUNK_BYTES"),
        eager_kernels=_flag("CHUNKCE_EAGER_KERNELS"),
        release_cache=_flag("CHUNKCE_RELEASE_CACHE"),
    )
