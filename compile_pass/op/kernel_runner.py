"""How the per-chunk kernels run: compiled by Inductor once per variant, or eagerly.

How the per-chunk kernels run: compiled by Inductor for the input's device once per variant
(dynamic shapes, ``emulate_precision_casts``), or eagerly where Inductor cannot compile for the
device (:func:`inductor_compiles_for`), under ``CHUNKCE_EAGER_KERNELS=1``, a dispatch mode or a
functorch transform. Why each setting: docs/op.md, "Per-chunk kernels".
"""

from __future__ import annotations

import contextlib
import functools
import re
import types
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import kernels

_MODULES = (kernels,)  # the kernels' modules, searched by function name
_RECORDS = (kernels.KernelArgs, kernels.StatisticsArgs)  # their constants' records
_RUN_HOOKS: list[Callable[[str, tuple], None]] = []


def _kernel(fn_name: str):
    return next(getattr(module, fn_name) for module in _MODULES if hasattr(module, fn_name))


@contextlib.contextmanager
def hooked_runs(hook: Callable[[str, tuple], None]) -> Iterator[None]:
    """Call ``hook(fn_name, variant)`` each time :func:`run` is about to run a compiled kernel,
    while the block runs (to look, or to inject a fault: what the hook raises, ``run`` raises)."""
    _RUN_HOOKS.append(hook)
    try:
        yield
    finally:
        _RUN_HOOKS.remove(hook)


@functools.cache
def compiled(fn_name: str, variant: tuple):
    """The kernel ``fn_name`` compiled for ``variant``, once (one code object per variant: its
    own Dynamo cache and recompile limit)."""
    fn = _kernel(fn_name)
    suffix = re.sub(r"\W+", "_", "_".join(map(str, variant)))
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{suffix}")
    clone = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__)
    # emulate_precision_casts: a cast to half precision rounds as it does eagerly
    return torch.compile(clone, dynamic=True, fullgraph=True,
                         options={"emulate_precision_casts": True})


@functools.cache
def inductor_compiles_for(device_type: str) -> bool:
    """Whether Inductor can compile the kernels for ``device_type`` (decided once, never learnt
    from a failed compile): a code generator is registered for it and its compiler (C++ for
    CPU, Triton for CUDA / XPU) is present."""
    internals.init_backend_registration()
    if internals.get_scheduling_for_device(device_type) is None:
        return False
    if device_type == "cpu" and internals.inductor_config.get().cpu_backend == "cpp":
        try:
            internals.get_cpp_compiler()
        except internals.invalid_cxx_compiler.get():
            return False
    if device_type in ("cuda", "xpu"):
        return internals.has_triton()
    return True


@functools.cache
def _hot_path() -> tuple:
    """The private torch names each kernel call reaches, resolved once per process (a per-tile lookup
    cost more than the tile's own bookkeeping): dispatch mode, functorch, fx config, autograd guard,
    counters."""
    return (internals.get_current_dispatch_mode.get(), internals.are_functorch_transforms_active.get(),
            internals.fx_config.get(), internals.below_autograd.get(), internals.counters.get())


def _plain_context() -> bool:
    """False under a dispatch mode or a functorch transform (the kernel runs eagerly there)."""
    dispatch_mode, functorch_active = _hot_path()[:2]
    return dispatch_mode() is None and not functorch_active()


def _symbolic(args: tuple) -> list:
    """The kernel's arguments as its compiled graph takes them: tensors and records detached,
    the logits' token dim unbacked (docs/op.md, "Per-chunk kernels")."""
    args = [arg.detach() if isinstance(arg, Tensor) else
            arg.detached() if isinstance(arg, _RECORDS) else arg for arg in args]
    internals.mark_unbacked(args[0], 0)  # the logits: [n, V] or [n, Vb]
    return args


def run(fn_name: str, variant: tuple, eager: bool, *args):
    """Run the kernel ``fn_name`` of :mod:`compile_pass.op.kernels` or
    :mod:`compile_pass.op.kernels` on ``args``; ``variant`` is its compile key
    (device type first). Errors propagate unchanged and leave no state behind.
    """
    if eager or not inductor_compiles_for(variant[0]) or not _plain_context():
        return _kernel(fn_name)(*args)
    # below autograd whoever calls, so the guards on dispatch keys never differ (a recompile)
    _, _, fx_config, below_autograd, _ = _hot_path()
    with fx_config.patch(use_duck_shape=False, backed_size_oblivious=True), below_autograd():
        for hook in _RUN_HOOKS:
            hook(fn_name, variant)
        with _dynamo_stats_kept():
            return compiled(fn_name, variant)(*_symbolic(args))


@contextlib.contextmanager
def _dynamo_stats_kept() -> Iterator[None]:
    """Dynamo's ``counters["stats"]`` (unique_graphs, calls_captured) as before the block: a kernel's
    compile is chunkce's own, not a graph of the user's (who counts recompiles with them); its graphs
    are counted in ``counters["chunkce"]["kernel_graphs"]``."""
    counters = _hot_path()[4]
    stats = counters["stats"]
    saved = stats.copy()
    try:
        yield
    finally:
        if stats["unique_graphs"] != saved["unique_graphs"]:
            counters["chunkce"]["kernel_graphs"] += stats["unique_graphs"] - saved["unique_graphs"]
        stats.clear()
        stats.update(saved)
