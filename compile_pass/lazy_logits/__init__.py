"""Returned logits at run time: the tensors a compiled step hands out for logits it did not compute.

Returned logits at run time: the tensors a compiled step hands out for logits it did not
compute (module map: docs/design.md). Imports only :mod:`compile_pass.op` of the project.
"""
from compile_pass.lazy_logits.staleness import DROPPED, Recipe, Refusing, StaleLogitsError
from compile_pass.lazy_logits.tensor import DroppedLogits, LazyLogits
from compile_pass.lazy_logits.wrap import Plan, Slot, wrap_compiled

__all__ = ["DROPPED", "DroppedLogits", "LazyLogits", "Plan", "Recipe", "Refusing", "Slot", "StaleLogitsError",
           "wrap_compiled"]
