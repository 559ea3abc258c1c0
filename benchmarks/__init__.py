"""Benchmarks of chunkce: op-level (``bench_op``) and model-level (``bench_model``).

Run from the repository root as modules, e.g. ``python -m benchmarks.bench_op --help``.
"""
