"""The graph pass on torch-level FX graphs: find -> plan -> apply, then the report.

The graph pass: find the cross-entropy sites of a torch-level FX graph, plan each, apply
the plans (module map: docs/design.md). Imports the op, :mod:`compile_pass.lazy_logits` and
:mod:`compile_pass.options`, never the entry points.
"""
from compile_pass.graph.pipeline import fuse_linear_cross_entropy

__all__ = ["fuse_linear_cross_entropy"]
