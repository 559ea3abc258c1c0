"""Returned logits at run time: the tensors a compiled step hands out for logits it did not
compute (module map: docs/design.md). Imports only :mod:`compile_pass.op` of the project."""
from compile_pass.lazy_logits.recipe import DROPPED, Recipe, Refusing
from compile_pass.lazy_logits.staleness import StaleLogitsError
from compile_pass.lazy_logits.tensor import DroppedLogits, LazyLogits
from compile_pass.lazy_logits.wrap import Plan, Slot, computed_where_input, wrap_compiled

__all__ = ["DROPPED", "DroppedLogits", "LazyLogits", "Plan", "Recipe", "Refusing", "Slot", "StaleLogitsError",
           "computed_where_input", "wrap_compiled"]
