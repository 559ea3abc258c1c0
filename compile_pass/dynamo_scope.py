"""How Dynamo traces for chunkce: transformers' one-shot logging skipped, for chunkce only.

While Dynamo traces a frame for chunkce (or :func:`compile_pass.explain`), it skips
transformers' ``warning_once`` / ``info_once``, which would break the graph between the lm_head
and the loss (GPT-2); every other backend sees ``ignore_logging_functions`` as stock.
Installed on first use, never on import, for every thread. Why and how: docs/models.md,
"GPT-2, and transformers' one-shot logging".
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import compile_pass.torch_internals as internals

log = logging.getLogger(__name__)

_CONFIG_NAME = "ignore_logging_functions"
SCOPE_ATTR = "_chunkce_dynamo_scope"  # set on a backend callable: its frames are traced in chunkce's scope
_SKIPPED = ("warning_once", "info_once")  # transformers.utils.logging, installed as logging.Logger methods
_UNWRAP = (internals.orig_backend.name, "compiler_fn", "backend", "__wrapped__")
_announced = False


def mark(backend: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``backend`` so Dynamo traces its frames in chunkce's scope; returns it."""
    setattr(backend, SCOPE_ATTR, True)
    return backend


class _ScopedIgnoreSet(set):
    """``ignore_logging_functions`` plus transformers' one-shot loggers while tracing for chunkce."""

    def __contains__(self, item: object) -> bool:
        return super().__contains__(item) or (_is_skipped(item) and _tracing_for_chunkce())


def install() -> None:
    """Make Dynamo's ignore set scope-aware for every thread (idempotent): the config entry's
    default and the calling thread's value."""
    config = internals.dynamo_config.get()
    entry = getattr(config, internals.config_entries.name, {}).get(_CONFIG_NAME)  # absent: this thread only
    if entry is not None and not isinstance(entry.default, _ScopedIgnoreSet):
        entry.default = _ScopedIgnoreSet(entry.default)
    current = getattr(config, _CONFIG_NAME)
    if not isinstance(current, _ScopedIgnoreSet):
        setattr(config, _CONFIG_NAME, _ScopedIgnoreSet(current))


def _is_skipped(item: object) -> bool:
    module = sys.modules.get("transformers.utils.logging")
    return module is not None and any(item is getattr(module, name, None) for name in _SKIPPED)


def _tracing_for_chunkce() -> bool:
    """Whether the frame Dynamo traces now will be compiled by a marked backend."""
    global _announced
    try:
        backend = internals.current_tx().output.compiler_fn
    except Exception:  # noqa: BLE001 - not tracing, or Dynamo's internals moved: behave as stock
        return False
    if not any(getattr(b, SCOPE_ATTR, False) for b in unwrapped(backend)):
        return False
    if not _announced:
        _announced = True
        log.info("chunkce: transformers' warning_once / info_once calls are skipped inside graphs "
                 "traced for chunkce (they would break the graph between the lm_head and the loss)")
    return True


def unwrapped(backend: Any) -> Iterator[Any]:
    """``backend``, then what it wraps, outermost first: Dynamo's WrapBackendDebug ->
    torch.compile's _TorchCompileWrapper -> the backend (-> a test counter's backend)."""
    for _ in range(8):
        if backend is None:
            return
        yield backend
        backend = next((getattr(backend, a) for a in _UNWRAP if getattr(backend, a, None) is not None), None)
