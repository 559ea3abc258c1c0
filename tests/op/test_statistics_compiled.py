"""The row-statistics op's slow checks: ``torch.library.opcheck`` of its ops on several inputs, an fp64
``gradcheck``, ``torch.compile(fullgraph=True)`` through AOTAutograd (the op one node forward, its
backward op one node backward) and through Inductor (no recompile for a new N), and the compiled
kernels over the fast file's sweep."""

from __future__ import annotations

import pytest
import torch
from statistics_reference import OUTPUTS, check, problem, recording_backend, unfused
from torch._dynamo.testing import CompileCounterWithBackend

from compile_pass import linear_statistics
from compile_pass.op.kernels import HeadScale

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile")]
TILES = {"chunk_size": 8, "chunk_bytes": 8 * 128 * 4}


def _op_inputs(case: int):
    """Small inputs of the ops (V 41 in 8-column tiles), a different option set each case."""
    gen = torch.Generator().manual_seed(case)
    hidden, weight = torch.randn(9, 8, generator=gen), torch.randn(41, 8, generator=gen)
    bias = torch.randn(41, generator=gen) if case != 1 else None
    indices = torch.randint(0, 41, (9, [1, 3, 2, 1][case]), generator=gen) if case != 2 else None
    temperature = torch.rand(9, generator=gen) + 0.5 if case in (1, 3) else None
    scale_tensor, scale_options = (HeadScale(0.5) if case == 2 else HeadScale()).op_arguments()
    arguments = dict(
        **scale_options, logits_dtype=torch.float32, statistics_dtype=torch.float32, chunk_size=[4, None, 2, 3][case],
        chunk_bytes=[4 * 8 * 4, None, 2 * 16 * 4, None][case], temperature_value=0.8 if case == 0 else None,
        temperature_multiplies=case == 3, row_statistics=case != 3 or indices is None, maximum_only=case == 1)
    return (hidden, weight, bias, indices, temperature, scale_tensor), arguments


@pytest.mark.parametrize("case", range(4))
def test_opcheck_forward_and_backward_ops(case):
    inputs, arguments = _op_inputs(case)
    torch.library.opcheck(torch.ops.chunkce.linear_statistics.default, inputs, arguments)
    outputs = torch.ops.chunkce.linear_statistics.default(*inputs, **arguments)
    statistics = (outputs[3], outputs[5], outputs[6], outputs[4])  # row_max, row_log_sum, row_mean, argmax
    gen = torch.Generator().manual_seed(10 + case)
    differentiable = (0, 1, 2, 3, 7)  # selected, lse, entropy, max, row_sum
    grads = [torch.randn(outputs[k].shape, generator=gen) if outputs[k].numel() else None for k in differentiable]
    grads[case % 4] = None  # one absent
    torch.library.opcheck(torch.ops.chunkce.linear_statistics_backward.default, (*grads, *inputs, *statistics),
                          {**arguments, "output_mask": [True, True, inputs[2] is not None]})


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "transform": HeadScale(1.5, divides=True)},
                                     {"row_statistics": False}], ids=["plain", "temperature_divisor", "selected_only"])
def test_gradcheck_fp64(options, monkeypatch):
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")
    hidden, weight, bias, indices = problem(6, 5, 23, dtype=torch.float64)

    def outputs(hidden, weight, bias):
        result = linear_statistics(hidden, weight, bias, indices, chunk_size=2, chunk_bytes=2 * 8 * 8, **options)
        return tuple(getattr(result, name) for name in OUTPUTS if getattr(result, name).numel())

    assert torch.autograd.gradcheck(outputs, (hidden, weight, bias))


def _read(hidden, weight, bias, indices):
    """What an RL loss reads: log-probs of the taken tokens, an entropy bonus, the max (z-loss-like)."""
    outputs = linear_statistics(hidden, weight, bias, indices, temperature=0.9, **TILES)
    return (outputs.selected.squeeze(-1) - outputs.lse - 0.01 * outputs.entropy + 1e-3 * outputs.max ** 2).sum()


def test_dynamo_fullgraph_aot_eager_one_op_node_each_way(monkeypatch):
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")
    graphs = {}
    backend = recording_backend(graphs)

    hidden, weight, bias, indices = problem(num_indices=1)
    compiled = torch.compile(_read, backend=backend, fullgraph=True)
    got = torch.autograd.grad(compiled(hidden, weight, bias, indices), [hidden, weight, bias])
    expected = torch.autograd.grad(_reference_read(hidden, weight, bias, indices), [hidden, weight, bias])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert sum("chunkce.linear_statistics.default" in target for target in graphs["forward"]) == 1, graphs
    assert sum("chunkce.linear_statistics_backward.default" in target for target in graphs["backward"]) == 1, graphs
    assert not any("logsumexp" in target or "softmax" in target for kind in graphs for target in graphs[kind])


def _reference_read(hidden, weight, bias, indices):
    outputs = unfused(hidden, weight, bias, indices, temperature=0.9)
    return (outputs.selected.squeeze(-1) - outputs.lse - 0.01 * outputs.entropy + 1e-3 * outputs.max ** 2).sum()


def test_inductor_no_recompile_for_a_new_number_of_tokens():
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_read, backend=counter, fullgraph=True, dynamic=True)
    for num_tokens in (37, 45, 64):
        hidden, weight, bias, indices = problem(num_tokens, num_indices=1, seed=num_tokens)
        got = torch.autograd.grad(compiled(hidden, weight, bias, indices), [hidden, weight, bias])
        expected = torch.autograd.grad(_reference_read(hidden, weight, bias, indices), [hidden, weight, bias])
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.parametrize("temperature", [{}, {"temperature": 0.7},
                                         {"temperature": torch.rand(37, generator=torch.Generator().manual_seed(5)) + 0.5,
                                          "temperature_multiplies": True}], ids=["none", "number", "rows_multiply"])
@pytest.mark.parametrize("num_indices, bias", [(1, False), (3, True), (0, True)], ids=["K1", "K3_bias", "no_indices"])
def test_compiled_kernels_over_the_sweep(temperature, num_indices, bias):
    hidden, weight, b, indices = problem(num_indices=num_indices, bias=bias)
    check(hidden, weight, b, indices, transform=HeadScale(0.8), **temperature, **TILES)
