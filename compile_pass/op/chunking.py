"""How many tokens each chunk of the op holds.

A chunk costs ``chunk_size * vocab_size * itemsize`` bytes for its logits (and as
much again for their gradient in backward). The automatic choice makes one chunk's
logits cost about what the hidden states ``[N, H]`` cost, never less than a floor
(``MIN_CHUNK_BYTES`` on CPU, ``MIN_CHUNK_BYTES_ACCELERATOR`` elsewhere, where
small matmuls leave the chip idle: on an H200 at H = 4096, V = 128256, bf16, full
forward + backward of 8192 tokens took 97 ms with 256-token chunks, 63 ms with
1024 and 59 ms with 2048), rounded to a multiple of ``ALIGN`` tokens and capped at
the number of tokens.

Backward with a half-precision weight over several token chunks accumulates the
weight gradient in fp32; it walks the vocabulary in ``VOCAB_BLOCKS`` blocks so the
fp32 accumulator is one block (``V / VOCAB_BLOCKS * H * 4`` bytes: a quarter of a
bf16 weight) rather than the whole ``[V, H]``, with token chunks ``VOCAB_BLOCKS``
times wider so each chunk of logits keeps its size.
"""

from __future__ import annotations

MIN_CHUNK_BYTES = 64 * 1024 * 1024  # bytes, CPU
MIN_CHUNK_BYTES_ACCELERATOR = 512 * 1024 * 1024  # bytes
ALIGN = 128  # tokens
VOCAB_BLOCKS = 8


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


