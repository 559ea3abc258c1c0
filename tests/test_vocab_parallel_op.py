"""The vocabulary-parallel loss (:mod:`compile_pass.op.vocab_parallel`) on 2 and 4 gloo ranks.

The cases run in spawned ranks (``vocab_parallel_cases.run_rank``), once per world size for the
whole file; each rank holds its ``Shard(0)`` rows of a head as DTensor lays them out (V 1001:
501 / 500 on 2 ranks, 251 / 251 / 251 / 248 on 4) and checks the loss and every gradient (hidden
states, its weight rows, its bias rows) against single-process ``F.cross_entropy(F.linear(...))``
with the whole head. Bounded: the ranks are killed after ``TIMEOUT_S``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import vocab_parallel_cases as cases
from torch.multiprocessing.spawn import ProcessException

from compile_pass.op.transform import HeadTransform
from compile_pass.op.vocab_parallel import vocab_parallel_cross_entropy

TIMEOUT_S = 420
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}  # bf16 projections summed in another order than the unfused path's
WORLD_SIZES = (2, 4)


def spawn_ranks(world_size: int, out_dir: str, timeout_s: float = TIMEOUT_S) -> tuple[list[dict[str, Any]], str]:
    """Run every case on ``world_size`` spawned ranks; kill them all after ``timeout_s``.
    Returns each rank's results and why the run ended early ("" when it did not)."""
    start = time.monotonic()
    context = mp.start_processes(cases.run_rank, args=(world_size, out_dir, list(cases.CASES)),
                                 nprocs=world_size, join=False, start_method="spawn")
    failure = ""
    try:
        while not context.join(timeout=1):
            if time.monotonic() - start > timeout_s:
                failure = f"timed out after {timeout_s:.0f} s; ranks killed"
                break
    except ProcessException as exc:  # a rank raised or died; join() has terminated the others
        failure = str(exc)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(10)
    results = []
    for rank in range(world_size):
        try:
            results.append(torch.load(f"{out_dir}/rank{rank}.pt", weights_only=False))
        except FileNotFoundError:
            results.append({})
    return results, failure


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda world: f"{world}ranks")
def spawned(request, tmp_path_factory):
    results, failure = spawn_ranks(request.param, str(tmp_path_factory.mktemp(f"vocab_parallel{request.param}")))

    def case(name: str) -> list[dict[str, Any]]:
        per_rank = []
        for rank, rank_results in enumerate(results):
            result = rank_results.get(name)
            if result is None:
                pytest.fail(f"rank {rank} did not finish case {name!r}: {failure or 'no result written'}")
            if "error" in result:
                pytest.fail(f"rank {rank} failed in case {name!r}:\n{result['error']}")
            per_rank.append(result)
        return per_rank

    return case


def assert_pairs(per_rank: list[dict[str, Any]], **tolerances) -> None:
    for rank, result in enumerate(per_rank):
        assert result["pairs"]
        for name, (got, expected) in result["pairs"].items():
            assert got.dtype == expected.dtype and got.shape == expected.shape, (rank, name)
            torch.testing.assert_close(got, expected, **tolerances, msg=lambda m, name=name: f"rank {rank} {name}: {m}")


@pytest.mark.slow
def test_exact_fp64_every_reduction_smoothing_class_weights_and_scale(spawned):
    """24 configurations a rank, several [4, 64] tiles a shard, uneven shards, ignored tokens."""
    per_rank = spawned("exact_fp64")
    assert len(per_rank[0]["pairs"]) == 3 * 2 * 2 * 3 * 4  # loss and three gradients each
    assert_pairs(per_rank)


@pytest.mark.slow
def test_exact_fp32_within_1e_5(spawned):
    assert_pairs(spawned("exact_fp32"), **FP32)


@pytest.mark.slow
def test_bf16_head_and_projection_dtype(spawned):
    assert_pairs(spawned("bf16"), **BF16)


@pytest.mark.slow
def test_compiled_fullgraph_traces_the_collectives_forward_and_backward(spawned):
    """``torch.compile(fullgraph=True)`` through AOTAutograd: exact, and the all-reduces are graph
    nodes (two in forward: max, then the sums; one in backward: the hidden-state gradient)."""
    per_rank = spawned("compiled")
    assert_pairs(per_rank, **FP32)
    for result in per_rank:
        graphs = result["graphs"]
        for kind, all_reduces, ops in (("dynamo", 2, "chunkce.vocab_parallel_statistics"),
                                       ("forward", 2, "chunkce.vocab_parallel_statistics"),
                                       ("backward", 1, "chunkce.vocab_parallel_backward")):
            nodes = graphs[kind]
            assert sum("_c10d_functional.all_reduce" in node for node in nodes) == all_reduces, (kind, nodes)
            assert sum("_c10d_functional.wait_tensor" in node for node in nodes) == all_reduces, (kind, nodes)
            assert any(ops in node for node in nodes), (kind, nodes)


@pytest.mark.slow
def test_checkpointing_and_saved_tensor_hooks(spawned):
    per_rank = spawned("checkpoint_and_hooks")
    assert_pairs(per_rank)
    assert all(result["packed"] > 0 for result in per_rank)


@pytest.mark.slow
def test_memory_is_a_tile_and_vectors_not_the_shards_logits(spawned):
    """Forward holds one [32, 256] fp32 tile (32 KiB) and [N] vectors, not [N, V_local] (8 MiB on 2
    ranks, 4 MiB on 4); backward adds the gradients it returns (and the [N, H] hidden-state one's
    all-reduce)."""
    for rank, result in enumerate(spawned("memory")):
        vectors = 32 * 2 * result["vector_bytes"]  # [N]: statistics, int64 targets and masks, the combine
        assert result["forward_peak"] <= result["tile_bytes"] + vectors, (rank, result)
        assert result["forward_peak"] < result["rows_bytes"] / 16, (rank, result)
        gradients = 3 * result["hidden_bytes"] + result["weight_bytes"]  # grad_hidden, its all-reduce, scratch
        assert result["backward_peak"] <= result["tile_bytes"] + gradients + vectors, (rank, result)
        assert result["backward_peak"] < result["rows_bytes"] / 4, (rank, result)


@pytest.mark.slow
def test_empty_shard(spawned):
    per_rank = spawned("empty_shard")
    assert_pairs(per_rank)
    assert sum(result["rows"][1] for result in per_rank) == 5


@pytest.mark.slow
def test_target_outside_the_vocabulary_raises_on_every_rank(spawned):
    for result in spawned("bad_target"):
        assert result["error_message"] is not None and "[0, 1001)" in result["error_message"]


def test_grads_in_forward_is_refused_with_the_fix():
    hidden, weight, target = torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="grads_in_forward.*leave it off"):
        vocab_parallel_cross_entropy(hidden, weight, target, None, None, reduction="mean", vocab_start=0,
                                     vocab_size=10, group_name="unused", grads_in_forward=[True, True, False],
                                     **cases.options(transform=HeadTransform()))
