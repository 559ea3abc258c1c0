"""What aten ops do to a :class:`compile_pass.lazy_logits.tensor.LazyLogits` below autograd without reading values.

    views (METADATA_OPS, split / unbind)    another LazyLogits over the same values (:func:`metadata_op`)
    copies (clone, _to_copy)                a lazy copy: the values of the moment it is made
    z[mask], z[idx] (index of token dims)   a lazy copy of the rows it selects (:func:`indexed`)
    z / t, z * t, log_softmax, softmax,     a derived LazyLogits with a form (:func:`derived`), computed
    exp(lp), p * lp, p * z                  from its operands' values as they were when it was made
    div_ / mul_ by a temperature            recorded on the root's rows (:func:`edit`), replayed when the
                                            values are computed

Autograd above records stock's backward nodes for each of them, so a read that is not fused
(:mod:`compile_pass.lazy_logits.reads`) gets stock's values and gradients. An op whose result
would have no form reads the values, as any other op does.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

import compile_pass.torch_internals as internals
from compile_pass.lazy_logits import forms
from compile_pass.op.checks import is_last_dim
from compile_pass.op.statistics import RowContent

_aten = torch.ops.aten
_TO_COPY, _UNSAFE_VIEW = internals.aten_to_copy.get(), internals.aten_unsafe_view.get()
_LOG_SOFTMAX, _SOFTMAX = internals.aten_log_softmax.get(), internals.aten_softmax.get()
# Ops that only change a tensor's metadata (view, dtype, device): they give another lazy
# tensor. accelerate's mixed-precision wrapper calls .float() on every output, callers
# detach or move outputs: none of that reads a value.
METADATA_OPS = {
    _aten.detach.default, _aten.alias.default, _TO_COPY, _aten.clone.default,
    _aten.view.default, _UNSAFE_VIEW, _aten.t.default, _aten.transpose.int,
    _aten.permute.default, _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.default, _aten.squeeze.dims, _aten.expand.default,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int,
}
_MULTI = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int}  # views returning a list
COPY_OPS = {_aten.clone.default, _TO_COPY}  # of METADATA_OPS, those that copy; the rest are views
_SCALES = {_aten.div.Tensor: False, _aten.div.Scalar: False, _aten.mul.Tensor: True, _aten.mul.Scalar: True}
_DERIVED = {*_SCALES, _LOG_SOFTMAX, _SOFTMAX, _aten.exp.default}
EDITS = {_aten.div_.Tensor: False, _aten.div_.Scalar: False, _aten.mul_.Tensor: True, _aten.mul_.Scalar: True}


@dataclass(frozen=True)
class Layout:
    """A tensor's metadata without its values."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class Lazy(abc.ABC):  # a type to ask isinstance of: nothing to implement
    """The lazy tensors (:class:`compile_pass.lazy_logits.tensor.LazyLogits` registers itself), known
    here without importing them."""


def is_lazy(value: Any) -> bool:
    return isinstance(value, Lazy)


def on_meta(value: Any) -> Any:
    """``value`` with every tensor an empty meta tensor of its layout (what an op would make)."""
    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return internals.tree_map(meta, value)


@dataclass(frozen=True)
class Pick:
    """Output ``index`` of a view op that returns a list (a view's recipe)."""

    func: Any
    index: int

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.func(*args, **kwargs)[self.index]


def metadata_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a LazyLogits (another LazyLogits over its values, aliasing it as torch's
    views do), or a copy (values computed now if the source's are, else a lazy copy)."""
    base = args[0]
    meta_kwargs = {**kwargs, "device": "meta"} if "device" in kwargs else kwargs
    out = func(on_meta(base), *args[1:], **meta_kwargs)
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else base.device
    if func in COPY_OPS:
        layout = Layout(out.shape, out.stride(), out.dtype, device)
        storage = forms.copied(base, out.dtype) if device == base.device else None  # elsewhere: its reads there
        return _copy(base, func, args, kwargs, layout, storage)
    if func in _MULTI:
        views = [type(base)(Layout(o.shape, o.stride(), o.dtype, device), parent=(base, Pick(func, i), args[1:],
                                                                                 kwargs))
                 for i, o in enumerate(out)]
        return internals.return_and_correct_aliasing(func, args, kwargs, views)
    view = type(base)(Layout(out.shape, out.stride(), out.dtype, device), parent=(base, func, args[1:], kwargs))
    return internals.return_and_correct_aliasing(func, args, kwargs, view)


def _copy(base: Any, func: Any, args: tuple, kwargs: dict, layout: Layout, storage: forms.Storage | None) -> Any:
    """A new root made by ``func`` from the LazyLogits among ``args``: a plain tensor computed now
    when one of their roots' values is (those can change later), else lazy (pending in their inputs)."""
    operands = [a for a in args if is_lazy(a)]
    if any(a.root_computed for a in operands) or len({id(a.inputs()) for a in operands}) != 1:
        return func(*[a.compute() if is_lazy(a) else a for a in args], **kwargs)
    counts = tuple(a.edit_count for a in operands)
    copy = type(base)(layout, copy_of=(func, args, kwargs, counts))
    copy.read_from(base.inputs(), storage)
    return copy


def derived(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args)`` as a derived LazyLogits when its result has a form, else None."""
    if func is _aten.index.Tensor:
        return indexed(args, kwargs)
    if kwargs or not args or func not in _DERIVED:
        return None
    lazy = [a for a in args if is_lazy(a)]
    if not lazy or any(a.rows is None for a in lazy):
        return None
    out = func(*on_meta(args))
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.shape != lazy[0].shape:
        return None
    storage = _derived_storage(func, args, out.dtype)
    if storage is None:
        return None
    return _copy(lazy[0], func, args, kwargs, Layout(out.shape, out.stride(), out.dtype, lazy[0].device), storage)


def indexed(args: tuple, kwargs: dict) -> Any:
    """``tensor[indices]`` (``aten.index``) of a LazyLogits whose indices (boolean masks or
    integer tensors) select token rows only, the vocabulary dim kept last: a lazy copy of those
    rows (their form), else None. The selected rows are found on the CPU, as a mask's count is
    (a host sync, which stock's boolean indexing makes too)."""
    tensor, indices = args
    if (kwargs or not is_lazy(tensor) or tensor.dim() == 0 or tensor.rows is None
            or any(is_lazy(index) for index in indices)):
        return None
    indices = [None if index is None else index.detach().clone() for index in indices]  # the values of now
    try:  # the rows' ids indexed as the values would be: an index of the vocabulary dim raises here
        rows = _aten.index.Tensor(tensor.rows, [None if index is None else index.cpu() for index in indices])
    except (IndexError, RuntimeError):  # torch's own error, from the values
        return None
    storage = forms.selected(tensor, rows)
    if storage is None:
        return None
    shape = (*rows.shape, tensor.shape[-1])
    layout = Layout(torch.Size(shape), torch.empty(shape, device="meta").stride(), tensor.dtype, tensor.device)
    return _copy(tensor, _aten.index.Tensor, (tensor, indices), {}, layout, storage)


def _derived_storage(func: Any, args: tuple, dtype: torch.dtype) -> forms.Storage | None:
    if func in _SCALES and len(args) == 2:
        a, b = args
        if is_lazy(a) and is_lazy(b):
            return forms.product(a, b, dtype) if func is _aten.mul.Tensor else None
        if is_lazy(a):
            return forms.scaled(a, b, _SCALES[func], dtype)
        return forms.scaled(b, a, True, dtype) if _SCALES[func] else None
    if func in (_LOG_SOFTMAX, _SOFTMAX) and is_lazy(args[0]):
        last = is_last_dim(args[1], args[0].dim())
        kind = RowContent.LOG_PROBS if func is _LOG_SOFTMAX else RowContent.PROBS
        return forms.softmaxed(args[0], kind, dtype) if last else None
    if func is _aten.exp.default:
        return forms.exponentiated(args[0], dtype)
    return None


def edit(func: Any, args: tuple, kwargs: dict) -> Any:
    """``div_`` / ``mul_`` of a LazyLogits: recorded on its root when its values are not
    computed and the rows keep a form (replayed when they are), else applied to the values."""
    tensor, other = args[0], args[1]
    func(on_meta(tensor), *on_meta(args[1:]), **kwargs)  # torch's checks (shapes, dtypes)
    overlaps = internals.has_internal_overlap(on_meta(tensor)) == 1  # torch refuses: the values' op raises
    kept = not overlaps and forms.record_edit(tensor, other, EDITS[func])
    if kept and not tensor.root_computed:
        other = other.detach().clone() if isinstance(other, torch.Tensor) else other
        tensor.add_edit(func, (other, *args[2:]), kwargs)
        return tensor
    func(tensor.compute(), *args[1:], **kwargs)
    return tensor


def replay(values: torch.Tensor, root: Any, edits: list) -> torch.Tensor:
    """``values`` (``root``'s, computed afresh) with ``edits`` applied in place, in order."""
    for tensor, func, args, kwargs in edits:
        func(tensor.view_in(values, root), *args, **kwargs)
    return values


def inplace_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """``detach_`` (autograd's business only): the tensor itself. Ops that change a tensor's
    shape or storage in place (``unsqueeze_``, ``t_``, ``resize_``, ``set_``, ...) are refused:
    the views already taken of it read its values through it."""
    if func is _aten.detach_.default:
        return args[0]
    name = func.overloadpacket.__name__
    raise RuntimeError(f"chunkce: {name}() would change the shape or storage of a LazyLogits in place, which it "
                       f"does not support (its views read their values through it): use the out-of-place "
                       f"{name.rstrip('_')}() (a view), or logits.compute() (the values, a plain tensor)")


def writes_first_argument(func: Any) -> bool:
    arguments = getattr(getattr(func, internals.overload_schema.name, None), "arguments", ())
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and alias.is_write
