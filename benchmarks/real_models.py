"""The published widths of four model families, for the benchmarks at the sizes users train.

    model = REAL_MODELS["llama3.2-1b"]      # hidden 2048, vocabulary 128256, tied head
    model.transformers_kwargs(layers=2)     # AutoConfig.for_model(model.model_type, **kwargs)

Each entry copies the fields of the model's published ``config.json`` (the ``source`` URL)
that set the cost of a training step: widths, vocabulary, attention heads, the MLP, and
whether the lm_head is the input embedding (``tie_word_embeddings``). All four publish a
tied head. Gemma 3's ``final_logit_softcapping`` is ``null`` in its config (transformers'
``Gemma3TextConfig`` default), so its head is a plain linear + cross-entropy.

``benchmarks.cases.SHAPES`` holds each head (hidden, vocabulary) under the same name, and
``benchmarks.bench_model.CONFIGS`` each model at two decoder layers (``<name>-2l``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RealModel:
    model_type: str  # transformers' model_type
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # tie_word_embeddings: the lm_head weight is the input embedding
    source: str  # the published config.json these numbers come from
    extra: tuple[tuple[str, object], ...] = ()  # other config fields of the published model

    def transformers_kwargs(self, layers: int) -> dict:
        """Keyword arguments of ``AutoConfig.for_model(self.model_type, ...)`` at ``layers`` layers."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "tie_word_embeddings": self.tied, **dict(self.extra)}

    def parameters(self, layers: int) -> int:
        """Parameters at ``layers`` decoder layers (norms left out: under 0.1 %)."""
        attention = self.hidden_size * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o, k, v
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        return embeddings + layers * (attention + mlp)


HF = "https://huggingface.co"
REAL_MODELS = {
    "llama3.2-1b": RealModel("llama", 2048, 128256, 8192, heads=32, kv_heads=8, head_dim=64, tied=True,
                             source=f"{HF}/meta-llama/Llama-3.2-1B/blob/main/config.json",
                             extra=(("rope_theta", 500000.0),)),
    "qwen3-0.6b": RealModel("qwen3", 1024, 151936, 3072, heads=16, kv_heads=8, head_dim=128, tied=True,
                            source=f"{HF}/Qwen/Qwen3-0.6B/blob/main/config.json",
                            extra=(("rope_theta", 1000000.0),)),
    "gemma3-1b": RealModel("gemma3_text", 1152, 262144, 6912, heads=4, kv_heads=1, head_dim=256, tied=True,
                           source=f"{HF}/google/gemma-3-1b-pt/blob/main/config.json",
                           extra=(("sliding_window", 512), ("query_pre_attn_scalar", 256),
                                  ("final_logit_softcapping", None))),
    "smollm2-360m": RealModel("llama", 960, 49152, 2560, heads=15, kv_heads=5, head_dim=64, tied=True,
                              source=f"{HF}/HuggingFaceTB/SmolLM2-360M/blob/main/config.json",
                              extra=(("rope_theta", 100000.0),)),
}
