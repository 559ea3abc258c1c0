"""What Dynamo does differently while it traces a graph for chunkce: skip
transformers' one-shot logging calls, so they do not break the graph.

transformers logs advisories with ``logger.warning_once`` / ``logger.info_once``
from inside forward, some on the way from the lm_head to the loss (GPT-2's
``loss_function`` property warns ``loss_type=None ... Using the default loss``).
Dynamo cannot trace a ``logging.Logger`` method: it breaks the graph there, the
logits reach the loss as a graph input, and the pass cannot rewrite the site.

Dynamo skips (runs nothing for, does not break on) the functions in
``torch._dynamo.config.ignore_logging_functions``. Adding transformers' helpers
to that set would change every ``torch.compile`` in the process, whatever its
backend. Instead :func:`install` puts a set there that also holds them, but
only while Dynamo traces a frame whose backend is chunkce's (or
:func:`compile_pass.explain`'s); for every other backend the set behaves as the
one it replaced. Dynamo's guards pin each compiled frame to its backend, so a
frame traced for chunkce is never reused by another backend.

What a chunkce user gives up: those one-shot messages are not printed from
inside a compiled region (an eager call of the same code still prints them).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

SCOPE_ATTR = "_chunkce_dynamo_scope"  # set on a backend callable: its frames are traced in chunkce's scope
_SKIPPED = ("warning_once", "info_once")  # transformers.utils.logging, installed as logging.Logger methods
_UNWRAP = ("_torchdynamo_orig_backend", "compiler_fn", "backend", "__wrapped__")
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
    """Make Dynamo's ignore set scope-aware (idempotent; keeps what it already holds).

    Called on ``import compile_pass`` and again on every chunkce compile, so a set
    assigned in between is wrapped again before the next frame is traced.
    """
    config = torch._dynamo.config
    current = config.ignore_logging_functions
    if not isinstance(current, _ScopedIgnoreSet):
        config.ignore_logging_functions = _ScopedIgnoreSet(current)


def _is_skipped(item: object) -> bool:
    module = sys.modules.get("transformers.utils.logging")
    return module is not None and any(item is getattr(module, name, None) for name in _SKIPPED)


def _tracing_for_chunkce() -> bool:
    """Whether the frame Dynamo traces now will be compiled by a marked backend."""
    global _announced
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # noqa: BLE001 - not tracing, or Dynamo's internals moved: behave as stock
        return False
    for _ in range(8):  # WrapBackendDebug -> _TorchCompileWrapper -> the backend (-> a counter's backend)
        if backend is None:
            return False
        if getattr(backend, SCOPE_ATTR, False):
            if not _announced:
                _announced = True
                log.info("chunkce: transformers' warning_once / info_once calls are skipped inside graphs "
                         "traced for chunkce (they would break the graph between the lm_head and the loss)")
            return True
        backend = next((getattr(backend, a) for a in _UNWRAP if getattr(backend, a, None) is not None), None)
    return False
