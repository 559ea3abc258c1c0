"""The tensor a compiled step returns for logits it did not compute: LazyLogits, DroppedLogits.

The tensor a compiled step returns for logits it did not compute: :class:`LazyLogits`, and
:class:`DroppedLogits` (``returned_logits="drop"``). Behaviour in full: docs/models.md,
"``LazyLogits`` (the default)".
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import compile_pass.torch_internals as internals
from compile_pass.lazy_logits import forms, ops, reads
from compile_pass.lazy_logits.ops import COPY_OPS, EDITS, METADATA_OPS, Layout
from compile_pass.lazy_logits.staleness import Inputs, StaleLogitsError

_aten = torch.ops.aten
__all__ = ["METADATA_OPS", "DroppedLogits", "LazyLogits", "Layout"]


class LazyLogits(torch.Tensor):
    """Returned logits the compiled step did not compute, with their shape, dtype, device and
    ``requires_grad``; computed exactly (the recipe, eagerly) on first read and kept. Views
    are lazy views of the same values; copies hold the values of their moment; row-statistics
    reads go through the op (:mod:`compile_pass.lazy_logits.reads`).

    Raises:
        StaleLogitsError: on a read after a tensor the logits are computed from changed.
    """

    @staticmethod
    def __new__(cls, layout: Layout, *, source: Inputs | None = None,
                parent: tuple[LazyLogits, Any, tuple, dict] | None = None,
                copy_of: tuple[Any, tuple, dict, tuple[int, ...]] | None = None) -> LazyLogits:
        self = internals.make_wrapper_subclass(cls, layout.shape, strides=layout.stride, dtype=layout.dtype,
                                               device=layout.device, requires_grad=False)
        # a root's values: ``source`` (the recipe's) or ``copy_of`` (func, args, kwargs, edits); a view's: ``parent``'s
        self._source, self._parent, self._copy_of, self._value = source, parent, copy_of, None
        self._copied_from: Inputs | None = None  # a lazy copy's: the inputs its values are read from
        self._edits: list = []  # a root's in-place temperatures not applied yet (ops.edit)
        self._form: forms.Storage | None = None  # a root's form (forms.py), made when first asked for
        self._view_rows, self._rows_made = None, False  # what _rows gives, once made
        return self

    @property
    def _storage(self) -> forms.Storage | None:
        """A root's form: the returned logits' made on first use (when the recipe has a head)."""
        head = getattr(self._source.recipe, "head", None) if self._source is not None else None
        if self._form is None and head is not None:
            self._form = forms.root_storage(self._source, head, self.shape)
        return self._form

    def read_from(self, inputs: Inputs, storage: forms.Storage | None) -> None:
        """A lazy copy's: its values are read from ``inputs`` (pending there until taken), its form
        ``storage`` (None: made on first use, or none)."""
        self._copied_from = inputs
        inputs.copied(self)
        if storage is not None:
            self._form = storage

    def add_edit(self, func: Any, args: tuple, kwargs: dict) -> None:
        """``func(self, *args, **kwargs)``, an in-place edit of this tensor, kept by its root and
        applied when the root's values are computed (:func:`compile_pass.lazy_logits.ops.replay`)."""
        self._root()._edits.append((self, func, args, kwargs))

    @property
    def root_storage(self) -> forms.Storage | None:
        """Its root's form storage (:class:`compile_pass.lazy_logits.forms.Storage`), None: none."""
        return getattr(self._root(), "_storage", None)  # None too where the fields were never made

    @property
    def root_computed(self) -> bool:
        """Whether its root's values were computed and kept (they can change from then on)."""
        return self._root()._value is not None

    @property
    def edit_count(self) -> int:
        """How many in-place edits its root keeps, not applied yet."""
        return len(self._root()._edits)

    @property
    def rows(self) -> torch.Tensor | None:
        """Which rows of its root's values this tensor's rows are (``shape[:-1]``), None: unknown
        or no form (made on first use: a view only read or printed makes none)."""
        if not self._rows_made:
            self._rows_made = True
            if self._parent is None:
                self._view_rows = forms.own_rows(self.shape) if self._storage is not None else None
            else:
                base, func, args, kwargs = self._parent
                self._view_rows = forms.view_rows(base.rows, base.shape[-1] if base.dim() else 0, func, args, kwargs)
        return self._view_rows

    @classmethod
    @torch.compiler.disable  # a compiled function reading a LazyLogits runs its reads eagerly (a graph break)
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = reads.fused(func, args, kwargs)
        except StaleLogitsError:  # the op cannot run now; kept values serve the read as torch runs it
            if not all(a.root_computed for a in (*args, *kwargs.values()) if isinstance(a, LazyLogits)):
                raise
            out = NotImplemented
        if out is not NotImplemented:
            return out
        with internals.disable_torch_function_subclass():
            return func(*args, **kwargs)

    def compute(self) -> torch.Tensor:
        """The values, computed on the first call and kept (a plain tensor, no autograd)."""
        if self._value is None:
            if self._parent is not None:
                base, func, args, kwargs = self._parent
                with torch.no_grad():
                    self._value = func(base.compute(), *args, **kwargs)  # a view of the base's kept values
            else:
                self._value = self._values_at(None)
                self.inputs().flush()  # copies of these values are taken now: from here on they can change
                self._copy_of = self._copied_from = None  # a computed copy holds its values only, not its source's
        return self._value

    @property
    def is_computed(self) -> bool:
        """Whether the values were computed (read) and kept already."""
        return self._value is not None

    def _root(self) -> LazyLogits:
        return self if self._parent is None else self._parent[0]._root()

    def view_in(self, values: torch.Tensor, root: LazyLogits) -> torch.Tensor:
        """The view this tensor is of ``root`` (itself, or a root it is a view of), taken of
        ``values`` (``root``'s values or a tensor of their layout)."""
        if self is root:
            return values
        base, func, args, kwargs = self._parent
        return func(base.view_in(values, root), *args, **kwargs)

    def inputs(self) -> Inputs:
        """The recipe's inputs its values are read from (its root's, or those its copy reads)."""
        root = self._root()
        return root._source if root._source is not None else root._copied_from

    def sources_kept(self) -> bool:
        """Whether a lazy copy's operands have kept values (which can change from now on)."""
        return any(ops.is_lazy(a) and a._root()._value is not None for a in self._copy_of[1])

    def _values_at(self, edits: int | None) -> torch.Tensor:
        """A root's values after its first ``edits`` in-place edits (None: all): the kept ones
        when they are those, else computed afresh (nothing kept)."""
        if self._value is not None and (edits is None or edits == len(self._edits)):
            return self._value
        with torch.no_grad():
            return ops.replay(self._make(), self, self._edits[:edits])

    def _make(self) -> torch.Tensor:
        """A root's values before its edits, computed afresh (nothing kept)."""
        if self._source is not None:
            return self._source.compute()
        func, args, kwargs, counts = self._copy_of
        operands = iter(counts)
        values = [a._transient(next(operands)) if ops.is_lazy(a) else a for a in args]
        with torch.no_grad():
            lazy = [a for a in args if ops.is_lazy(a)]
            fresh = len(lazy) == 1 and lazy[0]._root()._value is None  # computed for this copy alone
            if fresh and func in COPY_OPS and _same_layout(values[0], self) and _owns_storage(values[0]):
                return values[0]  # already a copy: no second [N, V]
            return func(*values, **kwargs)

    def _transient(self, edits: int | None = None) -> torch.Tensor:
        """The values without keeping any (with the first ``edits`` edits of the root; None: all):
        the kept ones if they are those, else computed afresh."""
        if self._value is not None and edits is None:
            return self._value
        if self._parent is None:
            return self._values_at(edits)
        base, func, args, kwargs = self._parent
        with torch.no_grad():
            return func(base._transient(edits), *args, **kwargs)

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

    def share_memory_(self) -> LazyLogits:
        raise RuntimeError("chunkce: share_memory_() needs a tensor that owns its storage, and LazyLogits computes "
                           "its values on first read: share logits.compute() (the values, a plain tensor) instead")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        first = isinstance(args[0], LazyLogits) if args else False
        rest = (*args[1:], *kwargs.values())
        if first and func in METADATA_OPS and not any(isinstance(a, LazyLogits) for a in rest):
            return ops.metadata_op(func, args, kwargs)
        if first and torch.Tag.inplace_view in func.tags:
            return ops.inplace_view(func, args, kwargs)
        if first and func in EDITS and not any(isinstance(a, LazyLogits) for a in rest):
            return ops.edit(func, args, kwargs)
        if func is _aten.copy_.default and isinstance(args[1], LazyLogits) and not isinstance(args[0], LazyLogits):
            func(args[0], args[1]._transient(), *args[2:], **kwargs)  # a copy: the source stays lazy
            return args[0]
        made = ops.derived(func, args, kwargs)
        if made is not None:
            return made
        values, kwargs_values = internals.tree_map(lambda t: t.compute() if isinstance(t, LazyLogits) else t, (args, kwargs))
        out = func(*values, **kwargs_values)
        if ops.writes_first_argument(func) and first:
            forms.break_rows(args[0])
            return args[0]  # an in-place op changed its kept values: it returns itself, as in-place ops do
        if isinstance(kwargs.get("out"), LazyLogits):
            forms.break_rows(kwargs["out"])
            return kwargs["out"]
        return out


ops.Lazy.register(LazyLogits)


def _computed_typed_storage(self: LazyLogits) -> Any:
    return internals.typed_storage.read(self.compute())()


internals.typed_storage.override(LazyLogits, _computed_typed_storage)


class DroppedLogits(LazyLogits):
    """A :class:`LazyLogits` whose recipe refuses (``returned_logits="drop"``): views, casts and
    copies give another; any read raises ``RuntimeError`` naming the option."""

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DroppedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _same_layout(values: torch.Tensor, like: torch.Tensor) -> bool:
    return (values.shape, values.stride(), values.dtype, values.device) == (
        like.shape, like.stride(), like.dtype, like.device)


def _owns_storage(values: torch.Tensor) -> bool:
    """Whether ``values`` spans its whole storage (a view of part of it would keep the rest alive)."""
    return values.storage_offset() == 0 and values.untyped_storage().nbytes() == values.numel() * values.element_size()
