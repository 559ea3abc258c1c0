"""How the op cuts a call into chunks: tokens per chunk, and the backward's walk.

A chunk costs ``chunk_size * vocab_size * itemsize`` bytes for its logits; backward
(and the grads-in-forward loop) overwrites them with their gradient in place
(:func:`compile_pass.op.kernels.chunk_backward`), so the op's working set beyond
its inputs and their gradients is one chunk.
:func:`choose_chunk_size` picks the tokens of a chunk from two numbers:

* a **byte budget** for one chunk's logits (``chunk_bytes``; default
  :data:`DEFAULT_CHUNK_BYTES`, or ``CHUNKCE_CHUNK_BYTES``), which fixes the
  working set whatever the number of tokens: it stays flat while unfused
  compile's ``[N, V]`` buffers grow with N;
* the **smallest chunk at which the matmuls still run at full speed**
  (:func:`min_full_speed_tokens`): every per-chunk matmul reads the whole
  ``[V, H]`` weight once, for ``2 * n`` flops per weight element, so a small chunk
  is bound by memory bandwidth, not by the arithmetic units. The default budget
  never goes below it; an explicit budget does (the user's trade).

Tuned on (the full tables and the trade-offs: ``docs/op.md``, "Chunk size"; these
are the same measurements):

* CPU, the project's 2-core AMD EPYC (32 MiB L3), torch 2.13 + MKL, fp32, weight std
  0.02, on an otherwise idle machine: the projection and the weight-gradient product
  of one chunk together at H 1024, V 32768 ran at 75 / 99 / 107 / 129 / 123 GFLOP/s
  with 64 / 128 / 256 / 512 / 1024 tokens. Hence a CPU floor of 256 tokens (a
  compromise: 512 runs the matmuls at full speed at twice the working set) and a
  16 MiB budget, which decides only for small vocabularies (V < 16384 in fp32).
* CUDA, H200 (torch 2.11), H 4096, V 128256, bf16 with fp32 logits, 8192 tokens,
  forward + backward: 97 ms with 256-token chunks, 63 ms with 1024, 59 ms with 2048.
  Hence an accelerator floor of 2048 tokens.

Then rounded down to a multiple of :data:`ALIGN` tokens (at least ``ALIGN``) and
capped at the number of tokens. :func:`resolve_chunk_size` is the one place the op
(and the graph pass's report) decides between an explicit ``chunk_size`` or
``chunk_bytes``, ``CHUNKCE_CHUNK_SIZE`` or ``CHUNKCE_CHUNK_BYTES``, and the default.

Backward with a half-precision weight over several token chunks accumulates the
weight gradient in fp32; it walks the vocabulary in ``VOCAB_BLOCKS`` blocks so the
fp32 accumulator is one block (``V / VOCAB_BLOCKS * H * 4`` bytes: a quarter of a
bf16 weight) rather than the whole ``[V, H]``, with token chunks ``VOCAB_BLOCKS``
times wider so each chunk of logits keeps its size. :func:`plan_backward` says
which blocks and chunks a call walks and which gradient buffers sum into.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from compile_pass.op.kernels import accumulate_dtype
from compile_pass.op.settings import settings

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # bytes of one chunk's logits, the default budget
MIN_FULL_SPEED_TOKENS_CPU = 256  # tokens
MIN_FULL_SPEED_TOKENS_ACCELERATOR = 2048  # tokens
ALIGN = 32  # tokens
VOCAB_BLOCKS = 8

Span = tuple[int, int]  # [start, end)


def min_full_speed_tokens(device_type: str) -> int:
    """The smallest chunk (tokens) at which the per-chunk matmuls run at full speed on a
    device type (measured: the module docstring)."""
    return MIN_FULL_SPEED_TOKENS_CPU if device_type == "cpu" else MIN_FULL_SPEED_TOKENS_ACCELERATOR


def choose_chunk_size(
    num_tokens: int,
    vocab_size: int,
    logits_itemsize: int,
    *,
    chunk_bytes: int | None = None,
    min_tokens: int = MIN_FULL_SPEED_TOKENS_CPU,
) -> int:
    """Automatic chunk size, in tokens.

    Args:
        num_tokens: N, the number of (flattened) tokens.
        vocab_size: V.
        logits_itemsize: bytes per element of one chunk of logits (the projection's dtype).
        chunk_bytes: the budget of one chunk's logits, in bytes; None = the default
            (:data:`DEFAULT_CHUNK_BYTES`), which is raised to ``min_tokens`` tokens where
            it holds fewer. An explicit budget is not raised.
        min_tokens: the smallest chunk at full matmul speed
            (:func:`min_full_speed_tokens` gives the device's).

    Returns:
        An int in ``[1, max(num_tokens, 1)]``: ``chunk_bytes // (V * logits_itemsize)``
        tokens (at least ``min_tokens`` for the default budget), rounded down to a
        multiple of ``ALIGN`` (at least ``ALIGN``), at most ``num_tokens``.
    """
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    tokens = budget // max(vocab_size * logits_itemsize, 1)
    if chunk_bytes is None:
        tokens = max(tokens, min_tokens)
    tokens = max(ALIGN, (tokens // ALIGN) * ALIGN)
    return max(1, min(tokens, num_tokens))


def resolve_chunk_size(chunk_size: int | None, num_tokens: int, vocab_size: int, itemsize: int,
                       device_type: str, *, chunk_bytes: int | None = None) -> int:
    """The tokens per chunk the op uses for one call.

    In order, the first given wins: the arguments ``chunk_size``, then ``chunk_bytes``;
    the environment's ``CHUNKCE_CHUNK_SIZE``, then ``CHUNKCE_CHUNK_BYTES``; else the
    default budget with the device's full-speed floor (:func:`choose_chunk_size`).

    Args:
        chunk_size: tokens per chunk, or None / 0 for automatic (any value below 1
            is automatic).
        num_tokens: N, the number of (flattened) tokens.
        vocab_size: V.
        itemsize: bytes per element of the logits (the projection runs in the hidden
            states' dtype).
        device_type: the device type of the hidden states (``"cpu"``, ``"cuda"``, ...).
        chunk_bytes: bytes of one chunk's logits, or None / 0 for the default budget.

    Returns:
        Tokens per chunk, at least 1.

    Raises:
        ValueError: ``CHUNKCE_CHUNK_SIZE`` or ``CHUNKCE_CHUNK_BYTES`` is read and is
            not a positive integer.
    """
    if chunk_size is not None and chunk_size > 0:
        return chunk_size
    env = settings()
    if chunk_bytes is None or chunk_bytes <= 0:
        if env.chunk_size:
            return env.chunk_size
        chunk_bytes = env.chunk_bytes
    return choose_chunk_size(num_tokens, vocab_size, itemsize, chunk_bytes=chunk_bytes,
                             min_tokens=min_full_speed_tokens(device_type))


def spans(total: int, size: int) -> list[Span]:
    """``[start, end)`` pieces of ``range(total)`` of ``size`` elements each.

    A trailing piece of one element joins the one before it: the per-chunk kernels
    are compiled with dynamic shapes, and Dynamo specialises a dimension of size 1,
    so a one-token (or one-class) last piece would compile a second variant.
    """
    bounds = list(range(0, total, size)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class BackwardPlan:
    """How one backward call walks its chunks and where each gradient lands.

    The walk is every token chunk within every vocabulary block. A gradient
    buffer either sums products over the walk (zero-initialised, added into in
    its own dtype) or is written once per piece by ``out=`` (left uninitialised:
    no memset of a buffer that is about to be overwritten).
    """

    want_hidden: bool  # grad_hidden_states [N, H]
    want_weight: bool  # grad_weight [V, H]
    want_bias: bool  # grad_bias [V]
    # vocabulary columns: VOCAB_BLOCKS blocks for a half-precision weight over several
    # token chunks, else one; token chunks VOCAB_BLOCKS times chunk_size when blocked.
    vocab_blocks: tuple[Span, ...]
    token_chunks: tuple[Span, ...]
    accumulate_dtype: torch.dtype  # of the weight-gradient accumulator and grad_bias (fp32 for half)
    grad_hidden_dtype: torch.dtype  # of the [N, H] buffer: the accumulate dtype when it sums over blocks
    hidden_sums: bool  # grad_hidden sums one product per vocabulary block; else out= fills each chunk
    weight_sums: bool  # the weight gradient sums one product per token chunk; else out= fills each block
    weight_block_accumulator: bool  # those sums go to a [Vb, H] accumulator, copied into grad_weight

    @property
    def zero_grad_hidden(self) -> bool:
        """grad_hidden starts at zero: it sums, or no chunk writes it (N = 0)."""
        return self.hidden_sums or not self.token_chunks

    @property
    def zero_grad_weight(self) -> bool:
        """grad_weight starts at zero: chunks add into it directly, or no chunk writes it."""
        return (self.weight_sums and not self.weight_block_accumulator) or not self.token_chunks


def plan_backward(num_tokens: int, vocab_size: int, chunk_size: int, hidden_dtype: torch.dtype,
                  weight_dtype: torch.dtype, output_mask: list[bool], has_bias: bool) -> BackwardPlan:
    """The walk of one backward call.

    Args:
        num_tokens: N.
        vocab_size: V.
        chunk_size: tokens per chunk (:func:`resolve_chunk_size`).
        hidden_dtype: dtype of the hidden states.
        weight_dtype: dtype of the weight.
        output_mask: ``[grad_hidden_states, grad_weight, grad_bias]`` wanted.
        has_bias: the call has a bias (else no bias gradient, whatever the mask says).
    """
    want_hidden, want_weight, want_bias = output_mask
    accumulate = accumulate_dtype(weight_dtype)
    blocks = 1
    if accumulate != weight_dtype and num_tokens > chunk_size:
        # at least 2 columns a block: a one-column block would specialise the kernels
        blocks = max(1, min(VOCAB_BLOCKS, vocab_size // 2))
    token_chunks = tuple(spans(num_tokens, chunk_size * blocks))  # same logits bytes a chunk
    weight_sums = len(token_chunks) > 1
    return BackwardPlan(
        want_hidden=want_hidden,
        want_weight=want_weight,
        want_bias=want_bias and has_bias,
        vocab_blocks=tuple(spans(vocab_size, -(-vocab_size // blocks))),
        token_chunks=token_chunks,
        accumulate_dtype=accumulate,
        grad_hidden_dtype=accumulate_dtype(hidden_dtype) if blocks > 1 else hidden_dtype,
        hidden_sums=blocks > 1,
        weight_sums=weight_sums,
        weight_block_accumulator=want_weight and weight_sums and accumulate != weight_dtype,
    )
