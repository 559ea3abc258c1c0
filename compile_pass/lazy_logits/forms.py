"""The form of a lazy tensor: which head rows its rows are and what they hold, made at dispatch level.

A root (the returned logits, a lazy copy, a derived tensor) has a :class:`Storage`: per row of its
values (row-major over ``shape[:-1]``), the head row and a :class:`compile_pass.lazy_logits.keys.Key`,
and one :class:`RowContent` for all rows: the values the key says (``z``), their log_softmax
(``lp``), softmax (``p``), ``p * lp`` or ``p * z``. Every tensor has ``_rows``: which rows of its
root's values its rows are (CPU int64, ``shape[:-1]``), or None when its last dim is not the
vocabulary. Views read their root's storage as it is now (an in-place temperature changes the keys of
the rows it wrote: :func:`record_edit`); copies and derived tensors take the keys of the moment they are
made. Anything else written to a root's rows takes their form away (:func:`break_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.lazy_logits.head import Head
from compile_pass.lazy_logits.keys import Key, Temperature
from compile_pass.op.checks import holds
from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.statistics import RowContent

_aten = torch.ops.aten
_RESHAPES = {_aten.view.default, internals.aten_unsafe_view.get()}


@dataclass
class Storage:
    """A root's form: ``head_rows`` and ``row_keys`` (indices into ``keys``, -1: no form) per row
    (``[S]`` CPU int64), its ``kind``, and for kinds other than ``LOGITS`` the dtype the values were
    rounded to (``value_dtype``)."""

    kind: RowContent
    head_rows: Tensor
    row_keys: Tensor
    keys: list[Key]
    value_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Form:
    """A tensor's form now, its rows flattened: ``head_rows`` and the key of each, ``keys[key_ids]``."""

    kind: RowContent
    dtype: torch.dtype
    value_dtype: torch.dtype | None
    head_rows: Tensor
    key_ids: Tensor
    keys: tuple[Key, ...]

    def groups(self) -> list[tuple[Key, Tensor | None]]:
        """``(key, positions)`` per key of these rows (positions None: every row; no rows: the first key's)."""
        ids = torch.unique(self.key_ids).tolist() or [0]
        if len(ids) == 1:
            return [(self.keys[ids[0]], None)]
        return [(self.keys[i], (self.key_ids == i).nonzero().squeeze(-1)) for i in ids]

    def same_rows(self, other: Form) -> bool:
        def identities(form: Form) -> Tensor:
            return torch.tensor([id(k) for k in form.keys], dtype=torch.int64)[form.key_ids]
        return torch.equal(self.head_rows, other.head_rows) and torch.equal(identities(self), identities(other))


def own_rows(shape: torch.Size) -> Tensor:
    return torch.arange(shape[:-1].numel()).view(shape[:-1])


def root_storage(source: object, head: Head, shape: torch.Size) -> Storage:
    num_rows = shape[:-1].numel()
    key = Key.root(source, head, num_rows)
    return Storage(RowContent.LOGITS, torch.arange(num_rows), torch.zeros(num_rows, dtype=torch.int64), [key])


def form_of(tensor: Tensor) -> Form | None:
    """``tensor``'s form (a LazyLogits), or None when some row has none."""
    storage, rows = tensor.root_storage, tensor.rows
    if storage is None or rows is None or not storage.keys:  # no keys: a copy of no rows
        return None
    flat = rows.reshape(-1)
    ids = storage.row_keys[flat]
    if bool((ids < 0).any()):
        return None
    return Form(storage.kind, tensor.dtype, storage.value_dtype, storage.head_rows[flat], ids, tuple(storage.keys))


def view_rows(rows: Tensor | None, vocab: int, func: object, args: tuple, kwargs: dict) -> Tensor | None:
    """The ``_rows`` of ``func``'s output (a view op of a tensor with ``rows``), or None when its
    last dim is not the vocabulary, in order. Read from the op applied to two markers: the rows
    broadcast over the vocabulary, and a meta tensor stepping along the vocabulary only."""
    if rows is None:
        return None
    row_marker = rows.unsqueeze(-1).expand(*rows.shape, vocab)
    column_marker = torch.empty_strided((*rows.shape, vocab), (0,) * rows.dim() + (1,), device="meta")
    if func in _RESHAPES:
        size = list(args[0])
        if not size or size[-1] != vocab:
            return None
        row_marker, column_marker = row_marker.reshape(size), column_marker.reshape(size)  # contiguous rows: views
    else:
        row_marker, column_marker = func(row_marker, *args, **kwargs), func(column_marker, *args, **kwargs)
    if (column_marker.dim() == 0 or column_marker.shape[-1] != vocab or column_marker.stride(-1) != 1
            or column_marker.storage_offset() != 0 or any(s != 0 for s in column_marker.stride()[:-1])):
        return None
    return row_marker[..., 0].contiguous()


def _snapshot(tensor: Tensor) -> tuple[Storage, Tensor] | None:
    """The storage and its rows flattened that ``tensor``'s rows are, if it has a form."""
    storage, rows = tensor.root_storage, tensor.rows
    if storage is None or rows is None:
        return None
    return storage, rows.reshape(-1)


def _new_storage(storage: Storage, rows: Tensor, change: object, kind: RowContent | None = None,
                 value_dtype: torch.dtype | None = None) -> Storage:
    """A storage of ``storage``'s ``rows``, each key mapped through ``change`` (a key or None)."""
    ids = storage.row_keys[rows]
    head_rows = storage.head_rows[rows]
    keys, mapped = [], torch.full_like(ids, -1)
    for old in torch.unique(ids).tolist():
        if old < 0:
            continue
        where = ids == old
        new = change(storage.keys[old], head_rows[where])
        if new is not None:
            mapped[where] = len(keys)
            keys.append(new)
    return Storage(kind or storage.kind, head_rows, mapped, keys, value_dtype)


def copied(tensor: Tensor, dtype: torch.dtype) -> Storage | None:
    """The storage of a copy of ``tensor`` (a LazyLogits) in ``dtype`` (clone, contiguous, ``.to()``)."""
    taken = _snapshot(tensor)
    if taken is None:
        return None
    storage, rows = taken
    if storage.kind is RowContent.LOGITS:
        return _new_storage(storage, rows, lambda key, head_rows: key.cast(dtype, head_rows))
    value_dtype = storage.value_dtype
    if not holds(dtype, value_dtype):
        if value_dtype != accumulate_dtype(value_dtype):
            return None  # the values were rounded already: a second rounding
        value_dtype = dtype
    return _new_storage(storage, rows, lambda key, head_rows: key, value_dtype=value_dtype)


def selected(tensor: Tensor, rows: Tensor) -> Storage | None:
    """The storage of a copy of the rows ``rows`` (ids into the root's rows, any shape) of
    ``tensor`` (a LazyLogits): ``tensor[mask]`` of its token dims."""
    storage = tensor.root_storage
    if storage is None:
        return None
    return _new_storage(storage, rows.reshape(-1), lambda key, head_rows: key, value_dtype=storage.value_dtype)


def scaled(tensor: Tensor, other: object, multiplies: bool, dtype: torch.dtype) -> Storage | None:
    """The storage of ``tensor * other`` (``/ other``) rounded to ``dtype`` (in place: the
    tensor's own), or None."""
    taken = _snapshot(tensor)
    if taken is None or taken[0].kind is not RowContent.LOGITS or not taken[0].keys:
        return None
    storage, rows = taken
    num_rows = storage.keys[0].num_rows
    temperature = Temperature.of(other, multiplies, tensor.shape, storage.head_rows[rows], num_rows)
    if temperature is None:
        return None
    compute = accumulate_dtype(temperature.dtype_with(tensor.dtype))
    return _new_storage(storage, rows, lambda k, head_rows: k.scaled(temperature, dtype, compute, head_rows))


def record_edit(tensor: Tensor, other: object, multiplies: bool) -> bool:
    """Record ``tensor.mul_(other)`` / ``div_`` on its root's rows (their keys change), or take
    the form of those rows away; whether they keep one."""
    storage = tensor.root_storage
    changed = scaled(tensor, other, multiplies, tensor.dtype) if storage is not None else None
    if changed is None:
        break_rows(tensor)
        return False
    rows = tensor.rows.reshape(-1)
    offset = len(storage.keys)
    storage.keys.extend(changed.keys)
    storage.row_keys[rows] = torch.where(changed.row_keys >= 0, changed.row_keys + offset, -1)
    return bool((changed.row_keys >= 0).all())


def break_rows(tensor: Tensor) -> None:
    """Take the form of ``tensor``'s rows (all of its root's, when unknown) away: something else wrote them."""
    storage = tensor.root_storage
    if storage is not None:
        storage.row_keys[tensor.rows.reshape(-1) if tensor.rows is not None else slice(None)] = -1


def softmaxed(tensor: Tensor, kind: RowContent, dtype: torch.dtype) -> Storage | None:
    """The storage of ``log_softmax`` (``kind=LOG_PROBS``) or ``softmax`` (``PROBS``) of ``tensor`` (of
    kind ``LOGITS``) over the last dim, in ``dtype``, where the op computes it in torch's precision."""
    taken = _snapshot(tensor)
    if taken is None or taken[0].kind is not RowContent.LOGITS:
        return None
    storage, rows = taken
    return _new_storage(storage, rows, lambda key, head_rows: key if key.reads_in(dtype) else None, kind=kind,
                        value_dtype=dtype)


def exponentiated(tensor: Tensor, dtype: torch.dtype) -> Storage | None:
    """The storage of ``exp`` of ``tensor`` when it holds log-probabilities: probabilities."""
    taken = _snapshot(tensor)
    if taken is None or taken[0].kind is not RowContent.LOG_PROBS:
        return None
    return _new_storage(*taken, lambda key, head_rows: key, kind=RowContent.PROBS, value_dtype=dtype)


_PRODUCTS = {frozenset((RowContent.PROBS, RowContent.LOG_PROBS)): RowContent.P_LOG_P,
             frozenset((RowContent.PROBS, RowContent.LOGITS)): RowContent.P_Z}


def product(a: Tensor, b: Tensor, dtype: torch.dtype) -> Storage | None:
    """The storage of ``a * b`` when it is ``p * lp`` or ``p * z`` of the same rows, in ``dtype``."""
    forms = form_of(a), form_of(b)
    if forms[0] is None or forms[1] is None or a.shape != b.shape or not forms[0].same_rows(forms[1]):
        return None
    kinds = frozenset((forms[0].kind, forms[1].kind))
    kind = _PRODUCTS.get(kinds)
    if kind is None or (kind is RowContent.P_Z and not all(key.reads_in(dtype) for key, _ in forms[0].groups())):
        return None
    storage, rows = _snapshot(a)
    return _new_storage(storage, rows, lambda key, head_rows: key, kind=kind, value_dtype=dtype)
