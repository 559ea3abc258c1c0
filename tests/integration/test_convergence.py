"""Convergence in Liger-Kernel's form on three architectures, fp32 and bf16 autocast: 32 AdamW steps on
the example's corpus compiled by stock Inductor and by chunkce from the same weights and batches; every
step's loss, the evaluation's top-k log-probabilities and every final parameter within Liger's
tolerances, and the head rewritten in the training and the evaluation graph.

The code is the benchmark's (``python -m benchmarks.convergence``: all nine architectures) at
:data:`benchmarks.convergence.TEST_SETUP` (2 layers of hidden 32, 4 x 32 tokens a step, the op's
per-tile math eager: ``eager_kernels``), since compiling dominates.
Llama (untied), Granite (its logits divided by ``logits_scaling``) and GPT-2 (the head tied to
the embedding, LayerNorm and GELU layers). The six cases compile many of the same C++ kernels, which
the run's Inductor cache (``conftest``) keys by their source.
"""

from __future__ import annotations

import pytest
import torch._dynamo
from torch._dynamo.utils import counters

from benchmarks.convergence import TEST_SETUP, compare

pytestmark = [pytest.mark.slow, pytest.mark.pinned, pytest.mark.usefixtures("eager_kernels")]


@pytest.fixture(scope="module", autouse=True)
def module_reset():
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "granite", "gpt2"])
def test_chunkce_trains_as_inductor_does(arch, dtype):
    result = compare(arch, dtype, TEST_SETUP)
    assert result.within == (True, True, True), result.line()
    assert (result.sites_rewritten, result.sites_refused) == (2, 0), result.line()  # training and evaluation
    assert result.passed, result.line()
