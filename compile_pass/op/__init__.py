"""The op: chunked linear + cross-entropy that never materializes the ``[N, V]`` logits.

    function.py    the public function: argument checks, flatten, the custom op, the reduction;
                   ``planned_tiles``, the tiles a call will walk
    checks.py      the argument checks; ``check_chunking``, which the pass's ``Options`` calls too
    schema.py      the ops' options, defined once (``OpOptions``: schemas, parsing, calls), and
                   ``ChunkPlan``: the options resolved for one call
    custom_ops.py  ``chunkce::linear_cross_entropy`` and ``..._backward``: fakes, autograd, torch.func
    vocab_parallel.py  ``vocab_parallel_cross_entropy``: the loss of a vocabulary-sharded
                   (tensor-parallel) head, its statistics combined over the group by all-reduces
    vocab_parallel_ops.py  its custom ops: the shard's row statistics, the loss rows' gradient
    grads_in_forward.py  opt-in ``chunkce::linear_cross_entropy_grads_in_forward``: gradients computed in forward
    loops.py       the ops' tile loops (the three of them): project a tile, run its kernel, write its
                   share of the outputs; ``op_body``, what every op's body runs around its loop
    kernels.py     the per-tile math (the log-sum-exp online across vocabulary blocks), compiled
                   by Inductor for the device; ``KernelArgs``, the constants they take as one record
    transform.py   ``HeadTransform``: what the logits go through between projection and loss (a
                   scale), applied and differentiated in one place for the kernels
    chunking.py    how a call is cut into [n, Vb] tiles, one rule for the three ops (``resolve_tiles``:
                   n the smallest chunk at full matmul speed, Vb from a byte budget), the backward's walk
    settings.py    the ``CHUNKCE_*`` environment variables

This package never imports the graph pass (:mod:`compile_pass.graph`) or the entry points.
"""
from compile_pass.op import vocab_parallel  # noqa: F401 - registers the chunkce::vocab_parallel_* ops
from compile_pass.op.function import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
