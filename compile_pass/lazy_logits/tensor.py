"""The tensor a compiled step returns for logits it did not compute: :class:`LazyLogits`,
and :class:`DroppedLogits`, a ``LazyLogits`` whose recipe refuses (``returned_logits="drop"``).

A :class:`LazyLogits` has the logits' shape, dtype, device and ``requires_grad``; ``.shape``
and ``len()`` read no values. Views (``view``, ``transpose``, indexing, ``detach``, ...)
give a lazy view: the same values, so a write through either side is seen by the other, and
torch's aliasing (``_base``, ``_is_view``, shared storage: ``return_and_correct_aliasing``).
Copies (``clone``, ``contiguous`` of a non-contiguous view, ``.to()`` / ``.float()`` that change
the dtype or device) hold the values of the moment they were made, as torch's do: made from
values already computed, a plain tensor at once; otherwise a lazy copy, computed when read
(without keeping its source's values) or, at the latest, just before its source's values
can change: when they are computed and kept, or at an ``optimizer.step()`` of a tensor they
are computed from (:mod:`compile_pass.lazy_logits.staleness`). The first other op that reads
a value runs the recipe (:class:`compile_pass.lazy_logits.recipe.Recipe`: the graph's own nodes
from the projection to the returned value) eagerly on the tensors the step returned, keeps the
result, and answers from it; later reads use the kept values. ``repr`` and ``copy_`` into a
plain tensor compute the values and keep none. It is never wrong: a read after a tensor it is
computed from changed raises :class:`compile_pass.lazy_logits.staleness.StaleLogitsError`.

A :class:`DroppedLogits` has the same skeleton, and its recipe raises ``RuntimeError`` naming
``returned_logits="drop"``: metadata ops (views, casts, copies) give another ``DroppedLogits``,
any op that reads a value raises.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_map

from compile_pass.lazy_logits.staleness import Inputs, StaleLogitsError

_aten = torch.ops.aten
# Ops that only change a tensor's metadata (view, dtype, device): they give another lazy
# tensor. accelerate's mixed-precision wrapper calls .float() on every output, callers
# detach or move outputs: none of that reads a value.
METADATA_OPS = {
    _aten.detach.default, _aten.alias.default, _aten._to_copy.default, _aten.clone.default,
    _aten.view.default, _aten._unsafe_view.default, _aten.t.default, _aten.transpose.int,
    _aten.permute.default, _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.default, _aten.expand.default,
}
_COPIES = {_aten.clone.default, _aten._to_copy.default}  # of METADATA_OPS, those that copy; the rest are views


@dataclass(frozen=True)
class Layout:
    """A tensor's metadata without its values."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


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
    Any other op computes the values once (the recipe), keeps them, and runs on them.
    ``repr`` / ``print`` and ``copy_`` into a plain tensor compute the values without
    keeping them (and ``repr`` shows the error text instead of raising when they can no
    longer be computed).

    Raises:
        StaleLogitsError: on the first read, when a tensor the logits are computed
            from changed since the step (see the module docstring).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, layout: Layout, *, source: Inputs | None = None,
                parent: tuple[LazyLogits, Any, tuple, dict] | None = None,
                copy_of: tuple[LazyLogits, Any, tuple, dict] | None = None) -> LazyLogits:
        self = torch.Tensor._make_wrapper_subclass(cls, layout.shape, strides=layout.stride, dtype=layout.dtype,
                                                   device=layout.device, requires_grad=False)
        # a root has its own values (``source``: the recipe's; ``copy_of``: a copy's), a view its ``parent``'s
        self._source, self._parent, self._copy_of, self._value = source, parent, copy_of, None
        self._copied_from: Inputs | None = None  # a lazy copy's: the inputs its values are read from
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
                self._copy_of = self._copied_from = None  # a computed copy holds its values only, not its source's
        return self._value

    @property
    def is_computed(self) -> bool:
        """Whether the values were computed (read) and kept already."""
        return self._value is not None

    def _root(self) -> LazyLogits:
        return self if self._parent is None else self._parent[0]._root()

    def _inputs(self) -> Inputs:
        root = self._root()
        return root._source if root._source is not None else root._copied_from

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


class DroppedLogits(LazyLogits):
    """Stands in for logits a training step did not compute (``returned_logits="drop"``): a
    :class:`LazyLogits` whose recipe refuses.

    Has the logits' shape, dtype and device and no storage. View, cast and copy ops give
    another ``DroppedLogits``; any op that would read values raises ``RuntimeError`` naming
    the option.
    """

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DroppedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _metadata_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a LazyLogits (another LazyLogits over its values, aliasing it as torch's
    views do), or a copy (values computed now if the source's are, else a lazy copy)."""
    base = args[0]
    on_meta = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta")
    out = func(on_meta, *args[1:], **{**kwargs, "device": "meta"} if "device" in kwargs else kwargs)
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else base.device
    layout = Layout(out.shape, out.stride(), out.dtype, device)
    if func not in _COPIES:
        view = type(base)(layout, parent=(base, func, args[1:], kwargs))
        return return_and_correct_aliasing(func, args, kwargs, view)
    if base._root()._value is not None:  # values to copy exist (and may change later): copied now
        return func(base.compute(), *args[1:], **kwargs)
    lazy_copy = type(base)(layout, copy_of=(base, func, args[1:], kwargs))
    lazy_copy._copied_from = base._inputs()
    lazy_copy._copied_from.copied(lazy_copy)
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
