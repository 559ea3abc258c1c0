"""The tag that ties torch.compile's caches to chunkce's source and options.

The tag that ties torch.compile's caches to chunkce's source and options:
``tag(options) -> "chunkce:<source hash>:<options.cache_key()>"``, appended to
``torch.compiler.config.cache_key_tag`` by the backend and the pre-grad pass's ``uuid()``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import compile_pass.torch_internals as internals
from compile_pass.options import Options

PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def source_hash() -> str:
    """Inductor's hash of every ``.py`` file of the package (walked, sorted by path), their
    relative paths included (a moved file changes it); computed once per process."""
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    names = "\0".join(path.relative_to(PACKAGE_DIR).as_posix() for path in paths)
    return internals.get_hash_for_files(tuple(map(str, paths)), extra=names).hex()


def tag(options: Options) -> str:
    """``chunkce:<source hash>:<options cache key>``."""
    return f"chunkce:{source_hash()}:{options.cache_key()}"
