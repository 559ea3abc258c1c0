"""One walk for an evaluation step's loss and its returned logits' reads: pure queries.

    replacement = one_walk_replacement(site, dead, tiles)   # graph/plan.py, for a site without grad

A loss site without grad whose projection's logits the step returns lazy would walk the vocabulary
twice: once for the loss (the op's forward), once more when the caller reads the returned logits
(an ``argmax`` for a metric). When the loss is the row statistics' (its spelling's ``one_walk``: no
class weight, no label smoothing) and those statistics are exactly what the lazy logits' first read
would compute (the recipe's head: :func:`compile_pass.graph.returned_logits.returned_head`), the
site is replaced by one ``chunkce::linear_statistics`` walk that gives the loss and returns the
statistics, which the lazy logits keep (:func:`compile_pass.lazy_logits.wrap.wrap_compiled`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch.fx import Node

from compile_pass.graph.dtype_chains import cast_chains
from compile_pass.graph.returned_logits import returned_head
from compile_pass.graph.sites import Reshape, Site
from compile_pass.lazy_logits.keys import holds
from compile_pass.op.dtypes import accumulate_dtype


def one_walk_replacement(site: Site, dead: set[Node],
                         tiles: tuple[int | None, int | None]) -> Callable[..., Any] | None:
    """``site``'s replacement that also returns the row statistics of its returned logits'
    head, once the ``dead`` nodes are erased; None where the loss's walk cannot serve the reads:
    a spelling without ``one_walk`` (or its refusal), token rows other than the head's (indexing
    replayed on the hidden states), another scale than the returned logits', or logits that
    the loss and the reads see as different values or accumulate in different dtypes."""
    spelling = site.call.spelling.one_walk
    replacement = spelling(site.call, site.projection) if spelling is not None else None
    found = returned_head(site.projection, dead, tiles)
    if replacement is None or found is None or found[0].sharded:  # a shard walks its own columns
        return None
    head, chain = found
    if not all(isinstance(step, Reshape) for step in site.hidden_plan):
        return None
    if (site.scale is None) != (head.scale is None) or (site.scale is not None and site.scale.node not in chain):
        return None
    loss_dtype, returned_dtype = cast_chains(site)[-1][-1], head.logits_dtype
    same_values = loss_dtype == returned_dtype or (holds(loss_dtype, head.computed_dtype)
                                                   and holds(returned_dtype, head.computed_dtype))
    if not same_values or accumulate_dtype(loss_dtype) != accumulate_dtype(returned_dtype):
        return None
    return partial(replacement, statistics_dtype=returned_dtype)
