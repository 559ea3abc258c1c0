"""chunkce: memory-efficient cross-entropy for any PyTorch language model through torch.compile.

    loss = compile_pass.linear_cross_entropy(hidden_states, weight, target)  # the op, eager
    model = torch.compile(model, backend="chunkce")                           # the pass, compiled

Importing the package changes no torch setting; it registers the backend's entry point
without importing the backend.
"""
import importlib
from importlib.metadata import EntryPoint
from typing import Any

from compile_pass.op import RowStatistics, linear_cross_entropy, linear_statistics
from compile_pass.explain import explain  # imported, not lazy: the submodule of that name would shadow it
from compile_pass.graph import fuse_linear_cross_entropy
from compile_pass.graph.publish import last_report
from compile_pass.graph.report import PassReport, SiteRecord, UnmatchedRecord
from compile_pass.lazy_logits import DroppedLogits, LazyLogits, StaleLogitsError
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


def _register_backend() -> None:
    """Add the ``chunkce`` entry point for a source checkout (Dynamo reads installed metadata
    only), unless Dynamo already has one or the backend."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._BACKENDS and BACKEND_NAME not in registry._COMPILER_FNS:
        registry._BACKENDS[BACKEND_NAME] = BACKEND_ENTRY_POINT


_register_backend()
