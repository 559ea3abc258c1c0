"""The tensor a compiled step returns for logits it did not compute: :class:`LazyLogits`.

Made by :func:`compile_pass.graph.lazy_logits.wrap` around a compiled graph from which
:func:`compile_pass.graph.lazy_logits.defer_if_only_returned` took the returned logits
out (the module docstring there says when, and what the graph returns instead).

A :class:`LazyLogits` has the logits' shape, dtype, device and ``requires_grad``; ``.shape``
and ``len()`` read no values. Views (``view``, ``transpose``, indexing, ``detach``, ...)
give a lazy view: the same values, so a write through either side is seen by the other, and
torch's aliasing (``_base``, ``_is_view``, shared storage: ``return_and_correct_aliasing``).
Copies (``clone``, ``contiguous`` of a non-contiguous view, ``.to()`` / ``.float()`` that change
the dtype or device) hold the values of the moment they were made, as torch's do: made from
values already computed, a plain tensor at once; otherwise a lazy copy, computed when read
(without keeping its source's values) or, at the latest, just before its source's values
can change: when they are computed and kept, or at an ``optimizer.step()`` of a tensor they
are computed from (the pre-hook below). The first other op that reads a value runs the
graph's own nodes from the projection to the returned value (:class:`Recipe`) eagerly on the
tensors the step returned, keeps the result, and answers from it; later reads use the kept
values. ``repr`` and ``copy_`` into a plain tensor compute the values and keep none.
Under grad mode the tensor is the output of an autograd node (:class:`_Recompute`) over
those tensors: a loss built from it backpropagates into the compiled step's hidden
states (through the step's own backward) and into the head's parameters.

It is never wrong. When the step returns, the version counter and the storage (address,
size) of every tensor the recipe reads are recorded, and for an FSDP2 unsharded head
parameter also its sharded parameter's version (FSDP2 all-gathers into the unsharded
one without bumping its version). The first read, and a backward through it, check
them (host metadata only, no device sync) and raise :class:`StaleLogitsError` if any
changed: ``optimizer.step()``, ``zero_()``, ``load_state_dict()``, FSDP2's resharding. A lazy
copy not computed before such a change outside an optimizer step raises the same way.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_map

from compile_pass.graph.logits_drop import METADATA_OPS

KEEP_OPTION = "options={'returned_logits': 'keep'}"


class StaleLogitsError(RuntimeError):
    """A :class:`LazyLogits` read after a tensor it is computed from changed in place."""


@dataclass(frozen=True)
class Recipe:
    """How one returned logits value is made, as the graph made it.

    Attributes:
        module: the graph's nodes from the projection to the returned value, copied
            (their inputs are its placeholders, in ``roles``' order).
        roles: what each input is: ``"hidden states"``, ``"lm_head weight"``,
            ``"lm_head bias"``, or ``"scale"`` (any other tensor the nodes read).
        scalars: which inputs the graph gave as a Python number (a symbolic float or
            int): they reach the recipe as a 0-d CPU tensor and are read with ``.item()``.
        autocast_dtype: the projection's dtype when it ran under autocast (its output
            dtype differs from its inputs'); the recipe runs under the same autocast.
    """

    module: GraphModule
    roles: tuple[str, ...]
    scalars: tuple[bool, ...]
    autocast_dtype: torch.dtype | None

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0)
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return self.module(*inputs)


class _Inputs:
    """The recipe's inputs as the step returned them, with what must not change before a read."""

    def __init__(self, recipe: Recipe, tensors: Sequence[torch.Tensor]) -> None:
        self.recipe = recipe
        self.tensors = tuple(tensors)
        watched = [(role, t) for role, t in zip(recipe.roles, tensors)]
        watched += [(f"{role} (its FSDP2 sharded parameter)", sharded) for role, t in zip(recipe.roles, tensors)
                    if (sharded := _fsdp_sharded_parameter(t)) is not None]
        self.watched = tuple((role, t, t._version, _storage_of(t)) for role, t in watched)
        self.stale: str | None = None  # why, once an optimizer stepped a tensor it reads
        self.pending: list[weakref.ref] = []  # lazy copies over these inputs not computed yet, oldest first
        self.flushing = False
        _watch_optimizer_steps(self)

    def check(self, when: str) -> None:
        """Raise :class:`StaleLogitsError` if a tensor the recipe reads changed since the step."""
        changed = self.stale
        for role, tensor, version, storage in self.watched:
            if changed is None and tensor._version != version:
                changed = f"the {role} {_were(role)} changed in place"
            elif changed is None and _storage_of(tensor) != storage:
                changed = f"the {role} had {_its(role)} storage freed or resized (e.g. FSDP2 resharding after backward)"
        if changed is not None:
            raise StaleLogitsError(
                f"chunkce: cannot {when} these logits: chunkce did not compute them in the compiled step "
                "(returned logits are computed when first read, from the step's hidden states and lm_head), "
                f"and since the step {changed}, so they can no longer be computed as the step would have. "
                "Read them before that (e.g. before optimizer.step(); under FSDP2 before backward), or "
                f"compile with {KEEP_OPTION} to have the step compute and return them."
            )

    def compute(self) -> torch.Tensor:
        self.check("read")
        with torch.no_grad():
            return self.recipe(self.tensors)

    def copied(self, copy: LazyLogits) -> None:
        """Record a lazy copy whose values are read from these inputs (through its source)."""
        if len(self.pending) >= 64:
            self.pending = [ref for ref in self.pending if (c := ref()) is not None and c._value is None]
        self.pending.append(weakref.ref(copy))

    def flush(self, everything: bool = False) -> None:
        """Compute and keep the pending copies whose source's values are kept now (they can
        change from here on), or every pending copy (``everything``: before an optimizer
        step changes these inputs). In creation order, so a copy of a copy sees its source
        kept. A copy that cannot be computed any more (stale) stays pending and raises on
        read, as its source does."""
        if self.flushing:
            return
        self.flushing, still = True, []
        try:
            for ref in self.pending:
                copy = ref()
                if copy is None or copy._value is not None:
                    continue
                if everything or copy._copy_of[0]._root()._value is not None:
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


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every _Inputs whose logits may still be read
_hook_handle: Any = None


def _watch_optimizer_steps(source: _Inputs) -> None:
    """Have every ``torch.optim`` optimizer step mark ``source`` stale when it steps a tensor
    ``source`` reads (its weight, bias or scale). Fused kernels (``AdamW(fused=True)``) change
    parameters without bumping their version counters; the step is seen here instead. The
    global pre-hook is registered at the first lazy logits, not at import."""
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook_handle = register_optimizer_step_pre_hook(_before_optimizer_step)
    _LIVE.add(source)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _LIVE:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for source in list(_LIVE):
        if source.stale is not None:
            continue
        for role, tensor, _, _ in source.watched:
            if id(tensor) in stepped:
                source.flush(everything=True)  # copies hold the values from before the step
                source.stale = f"an optimizer step ({type(optimizer).__name__}) updated the {role}"
                break


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without storage (e.g. a DTensor)
        return (0, 0)
    return (storage.data_ptr(), storage.nbytes())


def _fsdp_sharded_parameter(tensor: torch.Tensor) -> torch.Tensor | None:
    """The FSDP2 sharded parameter behind ``tensor`` if it is an FSDP2 unsharded parameter.

    FSDP2 all-gathers into the unsharded parameter under
    ``torch.autograd._unsafe_preserve_version_counter``, so an optimizer step shows only
    in the sharded parameter's version. Looked up each time (no weak reference is kept
    to the parameter: ``torch.utils.swap_tensors`` refuses tensors that have one)."""
    if not isinstance(tensor, torch.nn.Parameter):
        return None
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule

        for module, state in list(_module_state_mapping.items()):
            group = getattr(state, "_fsdp_param_group", None) if isinstance(module, FSDPModule) else None
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if getattr(fsdp_param, "_unsharded_param", None) is tensor:
                    return fsdp_param.sharded_param
    except Exception:  # noqa: BLE001 - no FSDP2 in this process: a plain parameter
        return None
    return None


@dataclass(frozen=True)
class _Layout:
    """A tensor's metadata without its values."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class _Recompute(torch.autograd.Function):
    """The lazy logits as an autograd node over the recipe's inputs.

    Forward makes no values (a :class:`LazyLogits`); backward recomputes the logits from
    the same inputs with autograd on and backpropagates ``grad`` through them."""

    @staticmethod
    def forward(ctx: Any, source: _Inputs, layout: _Layout, *tensors: torch.Tensor) -> LazyLogits:
        ctx.source = source
        return LazyLogits(layout, source=source)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        source: _Inputs = ctx.source
        source.check("backpropagate through")
        needs = ctx.needs_input_grad[2:]
        leaves = [t.detach().requires_grad_(need) if need else t for t, need in zip(source.tensors, needs)]
        with torch.enable_grad():
            logits = source.recipe(leaves)
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        grads = iter(torch.autograd.grad(logits, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if need else None for need in needs))


def lazy_logits(recipe: Recipe, tensors: Sequence[torch.Tensor], stand_in: torch.Tensor) -> LazyLogits:
    """The :class:`LazyLogits` of ``recipe`` over ``tensors`` (as the step returned them),
    shaped as ``stand_in`` (the graph's stand-in: an expanded scalar of the logits'
    shape, dtype and device; the logits themselves are contiguous)."""
    source = _Inputs(recipe, tensors)
    layout = _Layout(stand_in.shape, _contiguous_strides(stand_in.shape), stand_in.dtype, stand_in.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Recompute.apply(source, layout, *tensors)
    return LazyLogits(layout, source=source)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class LazyLogits(torch.Tensor):
    """Returned logits the compiled step did not compute; computed exactly on first read.

    Shape, dtype, device and ``requires_grad`` are the logits'. Views (``view``,
    ``transpose``, indexing, ``detach``, ...) give another ``LazyLogits`` over the same
    values: a write through either side is seen by the other, as in torch. Copies
    (``clone``, ``contiguous`` of a non-contiguous view, ``.to()`` / ``.float()`` that
    change the dtype or device) hold the values as they were when the copy was made: taken
    from values already computed, a plain tensor at once; otherwise a lazy copy, computed
    when read, or before its source's values can change (the source computed and kept, or
    an ``optimizer.step()`` of a tensor they are computed from), whichever comes first.
    Any other op computes the values once (:class:`Recipe`), keeps them, and runs on them.
    ``repr`` / ``print`` and ``copy_`` into a plain tensor compute the values without
    keeping them (and ``repr`` shows the error text instead of raising when they can no
    longer be computed).

    Raises:
        StaleLogitsError: on the first read, when a tensor the logits are computed
            from changed since the step (see the module docstring).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, layout: _Layout, *, source: _Inputs | None = None,
                parent: tuple[LazyLogits, Any, tuple, dict] | None = None,
                copy_of: tuple[LazyLogits, Any, tuple, dict] | None = None) -> LazyLogits:
        self = torch.Tensor._make_wrapper_subclass(cls, layout.shape, strides=layout.stride, dtype=layout.dtype,
                                                   device=layout.device, requires_grad=False)
        # a root has its own values (``source``: the recipe's; ``copy_of``: a copy's), a view its ``parent``'s
        self._source, self._parent, self._copy_of, self._value = source, parent, copy_of, None
        return self

    def compute(self) -> torch.Tensor:
        """The values, computed on the first call and kept (a plain tensor, no autograd)."""
        if self._value is None:
            if self._parent is not None:
                base, func, args, kwargs = self._parent
                with torch.no_grad():
                    self._value = func(base.compute(), *args, **kwargs)  # a view of the base's kept values
            else:
                self._value = self._make()
                self._inputs().flush()  # copies of these values are taken now: from here on they can change
        return self._value

    @property
    def is_computed(self) -> bool:
        """Whether the values were computed (read) and kept already."""
        return self._value is not None

    def _root(self) -> LazyLogits:
        return self if self._parent is None else self._parent[0]._root()

    def _inputs(self) -> _Inputs:
        root = self._root()
        return root._source if root._source is not None else root._copy_of[0]._inputs()

    def _make(self) -> torch.Tensor:
        """A root's values, computed afresh (nothing kept)."""
        if self._source is not None:
            return self._source.compute()
        source, func, args, kwargs = self._copy_of
        fresh = source._root()._value is None  # the source's values are computed for this copy alone
        with torch.no_grad():
            values = source._transient()
            if fresh and func in _COPIES and _same_layout(values, self) and _owns_storage(values):
                return values  # already a copy: no second [N, V]
            return func(values, *args, **kwargs)

    def _transient(self) -> torch.Tensor:
        """The values without keeping any: the kept ones if computed, else computed afresh."""
        if self._value is not None:
            return self._value
        if self._parent is None:
            return self._make()
        base, func, args, kwargs = self._parent
        with torch.no_grad():
            return func(base._transient(), *args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        try:
            values = self._transient()  # a log line or a debugger does not keep [N, V] alive
        except StaleLogitsError as exc:
            return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, not computed: {exc})"
        text = repr(values)
        return text[:-1] + f", grad_fn=<{type(self.grad_fn).__name__}>)" if self.grad_fn is not None else text

    def tolist(self) -> Any:  # these read values without going through dispatch
        return self.compute().tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return self.compute().numpy(*args, **kwargs)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compute().__array__(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save / pickle: the values
        return self.compute().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:  # the values, as a leaf, as stock's deepcopy gives
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.  If you were attempting to deepcopy a module, this may be "
                               "because of a torch.nn.utils.weight_norm usage, see "
                               "https://github.com/pytorch/pytorch/pull/103001")
        return copy.deepcopy(self.compute(), memo).requires_grad_(self.requires_grad)

    def __format__(self, spec: str) -> str:
        return self.compute().__format__(spec)

    # what reads a tensor's memory without dispatch: the computed values' (their storage is kept)
    def data_ptr(self) -> int:
        return self.compute().data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.compute().untyped_storage()

    def storage(self) -> Any:
        return self.compute().storage()

    def _typed_storage(self) -> Any:
        return self.compute()._typed_storage()

    def share_memory_(self) -> LazyLogits:
        raise RuntimeError("chunkce: share_memory_() needs a tensor that owns its storage, and LazyLogits computes "
                           "its values on first read: share logits.compute() (the values, a plain tensor) instead")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        rest = (*args[1:], *kwargs.values())
        if func in METADATA_OPS and isinstance(args[0], LazyLogits) and not any(isinstance(a, LazyLogits)
                                                                               for a in rest):
            return _metadata_op(func, args, kwargs)
        if torch.Tag.inplace_view in func.tags and isinstance(args[0], LazyLogits):
            return _inplace_view(func, args, kwargs)
        if func is _aten.copy_.default and isinstance(args[1], LazyLogits) and not isinstance(args[0], LazyLogits):
            func(args[0], args[1]._transient(), *args[2:], **kwargs)  # a copy: the source stays lazy
            return args[0]
        values, kwargs_values = tree_map(lambda t: t.compute() if isinstance(t, LazyLogits) else t, (args, kwargs))
        out = func(*values, **kwargs_values)
        if _writes_first_argument(func) and isinstance(args[0], LazyLogits):
            return args[0]  # an in-place op changed its kept values: it returns itself, as in-place ops do
        if isinstance(kwargs.get("out"), LazyLogits):
            return kwargs["out"]
        return out


_aten = torch.ops.aten
_COPIES = {_aten.clone.default, _aten._to_copy.default}  # of METADATA_OPS, those that copy; the rest are views


def _metadata_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a LazyLogits (another LazyLogits over its values, aliasing it as torch's
    views do), or a copy (values computed now if the source's are, else a lazy copy)."""
    base = args[0]
    on_meta = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta")
    out = func(on_meta, *args[1:], **{**kwargs, "device": "meta"} if "device" in kwargs else kwargs)
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else base.device
    layout = _Layout(out.shape, out.stride(), out.dtype, device)
    if func not in _COPIES:
        view = LazyLogits(layout, parent=(base, func, args[1:], kwargs))
        return return_and_correct_aliasing(func, args, kwargs, view)
    if base._root()._value is not None:  # values to copy exist (and may change later): copied now
        return func(base.compute(), *args[1:], **kwargs)
    lazy_copy = LazyLogits(layout, copy_of=(base, func, args[1:], kwargs))
    base._inputs().copied(lazy_copy)
    return lazy_copy


def _inplace_view(func: Any, args: tuple, kwargs: dict) -> LazyLogits:
    """``detach_`` (autograd's business only): the tensor itself. Ops that change a tensor's
    shape or storage in place (``unsqueeze_``, ``t_``, ``resize_``, ``set_``, ...) are refused:
    the views already taken of it read its values through it."""
    if func is _aten.detach_.default:
        return args[0]
    name = func.overloadpacket.__name__
    raise RuntimeError(f"chunkce: {name}() would change the shape or storage of a LazyLogits in place, which it "
                       f"does not support (its views read their values through it): use the out-of-place "
                       f"{name.rstrip('_')}() (a view), or logits.compute() (the values, a plain tensor)")


def _same_layout(values: torch.Tensor, like: torch.Tensor) -> bool:
    return (values.shape, values.stride(), values.dtype, values.device) == (
        like.shape, like.stride(), like.dtype, like.device)


def _owns_storage(values: torch.Tensor) -> bool:
    """Whether ``values`` spans its whole storage (a view of part of it would keep the rest alive)."""
    return values.storage_offset() == 0 and values.untyped_storage().nbytes() == values.numel() * values.element_size()


def _writes_first_argument(func: Any) -> bool:
    arguments = getattr(getattr(func, "_schema", None), "arguments", ())
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and alias.is_write
