"""chunkce: memory-efficient cross-entropy for any PyTorch language model through torch.compile.

    loss = compile_pass.linear_cross_entropy(hidden_states, weight, target)  # the op, eager
    model = torch.compile(model, backend="chunkce")                           # the pass, compiled

Importing the package changes no torch setting and does not import the backend.
"""
import importlib
import importlib.metadata
from importlib.metadata import EntryPoint
from typing import Any

import compile_pass.torch_internals as internals
from compile_pass import dynamo_scope
from compile_pass.explain import explain  # imported, not lazy: the submodule of that name would shadow it
from compile_pass.graph import fuse_linear_cross_entropy
from compile_pass.graph.report import PassReport, SiteRecord, UnmatchedRecord, last_report
from compile_pass.lazy_logits import DroppedLogits, LazyLogits, StaleLogitsError
from compile_pass.op import RowStatistics, linear_cross_entropy, linear_statistics
from compile_pass.options import Options
from compile_pass.pre_grad import ChunkcePreGradPass

BACKEND_NAME = "chunkce"
BACKEND_ENTRY_POINT = EntryPoint(name=BACKEND_NAME, value="compile_pass.backend:chunkce_backend",
                                 group="torch_dynamo_backends")  # as in pyproject.toml

__all__ = [
    "linear_cross_entropy",
    "linear_statistics",
    "RowStatistics",
    "chunkce_backend",
    "explain",
    "fuse_linear_cross_entropy",
    "ChunkcePreGradPass",
    "Options",
    "PassReport",
    "SiteRecord",
    "UnmatchedRecord",
    "last_report",
    "LazyLogits",
    "DroppedLogits",
    "StaleLogitsError",
]


def __getattr__(name: str) -> Any:
    """``chunkce_backend``, imported on first access (PEP 562): that import is the backend's first use."""
    if name == "chunkce_backend":
        return importlib.import_module("compile_pass.backend").chunkce_backend
    raise AttributeError(f"module 'compile_pass' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _load_and_compile(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """Dynamo's ``chunkce`` in a source checkout: imports the backend at its first compile and
    calls it with torch.compile's arguments."""
    return BACKEND_ENTRY_POINT.load()(gm, example_inputs, **kwargs)


def _register_backend() -> None:
    """Register :func:`_load_and_compile` as ``chunkce`` unless an installed distribution declares
    the entry point: Dynamo loads that one itself and registers the name then."""
    if not importlib.metadata.entry_points(group=BACKEND_ENTRY_POINT.group, name=BACKEND_NAME):
        internals.register_backend(dynamo_scope.mark(_load_and_compile), name=BACKEND_NAME)


_register_backend()
