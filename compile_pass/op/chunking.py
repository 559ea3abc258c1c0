"""How the op cuts a call into chunks: tokens per chunk, and the backward's walk.

A chunk costs ``chunk_size * vocab_size * itemsize`` bytes for its logits (and as
much again for their gradient in backward). The automatic choice makes one chunk's
logits cost about what the hidden states ``[N, H]`` cost, never less than a floor
(``MIN_CHUNK_BYTES`` on CPU, ``MIN_CHUNK_BYTES_ACCELERATOR`` elsewhere, where
small matmuls leave the chip idle: on an H200 at H = 4096, V = 128256, bf16, full
forward + backward of 8192 tokens took 97 ms with 256-token chunks, 63 ms with
1024 and 59 ms with 2048), rounded to a multiple of ``ALIGN`` tokens and capped at
the number of tokens. :func:`resolve_chunk_size` is the one place the op (and the
graph pass's report) decides between an explicit size, ``CHUNKCE_CHUNK_SIZE`` and
that choice.

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

MIN_CHUNK_BYTES = 64 * 1024 * 1024  # bytes, CPU
MIN_CHUNK_BYTES_ACCELERATOR = 512 * 1024 * 1024  # bytes
ALIGN = 128  # tokens
VOCAB_BLOCKS = 8

Span = tuple[int, int]  # [start, end)


def choose_chunk_size(
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    hidden_itemsize: int,
    logits_itemsize: int,
    min_chunk_bytes: int = MIN_CHUNK_BYTES,
) -> int:
    """Automatic chunk size, in tokens.

    Args:
        num_tokens: N, the number of (flattened) tokens.
        hidden_size: H.
        vocab_size: V.
        hidden_itemsize: bytes per element of the hidden states.
        logits_itemsize: bytes per element of one chunk of logits (the projection's
            dtype).
        min_chunk_bytes: the floor of one chunk's logits, in bytes
            (:func:`min_chunk_bytes_for` gives the device's).

    Returns:
        An int in ``[1, max(num_tokens, 1)]``: the tokens whose logits
        (``chunk_size * V * logits_itemsize`` bytes) cost about
        ``max(N * H * hidden_itemsize, min_chunk_bytes)`` bytes, rounded down to a
        multiple of ``ALIGN`` (at least ``ALIGN``).
    """
    budget = max(num_tokens * hidden_size * hidden_itemsize, min_chunk_bytes)
    tokens = budget // max(vocab_size * logits_itemsize, 1)
    tokens = max(ALIGN, (tokens // ALIGN) * ALIGN)
    return max(1, min(tokens, num_tokens))


def min_chunk_bytes_for(device_type: str) -> int:
    """The floor of one chunk's logits on a device type, in bytes."""
    return MIN_CHUNK_BYTES if device_type == "cpu" else MIN_CHUNK_BYTES_ACCELERATOR


def resolve_chunk_size(chunk_size: int | None, num_tokens: int, hidden_size: int, vocab_size: int,
                       itemsize: int, device_type: str) -> int:
    """The tokens per chunk the op uses for one call.

    An explicit ``chunk_size`` wins; else ``CHUNKCE_CHUNK_SIZE``; else
    :func:`choose_chunk_size` with the device's floor (:func:`min_chunk_bytes_for`).

    Args:
        chunk_size: tokens per chunk, or None / 0 for automatic (any value below 1
            is automatic).
        num_tokens: N, the number of (flattened) tokens.
        hidden_size: H.
        vocab_size: V.
        itemsize: bytes per element of the hidden states, and of the logits (the
            projection runs in the hidden states' dtype).
        device_type: the device type of the hidden states (``"cpu"``, ``"cuda"``, ...).

    Returns:
        Tokens per chunk, at least 1.

    Raises:
        ValueError: ``chunk_size`` is automatic and ``CHUNKCE_CHUNK_SIZE`` is set
            but is not a positive integer.
    """
    if chunk_size is not None and chunk_size > 0:
        return chunk_size
    return settings().chunk_size or choose_chunk_size(
        num_tokens, hidden_size, vocab_size, itemsize, itemsize, min_chunk_bytes_for(device_type),
    )


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
