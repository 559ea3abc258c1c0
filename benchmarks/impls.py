"""The implementations ``bench_op`` compares, each built on the same inputs.

Every implementation computes ``F.cross_entropy(F.linear(hidden, weight).to(logits_dtype),
target, ignore_index=-100)`` (mean) and gets its gradients into ``hidden.grad`` and
``weight.grad``:

    unfused-eager      F.linear + F.cross_entropy (``.float()`` on the logits, HF style,
                       with ``--logits-dtype fp32``)
    unfused-compiled   the same under ``torch.compile`` (Inductor)
    chunkce            ``compile_pass.linear_cross_entropy``, called eagerly
    chunkce-compiled   an lm_head + F.cross_entropy module under ``torch.compile(backend="chunkce")``
    torch-lce          ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` (torch >= 2.13)
    liger              ``liger_kernel``'s fused linear cross-entropy (CUDA, Triton)
    cce                Apple's Cut Cross-Entropy (CUDA, Triton)

An implementation that cannot run here says why (``Impl.problem``) and is skipped.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import compile_pass

IGNORE_INDEX = -100

# Many shapes and dtypes go through the same compiled functions with dynamic=False.
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, max(64, getattr(torch._dynamo.config, _name)))
        break


@dataclass
class OpInputs:
    """What every implementation gets. Gradients land in ``hidden.grad`` and ``weight.grad``."""

    hidden: Tensor  # [N, H], a leaf that requires grad
    weight: nn.Parameter  # [V, H], the lm_head weight
    target: Tensor  # [N] int64, some IGNORE_INDEX
    logits_dtype: torch.dtype | None  # None: the projection's dtype; fp32: HF's logits.float()
    chunk_size: int | None  # None: each implementation's own choice

    def zero_grad(self) -> None:
        self.hidden.grad = None
        self.weight.grad = None


LossFn = Callable[[], Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    build: Callable[[OpInputs], LossFn]
    problem: Callable[[torch.device, OpInputs], str | None]  # why it cannot run; None = it can
    note: Callable[[OpInputs], str] = lambda inputs: ""  # how it differs, for the report


def unfused_loss(hidden: Tensor, weight: Tensor, target: Tensor,
                 logits_dtype: torch.dtype | None) -> Tensor:
    logits = F.linear(hidden, weight)  # [N, V]
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


_compiled_unfused = torch.compile(unfused_loss, dynamic=False)


class LMHeadLoss(nn.Module):
    """The pattern the chunkce backend rewrites: an lm_head, an optional upcast, a loss."""

    def __init__(self, weight: nn.Parameter, logits_dtype: torch.dtype | None):
        super().__init__()
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.lm_head.weight = weight
        self.logits_dtype = logits_dtype

    def forward(self, hidden_states: Tensor, labels: Tensor) -> Tensor:
        logits = self.lm_head(hidden_states)  # [N, V]
        if self.logits_dtype is not None:
            logits = logits.to(self.logits_dtype)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


@functools.cache
def chunkce_backend() -> tuple[object | None, str | None]:
    """``(backend, None)`` to pass to torch.compile, or ``(None, why not)``.

    The name ``"chunkce"`` when Dynamo finds it (entry point installed); else the
    callable from ``compile_pass.backend`` (e.g. the package on PYTHONPATH only).
    """
    try:
        if "chunkce" in torch._dynamo.list_backends(exclude_tags=()):
            torch._dynamo.lookup_backend("chunkce")
            return "chunkce", None
    except Exception:  # noqa: BLE001 - an entry point whose module is missing or broken
        pass
    try:
        backend = importlib.import_module("compile_pass.backend")
    except ImportError as e:
        return None, f"backend 'chunkce' not registered and compile_pass.backend not importable ({e})"
    fn = getattr(backend, "chunkce_backend", None)
    if fn is None:
        return None, "compile_pass.backend has no chunkce_backend"
    return fn, None


def _build_chunkce_compiled(inputs: OpInputs) -> LossFn:
    backend, _ = chunkce_backend()
    kwargs = {"options": {"chunk_size": inputs.chunk_size}} if inputs.chunk_size else {}
    module = torch.compile(LMHeadLoss(inputs.weight, inputs.logits_dtype), backend=backend,
                           dynamic=False, **kwargs)
    return lambda: module(inputs.hidden, inputs.target)


def _torch_lce_problem(device: torch.device, inputs: OpInputs) -> str | None:
    if not hasattr(F, "linear_cross_entropy") or not hasattr(nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions"
    return None


def _build_torch_lce(inputs: OpInputs) -> LossFn:
    if inputs.chunk_size:
        options = nn.LinearCrossEntropyOptions(batch_chunk_size=inputs.chunk_size, chunking_method=None)
    else:
        options = nn.LinearCrossEntropyOptions()  # the chunked path, torch's automatic policy
    return lambda: F.linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target,
                                          ignore_index=IGNORE_INDEX, options=options)


def _triton_problem(module: str) -> Callable[[torch.device, OpInputs], str | None]:
    def problem(device: torch.device, inputs: OpInputs) -> str | None:
        if device.type != "cuda":
            return f"{module} needs CUDA (Triton kernels)"
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - not installed, or installed but broken
            return f"{module} not importable ({type(e).__name__}: {e})"
        return None
    return problem


def _build_liger(inputs: OpInputs) -> LossFn:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    return lambda: liger_fused_linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target,
                                                    ignore_index=IGNORE_INDEX)


def _build_cce(inputs: OpInputs) -> LossFn:
    from cut_cross_entropy import linear_cross_entropy
    return lambda: linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target,
                                        ignore_index=IGNORE_INDEX)


def _always(device: torch.device, inputs: OpInputs) -> None:
    return None


def _native_logits(inputs: OpInputs) -> str:
    # These compute the softmax in fp32 from logits in the input dtype; no separate cast.
    return "logits in input dtype" if inputs.logits_dtype is not None else ""


def _grads_in_forward(inputs: OpInputs) -> str:
    return "; ".join(filter(None, ("grads computed in forward", _native_logits(inputs))))


IMPLS: dict[str, Impl] = {impl.name: impl for impl in (
    Impl("unfused-eager",
         lambda i: lambda: unfused_loss(i.hidden, i.weight, i.target, i.logits_dtype), _always),
    Impl("unfused-compiled",
         lambda i: lambda: _compiled_unfused(i.hidden, i.weight, i.target, i.logits_dtype), _always),
    Impl("chunkce",
         lambda i: lambda: compile_pass.linear_cross_entropy(
             i.hidden, i.weight, i.target, ignore_index=IGNORE_INDEX,
             logits_dtype=i.logits_dtype, chunk_size=i.chunk_size),
         _always),
    Impl("chunkce-compiled", _build_chunkce_compiled,
         lambda device, inputs: chunkce_backend()[1]),
    Impl("torch-lce", _build_torch_lce, _torch_lce_problem, _grads_in_forward),
    Impl("liger", _build_liger, _triton_problem("liger_kernel.transformers.functional"), _grads_in_forward),
    Impl("cce", _build_cce, _triton_problem("cut_cross_entropy"), _native_logits),
)}
