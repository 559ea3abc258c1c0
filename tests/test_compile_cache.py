"""Warm restarts hit the compile caches, as for stock Inductor.

The rewritten graph holds only ``torch.ops.chunkce.*`` and torch ops, so
AOTAutograd's cache accepts it (a Python callable in the graph makes it bypass
the cache, so every new process recompiled from scratch). Each case runs the
first training step in two fresh processes sharing one cache directory
(``benchmarks/warm_start.py``, which also times it) and asserts the cache
counters of the second one, and that what it loaded is the rewritten graph.
"""

import pytest

from benchmarks.warm_start import run_in_fresh_process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["toy", "llama"])
def test_second_process_loads_the_rewritten_graph_from_the_caches(model, tmp_path):
    cold = run_in_fresh_process(model, "chunkce", str(tmp_path))
    warm = run_in_fresh_process(model, "chunkce", str(tmp_path))
    for run in (cold, warm):
        assert run["chunkce"]["sites_rewritten"] == 1, run
        assert run["op_in_code"], run  # Inductor's code calls the op: the site is rewritten in what ran
    assert cold["aot_autograd"]["autograd_cache_bypass"] == 0, cold
    assert cold["aot_autograd"]["autograd_cache_miss"] >= 1, cold
    # Every graph (the model's and the op's per-chunk kernels) comes from the caches.
    assert warm["aot_autograd"] == {"autograd_cache_hit": cold["aot_autograd"]["autograd_cache_miss"],
                                    "autograd_cache_miss": 0, "autograd_cache_bypass": 0}, warm
    assert warm["inductor"]["fxgraph_cache_miss"] == 0 and warm["inductor"]["fxgraph_cache_hit"] >= 1, warm
    assert warm["loss"] == cold["loss"] and warm["grad_sum"] == cold["grad_sum"]


def test_other_chunkce_options_do_not_answer_from_the_cache(tmp_path):
    """The backend tags the inner compile with its options and source: ``strict=True`` leaves
    the rewritten graph as it was, yet the model's graph misses; the per-chunk kernels,
    compiled outside the backend, still hit."""
    cold = run_in_fresh_process("toy", "chunkce", str(tmp_path))
    strict = run_in_fresh_process("toy", "chunkce", str(tmp_path), options={"strict": True})
    misses = cold["aot_autograd"]["autograd_cache_miss"]  # the model and the two kernels
    assert strict["aot_autograd"] == {"autograd_cache_hit": misses - 1, "autograd_cache_miss": 1,
                                      "autograd_cache_bypass": 0}, strict
    assert strict["loss"] == cold["loss"]
