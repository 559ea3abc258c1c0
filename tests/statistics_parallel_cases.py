"""Per-rank cases for ``tests/op/test_statistics_parallel.py``: the row-statistics op on a vocabulary-sharded
head, on gloo ranks (spawned by ``test_distributed.spawn_ranks``, run by ``vocab_parallel_cases.run_cases``).

Each rank builds the whole head from one seed and holds its ``Shard(0)`` rows as a DTensor on a 1-D
CPU mesh (uneven where V does not divide: 501 / 500 of 1001 on 2 ranks, 251 / 251 / 251 / 248 on 4);
the reference is ``statistics_reference.unfused`` on the whole head in the same process. A case returns
``pairs``: name -> ``(got, expected)`` (this rank's weight and bias gradient rows against the
reference's rows of its shard), compared by the test.
"""

from __future__ import annotations

from typing import Any

import torch
from statistics_reference import OUTPUTS, gradients, problem, recording_backend, unfused, upstream
from vocab_parallel_cases import Shard, run_cases

TILES = {"chunk_size": 4, "chunk_bytes": 4 * 64 * 8}  # [4, 64] fp64 tiles: several a rank
VOCAB = 1001


def _distributed(shard: Shard, full: torch.Tensor | None):
    from torch.distributed.tensor import Shard as Shard0
    from torch.distributed.tensor import distribute_tensor

    return None if full is None else distribute_tensor(full.detach(), shard.mesh, [Shard0(0)]).requires_grad_()


def run_both(shard: Shard, hidden, weight, bias, indices, *, wanted=OUTPUTS, reference=unfused,
             **options) -> dict[str, tuple]:
    """``linear_statistics`` on this rank's DTensor shard against ``reference`` (the unfused
    computation) on the whole head: every output and the gradients (hidden states: the full one;
    weight and bias: this rank's rows)."""
    from compile_pass import linear_statistics

    start, size = shard.rows(*weight.shape)
    w, b = _distributed(shard, weight), _distributed(shard, bias)
    ours = linear_statistics(hidden, w, b, indices, **options)
    theirs = reference(hidden, weight, bias, indices, **options)
    pairs = {name: (getattr(ours, name), getattr(theirs, name)) for name in (*OUTPUTS, "argmax")
             if getattr(ours, name) is not None and getattr(ours, name).numel()}
    grads = upstream(theirs, [name for name in wanted if name in pairs], vocab_size=weight.shape[0])
    mine = gradients(ours, [leaf for leaf in (hidden, w, b) if leaf is not None], grads)
    reference = gradients(theirs, [leaf for leaf in (hidden, weight, bias) if leaf is not None], grads)
    rows = slice(start, start + size)
    pairs["grad_hidden"] = (mine[0], reference[0])
    pairs["grad_weight"] = (mine[1].to_local(), reference[1][rows])
    if bias is not None:
        pairs["grad_bias"] = (mine[2].to_local(), reference[2][rows])
    return pairs


def _problem(dtype=torch.float64, vocab_size=VOCAB, bias=True, seed=0):
    hidden, weight, b, indices = problem(14, 8, vocab_size, num_indices=3, bias=bias, dtype=dtype, seed=seed)
    indices[1] = torch.tensor([vocab_size // 2, vocab_size // 2 - 1, vocab_size // 4])  # about shard boundaries
    return hidden, weight, b, indices


def _sweep(shard: Shard, dtype: torch.dtype, tiles: dict) -> dict[str, Any]:
    from compile_pass.op.kernels import HeadScale

    temperature = torch.rand(14, generator=torch.Generator().manual_seed(4), dtype=dtype) + 0.5
    configurations = {
        "plain": {}, "number": {"temperature": 0.7}, "rows": {"temperature": temperature},
        "rows_multiply_scale": {"temperature": temperature, "temperature_multiplies": True,
                                "transform": HeadScale(0.6)},
        "selected_only": {"row_statistics": False},
        "entropy_and_max_only": {"wanted": ("entropy", "max")},
    }
    pairs = {}
    for bias in (True, False):
        for key, options in configurations.items():
            hidden, weight, b, indices = _problem(dtype, bias=bias)
            result = run_both(shard, hidden, weight, b, indices, **options, **tiles)
            pairs.update({f"bias{int(bias)} {key} {name}": pair for name, pair in result.items()})
    return {"pairs": pairs}


def case_exact_fp64(shard: Shard) -> dict[str, Any]:
    """Temperatures (none, a number, per row, multiplied), a head scale, selected only, a subset of
    output gradients; with and without bias; fp64."""
    return _sweep(shard, torch.float64, TILES)


def case_exact_fp32(shard: Shard) -> dict[str, Any]:
    return _sweep(shard, torch.float32, {"chunk_size": 4, "chunk_bytes": 4 * 64 * 4})


def case_empty_shard(shard: Shard) -> dict[str, Any]:
    """V = 5: on 4 ranks DTensor gives the last rank no rows (2, 2, 1, 0)."""
    hidden, weight, bias, indices = problem(6, 8, 5, num_indices=2, dtype=torch.float64)
    pairs = run_both(shard, hidden, weight, bias, indices, chunk_size=2)
    pairs.update({f"selected_only {name}": pair for name, pair in run_both(
        shard, hidden, weight, bias, indices, row_statistics=False).items()})
    return {"pairs": pairs, "rows": shard.rows(5, 8)}


def case_extremes(shard: Shard) -> dict[str, Any]:
    """``-inf`` columns (all of rank 0's on 4 ranks), the maximum tied across shards (the first column
    wins), logits about 1e3: as the single-device op on the whole head (whose ``0 log 0 = 0`` entropy
    ``tests/op/test_statistics_op.py`` checks; torch's spelling is nan there)."""
    from compile_pass import linear_statistics

    hidden, weight, bias, indices = _problem(bias=True)
    bias = bias.detach().clone()
    bias[:300] = float("-inf")  # rank 0's columns (most of them) masked
    bias += 1e3
    weight = weight.detach().clone()
    weight[700] = weight[100] = hidden[0].detach() * 40  # a tie between ranks for row 0
    bias[700] = bias[100] = 1e3
    hidden, weight, bias = (t.requires_grad_() for t in (hidden.detach(), weight, bias))
    indices[:, 0] = 500
    return {"pairs": run_both(shard, hidden, weight, bias, indices, reference=linear_statistics, **TILES)}


def case_traced_and_compiled(shard: Shard) -> dict[str, Any]:
    """The traceable entry on the local shard under ``torch.compile(fullgraph=True)`` through
    AOTAutograd: exact, and the collectives are nodes of the forward and backward graphs."""
    from compile_pass.op.statistics import chunked_statistics

    graphs: dict[str, list[str]] = {}

    hidden, weight, bias, indices = _problem()
    start, size = shard.rows(*weight.shape)
    local_weight = weight.detach()[start:start + size].clone().requires_grad_()
    local_bias = bias.detach()[start:start + size].clone().requires_grad_()

    def read(hidden, weight, bias):
        outputs = chunked_statistics(hidden, weight, bias, indices, 0.8, vocab_parallel=(start, shard.group_name, VOCAB),
                                     logits_dtype=torch.float64, statistics_dtype=torch.float64, **TILES)
        return (outputs.selected.sum(-1) - outputs.lse + outputs.entropy + outputs.max).sum()

    total = torch.compile(read, backend=recording_backend(graphs), fullgraph=True)(hidden, local_weight, local_bias)
    got = torch.autograd.grad(total, [hidden, local_weight, local_bias])
    reference = unfused(hidden, weight, bias, indices, temperature=0.8)
    expected_total = (reference.selected.sum(-1) - reference.lse + reference.entropy + reference.max).sum()
    expected = torch.autograd.grad(expected_total, [hidden, weight, bias])
    rows = slice(start, start + size)
    pairs = {"total": (total.detach(), expected_total.detach()), "grad_hidden": (got[0], expected[0]),
             "grad_weight": (got[1], expected[1][rows]), "grad_bias": (got[2], expected[2][rows])}
    return {"pairs": pairs, "graphs": graphs}


def case_checkpoint_and_hooks(shard: Shard) -> dict[str, Any]:
    """Non-reentrant checkpointing (its recompute repeats the collectives) under saved-tensor hooks:
    exact; nothing ``[N, V_local]`` reaches the hooks."""
    from torch.utils.checkpoint import checkpoint

    from compile_pass import linear_statistics

    hidden, weight, bias, indices = _problem()
    start, size = shard.rows(*weight.shape)
    w, b = _distributed(shard, weight), _distributed(shard, bias)
    packed = []

    def pack(tensor):
        packed.append(tuple(tensor.shape))
        return tensor

    def read(hidden, w, b):
        outputs = linear_statistics(hidden, w, b, indices, **TILES)
        return (outputs.selected.sum(-1) - outputs.lse + outputs.entropy).sum()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        total = checkpoint(read, hidden, w, b, use_reentrant=False)
    got = torch.autograd.grad(total, [hidden, w, b])
    reference = unfused(hidden, weight, bias, indices)
    expected = torch.autograd.grad((reference.selected.sum(-1) - reference.lse + reference.entropy).sum(),
                                   [hidden, weight, bias])
    rows = slice(start, start + size)
    pairs = {"grad_hidden": (got[0], expected[0]), "grad_weight": (got[1].to_local(), expected[1][rows]),
             "grad_bias": (got[2].to_local(), expected[2][rows])}
    return {"pairs": pairs, "packed": packed, "local_rows": (14, size)}


def case_memory(shard: Shard) -> dict[str, Any]:
    """Peak bytes of this rank's forward and backward above their inputs (and the backward's
    returned gradients), [32, 256] fp32 tiles (32 KiB), against ``[N, V_local]``."""
    from compile_pass import linear_statistics
    from compile_pass.memory import measure_peak_bytes

    tokens, hidden_size, vocab_size, chunk_size, block = 512, 16, 8192, 32, 256
    hidden, weight, _, _ = problem(tokens, hidden_size, vocab_size, num_indices=0, bias=False)
    indices = torch.randint(0, vocab_size, (tokens, 1), generator=torch.Generator().manual_seed(2))
    _, size = shard.rows(vocab_size, hidden_size)
    w = _distributed(shard, weight)
    outputs, forward_peak = measure_peak_bytes(
        linear_statistics, hidden, w, None, indices, chunk_size=chunk_size, chunk_bytes=chunk_size * block * 4)
    total = sum(getattr(outputs, name).sum() for name in OUTPUTS)
    _, backward_peak = measure_peak_bytes(total.backward)
    return {"forward_peak": forward_peak, "backward_peak": backward_peak, "tile_bytes": chunk_size * block * 4,
            "rows_bytes": tokens * size * 4, "vector_bytes": tokens * 4, "hidden_bytes": tokens * hidden_size * 4,
            "weight_bytes": size * hidden_size * 4}


CASES = {
    "exact_fp64": case_exact_fp64,
    "exact_fp32": case_exact_fp32,
    "empty_shard": case_empty_shard,
    "extremes": case_extremes,
    "traced_and_compiled": case_traced_and_compiled,
    "checkpoint_and_hooks": case_checkpoint_and_hooks,
    "memory": case_memory,
}


def run_rank(rank: int, world_size: int, out_dir: str, case_names: list[str]) -> None:
    """Entry of each spawned process (``test_distributed.spawn_ranks``)."""
    run_cases(rank, world_size, out_dir, case_names, CASES)
