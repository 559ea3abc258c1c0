"""The op benchmarks' inputs: shapes, one case, its inputs and its fp64 reference.

    case = Case("h1024-v32k", 2048, torch.float32, None, None, torch.device("cpu"))
    inputs = setup(case)            # hidden [N, H], lm_head weight [V, H], targets [N]
    loss, grad_hidden, grad_weight = reference(inputs)   # fp64, torch's unfused ops

Shared by ``bench_op``, ``scaling`` and ``profile_op`` (the same seed, so the same
inputs, in every process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.impls import IGNORE_INDEX, OpInputs
from benchmarks.real_models import REAL_MODELS

WEIGHT_STD = 0.02  # lm_head init (Hugging Face's initializer_range), see setup()


@dataclass(frozen=True)
class Shape:
    hidden_size: int  # H
    vocab_size: int  # V


SHAPES = {
    "llama3-8b": Shape(4096, 128256),
    "qwen2.5-7b": Shape(3584, 152064),
    "gemma-2b-like": Shape(2048, 256000),
    "h2048-v128k": Shape(2048, 128256),
    "h1024-v32k": Shape(1024, 32768),
    "h1024-v262k": Shape(1024, 262144),  # Gemma 3's vocabulary
    "h2048-v248k": Shape(2048, 248320),  # the CCE anchor (16384 x 2048 x 248320, TRL #6858)
    "h256-v128k": Shape(256, 128256),
    "h128-v128k": Shape(128, 128256),
    "h256-v32k": Shape(256, 32768),
    "small": Shape(1024, 32000),
    "cpu-tiny": Shape(128, 8192),  # fp32 on 2 CPU cores in seconds
    # the published heads (benchmarks.real_models): llama3.2-1b, qwen3-0.6b, gemma3-1b, smollm2-360m
    **{name: Shape(m.hidden_size, m.vocab_size) for name, m in REAL_MODELS.items()},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    shape: str
    tokens: int  # N
    dtype: torch.dtype
    logits_dtype: torch.dtype | None
    chunk_size: int | None
    device: torch.device
    ignored: float = 0.05  # fraction of targets set to IGNORE_INDEX (padding, prompts)
    seed: int = 0
    dynamic: bool | None = False  # the compiled providers' torch.compile(dynamic=...)

    def describe(self) -> dict:
        shape = SHAPES[self.shape]
        return {"shape": self.shape, "tokens": self.tokens, "hidden": shape.hidden_size,
                "vocab": shape.vocab_size, "dtype": str(self.dtype).removeprefix("torch."),
                "logits_dtype": str(self.logits_dtype or self.dtype).removeprefix("torch."),
                "chunk_size": self.chunk_size or "auto", "device": self.device.type}


def setup(case: Case) -> OpInputs:
    """The one setup factory: hidden states, lm_head weight and targets of ``case``.

    Realistic scales: hidden states ~ N(0, 1) (what a final RMSNorm hands the head)
    and weight ~ N(0, 0.02^2), so the logits have std 0.02 sqrt(H) (0.64 at H 1024).
    With an unscaled ``randn`` weight the logits' std is sqrt(H) (32 at H 1024), most
    softmax probabilities and so most entries of the logits' gradient are denormal
    floats, and on x86 CPUs every provider's backward matmuls then run ~10x slower:
    an artefact of the benchmark, not a property of any provider.
    """
    shape = SHAPES[case.shape]
    gen = torch.Generator(case.device).manual_seed(case.seed)
    n, h, v = case.tokens, shape.hidden_size, shape.vocab_size
    hidden = torch.randn(n, h, device=case.device, dtype=case.dtype, generator=gen)  # [N, H]
    weight = torch.randn(v, h, device=case.device, dtype=case.dtype, generator=gen) * WEIGHT_STD  # [V, H]
    target = torch.randint(0, v, (n,), device=case.device, generator=gen)  # [N]
    ignored = torch.rand(n, device=case.device, generator=gen) < case.ignored
    target = target.masked_fill(ignored, IGNORE_INDEX)
    return OpInputs(hidden=hidden.requires_grad_(), weight=torch.nn.Parameter(weight),
                    target=target, logits_dtype=case.logits_dtype, chunk_size=case.chunk_size,
                    dynamic=case.dynamic)


def reference(inputs: OpInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 loss, grad of hidden, grad of weight: torch's unfused ops, a few hundred MiB at a time."""
    hidden = inputs.hidden.detach()
    weight = inputs.weight.detach().double().requires_grad_()  # [V, H]
    target = inputs.target
    count = (target != IGNORE_INDEX).sum().double()
    step = max(1, 2**29 // (weight.shape[0] * 8))  # tokens whose fp64 logits take 512 MiB
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grad_hidden = torch.empty_like(hidden, dtype=torch.float64)  # [N, H]
    for start in range(0, hidden.shape[0], step):
        chunk = hidden[start:start + step].double().requires_grad_()  # [n, H]
        part = F.cross_entropy(F.linear(chunk, weight), target[start:start + step],
                               ignore_index=IGNORE_INDEX, reduction="sum") / count
        part.backward()
        grad_hidden[start:start + step] = chunk.grad
        loss += part.detach()
    return loss, grad_hidden, weight.grad
