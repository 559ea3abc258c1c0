"""Returned logits at run time: the tensors a compiled step hands out for logits it did not compute.

Imports only :mod:`compile_pass.op` of the project (module map: docs/design.md).
"""
from compile_pass.lazy_logits.staleness import DROPPED_RECIPE, DroppedRecipe, Recipe, StaleLogitsError
from compile_pass.lazy_logits.tensor import DroppedLogits, LazyLogits
from compile_pass.lazy_logits.wrap import LazyOutputs, Slot, computed_where_input, wrap_compiled

__all__ = ["DROPPED_RECIPE", "DroppedLogits", "DroppedRecipe", "LazyLogits", "LazyOutputs", "Recipe", "Slot",
           "StaleLogitsError", "computed_where_input", "wrap_compiled"]
