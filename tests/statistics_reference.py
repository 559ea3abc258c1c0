"""The unfused torch computation :func:`compile_pass.linear_statistics` is exactly, and the inputs
its tests share (a helper of ``tests/op/test_statistics_*.py`` and the rank cases; not a test module).

:func:`unfused` is the docstring's code (``F.linear``, the transform, the casts, the temperature,
``gather`` / ``logsumexp`` / ``softmax * log_softmax`` / ``max`` / ``sum``); :func:`check` runs both on the
same leaves with the same random upstream gradients (for every output, or a subset) and asserts
every output and every gradient with ``torch.testing.assert_close``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.statistics import RowStatistics, linear_statistics
from compile_pass.op.kernels import HeadScale

OUTPUTS = ("selected", "lse", "entropy", "max", "row_sum")  # the differentiable outputs (argmax is an index)


def unfused(hidden_states, weight, bias=None, indices=None, *, logits_dtype=None, projection_dtype=None,
            transform=HeadScale(), temperature=None, temperature_multiplies=False, statistics_dtype=None,
            **_tiles) -> RowStatistics:
    """``linear_statistics``' docstring, in plain torch (materializes ``[N, V]``)."""
    if projection_dtype is not None:
        hidden_states, weight = hidden_states.to(projection_dtype), weight.to(projection_dtype)
        bias = None if bias is None else bias.to(projection_dtype)
    x = F.linear(hidden_states, weight, bias)
    logits_dtype = logits_dtype or x.dtype
    statistics_dtype = statistics_dtype or logits_dtype
    z = transform.resolve(x.dtype).apply(x).to(logits_dtype)
    if temperature is not None:
        opmath = accumulate_dtype(statistics_dtype)
        t = temperature.to(opmath).reshape(-1, 1) if isinstance(temperature, torch.Tensor) else temperature
        z = z.to(opmath) * t if temperature_multiplies else z.to(opmath) / t
    z = z.to(statistics_dtype).to(accumulate_dtype(statistics_dtype))
    lp = z.log_softmax(-1)
    values, argmax = z.max(-1)
    selected = None if indices is None else z.gather(-1, indices)
    return RowStatistics(selected, z.logsumexp(-1), -(lp.exp() * lp).sum(-1), values, argmax, z.sum(-1))


def problem(num_tokens=37, hidden_size=24, vocab_size=509, *, num_indices=3, bias=True, dtype=torch.float32,
            seed=0, spread=1.0, offset=0.0):
    """Leaves ``hidden [N, H]``, ``weight [V, H]`` (logits of std ``spread``), ``bias [V]`` (``offset``
    plus a tenth of that; or None) and ``indices [N, K]`` (None for K = 0, else some at 0 and V - 1)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64)
    hidden = hidden / hidden.norm(dim=1, keepdim=True).clamp_min(1e-6)
    weight = torch.randn(vocab_size, hidden_size, generator=gen, dtype=torch.float64) * spread
    b = offset + 0.1 * spread * torch.randn(vocab_size, generator=gen, dtype=torch.float64)
    indices = None
    if num_indices:
        indices = torch.randint(0, vocab_size, (num_tokens, num_indices), generator=gen)
        indices[0, 0], indices[-1, -1] = 0, vocab_size - 1
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight, b)]
    return leaves[0], leaves[1], leaves[2] if bias else None, indices


def upstream(outputs: RowStatistics, wanted=OUTPUTS, seed=1, vocab_size=None) -> dict:
    """A random gradient for each output in ``wanted`` (a fixed seed), by name; ``row_sum``'s
    divided by ``vocab_size`` (a row mean's: each of the row's columns gets it, so undivided its
    terms in ``d hidden`` would be ``V`` times the others', and their fp32 summation error with them)."""
    gen = torch.Generator().manual_seed(seed)
    grads = {name: torch.randn(getattr(outputs, name).shape, generator=gen, dtype=torch.float64).to(
        getattr(outputs, name).dtype) for name in wanted if getattr(outputs, name) is not None}
    if "row_sum" in grads and vocab_size:
        grads["row_sum"] = grads["row_sum"] / vocab_size
    return grads


def gradients(outputs: RowStatistics, leaves: list, grads: dict) -> list:
    """``d (sum of output * grad) / d leaves`` (None where a leaf gets none)."""
    terms = [(getattr(outputs, name) * grad).sum() for name, grad in grads.items()]
    return list(torch.autograd.grad(sum(terms), leaves, allow_unused=True))


def check(hidden, weight, bias, indices, *, wanted=OUTPUTS, tolerances=None, reference_options=None, **options):
    """``linear_statistics`` against :func:`unfused` on the same leaves: every output (argmax
    exactly) and the gradients of ``hidden``, ``weight``, ``bias`` from the outputs ``wanted``
    (with fp64 leaves for the reference when ``reference_options`` says so). Returns the op's
    outputs."""
    tolerances = tolerances or {}
    ours = linear_statistics(hidden, weight, bias, indices, **options)
    theirs = unfused(hidden, weight, bias, indices, **{**options, **(reference_options or {})})
    for name in (*OUTPUTS, "argmax"):
        got, expected = getattr(ours, name), getattr(theirs, name)
        if got is None or expected is None:
            assert got is None and expected is None, name
            continue
        assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
        torch.testing.assert_close(got, expected, **(tolerances if name != "argmax" else {}),
                                   msg=lambda m, name=name: f"{name}: {m}")
    leaves = [leaf for leaf in (hidden, weight, bias) if leaf is not None and leaf.requires_grad]
    if leaves and wanted:
        grads = upstream(ours, wanted, vocab_size=weight.shape[0])
        for name, got, expected in zip(("hidden", "weight", "bias"), gradients(ours, leaves, grads),
                                       gradients(theirs, leaves, grads)):
            torch.testing.assert_close(got, expected, **tolerances, msg=lambda m, name=name: f"grad {name}: {m}")
    return ours


def recording_backend(graphs: dict):
    """A ``torch.compile`` backend through AOTAutograd (run eagerly) that records the targets of the
    Dynamo graph and of the forward and backward graphs in ``graphs`` (``"dynamo"``, ``"forward"``,
    ``"backward"``)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def keep(kind):
        def compiler(graph, inputs):
            graphs[kind] = [str(node.target) for node in graph.graph.nodes]
            return make_boxed_func(graph)
        return compiler

    def backend(gm, example_inputs):
        graphs["dynamo"] = [str(node.target) for node in gm.graph.nodes]
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    return backend
