"""chunkce: memory-efficient cross-entropy for any PyTorch language model through torch.compile."""
from compile_pass.op import linear_cross_entropy
from compile_pass.backend import chunkce_backend, register as _register_backend
from compile_pass.explain import explain
from compile_pass.graph import fuse_linear_cross_entropy
from compile_pass.pre_grad import ChunkcePreGradPass
from compile_pass.options import Options
from compile_pass.graph.report import PassReport, SiteRecord, last_report

_register_backend()

__all__ = [
    "linear_cross_entropy",
    "chunkce_backend",
    "explain",
    "fuse_linear_cross_entropy",
    "ChunkcePreGradPass",
    "Options",
    "PassReport",
    "SiteRecord",
    "last_report",
]
