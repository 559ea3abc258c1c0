"""The pass's stages as named points a caller can hook, and its one rule for a failure.

The pass's stages as named points a caller can hook (to look, or to inject a fault), and its one
rule for a failure (:func:`attempt`: logged at WARNING and tolerated, raised under ``strict``).

    with stages.hooked("rewrite", fail):   # fail(site) runs each time the pass reaches "rewrite"
        fuse_linear_cross_entropy(graph)

A hook that raises is a failure of its stage (docs/design.md, "The pass never breaks a compile").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

POINTS = ("find", "read", "walk", "check", "plan", "fate", "rewrite", "traced", "erased", "take_out",
          "taken_out", "report")
_HOOKS: dict[str, list[Callable[[Any], None]]] = {}
T = TypeVar("T")


@contextlib.contextmanager
def hooked(point: str, hook: Callable[[Any], None]) -> Iterator[None]:
    """Call ``hook(value)`` each time the pass reaches ``point`` while the block runs.

    Raises:
        ValueError: ``point`` is not one of :data:`POINTS`.
    """
    if point not in POINTS:
        raise ValueError(f"chunkce.stages.hooked: expected a point of {POINTS}, got {point!r}")
    _HOOKS.setdefault(point, []).append(hook)
    try:
        yield
    finally:
        _HOOKS[point].remove(hook)


def reached(point: str, value: Any) -> None:
    """The pass is at ``point``: run its hooks."""
    for hook in _HOOKS.get(point, ()):
        hook(value)


def attempt(strict: bool, step: Callable[[], T], fallback: Callable[[Exception], T], what: str, *args: Any) -> T:
    """``step()``; when it raises: under ``strict`` the exception, else ``fallback(exc)`` after a
    WARNING ``chunkce: <what % args>`` with the traceback."""
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - the pass never fails a compile unless strict
        if strict:
            raise
        log.warning("chunkce: " + what, *args, exc_info=True)
        return fallback(exc)
