"""The providers ``bench_op`` and ``scaling`` compare, each built on the same inputs.

Every provider computes ``F.cross_entropy(F.linear(hidden, weight).to(logits_dtype),
target, ignore_index=-100)`` (mean) and gets its gradients into ``hidden.grad`` and
``weight.grad``, except the two floors, which run only the matmuls:

    unfused-eager         F.linear + F.cross_entropy (``.float()`` on the logits, HF style,
                          with ``--logits-dtype fp32``)
    unfused-compiled      the same under ``torch.compile`` (Inductor)
    autochunk             the same under ``torch.compile`` with Inductor's auto-chunker on
                          (``auto_chunker.enable``; its own chunk count, 8 in torch 2.13)
    autochunk-forced      the auto-chunker with its thresholds at 0 and ``num_chunk`` set
                          so a chunk holds about as many tokens as chunkce's chunk
    torch-lce             ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``:
                          torch's chunked path (torch >= 2.13), eager
    torch-lce-compiled    the same under ``torch.compile`` (``allow_retain_graph=True``, which
                          torch 2.13 would otherwise switch on itself with a warning)
    chunkce               ``compile_pass.linear_cross_entropy``, called eagerly
    chunkce-compiled      an lm_head + F.cross_entropy module under ``torch.compile(backend="chunkce")``
    chunkce-gif           ``compile_pass.linear_cross_entropy(..., grads_in_forward=True)``: the
                          opt-in mode that computes the gradients during forward
    floor-recompute       the four matmuls of the recompute design alone, tile by tile at
                          chunkce's tiles: projection, its recompute, grad_hidden,
                          grad_weight (``benchmarks.floors``)
    floor-four            the same four matmuls on the whole [N, V] (the time target's floor)
    floor-unfused         the three matmuls of the unfused design alone, on the whole [N, V]
    liger                 ``liger_kernel``'s fused linear cross-entropy (CUDA, Triton)
    cce                   Apple's Cut Cross-Entropy (CUDA, Triton)
    quack                 QuACK's ``quack.linear_cross_entropy.chunked_linear_cross_entropy``
                          (CUDA, CuTe DSL, SM90+; chunk_size 4096, as Liger's benchmark calls it)

A provider of others (torch's or Inductor's chunker on an older torch, Liger or CCE
off CUDA or not installed) that cannot run here says why (``Impl.problem``) and is
skipped. Ours (``Impl.ours``: chunkce's op, backend, grads-in-forward mode, chunk
rule and the floors built on it) have no such escape: anything of ours missing
raises, and the benchmark reports it as failed and exits non-zero. A provider whose
compile-time rewrite did not happen (the auto-chunker refusing the graph, the
chunkce pass not rewriting the site) raises from its first call that compiled a
graph, with the reason, so it is reported as failed, never timed as if it had run.

Nothing is configured on import: the benchmarks wrap their runs in
:func:`dynamo_limits` (Dynamo's recompile limit raised for the many shapes and
dtypes one process may put through the same compiled functions).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._functorch.config
import torch.nn.functional as F
from torch import Tensor, nn

import compile_pass
from benchmarks.floors import FourMatmulFloor, RecomputeFloor, UnfusedFloor

IGNORE_INDEX = -100


def dynamo_limits(limit: int = 64) -> contextlib.AbstractContextManager:
    """``torch._dynamo.config.patch`` raising the recompile limit to at least ``limit``.

    One process may put many shapes and dtypes through the same compiled functions
    (each provider's compiled closure shares its code object across cases); the
    default limit (8) would make Dynamo fall back to eager for the later ones.
    """
    config = torch._dynamo.config
    name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)), None)
    if name is None:
        return contextlib.nullcontext()
    return config.patch(**{name: max(limit, getattr(config, name))})


@dataclass
class OpInputs:
    """What every provider gets. Gradients land in ``hidden.grad`` and ``weight.grad``."""

    hidden: Tensor  # [N, H], a leaf that requires grad
    weight: nn.Parameter  # [V, H], the lm_head weight
    target: Tensor  # [N] int64, some IGNORE_INDEX
    logits_dtype: torch.dtype | None  # None: the projection's dtype; fp32: HF's logits.float()
    chunk_size: int | None  # None: each provider's own choice
    dynamic: bool | None = False  # the compiled providers' torch.compile(dynamic=...)

    def zero_grad(self) -> None:
        self.hidden.grad = None
        self.weight.grad = None

    @property
    def grad_bytes(self) -> int:
        """Bytes of the inputs' own gradients, ``[N, H]`` + ``[V, H]`` in the inputs' dtype."""
        return (self.hidden.numel() + self.weight.numel()) * self.hidden.element_size()


LossFn = Callable[[], Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    build: Callable[[OpInputs], LossFn]
    problem: Callable[[torch.device, OpInputs], str | None] | None = None  # others': why it cannot run here
    note: Callable[[OpInputs], str] = lambda inputs: ""  # how it differs, for the report
    computes_loss: bool = True  # False for the floors: no loss, no error against fp64
    ours: bool = False  # chunkce's: never skipped; any failure fails the benchmark

    def why_not(self, device: torch.device, inputs: OpInputs) -> str | None:
        """Why this provider of others cannot run here (None: it can; always None for ours)."""
        return None if self.problem is None else self.problem(device, inputs)


def unfused_loss(hidden: Tensor, weight: Tensor, target: Tensor,
                 logits_dtype: torch.dtype | None) -> Tensor:
    logits = F.linear(hidden, weight)  # [N, V]
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def _unfused_compiled(inputs: OpInputs, options: dict | None = None, dynamic: bool | None = None) -> LossFn:
    def loss(hidden, weight, target):
        return unfused_loss(hidden, weight, target, inputs.logits_dtype)
    compiled = torch.compile(loss, dynamic=inputs.dynamic if dynamic is None else dynamic, options=options)
    return lambda: compiled(inputs.hidden, inputs.weight, inputs.target)


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (its ``unique_graphs`` counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------- Inductor's auto-chunker


class _AutoChunkerLog(logging.Handler):
    """Collects the reason Inductor's auto-chunker logs when it refuses a graph (CantChunk)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.reasons.append(str(record.exc_info[1]))


def _auto_chunker_problem(device: torch.device, inputs: OpInputs) -> str | None:
    config = torch._inductor.config
    if not hasattr(config, "auto_chunker"):
        return f"torch {torch.__version__} has no torch._inductor.config.auto_chunker"
    return None


def _forced_chunks(inputs: OpInputs) -> int:
    return max(2, -(-inputs.hidden.shape[0] // chunkce_chunk_size(inputs)))


def _build_autochunk(inputs: OpInputs, *, forced: bool) -> LossFn:
    """The unfused loss under Inductor with ``auto_chunker.enable``; raises if it did not chunk.

    Forced: ``output_size_threshold`` and ``amplify_ratio_threshold`` at 0 (any
    amplifying node qualifies) and ``num_chunk`` from :func:`_forced_chunks`.
    The proof that it ran is Inductor's own counter,
    ``torch._inductor.metrics.num_auto_chunking``, read around the compiling call
    (compiled with the FX graph and AOTAutograd caches off, which skip the pass).
    Always compiled with static shapes: the auto-chunker refuses dynamic ones.
    """
    options = {"auto_chunker.enable": True}
    if forced:
        options.update({"auto_chunker.output_size_threshold": 0, "auto_chunker.amplify_ratio_threshold": 0,
                        "auto_chunker.num_chunk": _forced_chunks(inputs)})
    run = _unfused_compiled(inputs, options, dynamic=False)
    metrics = importlib.import_module("torch._inductor.metrics")
    logger = logging.getLogger("torch._inductor.fx_passes.joint_graph.__auto_chunker")
    checked = False

    def loss() -> Tensor:
        nonlocal checked
        if checked:
            return run()
        handler, level = _AutoChunkerLog(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        before, graphs = metrics.num_auto_chunking, _graphs_compiled()
        try:
            # A graph served by the FX graph or AOTAutograd cache runs no pass, so the
            # counter would not move: compile this one afresh.
            with torch._functorch.config.patch(enable_autograd_cache=False), \
                    torch._inductor.config.patch(fx_graph_cache=False):
                out = run()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        # No graph compiled: Dynamo served one this process compiled (and checked) before.
        if metrics.num_auto_chunking == before and _graphs_compiled() != graphs:
            why = "; ".join(handler.reasons) or "no CantChunk reason logged"
            raise RuntimeError(f"Inductor's auto-chunker did not chunk this graph ({why}); "
                               "lower auto_chunker.output_size_threshold / amplify_ratio_threshold")
        checked = True
        return out
    return loss


def _autochunk_note(inputs: OpInputs) -> str:
    return f"num_chunk {_forced_chunks(inputs)}, thresholds 0"


# ---------------------------------------------------------------- torch.nn.functional.linear_cross_entropy


def _torch_lce_problem(device: torch.device, inputs: OpInputs) -> str | None:
    if not hasattr(F, "linear_cross_entropy") or not hasattr(nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions"
    return None


def _torch_lce_options(inputs: OpInputs, **extra) -> nn.LinearCrossEntropyOptions:
    if inputs.chunk_size:
        return nn.LinearCrossEntropyOptions(batch_chunk_size=inputs.chunk_size, chunking_method=None, **extra)
    return nn.LinearCrossEntropyOptions(**extra)  # the chunked path, torch's automatic policy


def _build_torch_lce(inputs: OpInputs) -> LossFn:
    options = _torch_lce_options(inputs)
    return lambda: F.linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target,
                                          ignore_index=IGNORE_INDEX, options=options)


def _build_torch_lce_compiled(inputs: OpInputs) -> LossFn:
    options = _torch_lce_options(inputs, allow_retain_graph=True)

    def loss(hidden, weight, target):
        return F.linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE_INDEX, options=options)
    compiled = torch.compile(loss, dynamic=inputs.dynamic)
    return lambda: compiled(inputs.hidden, inputs.weight, inputs.target)


# ---------------------------------------------------------------- chunkce


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


def chunkce_chunk_size(inputs: OpInputs) -> int:
    """Tokens per chunk chunkce uses for these inputs.

    Asks the op's own rule (``compile_pass.op.tiling.resolve_tiles``: its ``n``), so an
    explicit ``chunk_size`` and ``CHUNKCE_CHUNK_SIZE`` count as they do in the op;
    raises whatever the rule raises (ours: a changed signature must fail loudly).
    """
    return int(chunkce_tiles(inputs).tokens)


def chunkce_tiles(inputs: OpInputs, whole_rows: bool = False):
    """The tiles chunkce uses for these inputs (``compile_pass.op.tiling.resolve_tiles``:
    the op's own rule; ``whole_rows`` for its grads-in-forward op)."""
    from compile_pass.op.tiling import resolve_tiles

    n, v = inputs.hidden.shape[0], inputs.weight.shape[0]
    return resolve_tiles(inputs.chunk_size, n, v, inputs.hidden.element_size(), inputs.hidden.device.type,
                         whole_rows=whole_rows)


def _chunkce_note(inputs: OpInputs, whole_rows: bool = False) -> str:
    tiles = chunkce_tiles(inputs, whole_rows)
    return f"tile {tiles.tokens} x {tiles.vocab_block}"


def _build_chunkce_compiled(inputs: OpInputs) -> LossFn:
    """The backend on an lm_head + loss module; raises at the first call if nothing was rewritten."""
    kwargs = {"options": {"chunk_size": inputs.chunk_size}} if inputs.chunk_size else {}
    # "chunkce" is registered by ``import compile_pass``; torch.compile raises here if it is not.
    module = torch.compile(LMHeadLoss(inputs.weight, inputs.logits_dtype), backend="chunkce",
                           dynamic=inputs.dynamic, **kwargs)
    counters = torch._dynamo.utils.counters
    checked = False

    def loss() -> Tensor:
        nonlocal checked
        before, graphs = counters["chunkce"]["sites_rewritten"], _graphs_compiled()
        out = module(inputs.hidden, inputs.target)
        if not checked:
            # No graph compiled: Dynamo served one this process compiled (and checked) before.
            if counters["chunkce"]["sites_rewritten"] == before and _graphs_compiled() != graphs:
                refused = {k: v for k, v in counters["chunkce"].items() if k.startswith("refused")}
                raise RuntimeError(f"the chunkce pass rewrote no site (counters {refused}); "
                                   "see logging.getLogger('compile_pass') for the reason")
            checked = True
        return out
    return loss


def _build_chunkce(inputs: OpInputs, **extra) -> LossFn:
    return lambda: compile_pass.linear_cross_entropy(
        inputs.hidden, inputs.weight, inputs.target, ignore_index=IGNORE_INDEX,
        logits_dtype=inputs.logits_dtype, chunk_size=inputs.chunk_size, **extra)


def _build_recompute_floor(inputs: OpInputs) -> LossFn:
    tiles = chunkce_tiles(inputs)
    return lambda: RecomputeFloor.apply(inputs.hidden, inputs.weight, tiles.tokens, tiles.vocab_block)


def _build_unfused_floor(inputs: OpInputs) -> LossFn:
    return lambda: UnfusedFloor.apply(inputs.hidden, inputs.weight)


# ---------------------------------------------------------------- CUDA peers


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


def _quack_problem(device: torch.device, inputs: OpInputs) -> str | None:
    if device.type != "cuda":
        return "quack needs CUDA (CuTe DSL kernels)"
    problem = _triton_problem("quack.linear_cross_entropy")(device, inputs)
    if problem is None and torch.cuda.get_device_capability(device) < (9, 0):
        return f"quack needs SM90+ (Hopper), got {torch.cuda.get_device_name(device)}"
    return problem


def _build_quack(inputs: OpInputs) -> LossFn:
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    return lambda: chunked_linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target, chunk_size=4096,
                                                ignore_index=IGNORE_INDEX, reduction="mean")


def _native_logits(inputs: OpInputs) -> str:
    # These compute the softmax in fp32 from logits in the input dtype; no separate cast.
    return "logits in input dtype" if inputs.logits_dtype is not None else ""


def _grads_in_forward(inputs: OpInputs) -> str:
    return "; ".join(filter(None, ("grads computed in forward", _native_logits(inputs))))


IMPLS: dict[str, Impl] = {impl.name: impl for impl in (
    Impl("unfused-eager", lambda i: lambda: unfused_loss(i.hidden, i.weight, i.target, i.logits_dtype)),
    Impl("unfused-compiled", _unfused_compiled),
    Impl("autochunk", functools.partial(_build_autochunk, forced=False), _auto_chunker_problem,
         lambda i: "Inductor's default chunk count"),
    Impl("autochunk-forced", functools.partial(_build_autochunk, forced=True), _auto_chunker_problem,
         _autochunk_note),
    Impl("torch-lce", _build_torch_lce, _torch_lce_problem, _grads_in_forward),
    Impl("torch-lce-compiled", _build_torch_lce_compiled, _torch_lce_problem, _grads_in_forward),
    Impl("chunkce", _build_chunkce, note=_chunkce_note, ours=True),
    Impl("chunkce-compiled", _build_chunkce_compiled, note=_chunkce_note, ours=True),
    Impl("chunkce-gif", functools.partial(_build_chunkce, grads_in_forward=True),
         note=lambda i: "; ".join(("grads computed in forward", _chunkce_note(i, whole_rows=True))), ours=True),
    Impl("floor-recompute", _build_recompute_floor, note=lambda i: f"4 matmuls, {_chunkce_note(i)}",
         computes_loss=False, ours=True),
    Impl("floor-four", lambda i: lambda: FourMatmulFloor.apply(i.hidden, i.weight),
         note=lambda i: "4 matmuls, whole [N, V]", computes_loss=False),
    Impl("floor-unfused", _build_unfused_floor, note=lambda i: "3 matmuls, whole [N, V]", computes_loss=False),
    Impl("liger", _build_liger, _triton_problem("liger_kernel.transformers.functional"), _grads_in_forward),
    Impl("cce", _build_cce, _triton_problem("cut_cross_entropy"), _native_logits),
    Impl("quack", _build_quack, _quack_problem, _native_logits),
)}


def exit_status(rows: list[dict], describe: Callable[[dict], str]) -> int:
    """1 when one of our providers (``Impl.ours``) has a ``failed`` row, each printed to
    stderr as ``BROKEN (ours): describe(row)``; else 0. For the benchmarks' ``main``."""
    broken = list(dict.fromkeys(describe(r) for r in rows
                                if r["metric"] == "failed" and r["impl"] in IMPLS and IMPLS[r["impl"]].ours))
    for line in broken:
        print(f"BROKEN (ours): {line}", file=sys.stderr)
    return 1 if broken else 0
