"""How many tokens each chunk of the op holds.

A chunk costs ``chunk_size * vocab_size * itemsize`` bytes for its logits (and as
much again for their gradient in backward). The automatic choice makes one chunk's
logits cost about what the hidden states ``[N, H]`` cost, never less than
``MIN_CHUNK_BYTES`` (so small batches do not pay a per-chunk overhead for no
memory gain), rounded to a multiple of ``ALIGN`` tokens for matmul efficiency and
capped at the number of tokens.
"""

from __future__ import annotations

import math

MIN_CHUNK_BYTES = 64 * 1024 * 1024  # bytes
ALIGN = 128  # tokens


def choose_chunk_size(
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    hidden_itemsize: int,
    logits_itemsize: int,
) -> int:
    """Automatic chunk size, in tokens.

    Args:
        num_tokens: N, the number of (flattened) tokens.
        hidden_size: H.
        vocab_size: V.
        hidden_itemsize: bytes per element of the hidden states.
        logits_itemsize: bytes per element of one chunk of logits (the projection's
            dtype).

    Returns:
        An int in ``[1, max(num_tokens, 1)]``: the tokens whose logits
        (``chunk_size * V * logits_itemsize`` bytes) cost about
        ``max(N * H * hidden_itemsize, MIN_CHUNK_BYTES)`` bytes, rounded down to a
        multiple of ``ALIGN`` (at least ``ALIGN``).
    """
    budget = max(num_tokens * hidden_size * hidden_itemsize, MIN_CHUNK_BYTES)
    tokens = budget // max(vocab_size * logits_itemsize, 1)
    tokens = max(ALIGN, (tokens // ALIGN) * ALIGN)
    return max(1, min(tokens, num_tokens))


def num_chunks(num_tokens: int, chunk_size: int) -> int:
    """``ceil(num_tokens / chunk_size)``; 0 for no tokens."""
    return math.ceil(num_tokens / chunk_size)
