"""Returned logits at run time: the tensors a compiled step hands out for logits it did not compute.

    out = model(input_ids=ids, labels=labels)   # compiled with backend="chunkce"
    out.logits                                  # a LazyLogits: computed exactly when first read

    recipe.py       Recipe: the graph's own nodes from the projection to the returned value;
                    Refusing (DROPPED): the recipe of dropped logits, which raises
    staleness.py    Inputs: the tensors a recipe reads and their versions; StaleLogitsError
    tensor.py       LazyLogits (views, copies, reads), DroppedLogits (a LazyLogits whose recipe refuses)
    wrap.py         Plan, wrap_compiled: the compiled step with a LazyLogits in each slot the pass emptied

Made by :mod:`compile_pass.graph.returned_logits` (at compile time) and the backend; this
package imports nothing else of the project.
"""
from compile_pass.lazy_logits.recipe import DROPPED, Recipe, Refusing
from compile_pass.lazy_logits.staleness import StaleLogitsError
from compile_pass.lazy_logits.tensor import DroppedLogits, LazyLogits
from compile_pass.lazy_logits.wrap import Plan, Slot, wrap_compiled

__all__ = ["DROPPED", "DroppedLogits", "LazyLogits", "Plan", "Recipe", "Refusing", "Slot", "StaleLogitsError",
           "wrap_compiled"]
