"""What ties torch.compile's caches to chunkce: a hash of the package's source, plus the options.

    tag(options)  ->  "chunkce:<source hash>:<options.cache_key()>"

The backend adds this tag to ``torch.compiler.config.cache_key_tag`` while its inner
backend compiles (the FX graph and AOTAutograd cache keys include that config);
:meth:`compile_pass.pre_grad.ChunkcePreGradPass.uuid` returns it. So a cache entry
written by another chunkce source, or with other options, never answers.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from compile_pass.options import Options

PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def source_hash() -> str:
    """SHA-256 (hex) of every ``.py`` file of the package, walked and sorted by path;
    computed once per process."""
    hasher = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        hasher.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        hasher.update(b"\0")
        hasher.update(path.read_bytes())
        hasher.update(b"\0")
    return hasher.hexdigest()


def tag(options: Options) -> str:
    """``chunkce:<source hash>:<options cache key>``."""
    return f"chunkce:{source_hash()}:{options.cache_key()}"
