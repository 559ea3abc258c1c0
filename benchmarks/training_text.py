"""The example's corpus (``examples/corpus.py``: the standard library's sources and the BPE
tokenizer trained on them), split into training and held-out tokens.

    text = load_text()                                     # cached per process
    batches = text.train_batches(steps=32, batch_size=16, seq_len=64, seed=0)   # [B, T] each
    held_out = text.held_out_batches(count=4, batch_size=8, seq_len=256)        # [B, T] each

The last :data:`HELD_OUT` of the token stream is never trained on: the long run's
perplexity and the convergence suite's evaluation batch come from it.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from corpus import encode, load_docs, load_tokenizer, sample_batches  # noqa: E402  examples/corpus.py

HELD_OUT = 0.02  # share of the token stream kept for evaluation


@dataclass(frozen=True)
class Text:
    """The corpus as two token streams, ``[tokens]`` int64 each."""

    train: torch.Tensor
    held_out: torch.Tensor

    def train_batches(self, steps: int, batch_size: int, seq_len: int, seed: int) -> list[torch.Tensor]:
        """``steps`` batches of random training windows (the example's sampling), ``[B, T]`` each."""
        return sample_batches(self.train, steps, batch_size, seq_len, seed)

    def held_out_batches(self, count: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """``count`` batches of consecutive, non-overlapping held-out windows, ``[B, T]`` each."""
        needed = count * batch_size * seq_len
        if needed > self.held_out.numel():
            raise ValueError(f"held-out text has {self.held_out.numel()} tokens, {needed} asked for")
        return list(self.held_out[:needed].view(count, batch_size, seq_len))


@functools.cache
def load_text(vocab_size: int = 32000, max_bytes: int = 8_000_000) -> Text:
    """The example's corpus and tokenizer (its defaults), tokenized once per process."""
    docs = load_docs(None, max_bytes)
    ids = encode(load_tokenizer(docs, vocab_size), docs)
    split = ids.numel() - int(ids.numel() * HELD_OUT)
    return Text(train=ids[:split], held_out=ids[split:])
