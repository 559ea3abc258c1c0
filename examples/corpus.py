"""Real text for the example, offline: the Python standard library's sources, or any file.

    text_docs = load_docs(path=None, max_bytes=8_000_000)   # list of str, deterministic
    tokenizer = load_tokenizer(text_docs, vocab_size=32000)  # byte-level BPE, cached on disk
    ids = encode(tokenizer, text_docs)                       # [num_tokens] int64, docs joined by EOS
    batches = sample_batches(ids, steps, batch_size, seq_len, seed)   # [(input_ids [B, T])]
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "chunkce"


def load_docs(path: str | None = None, max_bytes: int = 8_000_000) -> list[str]:
    """The training text as a list of documents, at most ``max_bytes`` UTF-8 bytes in all.

    ``path=None`` reads the standard library's ``*.py`` files (no ``site-packages``) in
    sorted order of their relative path, one document per file; otherwise the file at
    ``path`` is one document (truncated to ``max_bytes``).
    """
    if path is not None:
        raw = Path(path).read_bytes()[:max_bytes]
        return [raw.decode("utf-8", errors="replace")]
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
                   key=lambda p: p.relative_to(root).as_posix())
    docs, total = [], 0
    for file in files:
        raw = file.read_bytes()[: max_bytes - total]
        docs.append(raw.decode("utf-8", errors="replace"))
        total += len(raw)
        if total >= max_bytes:
            break
    if not docs:
        raise FileNotFoundError(f"no *.py files under the standard library at {root}")
    return docs


def load_tokenizer(docs: list[str], vocab_size: int = 32000, cache_dir: Path = CACHE_DIR) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``docs``, cached by corpus hash and vocab size.

    Training takes a few seconds for 8 MB on 2 cores. A small corpus yields fewer than
    ``vocab_size`` tokens (BPE runs out of pairs); never more.
    """
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.encode("utf-8", errors="replace") + b"\0")
    key = f"{digest.hexdigest()[:16]}-v{vocab_size}-tok{tokenizers.__version__}"
    cached = cache_dir / f"bpe-{key}.json"
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    tmp.replace(cached)                     # atomic: concurrent runs never read half a file
    return tokenizer


def encode(tokenizer: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream, each followed by EOS. Returns [num_tokens] int64."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def sample_batches(ids: torch.Tensor, steps: int, batch_size: int, seq_len: int,
                   seed: int) -> list[torch.Tensor]:
    """``steps`` batches of random windows, the same for a given seed. Each [batch_size, seq_len]."""
    if ids.numel() <= seq_len:
        raise ValueError(f"corpus has {ids.numel()} tokens, need more than --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (steps, batch_size), generator=gen)
    offsets = torch.arange(seq_len)
    return [ids[row[:, None] + offsets] for row in starts]   # [B, T] each
