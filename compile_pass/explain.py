"""``explain(model, *args, **kwargs)``: what the pass would do, site by site.

    print(compile_pass.explain(model, input_ids=ids, labels=ids))

Runs one forward through Dynamo with a capturing backend: each captured graph is
copied and the pass runs on the copy (the forward itself runs the original,
uncompiled graph), so nothing is trained, compiled by Inductor or changed. Dynamo
traces as it does for the chunkce backend (:mod:`compile_pass.dynamo_scope`).

Unlike ``torch._dynamo.explain``, it does not reset Dynamo: every other compiled
code (the op's per-chunk kernels, the user's compiled model) keeps its cache.
Each call traces afresh (a new capturing backend never matches an earlier call's
cache entries), and afterwards drops the Dynamo caches that hold its capture's
entries, so repeated calls never reach Dynamo's recompile limit. Those are the
code objects it traced: its own root function, and, where the graph broke, the
model's frames (``forward``, resume functions), whose entries for other backends
go too (they recompile on their next call; logged at DEBUG).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters

from compile_pass import dynamo_scope
from compile_pass.graph.driver import rewrite_losses
from compile_pass.graph.report import PassReport
from compile_pass.graph.returned_logits import take_out_returned_logits
from compile_pass.options import Options

log = logging.getLogger(__name__)


def explain(model: Callable[..., Any], *args: Any, **kwargs: Any) -> PassReport:
    """Report every cross-entropy site ``model(*args, **kwargs)`` reaches.

    One row per site: source line, module, rewritten / refused, reason, the chunk
    size the op would choose, and the bytes of logits the rewrite avoids. A loss
    whose logits arrive as a graph input (the graph broke between projection and
    loss) is named with its cause and a fix, and the graph-break reasons Dynamo
    gave are listed under the table, and so is a projection to the vocabulary of a
    training graph with no site (:mod:`compile_pass.graph.no_site`). Nothing is logged.

    Returns:
        A :class:`compile_pass.graph.report.PassReport`; ``str()`` of it is a table.
    """
    reports: list[PassReport] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        copy = torch.fx.GraphModule(gm, graph)
        fused = rewrite_losses(copy.graph, Options())  # no counters, no logs
        take_out_returned_logits(copy.graph, fused, Options())  # as the backend does: the report says so
        reports.append(fused.report)
        return gm.forward

    def root(*args: Any, **kwargs: Any) -> Any:
        # Dynamo's root frame. Not ``torch.compile(model)``: that roots every module
        # at one wrapper code object, whose cache the user's compiled modules share.
        return model(*args, **kwargs)

    dynamo_scope.mark(capture)  # trace as the chunkce backend does (transformers' one-shot logging skipped)
    dynamo_scope.install()
    breaks_before = dict(counters["graph_break"])
    try:
        torch.compile(root, backend=capture)(*args, **kwargs)
    finally:
        _forget(capture)
    breaks = [reason for reason, n in counters["graph_break"].items() if n > breaks_before.get(reason, 0)]
    return PassReport([record for r in reports for record in r.records], graph_breaks=breaks,
                      unmatched=[record for r in reports for record in r.unmatched])


def _forget(backend: Callable[..., Any]) -> None:
    """Drop Dynamo's caches of every code object holding an entry compiled for ``backend``,
    and Dynamo's reference to ``backend`` (only ``torch._dynamo.reset()`` clears it)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    from torch._dynamo import convert_frame, eval_frame

    def compiled_for(entry_backend: Any) -> bool:
        return any(b is backend for b in dynamo_scope.unwrapped(entry_backend))

    with convert_frame.compile_lock:
        for ref in list(convert_frame.input_codes.seen):
            code = ref()
            entries = _debug_get_cache_entry_list(code) if code is not None else []
            ours = sum(compiled_for(e.backend) for e in entries)
            if not ours:
                continue
            if ours < len(entries):
                log.debug("chunkce.explain: dropping Dynamo's cache of %s (%s:%s), with %d entries of other "
                          "backends; they recompile on their next call", code.co_name, code.co_filename,
                          code.co_firstlineno, len(entries) - ours)
            reset_code(code)
        for key, cached in list(eval_frame.cached_backends.items()):
            if compiled_for(cached):
                del eval_frame.cached_backends[key]
