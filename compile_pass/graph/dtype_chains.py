"""The dtypes a site's logits pass through between the projection and the loss, which the guard
and the rewrite both read."""

from __future__ import annotations

import torch

from compile_pass.graph.nodes import example_value
from compile_pass.graph.sites import Site, StepKind


def logits_dtypes(site: Site) -> list[torch.dtype]:
    """The dtypes the logits pass through: the projection's, each cast's, the scaling's,
    and the dtype the loss is computed in (the cross-entropy output's: fp32 under
    autocast). Consecutive repeats are dropped."""
    chain = [example_value(site.projection.node).dtype]
    chain += [example_value(step.node).dtype for step in site.steps if step.kind in (StepKind.CAST, StepKind.SCALE)]
    chain.append(example_value(site.node).dtype)
    return _dedupe(chain)


def cast_chains(site: Site) -> list[list[torch.dtype]]:
    """The dtype chains between the points where the op rounds the logits: :func:`logits_dtypes`,
    split at the scaling's dtype when there is one."""
    if site.scale is None:
        return [logits_dtypes(site)]
    chains: list[list[torch.dtype]] = [[example_value(site.projection.node).dtype]]
    for step in site.steps:
        if step.kind is StepKind.CAST:
            chains[-1].append(example_value(step.node).dtype)
        elif step.kind is StepKind.SCALE:
            chains[-1].append(site.scale.dtype)
            chains.append([site.scale.dtype])
    chains[-1].append(example_value(site.node).dtype)
    return [_dedupe(chain) for chain in chains]


def _dedupe(chain: list[torch.dtype]) -> list[torch.dtype]:
    """``chain`` without consecutive repeats."""
    return [dtype for i, dtype in enumerate(chain) if i == 0 or dtype != chain[i - 1]]
