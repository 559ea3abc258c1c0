"""The pass as a pre-grad custom pass for stock Inductor; ``uuid()`` is the cache key tag.

    with torch._inductor.config.patch(pre_grad_custom_pass=ChunkcePreGradPass()):
        torch.compile(model, backend="inductor")(...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

import compile_pass.torch_internals as internals
from compile_pass import cache_key
from compile_pass.graph.pipeline import run_pass
from compile_pass.options import Options, ReturnedLogits


class ChunkcePreGradPass(internals.custom_graph_pass.get()):
    """``pre_grad_custom_pass`` for Inductor with ``options`` (``Options`` or a dict;
    ``inner_backend`` and ``inductor_config`` ignored). Returned logits stay computed
    (``"lazy"`` means ``"keep"``: no wrapper around the compiled graph here).

    Raises:
        ValueError: ``returned_logits="drop"``.
    """

    def __init__(self, options: Mapping[str, Any] | Options | None = None) -> None:
        options = Options.from_mapping(options)
        if options.returned_logits is ReturnedLogits.DROP:
            raise ValueError("chunkce: returned_logits='drop' needs the chunkce backend "
                             "(torch.compile(model, backend='chunkce', options=...)); the pre-grad pass cannot "
                             "drop logits")
        self.options = dataclasses.replace(options, returned_logits=ReturnedLogits.KEEP)

    def __call__(self, graph: torch.fx.Graph) -> None:
        run_pass(graph, self.options, subgraphs=False)  # Inductor visits each subgraph itself

    def uuid(self) -> str:
        return cache_key.tag(self.options)
