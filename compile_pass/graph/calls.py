"""A consumer of the logits as the pass reads it (:class:`Call`), and how a :class:`Spelling` of
one is read and replaced; every spelling is registered in :data:`compile_pass.graph.spellings.SPELLINGS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.fx import Node

from compile_pass.graph.forms import Projection
from compile_pass.graph.refusals import Reason

LOSS, STATISTIC = "loss", "statistic"  # Spelling.kind


@dataclass(frozen=True)
class Call:
    """A consumer of the logits, every argument spelled out (the defaults: ``F.cross_entropy``'s)."""

    input: Any  # what the consuming node reads: logits, or log-probabilities of a spelling
    target: Any  # class indices [...] (None for a statistic)
    weight: Any  # class weights Node or None
    ignore_index: Any
    reduction: Any
    label_smoothing: Any
    spelling: Spelling
    # nodes between the projection and `input` that the walk passes although they are not
    # shape/dtype-only: the log_softmax of a spelling ("log_softmax") and its negations ("neg")
    passes: Mapping[Node, str] = field(default_factory=dict)
    class_dim: int = 1  # of an input with 3 or more dims: 1 (torch's losses) or -1
    inner: tuple[Node, ...] = ()  # the spelling's nodes besides the consuming node (erased with it)
    unsupported: str | None = None  # what of this spelling the op cannot reproduce (a LOSS_SPELLING stop)
    params: Any = None  # the spelling's own reading, for its replacement

    @property
    def form(self) -> str:
        return self.spelling.name


@dataclass(frozen=True)
class Spelling:
    """One spelling: ``read(node) -> Call | None`` and ``replace(call, projection)``.

    ``replace`` gives the function whose traced nodes replace the consuming node, with
    :func:`compile_pass.op.function.chunked_cross_entropy`'s signature, or the
    :class:`Reason` it has none for this head. ``kind``: :data:`LOSS` (the guard checks the
    call's target and arguments) or :data:`STATISTIC` (a row statistic: no target).
    ``one_walk`` (a loss's, optional) gives the replacement that also returns the row statistics of
    its logits (``statistics_dtype=`` added to the signature; it returns ``(loss, lse, entropy,
    max, argmax)``), or None when the loss cannot be computed from them
    (:mod:`compile_pass.graph.one_walk`).
    """

    name: str  # SiteRecord.form
    read: Callable[[Node], Call | None]
    replace: Callable[[Call, Projection], Callable[..., Any] | Reason]
    kind: str = LOSS
    one_walk: Callable[[Call, Projection], Callable[..., Any] | None] | None = None
