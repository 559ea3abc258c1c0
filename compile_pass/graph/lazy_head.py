"""The head of returned logits as the row-statistics op takes it: a
:class:`compile_pass.lazy_logits.head.Head` for a recipe (:func:`head_of`), so that reads of the lazy
logits that need only row statistics go through the op (:mod:`compile_pass.lazy_logits.reads`).

Read from the recipe's chain (:func:`compile_pass.graph.returned_logits.returned_chain`): the
projection (``linear`` / ``matmul`` / ``+ bias``, a colwise_rep tensor-parallel head's shard),
autocast's dtype, dtype casts, copies and one absorbed scale (:mod:`compile_pass.graph.scale`). None
when the op cannot round as the chain does (casts before or after the scale that are not one
rounding) or an operand is not among the recipe's inputs: reads then compute the logits.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from compile_pass.graph.forms import Projection
from compile_pass.graph.nodes import example_value
from compile_pass.graph.scale import read_scale
from compile_pass.lazy_logits.head import Head
from compile_pass.lazy_logits.keys import holds


def head_of(projection: Projection, chain: list[Node], inputs: list[Node], hidden: Node,
            autocast_dtype: torch.dtype | None, tiles: tuple[int | None, int | None] = (None, None)) -> Head | None:
    """The head of a recipe over ``inputs`` running ``chain`` (``[projection, step, ...,
    returned]``), whose hidden states are the input ``hidden``, read in ``tiles`` (``(chunk_size,
    chunk_bytes)``, None: the op's rule); None when the op cannot take it."""
    position = {node: i for i, node in enumerate(inputs)}
    operands = (hidden, projection.weight, projection.bias)
    if any(node is not None and node not in position for node in operands):
        return None
    segments: list[list[torch.dtype]] = [[example_value(projection.node).dtype]]  # dtypes before / after the scale
    scale = None
    for node in chain[1:]:
        read = read_scale(node)
        if read is not None and read.scale is not None:
            if scale is not None:
                return None
            scale = read.scale
            segments.append([scale.dtype])
        else:
            segments[-1].append(example_value(node).dtype)
    if not all(_one_rounding(dtypes) for dtypes in segments):
        return None
    bias = None if projection.bias is None else position[projection.bias]
    common = dict(hidden=position[hidden], weight=position[projection.weight], bias=bias,
                  logits_dtype=segments[-1][-1], weight_is_hv=projection.weight_is_hv,
                  projection_dtype=autocast_dtype, sharded=projection.sharded is not None,
                  chunk_size=tiles[0], chunk_bytes=tiles[1])
    if scale is None:
        return Head(computed_dtype=segments[0][0], **common)
    value = scale.item if scale.item is not None else scale.value
    if isinstance(value, Node) and value not in position:
        return None
    return Head(computed_dtype=scale.dtype, scale=position[value] if isinstance(value, Node) else value,
                scale_is_input=isinstance(value, Node), divides=scale.divides, scale_dtype=scale.dtype, **common)


def _one_rounding(dtypes: list[torch.dtype]) -> bool:
    """Whether casting through ``dtypes`` rounds as one cast from the first to the last does."""
    return all(holds(dtype, dtypes[0]) for dtype in dtypes[1:-1])
