"""How returned logits are made when read (Recipe), and whether their inputs changed since the step.

How returned logits the step did not compute are made when read (a :class:`Recipe`), and whether
what they are made from changed since the step: the
version counter and storage of every tensor the recipe reads (and an FSDP2 unsharded head's
sharded parameter), compared on host metadata only; any optimizer step of one marks it stale
(fused optimizers bump no versions). Raises :class:`StaleLogitsError`; docs/models.md.

:data:`DROPPED_RECIPE`: the recipe of logits that must never be made (``returned_logits="drop"``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule

import compile_pass.torch_internals as internals
from compile_pass.lazy_logits.head import Head


class StaleLogitsError(RuntimeError):
    """A :class:`compile_pass.LazyLogits` read after a tensor it is computed from changed in place."""


class Inputs:
    """The recipe's inputs as the step returned them, with what must not change before a read."""

    def __init__(self, recipe: Recipe | DroppedRecipe, tensors: Sequence[torch.Tensor]) -> None:
        self.recipe = recipe
        self.tensors = tuple(tensors)
        watched = [(role, t) for role, t in zip(recipe.roles, tensors)]
        self.unchecked: str | None = None  # why staleness cannot be checked on this torch: every read raises
        try:
            watched += [(f"{role} (its FSDP2 sharded parameter)", sharded) for role, t in zip(recipe.roles, tensors)
                        if (sharded := _fsdp_sharded_parameter(t)) is not None]
        except (internals.TorchInternalMissing, AttributeError) as exc:  # FSDP2's internals moved
            self.unchecked = str(exc)
        self.watched = tuple((role, t, _version_of(t), _storage_of(t)) for role, t in watched)
        self.stale: str | None = None  # why, once an optimizer stepped a tensor it reads
        self.pending: list[weakref.ref] = []  # lazy copies over these inputs not computed yet, oldest first
        self.flushing = False
        if self.watched:
            _watch_optimizer_steps(self)

    def check(self, when: str) -> None:
        """Raise :class:`StaleLogitsError` if a tensor the recipe reads changed since the step."""
        if self.unchecked is not None:
            raise StaleLogitsError(
                f"chunkce: cannot {when} these logits: on torch {torch.__version__} chunkce cannot tell whether "
                f"FSDP2 changed the tensors they are computed from ({self.unchecked}), so it does not compute "
                f"them; compile with {KEEP_OPTION} to have the step compute and return them.")
        changed = self.stale
        for role, tensor, version, storage in self.watched:
            if changed is None and _version_of(tensor) != version:
                changed = f"the {role} {_were(role)} changed in place"
            elif changed is None and _storage_of(tensor) != storage:
                changed = f"the {role} had {_its(role)} storage freed or resized (e.g. FSDP2 resharding after backward)"
        if changed is not None:
            raise StaleLogitsError(
                f"chunkce: cannot {when} these logits: chunkce did not compute them in the compiled step "
                "(returned logits are computed when first read, from the step's hidden states and lm_head), "
                f"and since the step {changed}, so they can no longer be computed as the step would have. "
                "What was read before that (the values, or the same statistic of the same rows) is served "
                "after it; read what you need before that (e.g. before optimizer.step(); under FSDP2 before backward), or "
                f"compile with {KEEP_OPTION} to have the step compute and return them."
            )

    def compute(self) -> torch.Tensor:
        self.check("read")
        with torch.no_grad():
            return self.recipe(self.tensors)

    def copied(self, copy: Any) -> None:
        """Record a lazy copy (a ``LazyLogits``) whose values are read from these inputs (through its source)."""
        if len(self.pending) >= 64:
            self.pending = [ref for ref in self.pending if (c := ref()) is not None and not c.is_computed]
        self.pending.append(weakref.ref(copy))

    def flush(self, everything: bool = False) -> None:
        """Compute and keep the pending copies whose source's values are kept now, or all of them
        (``everything``: before an optimizer step), in creation order; a stale one stays pending."""
        if self.flushing:
            return
        self.flushing, still = True, []
        try:
            for ref in self.pending:
                copy = ref()
                if copy is None or copy.is_computed:
                    continue
                if everything or copy.sources_kept():
                    try:
                        copy.compute()
                        continue
                    except StaleLogitsError:
                        pass
                still.append(ref)
            self.pending = still
        finally:
            self.flushing = False


def _were(role: str) -> str:
    return "were" if role.startswith("hidden states") else "was"


def _its(role: str) -> str:
    return "their" if role.startswith("hidden states") else "its"


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every Inputs whose logits may still be read
_hook_handle: Any = None


def _watch_optimizer_steps(source: Inputs) -> None:
    """Have every ``torch.optim`` optimizer step mark ``source`` stale when it steps a tensor
    ``source`` reads (its weight, bias or scale). The global pre-hook is registered at the
    first lazy logits, not at import."""
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook_handle = register_optimizer_step_pre_hook(_before_optimizer_step)
    _LIVE.add(source)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _LIVE:
        return
    # a frozen head (requires_grad False) is never stepped; one that requires grad counts (may over-report)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]
               if p.requires_grad or p.grad is not None}
    for source in list(_LIVE):
        if source.stale is not None:
            continue
        for role, tensor, _, _ in source.watched:
            if id(tensor) in stepped:
                source.flush(everything=True)  # copies hold the values from before the step
                source.stale = f"an optimizer step ({type(optimizer).__name__}) updated the {role}"
                break


def _version_of(tensor: torch.Tensor) -> Any:
    """``tensor``'s version counter (a DTensor's and its local shard's); None for an inference
    tensor, which has none."""
    if tensor.is_inference():
        return None
    local = _local_shard(tensor)
    version = internals.version.read(tensor)
    return version if local is None else (version, _version_of(local))


def _local_shard(tensor: torch.Tensor) -> torch.Tensor | None:
    """A ``DTensor``'s local tensor (this rank's shard), else None (never imports DTensor's package)."""
    module = sys.modules.get("torch.distributed.tensor")
    return internals.local_tensor.read(tensor) if module is not None and isinstance(tensor, module.DTensor) else None


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """The (address, bytes) of ``tensor``'s storage (a ``DTensor``'s: its local shard's, which
    FSDP2 frees when it reshards a tensor-parallel parameter)."""
    local = _local_shard(tensor)
    if local is not None:
        return _storage_of(local)
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without storage (e.g. a DTensor)
        return (0, 0)
    return (storage.data_ptr(), storage.nbytes())


def _fsdp_sharded_parameter(tensor: torch.Tensor) -> torch.Tensor | None:
    """The FSDP2 sharded parameter behind ``tensor`` if it is an FSDP2 unsharded parameter (whose
    version an all-gather preserves); looked up each time, never weakly referenced. Raises
    :class:`~compile_pass.torch_internals.TorchInternalMissing` (or AttributeError) where FSDP2's
    internals moved: never a silent None."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 module in this process
    if fsdp is None or not isinstance(tensor, torch.nn.Parameter):
        return None
    for module in list(internals.module_state.get().keys()):
        if not isinstance(module, fsdp.FSDPModule):
            continue
        for group in internals.fsdp_param_groups.read(internals.fsdp_state(module)):
            for fsdp_param in group.fsdp_params:
                if internals.unsharded_param.read_if_set(fsdp_param) is tensor:
                    return fsdp_param.sharded_param
    return None


KEEP_OPTION = "options={'returned_logits': 'keep'}"


@dataclass(frozen=True)
class Recipe:
    """How one returned logits value is made, as the graph made it: ``module`` (the graph's
    nodes from the projection, inputs in ``roles``' order: ``"hidden states"``, ``"lm_head
    weight"``, ``"lm_head bias"``, ``"scale"``), ``scalars`` (inputs given as Python numbers,
    passed as 0-d CPU tensors), ``autocast_dtype`` (run under autocast to it) and ``head``
    (for fused reads; None: every read computes the values).
    """

    module: GraphModule
    roles: tuple[str, ...]
    scalars: tuple[bool, ...]
    autocast_dtype: torch.dtype | None
    head: Head | None = None

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0)
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return self.module(*inputs)


@dataclass(frozen=True)
class DroppedRecipe:
    """The recipe of logits a training step dropped (``returned_logits="drop"``): no inputs,
    and making them raises ``RuntimeError`` naming the option."""

    roles: tuple[str, ...] = ()
    scalars: tuple[bool, ...] = ()

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise RuntimeError(
            "chunkce: these logits were not computed: this compiled step was built with "
            "options={'returned_logits': 'drop'}, which skips returned logits nothing in the graph reads. "
            "Compile with returned_logits='lazy' (the default: computed when read) or 'keep' to get the logits."
        )


DROPPED_RECIPE = DroppedRecipe()
