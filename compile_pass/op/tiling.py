"""How the op cuts a call into tiles of n tokens by Vb vocabulary columns, and its environment.

How the op cuts a call into tiles of ``n`` tokens by ``Vb`` vocabulary columns, one rule
(:func:`choose_tiles`) for forward, backward and the grads-in-forward op; :func:`resolve_tiles`
applies the precedence (argument, else ``CHUNKCE_*``, else default); :func:`plan_backward`
is the backward's walk. The rule, its floors and budgets and their measurements:
docs/op.md, "Tiles".

Every ``CHUNKCE_*`` environment variable is read here, in this one place, at each call of
:func:`settings` (nothing cached; what each does: docs/api.md, "Environment variables");
:func:`accumulate_dtype` is the dtype the op computes a floating dtype's arithmetic in (its
"opmath" dtype, as torch's kernels).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

MiB = 1024 * 1024
# The default tiles: a budget and a token floor per device kind, this one place. Choose them from
# ``python -m benchmarks.tile_kernels curve`` (time and working set against both; docs/op.md, "Tiles").
DEFAULT_CHUNK_BYTES = 7 * MiB  # bytes of one tile of logits: the default budget on CPU
DEFAULT_CHUNK_BYTES_ACCELERATOR = 128 * MiB  # and on accelerators (benchmarks.calls_per_op: docs/op.md, "Calls per op")
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
    """The smallest chunk (tokens) at which the per-tile matmuls run at full speed on a device type."""
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
    parts: int = 1,
) -> Tiles:
    """The tile of one call: the rule (docs/op.md, "Tiles").

    Args:
        num_tokens: N; vocab_size: V; logits_itemsize: bytes of a tile's element.
        chunk_bytes: a tile's budget in bytes; None = ``default_chunk_bytes`` / ``parts``.
        min_tokens: the full-speed floor (:func:`min_full_speed_tokens`).
        chunk_size: ``n``, given; None = the rule's.
        whole_rows: ``Vb = V`` (the grads-in-forward op).
        parts: the walk threads the tiles are split over (:func:`walk_threads`): with the default
            budget, each holds its share of it, and the token chunks and vocabulary blocks the
            rule chooses come in multiples of ``parts`` where they can (no thread idles at the end).

    Returns:
        ``Tiles(n, Vb)``: ``n`` a multiple of :data:`ALIGN` unless given, capped at N; ``Vb`` V,
        or a multiple of :data:`VOCAB_ALIGN` below it (at least :data:`MIN_VOCAB_BLOCK`).
    """
    budget = default_chunk_bytes // parts if chunk_bytes is None else chunk_bytes
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
        if parts > 1 and not whole_rows:
            tokens = _balanced(num_tokens, tokens, parts, ALIGN)
    tokens = max(1, min(tokens, num_tokens))
    if whole_rows:
        return Tiles(tokens, max(vocab_size, 1))
    columns = budget // (tokens * logits_itemsize)
    if columns >= vocab_size and parts > 1 and vocab_size >= parts * VOCAB_ALIGN:
        columns = _ceil(vocab_size, parts)  # whole rows fit: still a block a part (the backward's split)
    if columns >= vocab_size:
        return Tiles(tokens, max(vocab_size, 1))
    if columns >= VOCAB_ALIGN:
        columns = (columns // VOCAB_ALIGN) * VOCAB_ALIGN
        if parts > 1:
            columns = _balanced(vocab_size, columns, parts, VOCAB_ALIGN)
    return Tiles(tokens, min(max(columns, MIN_VOCAB_BLOCK), vocab_size))


def _balanced(total: int, size: int, parts: int, step: int) -> int:
    """A piece size at most ``size`` (a multiple of ``step``, at least ``step``) that cuts ``total``
    into a multiple of ``parts`` pieces where one exists, else ``size``: ``N = 1536`` in pieces
    of 512 on two threads is 4 pieces of 384, not 3 of 512."""
    if total <= 0:
        return size
    wanted = _ceil(_ceil(total, size), parts) * parts  # pieces: the next multiple of parts
    while wanted * step <= total:
        candidate = _ceil(_ceil(total, wanted), step) * step  # total / wanted, up to a step
        if _ceil(total, candidate) % parts == 0:
            return candidate
        wanted += parts
    return size


def _ceil(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def walk_threads(device_type: str) -> int:
    """The threads a walk's tiles are split over (docs/op.md, "Walk threads"): on CPU
    ``CHUNKCE_WALK_THREADS``, else ``torch.get_num_threads()``; 1 on other devices (their tiles
    run one after another, each parallel on the device)."""
    if device_type != "cpu":
        return 1
    return settings().walk_threads or torch.get_num_threads()


def resolve_tiles(chunk_size: int | None, num_tokens: int, vocab_size: int, itemsize: int,
                  device_type: str, *, chunk_bytes: int | None = None, whole_rows: bool = False,
                  parts: int | None = None) -> Tiles:
    """The tiles the op uses for one call (and the pass's report shows for a site): for each
    size, the argument, else ``CHUNKCE_CHUNK_SIZE`` / ``CHUNKCE_CHUNK_BYTES``, else the device's
    default, then :func:`choose_tiles` over ``parts`` walk threads (None: the device's
    :func:`walk_threads`, one for whole rows). ``itemsize``: bytes of a logit.

    Raises:
        ValueError: ``chunk_size`` or ``chunk_bytes`` below 1, or a ``CHUNKCE_*`` variable that
            is not a positive integer.
    """
    for name, value in (("chunk_size", chunk_size), ("chunk_bytes", chunk_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"chunkce: expected {name} to be a positive int or None (automatic), got {value}")
    env = settings()
    chunk_size = env.chunk_size if chunk_size is None else chunk_size
    chunk_bytes = env.chunk_bytes if chunk_bytes is None else chunk_bytes
    if parts is None:
        parts = 1 if whole_rows else walk_threads(device_type)
    return choose_tiles(num_tokens, vocab_size, itemsize, chunk_bytes=chunk_bytes,
                        min_tokens=min_full_speed_tokens(device_type), chunk_size=chunk_size,
                        whole_rows=whole_rows, default_chunk_bytes=default_chunk_bytes(device_type),
                        parts=parts)


def spans(total: int, size: int) -> list[Span]:
    """``[start, end)`` pieces of ``range(total)`` of ``size`` elements each; a trailing piece of
    one element joins the one before it (Dynamo would specialise a size-1 dimension: a recompile)."""
    bounds = list(range(0, total, size)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class BackwardPlan:
    """How one backward call walks its tiles (every token chunk within every vocabulary block)
    and whether each gradient buffer sums over the walk (zero-initialised) or is written once
    a piece by ``out=`` (uninitialised)."""

    want_hidden: bool  # grad_hidden_states [N, H]
    want_weight: bool  # grad_weight [V, H]
    want_bias: bool  # grad_bias [V]
    # the forward's tiles (blocks at most V / VOCAB_BLOCKS wide for a half-precision weight)
    vocab_blocks: tuple[Span, ...]
    token_chunks: tuple[Span, ...]
    accumulate_dtype: torch.dtype  # of the weight-gradient accumulator and grad_bias (fp32 for half)
    grad_hidden_dtype: torch.dtype  # of the [N, H] buffer: the accumulate dtype when it sums over blocks
    hidden_sums: bool  # grad_hidden sums one product per vocabulary block; else out= fills each chunk
    hidden_first_written: bool  # the first block's product is written by out= (full precision), not added
    weight_sums: bool  # the weight gradient sums one product per token chunk; else out= fills each block
    weight_block_accumulator: bool  # those sums go to a [Vb, H] accumulator, copied into grad_weight

    @property
    def zero_grad_hidden(self) -> bool:
        """grad_hidden starts at zero: it sums onto zeros, or no tile writes it (N = 0, or V = 0: an
        empty shard)."""
        return (self.hidden_sums and not self.hidden_first_written) or not self.token_chunks or not self.vocab_blocks

    @property
    def zero_grad_weight(self) -> bool:
        """grad_weight starts at zero: chunks add into it directly, or no chunk writes it."""
        return (self.weight_sums and not self.weight_block_accumulator) or not self.token_chunks


def plan_backward(num_tokens: int, vocab_size: int, tiles: Tiles, hidden_dtype: torch.dtype,
                  weight_dtype: torch.dtype, output_mask: list[bool], has_bias: bool) -> BackwardPlan:
    """The walk of one backward call over the forward's ``tiles``; ``output_mask``:
    ``[grad_hidden_states, grad_weight, grad_bias]`` wanted (no bias gradient without a bias)."""
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
        hidden_first_written=hidden_dtype == weight_dtype == accumulate_dtype(hidden_dtype),
        weight_sums=weight_sums,
        weight_block_accumulator=want_weight and weight_sums and accumulate != weight_dtype,
    )


_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Settings:
    """Process-wide defaults from the environment; ``None``: the variable is unset."""

    chunk_size: int | None = None
    chunk_bytes: int | None = None
    eager_kernels: bool = False
    release_cache: bool = False
    walk_threads: int | None = None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _positive_int(name: str) -> int | None:
    """``name`` as a positive int, None when unset or blank; ValueError when set otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"chunkce: expected {name} to be a positive integer, got {raw!r}")
    return value


def settings() -> Settings:
    """The ``CHUNKCE_*`` variables now. Raises ValueError: ``CHUNKCE_CHUNK_SIZE``,
    ``CHUNKCE_CHUNK_BYTES`` or ``CHUNKCE_WALK_THREADS`` set but not a positive integer."""
    return Settings(
        chunk_size=_positive_int("CHUNKCE_CHUNK_SIZE"),
        chunk_bytes=_positive_int("CHUNKCE_CHUNK_BYTES"),
        eager_kernels=_flag("CHUNKCE_EAGER_KERNELS"),
        release_cache=_flag("CHUNKCE_RELEASE_CACHE"),
        walk_threads=_positive_int("CHUNKCE_WALK_THREADS"),
    )


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision logits, else the logits' own dtype (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)
