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

When: not on ``import compile_pass`` (that changes no torch setting), but on
first use: the import of :mod:`compile_pass.backend` (Dynamo imports it at the
first ``torch.compile(..., backend="chunkce")``, or the user imports
``chunkce_backend``), every chunkce backend call, and every ``explain`` call.

Any thread: Dynamo's config values are per thread (``ContextVar`` overrides; a
thread's first read copies the entry's default). :func:`install` wraps both the
default, so every thread that reads the set later gets the scoped one, and the
calling thread's value. A thread that had read the set before the first use
keeps its copy until a chunkce backend call on it wraps that too: its first
chunkce frame is traced as stock (GPT-2's site is then refused as
``graph_break``, never miscompiled). Compile-start callbacks are no substitute:
``torch._dynamo.reset()`` clears them, and they fire once for all threads.

What a chunkce user gives up: those one-shot messages are not printed from
inside a compiled region (an eager call of the same code still prints them).
Other backends see the set behave as stock: same members, same membership
answers, and adding to it or assigning a new set works as before (a set
assigned later is wrapped again at the next chunkce compile).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

_CONFIG_NAME = "ignore_logging_functions"
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
    """Make Dynamo's ignore set scope-aware for every thread (idempotent; keeps what it holds).

    Wraps the config entry's default (what a thread copies on its first read) and the
    calling thread's current value.
    """
    config = torch._dynamo.config
    entry = getattr(config, "_config", {}).get(_CONFIG_NAME)  # Dynamo's config internals; absent: this thread only
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
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
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
