"""``compile_pass.linear_statistics`` on a vocabulary-sharded head (a DTensor ``Shard(0)`` weight) on 2
and 4 gloo ranks: every rank gets the global values and gradients of the unfused computation on the
whole head (``statistics_parallel_cases``; V 1001: uneven shards, several [4, 64] tiles a rank), and no
rank holds ``[N, V_local]``. Bounded: the ranks are killed after ``TIMEOUT_S``."""

from __future__ import annotations

import pytest
import statistics_parallel_cases as cases
from test_distributed import spawn_ranks
from test_vocab_parallel_op import assert_pairs

pytestmark = pytest.mark.slow  # spawns ranks

TIMEOUT_S = 420
FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module", params=(2, 4), ids=lambda world: f"{world}ranks")
def spawned(request, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp(f"statistics_parallel{request.param}"))
    return spawn_ranks(list(cases.CASES), out_dir, TIMEOUT_S, request.param, run_rank=cases.run_rank).case


def test_exact_fp64(spawned):
    """Temperatures (a number, per row, multiplied), a head scale, selected only, a subset of output
    gradients, with and without bias: every output, argmax and gradient."""
    per_rank = spawned("exact_fp64")
    assert len(per_rank[0]["pairs"]) >= 2 * 6 * 6
    assert_pairs(per_rank)


def test_exact_fp32(spawned):
    assert_pairs(spawned("exact_fp32"), **FP32)


def test_empty_shard(spawned):
    per_rank = spawned("empty_shard")
    assert_pairs(per_rank)
    assert sum(result["rows"][1] for result in per_rank) == 5


def test_minus_infinity_shards_ties_and_large_logits(spawned):
    assert_pairs(spawned("extremes"))


def test_traceable_entry_compiled_fullgraph_with_the_collectives_in_the_graphs(spawned):
    """Forward: the shard's op, the max and the sums and the argmax min (three all-reduces), the row
    statistics op; backward: the backward op and the hidden-state gradient's all-reduce."""
    for result in spawned("traced_and_compiled"):
        assert_pairs([result])
        forward, backward = result["graphs"]["forward"], result["graphs"]["backward"]
        assert sum("_c10d_functional.all_reduce" in node for node in forward) == 3, forward
        assert sum("chunkce.linear_statistics.default" in node for node in forward) == 1, forward
        assert sum("chunkce.vocab_parallel_row_statistics.default" in node for node in forward) == 1, forward
        assert sum("_c10d_functional.all_reduce" in node for node in backward) == 1, backward
        assert sum("chunkce.linear_statistics_backward.default" in node for node in backward) == 1, backward


def test_checkpointing_under_saved_tensor_hooks(spawned):
    for result in spawned("checkpoint_and_hooks"):
        assert_pairs([result])
        assert result["packed"] and result["local_rows"] not in result["packed"]


def test_memory_is_tiles_and_vectors_not_the_shards_logits(spawned):
    """[32, 256] fp32 tiles (32 KiB; the kernels run eagerly in the ranks: a few tile-sized
    temporaries) and [N] vectors, never [N, V_local] (8 MiB on 2 ranks, 4 MiB on 4)."""
    for rank, result in enumerate(spawned("memory")):
        working = 8 * result["tile_bytes"] + 32 * result["vector_bytes"]
        assert result["forward_peak"] <= working, (rank, result)
        assert result["forward_peak"] < result["rows_bytes"] / 8, (rank, result)
        gradients = 3 * result["hidden_bytes"] + result["weight_bytes"]
        assert result["backward_peak"] <= working + gradients, (rank, result)
        assert result["backward_peak"] < result["rows_bytes"] / 2, (rank, result)
