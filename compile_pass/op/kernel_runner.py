"""How the per-chunk kernels of :mod:`compile_pass.op.kernels` are run: compiled by Inductor
for the input's device, once per variant, or eagerly.

Each variant (device type, projection dtype, logits dtype, class weights present,
label smoothing present, the head transform's form) is compiled once, with dynamic shapes (token dim
unbacked, no duck sizing: :func:`run`), so no chunk length, sequence length or
order of calls recompiles it, and with ``emulate_precision_casts`` so a cast to
half precision rounds as it does eagerly. Where Inductor cannot
compile for the device (no code generator for it, e.g. ``meta``; no C++ compiler;
no Triton), by the explicit rule of :func:`inductor_compiles_for`, or with
``CHUNKCE_EAGER_KERNELS=1``, the same functions run eagerly.
"""

from __future__ import annotations

import functools
import re
import types

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from compile_pass.op import kernels


@functools.cache
def _compiled(fn_name: str, variant: tuple):
    # A distinct code object per variant gives each its own Dynamo cache, so the
    # variants never count against one another's recompile limit.
    fn = getattr(kernels, fn_name)
    suffix = re.sub(r"\W+", "_", "_".join(map(str, variant)))
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{suffix}")
    clone = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__)
    # emulate_precision_casts: Inductor otherwise keeps a fused intermediate in fp32
    # across a cast to half precision, so the logits (and their gradient) would not be
    # rounded to logits_dtype where the graph casts them.
    return torch.compile(clone, dynamic=True, fullgraph=True,
                         options={"emulate_precision_casts": True})


@functools.cache
def inductor_compiles_for(device_type: str) -> bool:
    """Whether Inductor can compile the kernels for ``device_type``: an explicit rule,
    decided once per device type, never learnt from a failed compile.

    True when Inductor has a code generator registered for the device type (CPU,
    CUDA, XPU, MPS built in; an out-of-tree device such as Ascend's ``npu`` when
    its extension registers one) and that generator's compiler is present: a C++
    compiler for CPU, Triton for CUDA and XPU. ``meta`` and unknown device types
    have none: their kernels run eagerly.
    """
    from torch._inductor.codegen.common import (
        get_scheduling_for_device,
        init_backend_registration,
    )

    init_backend_registration()
    if get_scheduling_for_device(device_type) is None:
        return False
    from torch._inductor import config as inductor_config

    if device_type == "cpu" and inductor_config.cpu_backend == "cpp":
        from torch._inductor import cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            cpp_builder.get_cpp_compiler()
        except InvalidCxxCompiler:
            return False
    if device_type in ("cuda", "xpu"):
        from torch.utils._triton import has_triton

        return has_triton()
    return True


def _plain_context() -> bool:
    """False under a dispatch mode or a functorch transform (e.g. opcheck, AOTAutograd's
    checks, torch.func): the kernel runs eagerly there."""
    return (_get_current_dispatch_mode() is None
            and not torch._C._are_functorch_transforms_active())


def _symbolic(args: tuple) -> list:
    """The kernel's arguments as its compiled graph takes them, so that no call can
    invalidate it: every tensor detached (a view's ``_base`` would be guarded on,
    and its size duck-sized against the chunk's), and the chunk of logits' token dim
    unbacked (it takes every value from 1 to ``chunk_size``). The other per-token
    arguments keep backed sizes, compiled size-oblivious (:func:`run`), so they are
    not specialised at 1 either: with two unbacked token dims Inductor 2.13 no longer
    writes ``chunk_backward``'s gradient in place but through a second ``[n, Vb]``
    buffer."""
    args = [arg.detach() if isinstance(arg, Tensor) else
            arg.detached() if isinstance(arg, kernels.KernelArgs) else arg for arg in args]
    torch._dynamo.decorators.mark_unbacked(args[0], 0)  # the logits: [n, V] or [n, Vb]
    return args


def run(fn_name: str, variant: tuple, eager: bool, *args):
    """Run the kernel ``fn_name`` of :mod:`compile_pass.op.kernels` (``"chunk_forward"`` or
    ``"chunk_backward"``) on ``args``.

    ``variant`` is the compile key (device type first, then dtypes and
    optional-argument presence). The kernel runs eagerly when ``eager`` is set
    (``CHUNKCE_EAGER_KERNELS``), when Inductor cannot compile for the device
    (:func:`inductor_compiles_for`), or under a dispatch mode or functorch
    transform; otherwise through its variant's compiled graph: one graph per
    variant, whatever the chunk length, number of tokens or vocabulary block
    (the vocabulary dims are symbolic and not duck-sized, the token dim is
    unbacked). Every error, a failed compile or an out-of-memory error included,
    propagates unchanged and changes no state: the next call tries again.
    """
    if eager or not inductor_compiles_for(variant[0]) or not _plain_context():
        return getattr(kernels, fn_name)(*args)
    # Below autograd whoever calls: the op's own dispatch, or a dispatch mode's handler
    # (AOTAutograd checks a compiled graph's first run for custom-op aliasing under one)
    # leave different keys excluded, and the kernel's guards on its inputs' dispatch
    # keys would tell the two apart (a recompile).
    with (fx_config.patch(use_duck_shape=False, backed_size_oblivious=True),
          torch._C._AutoDispatchBelowADInplaceOrView()):
        return _compiled(fn_name, variant)(*_symbolic(args))
