"""A consumer of the logits as the pass reads it (LossCall, StatisticCall) and a Spelling of one.

A consumer of the logits as the pass reads it (a :class:`LossCall` or a :class:`StatisticCall`),
and how a :class:`Spelling` of one is read and replaced; every spelling is registered in
:data:`compile_pass.graph.spellings.SPELLINGS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torch.fx import Node

from compile_pass.graph.projection import Projection
from compile_pass.graph.refusals import Reason


class StepKind(Enum):
    """How a node between projection and loss treats the logits (the last two: ``Call.passes``)."""

    RESHAPE = "reshape"
    COPY = "copy"
    CAST = "cast"
    INDEX = "index"
    SCALE = "scale"
    LOG_SOFTMAX = "log_softmax"
    NEG = "neg"


class SpellingKind(Enum):
    """What a spelling computes of the logits: a loss (the guard checks its target and arguments)
    or a row statistic (no target, no loss argument)."""

    LOSS = "loss"
    STATISTIC = "statistic"


@dataclass(frozen=True, kw_only=True)
class Call:
    """What every consumer of the logits has, whatever it computes."""

    input: Any  # what the consuming node reads: logits, or log-probabilities of a spelling (a Node when readable)
    spelling: Spelling
    # nodes between the projection and `input` that the walk passes although they are not
    # shape/dtype-only: the log_softmax of a spelling and its negations
    passes: Mapping[Node, StepKind] = field(default_factory=dict)
    class_dim: int = 1  # of an input with 3 or more dims: 1 (torch's losses) or -1
    inner: tuple[Node, ...] = ()  # the spelling's nodes besides the consuming node (erased with it)
    unsupported: str | None = None  # what of this spelling the op cannot reproduce (a LOSS_SPELLING stop)


@dataclass(frozen=True, kw_only=True)
class LossCall(Call):
    """A loss of the logits, every argument spelled out (the defaults: ``F.cross_entropy``'s); an
    argument that is not a constant (a Node) is refused by the guard."""

    target: Any  # class indices [...] (a Node when readable)
    weight: Node | None = None  # class weights
    ignore_index: int | Node = -100
    reduction: str | Node = "mean"
    label_smoothing: float | Node = 0.0


@dataclass(frozen=True, kw_only=True)
class StatisticCall(Call):
    """A row statistic of the logits (one value per row, over the last dim)."""

    keepdim: bool = False


@dataclass(frozen=True)
class Spelling:
    """One spelling: ``read(node) -> Call | None`` and ``replace(call, projection)``.

    ``replace`` gives the function whose traced nodes replace the consuming node, with
    :func:`compile_pass.op.loss.chunked_cross_entropy`'s signature, or the
    :class:`Reason` it has none for this head. ``kind``: what its calls are (a
    :class:`LossCall` or a :class:`StatisticCall`).
    ``one_walk`` (a loss's, optional) gives the replacement that also returns the row statistics of
    its logits (``statistics_dtype=`` added to the signature; it returns ``(loss, lse, entropy,
    max, argmax)``), or None when the loss cannot be computed from them
    (:mod:`compile_pass.graph.plan`).
    """

    name: str  # SiteRecord.spelling
    read: Callable[[Node], Call | None]
    replace: Callable[[Any, Projection], Callable[..., Any] | Reason]
    kind: SpellingKind = SpellingKind.LOSS
    one_walk: Callable[[Any, Projection], Callable[..., Any] | None] | None = None
