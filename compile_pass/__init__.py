"""chunkce: memory-efficient cross-entropy for any PyTorch language model through torch.compile."""
from compile_pass.op import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
