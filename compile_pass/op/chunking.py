"""How the op cuts a call into tiles: ``n`` tokens by ``Vb`` vocabulary columns, one rule
for forward, backward and the grads-in-forward op.

A tile of logits ``[n, Vb]`` costs ``n * Vb * itemsize`` bytes. Forward walks a token
chunk's vocabulary blocks with the log-sum-exp online across them
(:func:`compile_pass.op.kernels.chunk_forward`); backward walks the same tiles with the
saved row statistics and overwrites each tile's logits with their gradient in place
(:func:`compile_pass.op.kernels.chunk_backward`). So the op's working set beyond its
inputs and their gradients is one tile (plus ``[N]`` vectors), whatever ``V`` and ``N``.
:func:`choose_tiles` is the rule, from two numbers:

* the **smallest chunk at which the matmuls still run at full speed**
  (:func:`min_full_speed_tokens`) sets ``n``: every per-tile matmul reads a
  ``[Vb, H]`` block of the weight for ``2 * n`` flops per element, so a small ``n`` is
  bound by memory bandwidth, not by the arithmetic units;
* a **byte budget** for one tile (``chunk_bytes``; default :func:`default_chunk_bytes`,
  or ``CHUNKCE_CHUNK_BYTES``) sets ``Vb = budget / (n * itemsize)``, rounded down to a
  multiple of :data:`VOCAB_ALIGN` columns. A vocabulary that fits in one tile takes whole
  rows and more tokens (``n = budget / (V * itemsize)``, never below the floor).

The floors and budgets are measured in ``docs/op.md`` ("Tiles"): CPU 512 tokens and 7 MiB,
an accelerator 2048 tokens and 64 MiB.

``chunk_size`` (or ``CHUNKCE_CHUNK_SIZE``) overrides ``n``; the budget still sets ``Vb``.
:func:`resolve_tiles` is the one place the op (and the graph pass's report, which shows
its tiles for each rewritten site) decides, for each size: the argument, else its
environment variable, else the default; None is "automatic" all the way there.

The grads-in-forward op computes a row's gradient in the same walk as its log-sum-exp,
so it needs the whole row's statistics before any gradient: it takes whole rows
(``whole_rows=True``: ``Vb = V``, ``n`` from the budget, at least the floor when the
budget is the default), one ``[n, V]`` chunk at a time (its trade: three matmuls where the
recompute op runs four, for a working set of one whole-row chunk).

Backward with a half-precision weight over several token chunks accumulates the
weight gradient of a vocabulary block in fp32 (``[Vb, H]``); its blocks are at most
``V / VOCAB_BLOCKS`` wide, so that accumulator is at most an eighth of ``4 V H`` bytes.
:func:`plan_backward` says which tiles a backward call walks and which gradient buffers
sum into.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from compile_pass.op.dtypes import accumulate_dtype
from compile_pass.op.settings import settings

MiB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 7 * MiB  # bytes of one tile of logits: the default budget on CPU
DEFAULT_CHUNK_BYTES_ACCELERATOR = 64 * MiB  # and on accelerators
MIN_FULL_SPEED_TOKENS_CPU = 512  # tokens
MIN_FULL_SPEED_TOKENS_ACCELERATOR = 2048  # tokens
ALIGN = 32  # tokens
VOCAB_ALIGN = 128  # vocabulary columns
MIN_VOCAB_BLOCK = 2  # columns: a one-column block would specialise the compiled kernels
VOCAB_BLOCKS = 8  # a half-precision weight's backward: blocks at most V / VOCAB_BLOCKS wide

Span = tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class Tiles:
    """The tile of one call: ``tokens`` (n) by ``vocab_block`` (Vb) logits, each at least
    1 and at most the call's N (resp. V) where that is positive."""

    tokens: int
    vocab_block: int

    def bytes(self, itemsize: int) -> int:
        """Bytes of one tile of logits."""
        return self.tokens * self.vocab_block * itemsize


def min_full_speed_tokens(device_type: str) -> int:
    """The smallest chunk (tokens) at which the per-tile matmuls run at full speed on a
    device type (measured: the module docstring)."""
    return MIN_FULL_SPEED_TOKENS_CPU if device_type == "cpu" else MIN_FULL_SPEED_TOKENS_ACCELERATOR


def default_chunk_bytes(device_type: str) -> int:
    """The default budget of one tile of logits, in bytes, on a device type."""
    return DEFAULT_CHUNK_BYTES if device_type == "cpu" else DEFAULT_CHUNK_BYTES_ACCELERATOR


def _align_down(value: int, step: int) -> int:
    return max(step, (value // step) * step)


def choose_tiles(
    num_tokens: int,
    vocab_size: int,
    logits_itemsize: int,
    *,
    chunk_bytes: int | None = None,
    min_tokens: int = MIN_FULL_SPEED_TOKENS_CPU,
    chunk_size: int | None = None,
    whole_rows: bool = False,
    default_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Tiles:
    """The tile of one call: the rule.

    Args:
        num_tokens: N, the number of (flattened) tokens.
        vocab_size: V.
        logits_itemsize: bytes per element of a tile of logits (the projection's dtype).
        chunk_bytes: the budget of one tile, in bytes; None = ``default_chunk_bytes``.
        min_tokens: the smallest chunk at full matmul speed (:func:`min_full_speed_tokens`).
        chunk_size: tokens a tile, given (``n``); None = the rule's.
        whole_rows: every tile holds whole rows (``Vb = V``; the grads-in-forward op).
        default_chunk_bytes: the default budget (:func:`default_chunk_bytes` gives the
            device's).

    Returns:
        ``Tiles(n, Vb)``. ``n``: ``chunk_size`` if given; else with ``whole_rows``, the
        budget's rows (at least ``min_tokens`` for the default budget); else
        ``min_tokens`` (fewer when the budget cannot hold ``min_tokens`` rows of
        ``VOCAB_ALIGN`` columns), raised to the budget's rows when a row fits in it;
        rounded down to a multiple of :data:`ALIGN` (at least ``ALIGN``) and capped at N.
        ``Vb``: V with ``whole_rows`` or when ``n`` rows fit the budget, else the
        budget's columns at ``n`` tokens rounded down to a multiple of ``VOCAB_ALIGN``
        (at least :data:`MIN_VOCAB_BLOCK`, at most V).
    """
    budget = default_chunk_bytes if chunk_bytes is None else chunk_bytes
    row_bytes = max(vocab_size, 1) * logits_itemsize
    if chunk_size is not None:
        tokens = chunk_size
    else:
        rows = budget // row_bytes  # whole rows the budget holds
        if whole_rows:
            tokens = max(rows, min_tokens) if chunk_bytes is None else rows
        else:
            narrow = min(max(vocab_size, 1), VOCAB_ALIGN) * logits_itemsize  # the narrowest tile's row
            tokens = max(min(min_tokens, budget // narrow), rows)
        tokens = _align_down(tokens, ALIGN)
    tokens = max(1, min(tokens, num_tokens))
    if whole_rows:
        return Tiles(tokens, max(vocab_size, 1))
    columns = budget // (tokens * logits_itemsize)
    if columns >= vocab_size:
        return Tiles(tokens, max(vocab_size, 1))
    if columns >= VOCAB_ALIGN:
        columns = (columns // VOCAB_ALIGN) * VOCAB_ALIGN
    return Tiles(tokens, min(max(columns, MIN_VOCAB_BLOCK), vocab_size))


def resolve_tiles(chunk_size: int | None, num_tokens: int, vocab_size: int, itemsize: int,
                  device_type: str, *, chunk_bytes: int | None = None, whole_rows: bool = False) -> Tiles:
    """The tiles the op uses for one call; the graph pass's report shows what it returns
    for a rewritten site's sizes.

    One precedence for each of the two sizes, independently: the argument, else its
    environment variable, else the default. Tokens a tile: ``chunk_size``, else
    ``CHUNKCE_CHUNK_SIZE``, else the rule; the budget: ``chunk_bytes``, else
    ``CHUNKCE_CHUNK_BYTES``, else the device's default (:func:`default_chunk_bytes`, with
    the device's full-speed floor): :func:`choose_tiles`.

    Args:
        chunk_size: tokens a tile, or None for automatic.
        num_tokens: N, the number of (flattened) tokens.
        vocab_size: V.
        itemsize: bytes per element of the logits (the projection runs in the hidden
            states' dtype).
        device_type: the device type of the hidden states (``"cpu"``, ``"cuda"``, ...).
        chunk_bytes: bytes of one tile of logits, or None for automatic.
        whole_rows: tiles of whole rows (the grads-in-forward op).

    Returns:
        The :class:`Tiles`.

    Raises:
        ValueError: ``chunk_size`` or ``chunk_bytes`` is below 1 (a direct op call: the
            public function and ``Options`` check them first), or ``CHUNKCE_CHUNK_SIZE`` or
            ``CHUNKCE_CHUNK_BYTES`` is read and is not a positive integer.
    """
    for name, value in (("chunk_size", chunk_size), ("chunk_bytes", chunk_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"chunkce: expected {name} to be a positive int or None (automatic), got {value}")
    env = settings()
    chunk_size = env.chunk_size if chunk_size is None else chunk_size
    chunk_bytes = env.chunk_bytes if chunk_bytes is None else chunk_bytes
    return choose_tiles(num_tokens, vocab_size, itemsize, chunk_bytes=chunk_bytes,
                        min_tokens=min_full_speed_tokens(device_type), chunk_size=chunk_size,
                        whole_rows=whole_rows, default_chunk_bytes=default_chunk_bytes(device_type))


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
    """How one backward call walks its tiles and where each gradient lands.

    The walk is every token chunk within every vocabulary block. A gradient
    buffer either sums products over the walk (zero-initialised, added into in
    its own dtype) or is written once per piece by ``out=`` (left uninitialised:
    no memset of a buffer that is about to be overwritten).
    """

    want_hidden: bool  # grad_hidden_states [N, H]
    want_weight: bool  # grad_weight [V, H]
    want_bias: bool  # grad_bias [V]
    # the forward's tiles: vocabulary blocks of tiles.vocab_block columns (at most
    # V / VOCAB_BLOCKS for a half-precision weight over several token chunks), token chunks
    # of tiles.tokens
    vocab_blocks: tuple[Span, ...]
    token_chunks: tuple[Span, ...]
    accumulate_dtype: torch.dtype  # of the weight-gradient accumulator and grad_bias (fp32 for half)
    grad_hidden_dtype: torch.dtype  # of the [N, H] buffer: the accumulate dtype when it sums over blocks
    hidden_sums: bool  # grad_hidden sums one product per vocabulary block; else out= fills each chunk
    weight_sums: bool  # the weight gradient sums one product per token chunk; else out= fills each block
    weight_block_accumulator: bool  # those sums go to a [Vb, H] accumulator, copied into grad_weight

    @property
    def zero_grad_hidden(self) -> bool:
        """grad_hidden starts at zero: it sums, or no tile writes it (N = 0, or V = 0: an empty shard)."""
        return self.hidden_sums or not self.token_chunks or not self.vocab_blocks

    @property
    def zero_grad_weight(self) -> bool:
        """grad_weight starts at zero: chunks add into it directly, or no chunk writes it."""
        return (self.weight_sums and not self.weight_block_accumulator) or not self.token_chunks


def plan_backward(num_tokens: int, vocab_size: int, tiles: Tiles, hidden_dtype: torch.dtype,
                  weight_dtype: torch.dtype, output_mask: list[bool], has_bias: bool) -> BackwardPlan:
    """The walk of one backward call over the forward's tiles.

    Args:
        num_tokens: N.
        vocab_size: V.
        tiles: the call's tiles (:func:`resolve_tiles`).
        hidden_dtype: dtype of the hidden states.
        weight_dtype: dtype of the weight.
        output_mask: ``[grad_hidden_states, grad_weight, grad_bias]`` wanted.
        has_bias: the call has a bias (else no bias gradient, whatever the mask says).
    """
    want_hidden, want_weight, want_bias = output_mask
    accumulate = accumulate_dtype(weight_dtype)
    token_chunks = tuple(spans(num_tokens, tiles.tokens))
    block = tiles.vocab_block
    if accumulate != weight_dtype and len(token_chunks) > 1:  # the fp32 [Vb, H] accumulator: bounded
        block = min(block, max(MIN_VOCAB_BLOCK, -(-vocab_size // VOCAB_BLOCKS)))
    vocab_blocks = tuple(spans(vocab_size, block))
    blocked = len(vocab_blocks) > 1
    weight_sums = len(token_chunks) > 1
    return BackwardPlan(
        want_hidden=want_hidden,
        want_weight=want_weight,
        want_bias=want_bias and has_bias,
        vocab_blocks=vocab_blocks,
        token_chunks=token_chunks,
        accumulate_dtype=accumulate,
        grad_hidden_dtype=accumulate_dtype(hidden_dtype) if blocked else hidden_dtype,
        hidden_sums=blocked,
        weight_sums=weight_sums,
        weight_block_accumulator=want_weight and weight_sums and accumulate != weight_dtype,
    )
