"""The ops: chunked linear + cross-entropy and per-row statistics that never materialize the logits.

The ``[N, V]`` logits are never held (module map: docs/design.md). Imports nothing else of the project.
"""
from compile_pass.op import vocab_parallel  # noqa: F401 - registers the chunkce::vocab_parallel_* ops
from compile_pass.op.loss import linear_cross_entropy
from compile_pass.op.statistics import RowStatistics, linear_statistics

__all__ = ["linear_cross_entropy", "linear_statistics", "RowStatistics"]
