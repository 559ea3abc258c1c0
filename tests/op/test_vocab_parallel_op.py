"""The vocabulary-parallel loss (:mod:`compile_pass.op.vocab_parallel`) on 2 and 4 gloo ranks.

The cases run in spawned ranks (``vocab_parallel_cases.run_rank``), once per world size for the
whole file; each rank holds its ``Shard(0)`` rows of a head as DTensor lays them out (V 1001:
501 / 500 on 2 ranks, 251 / 251 / 251 / 248 on 4) and checks the loss and every gradient (hidden
states, its weight rows, its bias rows) against single-process ``F.cross_entropy(F.linear(...))``
with the whole head. Bounded: the ranks are killed after ``TIMEOUT_S``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import vocab_parallel_cases as cases
from test_distributed import Spawned
from test_distributed import spawn_ranks as spawn

from compile_pass.op.kernels import HeadScale
from compile_pass.op.loss import chunked_cross_entropy

TIMEOUT_S = 420
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}  # bf16 projections summed in another order than the unfused path's
WORLD_SIZES = (2, 4)


def spawn_ranks(world_size: int, out_dir: str, case_names: list[str] | None = None) -> Spawned:
    """Every rank's results of ``case_names`` (default: every case of ``cases.CASES``):
    test_distributed's bounded spawn, with this file's cases."""
    names = list(cases.CASES) if case_names is None else case_names
    return spawn(names, out_dir, TIMEOUT_S, world_size, run_rank=cases.run_rank)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda world: f"{world}ranks")
def spawned(request, tmp_path_factory):
    """``case(name)``: every rank's result of case ``name`` (a rank's traceback fails the test)."""
    return spawn_ranks(request.param, str(tmp_path_factory.mktemp(f"vocab_parallel{request.param}"))).case


def assert_pairs(per_rank: list[dict[str, Any]], **tolerances) -> None:
    for rank, result in enumerate(per_rank):
        assert result["pairs"]
        for name, (got, expected) in result["pairs"].items():
            assert got.dtype == expected.dtype and got.shape == expected.shape, (rank, name)
            torch.testing.assert_close(got, expected, **tolerances, msg=lambda m, name=name: f"rank {rank} {name}: {m}")


@pytest.mark.slow
def test_exact_fp64_every_reduction_smoothing_class_weights_and_scale(spawned):
    """36 configurations a rank, several [4, 64] tiles a shard, uneven shards, ignored tokens; and an
    ignore_index that is one of another shard's classes."""
    per_rank = spawned("exact_fp64")
    assert len(per_rank[0]["pairs"]) == (3 * 2 * 2 * 3 + 1) * 4  # loss and three gradients each
    assert_pairs(per_rank)
    for result in per_rank:
        assert not result["no_grad"]["requires_grad"]
        torch.testing.assert_close(*result["no_grad"]["loss"])


@pytest.mark.slow
def test_exact_fp32_within_1e_5(spawned):
    """fp32 against the unfused fp32 path. ``grad_hidden_states`` sums ``V`` products of a cancelling
    gradient (softmax minus the smoothed one-hot) with the weight's rows: its absolute error follows the
    summation order of the machine's vector width (AVX2 vs AVX-512), so atol 1e-5 there; the loss and the
    other gradients atol 1e-6. Exactness itself is the fp64 test's."""
    per_rank = spawned("exact_fp32")
    hidden = [{"pairs": {n: p for n, p in r["pairs"].items() if n.endswith("grad_hidden_states")}} for r in per_rank]
    others = [{"pairs": {n: p for n, p in r["pairs"].items() if not n.endswith("grad_hidden_states")}}
              for r in per_rank]
    assert_pairs(hidden, rtol=FP32["rtol"], atol=1e-5)
    assert_pairs(others, **FP32)


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
def test_emitted_with_fx_proxies_as_the_pass_does_and_run(spawned):
    per_rank = spawned("fx_traced")
    assert_pairs(per_rank)
    for result in per_rank:
        assert sum("_c10d_functional.all_reduce" in node for node in result["nodes"]) == 2, result["nodes"]


def test_traces_with_fx_proxies_on_fake_tensors():
    """The graph pass's emission (FX proxies, fake example values; no process group needed to trace):
    only registered ops and tensor methods, a fake value on every node, the loss 0-d."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty(2, 7, 8), torch.empty(251, 8), torch.zeros(2, 7, dtype=torch.int64),
                 torch.empty(251), torch.empty(1001)]
    module = cases.traced_loss("0", fakes, reduction="mean", vocab_start=502, vocab_size=1001,
                               **cases.options(logits_dtype=torch.float32, label_smoothing=0.1,
                                               transform=HeadScale(0.5)))
    nodes = [node for node in module.graph.nodes if node.op not in ("placeholder", "output")]
    assert {node.op for node in nodes} <= {"call_function", "call_method"}
    functions = [str(node.target) for node in nodes if node.op == "call_function"]
    for name, count in (("chunkce.vocab_parallel_statistics", 1), ("chunkce.vocab_parallel_loss", 1),
                        ("_c10d_functional.all_reduce", 2), ("_c10d_functional.wait_tensor", 2)):
        assert sum(name in function for function in functions) == count, functions
    assert all(isinstance(node.meta.get("example_value"), (torch.Tensor, tuple)) for node in nodes), [
        node.format_node() for node in nodes if "example_value" not in node.meta]
    (output,) = next(node for node in module.graph.nodes if node.op == "output").args
    assert output.meta["example_value"].shape == ()


@pytest.mark.slow
def test_dtensor_entry_on_a_colwise_parallel_head(spawned):
    """``compile_pass.linear_cross_entropy`` on ColwiseParallel's DTensor weight and bias (the layout
    decides: the vocabulary-parallel loss): exact, the gradients DTensors of the same layout (a replicated
    DTensor input's: the fp32 hidden-state gradient of a ``sum`` against fp64, no worse than twice the
    unfused fp32 path's error); a plain weight with a DTensor bias, a replicated weight and a plain bias
    with a DTensor weight are refused."""
    per_rank = spawned("dtensor_entry")
    assert_pairs(per_rank, **FP32)
    for result in per_rank:
        op, unfused = result["replicated_grad_errors"]["op"], result["replicated_grad_errors"]["unfused"]
        assert op <= max(2 * unfused, 1e-6), result["replicated_grad_errors"]  # against fp64
        errors = result["refusals"]
        assert errors["plain weight"].startswith("TypeError") and "chunkce.linear_cross_entropy" in errors[
            "plain weight"] and "DTensor" in errors["plain weight"], errors
        assert errors["replicated weight"].startswith("ValueError") and "Shard(0)" in errors["replicated weight"]
        assert errors["plain bias"].startswith("ValueError") and "linear_bias" in errors["plain bias"]


@pytest.mark.slow
def test_inductor_with_compiled_kernels_on_2_ranks(tmp_path):
    """The whole loss compiled by Inductor (``fullgraph=True``) and the per-tile kernels compiled too
    (``CHUNKCE_EAGER_KERNELS=0``), two steps: exact in fp32 on 2 ranks."""
    per_rank = spawn_ranks(2, str(tmp_path), case_names=["inductor"]).case("inductor")
    for result in per_rank:
        assert [tuple(g) for g in result["graphs"]] == [(1, 2), (1, 2)], result  # the loss; 2 kernels; no recompile
    assert_pairs(per_rank, **FP32)


@pytest.mark.slow
def test_checkpointing_and_saved_tensor_hooks(spawned):
    per_rank = spawned("checkpoint_and_hooks")
    assert_pairs(per_rank)
    assert all(result["packed"] > 0 for result in per_rank)


@pytest.mark.slow
def test_memory_is_a_tile_and_vectors_not_the_shards_logits(spawned):
    """Forward holds one [32, 256] fp32 tile (32 KiB) a walk thread and [N] vectors, not [N, V_local]
    (8 MiB on 2 ranks, 4 MiB on 4); backward adds the gradients it returns (and the [N, H]
    hidden-state one's all-reduce), and each walk thread after the first its [N, H] sum."""
    for rank, result in enumerate(spawned("memory")):
        vectors = 32 * 2 * result["vector_bytes"]  # [N]: statistics, int64 targets and masks, the combine
        tiles = result["walk_threads"] * result["tile_bytes"]
        assert result["forward_peak"] <= tiles + vectors, (rank, result)
        assert result["forward_peak"] < result["rows_bytes"] / 16, (rank, result)
        gradients = (3 + result["walk_threads"] - 1) * result["hidden_bytes"] + result["weight_bytes"]
        assert result["backward_peak"] <= tiles + gradients + vectors, (rank, result)
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
        chunked_cross_entropy(hidden, weight, target, None, None, reduction="mean", vocab_start=0,
                                     vocab_size=10, group_name="unused", grads_in_forward=[True, True, False],
                                     **cases.options(transform=HeadScale()))


# The registered schemas, written out (a graph or a cache entry relies on them): the tensors
# positional, then keyword-only the ops' own arguments and the single-device op's options.
_INPUTS = ("Tensor hidden_states, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, "
           "Tensor? logit_scale_tensor")
_OPTIONS = ("SymInt ignore_index, float label_smoothing, ScalarType logits_dtype, SymInt? chunk_size=None, "
            "SymInt? chunk_bytes=None, float? logit_scale=None, bool scale_divides=False, ScalarType? scale_dtype=None")
_SHARD = "SymInt vocab_start, SymInt vocab_size"
SCHEMAS = {
    "vocab_parallel_statistics": f"({_INPUTS}, *, {_SHARD}, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "vocab_parallel_loss": f"(Tensor loss, {_INPUTS}, Tensor row_max, Tensor row_log_sum, *, {_SHARD}, "
                           f"str group_name, {_OPTIONS}) -> Tensor",
    "vocab_parallel_backward": f"(Tensor grad_loss, {_INPUTS}, Tensor row_max, Tensor row_log_sum, *, "
                               f"bool[] output_mask, {_SHARD}, {_OPTIONS}) -> (Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_registered_schemas_are_unchanged(name):
    assert str(getattr(torch.ops.chunkce, name).default._schema) == f"chunkce::{name}{SCHEMAS[name]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3))
def test_opcheck_statistics_and_backward(case):
    """``torch.library.opcheck`` of the two ops that compute (no collective inside either): a shard in
    the middle of V 41 (rows 10..25), with or without bias, smoothing and class weights."""
    gen = torch.Generator().manual_seed(case)
    hidden, weight = torch.randn(9, 8, generator=gen), torch.randn(15, 8, generator=gen)
    target = torch.randint(0, 41, (9,), generator=gen)
    target[case] = -100
    target[case + 1] = 12  # one in the shard
    bias = torch.randn(15, generator=gen) if case != 1 else None
    class_weight = torch.rand(41, generator=gen) if case == 2 else None
    smoothing = [0.0, 0.1, 0.3][case]
    options = {"ignore_index": -100, "label_smoothing": smoothing, "logits_dtype": torch.float32,
               "chunk_size": [4, None, 2][case], "vocab_start": 10, "vocab_size": 41}
    torch.library.opcheck(torch.ops.chunkce.vocab_parallel_statistics.default,
                          (hidden, weight, target, bias, class_weight, None), options)
    row_max, row_log_sum, grad_loss = torch.randn(9, generator=gen) + 3, torch.rand(9, generator=gen) + 2, torch.rand(9)
    torch.library.opcheck(torch.ops.chunkce.vocab_parallel_backward.default,
                          (grad_loss, hidden, weight, target, bias, class_weight, None, row_max, row_log_sum),
                          {**options, "output_mask": [True, True, bias is not None]})
