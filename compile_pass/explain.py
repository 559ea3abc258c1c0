"""``explain(model, *args, **kwargs)``: what the pass would do, site by site.

    print(compile_pass.explain(model, input_ids=ids, labels=ids))

Runs one forward through Dynamo with a capturing backend: each captured graph is
copied and the pass runs on the copy (the forward itself runs the original,
uncompiled graph), so nothing is trained, compiled by Inductor or changed. Dynamo
traces as it does for the chunkce backend (:mod:`compile_pass.dynamo_scope`). Like
``torch._dynamo.explain``, it resets Dynamo before and after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters

from compile_pass import dynamo_scope
from compile_pass.graph import fuse_linear_cross_entropy
from compile_pass.options import Options
from compile_pass.graph.report import PassReport


def explain(model: Callable[..., Any], *args: Any, **kwargs: Any) -> PassReport:
    """Report every cross-entropy site ``model(*args, **kwargs)`` reaches.

    One row per site: source line, module, rewritten / refused, reason, the chunk
    size the op would choose, and the bytes of logits the rewrite avoids. A loss
    whose logits arrive as a graph input (the graph broke between projection and
    loss) is named with its cause and a fix, and the graph-break reasons Dynamo
    gave are listed under the table.

    Returns:
        A :class:`compile_pass.graph.report.PassReport`; ``str()`` of it is a table.
    """
    reports: list[PassReport] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        copy = torch.fx.GraphModule(gm, graph)
        reports.append(fuse_linear_cross_entropy(copy.graph, Options()))
        return gm.forward

    dynamo_scope.mark(capture)  # trace as the chunkce backend does (transformers' one-shot logging skipped)

    torch._dynamo.reset()
    breaks_before = dict(counters["graph_break"])
    try:
        torch.compile(model, backend=capture)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    breaks = [reason for reason, n in counters["graph_break"].items() if n > breaks_before.get(reason, 0)]
    return PassReport([record for r in reports for record in r.records], graph_breaks=breaks)
