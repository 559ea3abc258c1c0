"""The graph pass on torch-level FX graphs: find -> plan -> apply, then the report.

Module map: docs/design.md. Imports the op, :mod:`compile_pass.lazy_logits` and
:mod:`compile_pass.options`, never the entry points.
"""
from compile_pass.graph.pipeline import fuse_linear_cross_entropy

__all__ = ["fuse_linear_cross_entropy"]
