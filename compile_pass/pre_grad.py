"""The pass as a pre-grad custom pass for stock Inductor.

    from compile_pass import ChunkcePreGradPass
    with torch._inductor.config.patch(pre_grad_custom_pass=ChunkcePreGradPass()):
        torch.compile(model, backend="inductor")(...)

Inductor's pre-grad graph is the torch-level graph Dynamo captured, so this is
the same pass the ``chunkce`` backend runs. ``uuid()`` is :func:`compile_pass.cache_key.tag`
(the package's source hash plus the options), so the FX graph and AOTAutograd caches
never serve a graph compiled without the pass, by another version of it, or with other options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from compile_pass import cache_key
from compile_pass.graph import fuse_linear_cross_entropy
from compile_pass.options import Options


class ChunkcePreGradPass(CustomGraphPass):
    """``pre_grad_custom_pass`` for Inductor: rewrites ``linear -> cross_entropy`` sites.

    Args:
        options: :class:`compile_pass.options.Options` or a dict of them
            (``chunk_size``, ``strict``; ``inner_backend`` and ``inductor_config``
            are ignored).

    Returned logits stay computed in the step (``returned_logits="lazy"``, the default,
    means ``"keep"`` here): lazy logits need the backend's wrapper around the compiled
    graph, which a pre-grad pass cannot add, so it runs the driver alone, with no
    returned-logits pass (:mod:`compile_pass.graph.returned_logits`). So in a graph
    without grad (evaluation) a site whose logits are returned is left as stock compiles
    it: rewriting it would add a second projection and save nothing
    (``compile_pass.graph.report.LEFT``).

    Raises:
        ValueError: ``returned_logits="drop"``: it needs that wrapper too.
    """

    def __init__(self, options: Mapping[str, Any] | Options | None = None) -> None:
        options = Options.from_mapping(options)
        if options.returned_logits == "drop":
            raise ValueError("chunkce: returned_logits='drop' needs the chunkce backend "
                             "(torch.compile(model, backend='chunkce', options=...)); the pre-grad pass cannot "
                             "drop logits")
        self.options = dataclasses.replace(options, returned_logits="keep")

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_linear_cross_entropy(graph, self.options, subgraphs=False)  # Inductor visits each subgraph itself

    def uuid(self) -> str:
        return cache_key.tag(self.options)
