"""``compile_pass.linear_statistics`` (the row-statistics op) against the unfused torch computation
of its docstring (``statistics_reference.unfused``): every output and the gradient of every leaf,
over several tiles and token chunks (N 37 in chunks of 8, V 509 in 128-column blocks: four, the
last ragged). Most cases run the per-tile math eagerly (``eager_kernels``); those named compiled
run the kernels Inductor compiles. The slow checks (opcheck, gradcheck, Dynamo, Inductor):
``tests/op/test_statistics_compiled.py``; tensor parallelism: ``tests/op/test_statistics_parallel.py``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from statistics_reference import OUTPUTS, check, gradients, problem, unfused, upstream
from torch._dynamo.utils import counters

from compile_pass import RowStatistics, linear_statistics
from compile_pass.op import kernel_runner, kernels
from compile_pass.op.kernels import HeadScale

TILES = {"chunk_size": 8, "chunk_bytes": 8 * 128 * 4}  # [8, 128] fp32 tiles: 5 token chunks x 4 blocks
FP64_TILES = {"chunk_size": 8, "chunk_bytes": 8 * 128 * 8}
TEMPERATURES = {
    "none": {},
    "number": {"temperature": 0.7},
    "rows": {"temperature": torch.rand(37, generator=torch.Generator().manual_seed(5)) + 0.5},
    "rows_multiply": {"temperature": torch.rand(37, generator=torch.Generator().manual_seed(6)) + 0.5,
                      "temperature_multiplies": True},
    "0-d": {"temperature": torch.tensor(1.3)},
}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the kernels run, and their arguments, in order."""
    calls = []
    real_run = kernel_runner.run
    monkeypatch.setattr(kernel_runner, "run", lambda name, *a: calls.append((name, a)) or real_run(name, *a))
    return calls


@pytest.mark.usefixtures("eager_kernels")
@pytest.mark.parametrize("temperature", sorted(TEMPERATURES))
@pytest.mark.parametrize("num_indices, bias", [(1, False), (3, True), (0, True)], ids=["K1", "K3_bias", "no_indices"])
def test_every_output_and_gradient_over_several_tiles(temperature, num_indices, bias):
    hidden, weight, b, indices = problem(num_indices=num_indices, bias=bias)
    check(hidden, weight, b, indices, **TEMPERATURES[temperature], **TILES)


@pytest.mark.usefixtures("eager_kernels")
@pytest.mark.parametrize("transform", [HeadScale(0.37), HeadScale(2.5, divides=True),
                                       HeadScale.of(torch.tensor(0.5), dtype=torch.float64)],
                         ids=["scale", "divisor", "tensor_scale_fp64"])
def test_head_scale_then_temperature(transform):
    hidden, weight, bias, indices = problem()
    check(hidden, weight, bias, indices, transform=transform, **TEMPERATURES["rows"], **TILES)


def test_compiled_kernels_equal_the_unfused_computation():
    """The kernels Inductor compiles: no temperature; then a per-row one after a head scale."""
    hidden, weight, bias, indices = problem()
    check(hidden, weight, bias, indices, **TILES)
    check(hidden, weight, bias, indices, transform=HeadScale(0.37), **TEMPERATURES["rows"], **TILES)


@pytest.mark.usefixtures("eager_kernels")
def test_fp64_exact():
    hidden, weight, bias, indices = problem(dtype=torch.float64)
    check(hidden, weight, bias, indices, temperature=0.9, **FP64_TILES)


@pytest.mark.usefixtures("eager_kernels")
@pytest.mark.parametrize("options", [
    {"logits_dtype": torch.float32},  # logits.float() after a bf16 projection
    {"statistics_dtype": torch.float32},  # bf16 logits, their statistics read in fp32
    {"statistics_dtype": torch.float32, "temperature": 0.6},
    {},  # bf16 throughout: the statistics in fp32 of bf16 values
], ids=["logits_fp32", "statistics_fp32", "statistics_fp32_temperature", "bf16"])
def test_half_precision_head(options):
    """Tiny bf16 head (bf16 matmuls are emulated on CPU): against the unfused bf16 path."""
    hidden, weight, bias, indices = problem(9, 8, 67, dtype=torch.bfloat16)
    check(hidden, weight, bias, indices, chunk_size=4, chunk_bytes=4 * 16 * 2,
          tolerances={"rtol": 1.6e-2, "atol": 1e-2}, **options)  # rtol: torch's for bf16 (two roundings of ~11)


@pytest.mark.usefixtures("eager_kernels")
def test_random_subsets_of_output_gradients(kernel_calls):
    """Each non-empty subset of the outputs' gradients (the others None): the gradients as torch's;
    the walk runs only for a dense term, and a term absent is None in the backward kernel."""
    hidden, weight, bias, indices = problem()
    subsets = [subset for size in range(1, len(OUTPUTS)) for subset in itertools.combinations(OUTPUTS, size)]
    for subset in random.Random(0).sample(subsets, 8) + [("selected",), ("entropy",), ("row_sum",)]:
        kernel_calls.clear()
        check(hidden, weight, bias, indices, wanted=subset, **TILES)
        backward_calls = [args for name, args in kernel_calls if name == "statistics_backward"]
        dense = ("lse", "entropy", "max", "row_sum")
        assert bool(backward_calls) == any(name in subset for name in dense), subset
        for args in backward_calls:
            tile_grads = args[8:12]  # after variant, eager, 6 tensors: grad_lse, grad_entropy, grad_max, grad_sum
            assert [grad is not None for grad in tile_grads] == [name in subset for name in dense], subset


@pytest.mark.usefixtures("eager_kernels")
def test_zero_gradients_and_an_unused_leaf():
    hidden, weight, bias, indices = problem()
    ours = linear_statistics(hidden, weight, bias, indices, **TILES)
    zeros = {name: torch.zeros_like(getattr(ours, name)) for name in OUTPUTS}
    assert all(grad.abs().sum() == 0 for grad in gradients(ours, [hidden, weight, bias], zeros))
    frozen = weight.detach()
    ours = linear_statistics(hidden, frozen, None, indices, **TILES)
    (grad,) = torch.autograd.grad(ours.entropy.sum() + ours.selected.sum(), [hidden])
    expected = unfused(hidden, frozen, None, indices)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.entropy.sum() + expected.selected.sum(), [hidden])[0])


@pytest.mark.usefixtures("eager_kernels")
def test_argmax_is_the_first_maximum_across_blocks():
    """Ties inside a block and across blocks: the first column, as ``torch.argmax``."""
    hidden, weight, _, _ = problem(1, 8, 509, bias=False)
    hidden, weight = hidden.detach(), weight.detach().clone()
    for column in (300, 141, 140, 10):  # in blocks 2, 1, 1, 0
        weight[column] = hidden[0] * 50
    for first in (10, 140):
        ours, expected = linear_statistics(hidden, weight, **TILES), unfused(hidden, weight)
        assert ours.argmax.tolist() == expected.argmax.tolist() == [first]
        assert ours.max.tolist() == expected.max.tolist()
        weight[10] = 0.0  # now the first maximum is 140, the first of a tie inside a block


@pytest.mark.parametrize("eager", ["1", "0"])
@pytest.mark.parametrize("maximum_only", [False, True])
def test_argmax_of_a_row_with_nan_is_its_first_nan(monkeypatch, eager, maximum_only):
    """nan in a block after a larger finite value (row 0), and again in a later block: ``max`` nan
    and ``argmax`` the first nan, as ``torch.argmax``, the compiled and the eager kernels."""
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", eager)
    hidden, weight, bias, _ = problem(4, 8, 509, seed=5)
    hidden, weight, bias = hidden.detach(), weight.detach().clone(), bias.detach().clone()
    weight[130] = hidden[0] * 50  # row 0's maximum, in block 1 (columns 128-255)
    bias[150] = bias[400] = float("nan")  # every row: nan in blocks 1 and 3, after row 0's maximum
    for first in (140, 150):
        if first == 140:
            weight[140] = float("nan")  # every row's column 140 nan, before the others
        ours = linear_statistics(hidden, weight, bias, maximum_only=maximum_only, **TILES)
        expected = torch.nn.functional.linear(hidden, weight, bias)
        assert ours.argmax.tolist() == expected.argmax(-1).tolist() == [first] * 4
        assert ours.max.isnan().all()
        weight[140] = 0.0


@pytest.mark.parametrize("block", [2 ** 24 - 1, 2 ** 24 + 2])
def test_the_first_column_is_exact_up_to_float32s_integers_and_torchs_beyond(block):
    """The argmax's columns are float32 below 2**24 (every integer exact there) and ``torch.argmax``
    from 2**24 on (in float32 column 2**24 + 1 would be 2**24): the maximum in the last column, and
    a tie at 2**24 - 2 and the last, whose first wins."""
    z = torch.zeros(2, block)
    z[0, -1] = z[1, 2 ** 24 - 2] = z[1, -1] = 1.0
    torch.testing.assert_close(kernels._first_column(z, z.amax(-1)), torch.argmax(z, dim=-1), rtol=0, atol=0)
    assert kernels._first_column(z, z.amax(-1)).tolist() == [block - 1, 2 ** 24 - 2]


@pytest.mark.usefixtures("eager_kernels")
def test_rows_with_minus_infinity():
    """``-inf`` logits (a masked vocabulary): ``0 log 0 = 0``, no gradient at them; the other values and
    gradients are those of the unfused computation over the finite columns; a row of only ``-inf``
    and a row holding ``+inf`` as torch's (``lse`` -inf / inf, the entropy nan)."""
    hidden, weight, bias, indices = problem(num_indices=1)
    masked = torch.zeros(509, dtype=torch.bool)
    masked[torch.randperm(509, generator=torch.Generator().manual_seed(3))[:200]] = True
    keep = (~masked).nonzero().squeeze(1)
    bias_masked = bias.masked_fill(masked, float("-inf"))
    indices = keep[indices % keep.numel()]  # selected columns among the finite ones
    ours = linear_statistics(hidden, weight, bias_masked, indices, **TILES)
    position = torch.full((509,), -1, dtype=torch.int64)
    position[keep] = torch.arange(keep.numel())
    expected = unfused(hidden, weight[keep], bias[keep], position[indices])
    softmax_outputs = [name for name in OUTPUTS if name != "row_sum"]  # the row sum is -inf, as torch's
    for name in softmax_outputs:
        torch.testing.assert_close(getattr(ours, name), getattr(expected, name))
    assert torch.equal(ours.argmax, keep[expected.argmax])
    with_minus_inf = unfused(hidden, weight, bias.masked_fill(masked, float("-inf")), indices)
    assert torch.equal(ours.row_sum, with_minus_inf.row_sum) and bool((ours.row_sum == float("-inf")).all())
    summed = linear_statistics(hidden, weight, bias.masked_fill(masked, float("-inf")), indices, **TILES)
    grads = upstream(summed, ["row_sum"], vocab_size=509)  # every column's gradient, the -inf ones too
    for got, want in zip(gradients(summed, [hidden, weight, bias], grads),
                         gradients(with_minus_inf, [hidden, weight, bias], grads)):
        torch.testing.assert_close(got, want)
    grads = upstream(ours, softmax_outputs)
    got = gradients(ours, [hidden, weight, bias], grads)
    want = gradients(expected, [hidden, weight, bias], grads)
    torch.testing.assert_close(got[0], want[0])
    assert got[1][masked].abs().sum() == 0 and got[2][masked].abs().sum() == 0
    torch.testing.assert_close(got[1][keep], want[1][keep])
    torch.testing.assert_close(got[2][keep], want[2][keep])
    edges = bias.detach().clone().unsqueeze(0).repeat(2, 1)  # the logits of a zero hidden state
    edges[0] = float("-inf")
    edges[1, 7] = float("inf")
    with torch.no_grad():
        for row, (lse, max_) in enumerate(((float("-inf"), float("-inf")), (float("inf"), float("inf")))):
            one = linear_statistics(torch.zeros(1, 24), torch.zeros(509, 24), edges[row], **TILES)
            reference = unfused(torch.zeros(1, 24), torch.zeros(509, 24), edges[row])
            assert one.lse.item() == reference.lse.item() == lse and one.max.item() == max_
            assert one.entropy.isnan().all() and reference.entropy.isnan().all()
            assert one.argmax.item() == reference.argmax.item()


@pytest.mark.usefixtures("eager_kernels")
def test_selected_only_takes_no_walk(kernel_calls):
    """``row_statistics=False``: ``selected`` and its gradients as torch's, no kernel run, the row
    statistics empty; without indices, nothing is computed."""
    hidden, weight, bias, indices = problem()
    for options in ({}, {"temperature": TEMPERATURES["rows"]["temperature"], "transform": HeadScale(0.4)}):
        ours = linear_statistics(hidden, weight, bias, indices, row_statistics=False, **options)
        expected = unfused(hidden, weight, bias, indices, **options)
        torch.testing.assert_close(ours.selected, expected.selected)
        grads = upstream(ours, ("selected",))
        for got, want in zip(gradients(ours, [hidden, weight, bias], grads),
                             gradients(expected, [hidden, weight, bias], grads)):
            torch.testing.assert_close(got, want)
        assert all(getattr(ours, name).shape == (0,) for name in ("lse", "entropy", "max", "argmax", "row_sum"))
    assert kernel_calls == []
    empty = linear_statistics(hidden, weight, bias, None, row_statistics=False)
    assert empty.selected is None and empty.lse.shape == (0,) and empty.argmax.dtype == torch.int64


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_maximum_only_walks_without_the_sums(kernel_calls, monkeypatch, eager):
    """``maximum_only=True``: ``max``, ``argmax``, ``selected`` and their gradients as torch's (ties,
    ``-inf`` columns, a transform and a per-row temperature), ``lse`` and ``entropy`` empty; every
    tile runs the maximum kernel, none the one that sums exponentials."""
    if eager:
        monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")
    hidden, weight, bias, indices = problem()
    weight = weight.detach().clone()
    weight[300] = weight[141] = hidden[0].detach() * 50  # row 0: a tie across blocks, the first wins
    bias = bias.detach().masked_fill(torch.arange(509) % 7 == 0, float("-inf"))
    bias[300] = bias[141] = 0.0
    bias.requires_grad_()
    weight.requires_grad_()
    options = {"temperature": TEMPERATURES["rows"]["temperature"], "transform": HeadScale(0.4), **TILES}
    ours = linear_statistics(hidden, weight, bias, indices, maximum_only=True, **options)
    expected = unfused(hidden, weight, bias, indices, **{k: v for k, v in options.items() if k not in TILES})
    assert ours.argmax[0] == 141 and torch.equal(ours.argmax, expected.argmax)
    torch.testing.assert_close(ours.max, expected.max)
    torch.testing.assert_close(ours.selected, expected.selected)
    assert ours.lse.shape == ours.entropy.shape == ours.row_sum.shape == (0,)
    grads = upstream(ours, ("selected", "max"))
    for got, want in zip(gradients(ours, [hidden, weight, bias], grads),
                         gradients(expected, [hidden, weight, bias], grads)):
        torch.testing.assert_close(got, want)
    forward = [name for name, _ in kernel_calls if name.endswith("forward")]
    assert forward and set(forward) == {"maximum_forward"}, forward


def test_returns_row_statistics_in_the_accumulate_dtype():
    hidden, weight, bias, indices = problem(5, 4, 11)
    with torch.no_grad():
        ours = linear_statistics(hidden, weight, bias, indices, chunk_size=2)
    assert isinstance(ours, RowStatistics)
    assert [getattr(ours, name).dtype for name in OUTPUTS] == [torch.float32] * len(OUTPUTS)
    assert ours.argmax.dtype == torch.int64
    assert ours.selected.shape == (5, 3) and ours.lse.shape == (5,)


# --- memory ---------------------------------------------------------------------------------------

MiB = 2**20


def _peaks(num_tokens, hidden_size, vocab_size, num_indices=1, **options):
    """Peak bytes of the forward (above its inputs) and of the backward (above its inputs and the
    gradients it must return) of selected + lse + entropy + max, the kernels compiled."""
    from compile_pass.memory import measure_peak_bytes

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) * 0.02).requires_grad_()
    indices = torch.randint(0, vocab_size, (num_tokens, num_indices), generator=gen)

    def loss(outputs):
        return sum(getattr(outputs, name).sum() for name in OUTPUTS if getattr(outputs, name).numel())

    loss(linear_statistics(hidden, weight, None, indices, **options)).backward()  # compiles the kernels
    hidden.grad = weight.grad = None
    outputs, forward = measure_peak_bytes(lambda: linear_statistics(hidden, weight, None, indices, **options))
    _, backward = measure_peak_bytes(loss(outputs).backward)
    return forward, backward - (num_tokens * hidden_size + vocab_size * hidden_size) * 4


@pytest.mark.parametrize("threads", ["1", "2"])
def test_working_set_is_one_tile_whatever_the_vocabulary(monkeypatch, threads):
    """1024 tokens x V 8192 / 32768 fp32 (the logits alone: 32 / 128 MiB): forward and backward hold
    one [512, 3584] tile (7 MiB; backward's kernel writes the tile's gradient over it) and [N] vectors;
    on two walk threads, a tile of at most half the budget each ([512, 1408] and [512, 1664]; the
    split's extra [N, H] sum: 64 KiB)."""
    monkeypatch.setenv("CHUNKCE_WALK_THREADS", threads)
    for vocab_size in (8192, 32768):
        forward, backward = _peaks(1024, 16, vocab_size)
        tiles = 7 * MiB if threads == "1" else 2 * {8192: 1408, 32768: 1664}[vocab_size] * 512 * 4
        assert tiles <= forward <= 7 * MiB + 128 * 1024, (vocab_size, forward / MiB)
        assert tiles <= backward <= 7 * MiB + 128 * 1024, (vocab_size, backward / MiB)


@pytest.mark.usefixtures("eager_kernels")
def test_selected_only_working_set_is_the_gathered_rows():
    """``row_statistics=False``: O(N K H), whatever V (the [N, K, H] rows are 256 KiB here)."""
    rows = 1024 * 4 * 16 * 4
    for vocab_size in (8192, 65536):
        forward, backward = _peaks(1024, 16, vocab_size, num_indices=4, row_statistics=False)
        assert rows <= forward <= 2 * rows, (vocab_size, forward)
        assert rows <= backward <= 3 * rows, (vocab_size, backward)


# --- autograd: hooks, checkpointing, double backward -------------------------------------------------


class PackRecorder(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that record what they pack (shape, dtype, storage)."""

    def __init__(self):
        self.packed = []

        def pack(tensor):
            self.packed.append((tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().data_ptr()))
            return tensor

        super().__init__(pack, lambda tensor: tensor)


@pytest.mark.usefixtures("eager_kernels")
def test_saved_tensor_hooks_see_the_inputs_and_row_statistics_only():
    hidden, weight, bias, indices = problem()
    temperature = TEMPERATURES["rows"]["temperature"]
    recorder = PackRecorder()
    with recorder:
        ours = linear_statistics(hidden, weight, bias, indices, temperature=temperature, **TILES)
    inputs = {t.untyped_storage().data_ptr() for t in (hidden, weight, bias, indices, temperature)}
    assert {storage for _, _, storage in recorder.packed} >= inputs
    statistics = [(shape, dtype) for shape, dtype, storage in recorder.packed if storage not in inputs]
    assert sorted(statistics, key=str) == sorted([((37,), torch.float32)] * 3 + [((37,), torch.int64)], key=str)
    grads = upstream(ours, vocab_size=509)
    expected = gradients(unfused(hidden, weight, bias, indices, temperature=temperature), [hidden, weight, bias], grads)
    with torch.autograd.graph.save_on_cpu():
        offloaded = linear_statistics(hidden, weight, bias, indices, temperature=temperature, **TILES)
    for outputs in (ours, offloaded):
        for got, want in zip(gradients(outputs, [hidden, weight, bias], grads), expected):
            torch.testing.assert_close(got, want)


@pytest.mark.usefixtures("eager_kernels")
def test_non_reentrant_checkpointing(kernel_calls):
    from torch.utils.checkpoint import checkpoint

    hidden, weight, bias, indices = problem()

    def read(hidden, weight, bias):
        outputs = linear_statistics(hidden, weight, bias, indices, **TILES)
        return (outputs.selected.sum(-1) - 2 * outputs.lse + outputs.entropy).sum()

    recorder = PackRecorder()
    with recorder:
        total = checkpoint(read, hidden, weight, bias, use_reentrant=False)
    assert all(shape != (37, 509) for shape, _, _ in recorder.packed)
    got = torch.autograd.grad(total, [hidden, weight, bias])
    forward_walks = sum(name == "statistics_forward" for name, _ in kernel_calls)
    assert forward_walks == 2 * 5 * 4  # the forward, then its recompute in backward: 5 chunks x 4 blocks
    reference = unfused(hidden, weight, bias, indices)
    want = torch.autograd.grad((reference.selected.sum(-1) - 2 * reference.lse + reference.entropy).sum(),
                               [hidden, weight, bias])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("eager_kernels")
def test_double_backward_is_refused_naming_the_unfused_computation():
    hidden, weight, bias, indices = problem()
    ours = linear_statistics(hidden, weight, bias, indices, **TILES)
    (grad,) = torch.autograd.grad(ours.lse.sum(), [hidden], create_graph=True)
    with pytest.raises(NotImplementedError, match="chunkce.linear_statistics: double backward.*unfused F.linear"):
        grad.sum().backward()


# --- arguments ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, error, match", [
    ({"hidden_states": torch.randn(2, 3, 24)}, ValueError, "hidden_states of shape \\[N, H\\]"),
    ({"weight": torch.randn(509, 23)}, ValueError, "weight of shape \\[V, 24\\]"),
    ({"weight": torch.randn(509, 24, dtype=torch.float64)}, TypeError, "projection_dtype="),
    ({"bias": torch.randn(508)}, ValueError, "bias of shape \\[509\\]"),
    ({"indices": torch.zeros(37, 2, dtype=torch.int32)}, ValueError, "indices of dtype torch.int64"),
    ({"indices": torch.zeros(36, 2, dtype=torch.int64)}, ValueError, "shape \\[37, K\\]"),
    ({"temperature": torch.ones(36)}, ValueError, "temperature of shape \\[37\\]"),
    ({"temperature": torch.ones(37, requires_grad=True)}, NotImplementedError, "temperature.detach"),
    ({"temperature": "hot"}, TypeError, "temperature to be a number"),
    ({"statistics_dtype": torch.int32}, TypeError, "statistics_dtype to be a floating"),
    ({"transform": 0.5}, TypeError, "HeadScale"),
    ({"row_statistics": 1}, TypeError, "row_statistics to be a bool"),
    ({"chunk_size": 0}, ValueError, "chunk_size to be a positive int"),
])
def test_bad_arguments_are_refused_naming_them(override, error, match):
    hidden, weight, bias, indices = problem()
    arguments = {"hidden_states": hidden, "weight": weight, "bias": bias, "indices": indices} | override
    with pytest.raises(error, match=f"chunkce.linear_statistics: .*{match}"):
        linear_statistics(**arguments)


def test_index_outside_the_vocabulary_raises():
    hidden, weight, bias, indices = problem()
    indices = indices.clone()
    indices[3, 1] = 509
    for row_statistics in (True, False):
        with pytest.raises(RuntimeError, match="expected every index in \\[0, 509\\)"):
            linear_statistics(hidden, weight, bias, indices, row_statistics=row_statistics)


_OPTIONS = ("ScalarType logits_dtype, ScalarType statistics_dtype, float? logit_scale=None, bool scale_divides=False, "
            "ScalarType? scale_dtype=None, float? temperature_value=None, bool temperature_multiplies=False, "
            "bool row_statistics=True, bool maximum_only=False, SymInt? chunk_size=None, SymInt? chunk_bytes=None, "
            "SymInt vocab_start=0, SymInt? vocab_size=None")
_TENSORS = ("Tensor hidden_states, Tensor weight, Tensor? bias, Tensor? indices, Tensor? temperature, "
            "Tensor? logit_scale_tensor")
_STATISTICS = "Tensor row_max, Tensor row_log_sum, Tensor row_mean, Tensor argmax"
SCHEMAS = {
    "linear_statistics": f"({_TENSORS}, *, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
                         "Tensor)",
    "linear_statistics_backward": "(Tensor? grad_selected, Tensor? grad_lse, Tensor? grad_entropy, Tensor? grad_max, "
                                  f"Tensor? grad_sum, {_TENSORS}, {_STATISTICS}, *, bool[] output_mask, {_OPTIONS}) "
                                  "-> (Tensor, Tensor, Tensor)",
    "vocab_parallel_row_statistics": f"(Tensor selected, Tensor lse, Tensor entropy, Tensor max, Tensor row_sum, "
                                     f"{_TENSORS}, {_STATISTICS}, *, str group_name, {_OPTIONS}) "
                                     "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_registered_schemas_are_unchanged(name):
    """Tensors positional, options keyword-only (a graph or a cache entry relies on them)."""
    assert str(getattr(torch.ops.chunkce, name).default._schema) == f"chunkce::{name}{SCHEMAS[name]}"


# --- tracing, meta, recompiles -----------------------------------------------------------------------


def test_traceable_entry_runs_on_fx_proxies_over_fake_tensors():
    """``chunked_statistics`` as the graph pass emits it (``trace_into``: proxies carrying fake values):
    the graph holds the op and tensor methods only, a fake value on every node."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_pass.graph.nodes import trace_into
    from compile_pass.op.statistics import chunked_statistics

    def read(hidden, weight, indices, temperature, **options):
        outputs = chunked_statistics(hidden, weight, None, indices, temperature, **options)
        return outputs.selected.sum(-1) - outputs.lse + outputs.entropy + outputs.max + outputs.argmax

    with FakeTensorMode():
        fakes = [torch.empty(37, 24), torch.empty(509, 24), torch.zeros(37, 3, dtype=torch.int64), torch.ones(37)]
    graph = torch.fx.Graph()
    placeholders = []
    for name, fake in zip(("hidden", "weight", "indices", "temperature"), fakes):
        placeholders.append(graph.placeholder(name))
        placeholders[-1].meta["example_value"] = fake
    out = trace_into(graph, read, *placeholders, logits_dtype=torch.float32, statistics_dtype=torch.float32,
                     transform=HeadScale(0.5), temperature_multiplies=False, row_statistics=True,
                     chunk_size=None, chunk_bytes=None)
    graph.output(out)
    nodes = [node for node in graph.nodes if node.op not in ("placeholder", "output")]
    assert {node.op for node in nodes} <= {"call_function", "call_method"}
    assert sum(node.target is torch.ops.chunkce.linear_statistics.default for node in nodes) == 1
    assert all("example_value" in node.meta for node in nodes)
    assert out.meta["example_value"].shape == (37,)
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    hidden, weight, _, indices = problem(bias=False)
    temperature = TEMPERATURES["rows"]["temperature"]
    with torch.no_grad():
        expected = unfused(hidden, weight, None, indices, transform=HeadScale(0.5), temperature=temperature)
        torch.testing.assert_close(module(hidden, weight, indices, temperature),
                                   expected.selected.sum(-1) - expected.lse + expected.entropy + expected.max
                                   + expected.argmax)


def test_meta_tensors_forward_and_backward():
    hidden = torch.empty(37, 24, device="meta", requires_grad=True)
    weight = torch.empty(509, 24, device="meta", requires_grad=True)
    indices = torch.zeros(37, 2, dtype=torch.int64, device="meta")
    outputs = linear_statistics(hidden, weight, None, indices, temperature=0.5)
    assert outputs.selected.shape == (37, 2) and outputs.argmax.dtype == torch.int64
    grad_hidden, grad_weight = torch.autograd.grad(outputs.entropy.sum() + outputs.selected.sum(), [hidden, weight])
    assert grad_hidden.shape == (37, 24) and grad_weight.shape == (509, 24)


def test_no_kernel_recompile_for_new_lengths_indices_or_temperatures():
    """After one warm-up call: new N (ragged tails, one token), K 1 / 2, new temperature values and
    vocabularies reuse the two compiled kernels."""
    kernel_runner.compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()

    def step(num_tokens, num_indices=3, temperature=0.7, vocab_size=509):
        hidden, weight, bias, indices = problem(num_tokens, 8, vocab_size, num_indices=num_indices, seed=num_tokens)
        outputs = linear_statistics(hidden, weight, bias, indices, temperature=temperature, **TILES)
        sum(getattr(outputs, name).sum() for name in OUTPUTS).backward()

    step(37)
    assert counters["chunkce"]["kernel_graphs"] == 2, dict(counters["chunkce"])  # the forward and backward kernels
    with torch._dynamo.config.patch(error_on_recompile=True):
        for num_tokens in (64, 1, 9, 81):
            step(num_tokens)
        step(37, num_indices=1)
        step(37, num_indices=2, temperature=1.9)
        step(37, vocab_size=97)
    assert counters["chunkce"]["kernel_graphs"] == 2
