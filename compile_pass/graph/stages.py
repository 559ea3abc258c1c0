"""The pass's stages as named points a caller can hook, and its one rule for a failure.

The pass's stages as named points a caller can hook (to look, or to inject a fault), and its one
rule for a failure (:func:`tolerant`, on each stage that may fail: logged at WARNING and its
fallback taken, raised under ``strict``).

    with stages.hooked("rewrite", fail):   # fail(site) runs each time the pass reaches "rewrite"
        fuse_linear_cross_entropy(graph)

    @stages.tolerant("could not plan the site {site.node.name}; left it unfused", fallback=_unplanned)
    def _plan_site(site, order): ...
    plan = _plan_site(site, order, strict=options.strict)   # _unplanned(site, order, exc) if it raised

A hook that raises is a failure of its stage (docs/design.md, "The pass never breaks a compile").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
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
        if not _HOOKS[point]:
            del _HOOKS[point]  # no point without hooks is left behind


def reached(point: str, value: Any) -> None:
    """The pass is at ``point``: run its hooks."""
    for hook in _HOOKS.get(point, ()):
        hook(value)


def tolerant(what: str, fallback: Callable[..., Any] | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A stage of the pass that may fail: the decorated ``step`` is called as ``step(*args,
    strict=...)``. When it raises: under ``strict`` the exception, else a WARNING ``chunkce:
    <what>`` with the traceback (``what`` formatted with the step's arguments by name) and
    ``fallback(*args, exc)`` (None without one). A step that takes ``strict`` itself gets it too."""
    def decorate(step: Callable[..., T]) -> Callable[..., T]:
        signature = inspect.signature(step)
        passes_strict = "strict" in signature.parameters

        @functools.wraps(step)
        def run(*args: Any, strict: bool, **kwargs: Any) -> T:
            try:
                return step(*args, **kwargs, **({"strict": strict} if passes_strict else {}))
            except Exception as exc:  # noqa: BLE001 - the pass never fails a compile unless strict
                if strict:
                    raise
                arguments = signature.bind_partial(*args, **kwargs).arguments
                log.warning("chunkce: %s", what.format(**arguments), exc_info=True)
                return fallback(*args, exc) if fallback is not None else None
        return run
    return decorate
