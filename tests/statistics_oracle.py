"""The precision oracle of the row-statistics op (the idea of ``precision_oracle.py``): the op's
fp32 outputs and gradients against fp64, next to torch's own fp32 error.

For each case, fp32 leaves (``statistics_reference.problem``: unit hidden states, logits of std
``spread`` about ``offset``) go through the unfused computation in fp32 (torch) and through
``linear_statistics`` in fp32 (8-token chunks, 128-column tiles: the state online across four
blocks); the reference is the unfused computation in fp64 on the same fp32 values. An error is
``||x - ref|| / ||ref||`` of each output (``QUANTITIES``' first four) and of ``d hidden``,
``d weight``, ``d bias`` of the outputs weighted by fixed random upstream gradients.
"""

from __future__ import annotations

import torch
from statistics_reference import OUTPUTS, gradients, problem, unfused, upstream

from compile_pass.op.statistics import linear_statistics

SHAPE = (96, 32, 509)  # N, H, V
TILES = {"chunk_size": 8, "chunk_bytes": 8 * 128 * 4}
# (name, logit spread, offset, temperature: None, a number, or "rows" ([N] in [0.5, 1.5)))
CASES = (
    ("spread 1", 1.0, 0.0, None),
    ("spread 30", 30.0, 0.0, None),
    ("spread 300", 300.0, 0.0, None),
    ("offset 1e3, spread 1", 1.0, 1e3, None),
    ("spread 30, temperature per row", 30.0, 0.0, "rows"),
    ("offset 1e3, temperature 0.01", 0.01, 1e3, 0.01),
)
QUANTITIES = (*OUTPUTS, "d hidden", "d weight", "d bias")


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def case_errors(spread: float, offset: float, temperature) -> tuple[list[float], list[float]]:
    """(torch's fp32 errors, the op's fp32 errors) against fp64, in ``QUANTITIES`` order."""
    hidden, weight, bias, indices = problem(*SHAPE, num_indices=2, spread=spread, offset=offset)
    if temperature == "rows":
        temperature = torch.rand(SHAPE[0], generator=torch.Generator().manual_seed(7)) + 0.5
    options = {} if temperature is None else {"temperature": temperature}
    leaves64 = [leaf.detach().double().requires_grad_() for leaf in (hidden, weight, bias)]
    reference = unfused(*leaves64, indices, **options)
    grads = upstream(reference, vocab_size=weight.shape[0])

    def values_and_grads(outputs, leaves):
        return [getattr(outputs, name).detach().double() for name in OUTPUTS] + [
            grad.double() for grad in gradients(outputs, leaves, {k: g.float() for k, g in grads.items()})]

    expected = [getattr(reference, name).detach() for name in OUTPUTS] + gradients(reference, leaves64, grads)
    theirs = values_and_grads(unfused(hidden, weight, bias, indices, **options), [hidden, weight, bias])
    ours = values_and_grads(linear_statistics(hidden, weight, bias, indices, **options, **TILES),
                            [hidden, weight, bias])
    return ([relative_error(t, r) for t, r in zip(theirs, expected)],
            [relative_error(o, r) for o, r in zip(ours, expected)])
