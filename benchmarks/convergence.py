"""Convergence in Liger-Kernel's form: mini models trained by stock Inductor and by chunkce.

    python -m benchmarks.convergence                         # every architecture, fp32 and bf16
    python -m benchmarks.convergence --archs llama gpt2 --dtypes fp32

Each architecture's mini configuration (4 layers, vocabulary 32000, from transformers' config
class) is trained twice from the same initial weights on the same batches of the example's
corpus (:mod:`benchmarks.training_text`): ``torch.compile(model)`` and
``torch.compile(model, backend="chunkce")``, AdamW, 32 steps, fp32 or under bf16 autocast
(fp32 weights). Then, in evaluation mode under ``no_grad``, one held-out batch through the
same compiled model: the top-k log-probabilities of its logits. Compared, as Liger's
``test/convergence/{fp32,bf16}/test_mini_models.py`` compares them: every step's loss, the
top-k log-probabilities and every final parameter, within its published tolerances
(:data:`TOLERANCES`). chunkce's run must have rewritten its head (``counters["chunkce"]``).

Liger's settings kept: AdamW at lr 1e-4, batch 16, 32 steps, 4 layers, vocabulary 32000,
dropout off, Qwen2 tied as Liger ties it. Changed, for a 2-core CPU without bf16 matmul
units (bf16 is emulated, 10-500x slower than fp32): the width (hidden 128 for the benchmark
where Liger uses 512-1024) and the sequence (64 tokens a row where Liger's rows are its
dataset's lines); the test suite (``tests/integration/test_convergence.py``) uses
:data:`TEST_SETUP`, smaller still. Liger compares bf16 weights (``model.to(bfloat16)``);
here bf16 is autocast over fp32 weights, the way mixed-precision training runs.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from benchmarks.training_text import load_text

BACKENDS = ("inductor", "chunkce")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Setup:
    """Sizes and optimizer of one comparison (Liger's, but the width and sequence)."""

    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab_size: int = 32000
    batch_size: int = 16
    seq_len: int = 64
    steps: int = 32
    lr: float = 1e-4
    topk: int = 20
    seed: int = 0


TEST_SETUP = Setup(hidden_size=32, layers=2, batch_size=4, seq_len=32)


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise (``torch.allclose``)."""

    atol: float
    rtol: float

    def holds(self, actual: torch.Tensor, expected: torch.Tensor) -> bool:
        return bool(torch.allclose(actual, expected, atol=self.atol, rtol=self.rtol))


@dataclass(frozen=True)
class Tolerances:
    loss: Tolerance
    logprobs: Tolerance
    params: Tolerance


TOLERANCES = {  # Liger's test/convergence/{fp32,bf16}/test_mini_models.py
    "fp32": Tolerances(Tolerance(1e-8, 2e-5), Tolerance(5e-3, 1e-5), Tolerance(5e-3, 1e-5)),
    "bf16": Tolerances(Tolerance(1e-2, 5e-2), Tolerance(1e-1, 1e-2), Tolerance(1e-2, 1e-2)),
}


def _decoder(config_class: Callable, setup: Setup, **fields) -> object:
    """A decoder-only config with the setup's sizes and no dropout; ``fields`` override."""
    sizes = dict(vocab_size=setup.vocab_size, hidden_size=setup.hidden_size,
                 intermediate_size=2 * setup.hidden_size, num_hidden_layers=setup.layers,
                 num_attention_heads=setup.heads, num_key_value_heads=setup.kv_heads,
                 max_position_embeddings=max(512, setup.seq_len), attention_dropout=0.0,
                 tie_word_embeddings=False, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return config_class(**{**sizes, **fields})


def _llama(setup):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(_decoder(LlamaConfig, setup))


def _qwen2(setup):  # tied, as Liger's mini_qwen2
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(_decoder(Qwen2Config, setup, tie_word_embeddings=True))


def _qwen3(setup):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(_decoder(Qwen3Config, setup, head_dim=setup.hidden_size // setup.heads))


def _mistral(setup):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(_decoder(MistralConfig, setup, sliding_window=4096))


def _phi3(setup):
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(_decoder(Phi3Config, setup, resid_pdrop=0.0, embd_pdrop=0.0))


def _gpt2(setup):  # the head tied to the token embedding
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=setup.vocab_size, n_embd=setup.hidden_size, n_layer=setup.layers,
                        n_head=setup.heads, n_inner=2 * setup.hidden_size, n_positions=max(512, setup.seq_len),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def _mixtral(setup):  # 4 experts, top 2, no router jitter, no auxiliary loss
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(_decoder(MixtralConfig, setup, num_local_experts=4, num_experts_per_tok=2,
                                       router_jitter_noise=0.0, output_router_logits=False))


def _cohere(setup):  # logits * logit_scale, tied as Cohere's Command models are
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(_decoder(CohereConfig, setup, logit_scale=0.0625, tie_word_embeddings=True))


def _granite(setup):  # logits / logits_scaling, Granite 3's multipliers
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(_decoder(GraniteConfig, setup, logits_scaling=8.0, embedding_multiplier=12.0,
                                       residual_multiplier=0.22, attention_multiplier=0.015625))


ARCHITECTURES: dict[str, Callable[[Setup], torch.nn.Module]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "phi3": _phi3,
    "gpt2": _gpt2, "mixtral": _mixtral, "cohere": _cohere, "granite": _granite,
}


@dataclass
class Run:
    """One backend's training: per-step losses, the evaluation's top-k log-probs, final parameters."""

    losses: torch.Tensor          # [steps] fp32
    topk_logprobs: torch.Tensor   # [B, T, k] fp32
    params: dict[str, torch.Tensor]
    counters: dict[str, int] = field(default_factory=dict)


def _autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def train(arch: str, dtype: str, backend: str, setup: Setup, init_state: dict[str, torch.Tensor],
          batches: list[torch.Tensor], eval_ids: torch.Tensor) -> Run:
    """Train ``arch`` from ``init_state`` on ``batches`` compiled with ``backend`` (``"inductor"``:
    ``torch.compile``'s default), then evaluate ``eval_ids`` [B, T] through the same compiled model."""
    torch._dynamo.reset()
    counters.clear()
    model = ARCHITECTURES[arch](setup)
    model.load_state_dict(init_state)
    model.train()
    compiled = torch.compile(model) if backend == "inductor" else torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    losses = []
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(dtype):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().float())
    model.eval()
    with torch.no_grad(), _autocast(dtype):
        logits = compiled(input_ids=eval_ids, labels=eval_ids).logits   # [B, T, V], lazy under chunkce
        topk = logits.float().log_softmax(-1).topk(setup.topk, dim=-1).values
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Run(torch.stack(losses), topk, params, dict(counters["chunkce"]))


@dataclass(frozen=True)
class Comparison:
    """chunkce against Inductor on one architecture and dtype."""

    arch: str
    dtype: str
    loss_diff: float       # max over steps of |chunkce - inductor|
    logprob_diff: float    # max over the top-k log-probs
    param_diff: float      # max over every element of every parameter
    within: tuple[bool, bool, bool]   # loss, log-probs, parameters within TOLERANCES[dtype]
    sites_rewritten: int   # chunkce's counter over its training and evaluation compiles
    sites_refused: int
    seconds: float

    @property
    def passed(self) -> bool:
        return all(self.within) and self.sites_rewritten > 0 and self.sites_refused == 0

    def line(self) -> str:
        marks = "/".join("ok" if ok else "FAIL" for ok in self.within)
        return (f"{self.arch:<8} {self.dtype:<5} loss {self.loss_diff:9.2e}  log-probs {self.logprob_diff:9.2e}  "
                f"params {self.param_diff:9.2e}  [{marks}]  rewritten {self.sites_rewritten} "
                f"refused {self.sites_refused}  {'PASS' if self.passed else 'FAIL'}  {self.seconds:6.1f} s")


def compare(arch: str, dtype: str, setup: Setup = Setup()) -> Comparison:
    """Train ``arch`` with Inductor and with chunkce from the same weights and batches; compare."""
    start = time.perf_counter()
    text = load_text(setup.vocab_size)
    batches = text.train_batches(setup.steps, setup.batch_size, setup.seq_len, setup.seed)
    eval_ids = text.held_out_batches(1, setup.batch_size, setup.seq_len)[0]
    torch.manual_seed(setup.seed)
    init_state = {k: v.clone() for k, v in ARCHITECTURES[arch](setup).state_dict().items()}
    expected, actual = (train(arch, dtype, backend, setup, init_state, batches, eval_ids) for backend in BACKENDS)
    tol = TOLERANCES[dtype]
    param_within = all(tol.params.holds(actual.params[name], p) for name, p in expected.params.items())
    return Comparison(
        arch, dtype,
        loss_diff=(actual.losses - expected.losses).abs().max().item(),
        logprob_diff=(actual.topk_logprobs - expected.topk_logprobs).abs().max().item(),
        param_diff=max((actual.params[name] - p).abs().max().item() for name, p in expected.params.items()),
        within=(tol.loss.holds(actual.losses, expected.losses),
                tol.logprobs.holds(actual.topk_logprobs, expected.topk_logprobs), param_within),
        sites_rewritten=actual.counters.get("sites_rewritten", 0),
        sites_refused=actual.counters.get("sites_refused", 0),
        seconds=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """Print one line per architecture and dtype; exit status 1 when any fails."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", choices=tuple(ARCHITECTURES), default=tuple(ARCHITECTURES))
    p.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=tuple(DTYPES))
    p.add_argument("--hidden-size", type=int, default=Setup.hidden_size)
    p.add_argument("--seq-len", type=int, default=Setup.seq_len)
    p.add_argument("--steps", type=int, default=Setup.steps)
    args = p.parse_args(argv)
    setup = replace(Setup(), hidden_size=args.hidden_size, seq_len=args.seq_len, steps=args.steps)
    print(f"convergence: {setup}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("max |chunkce - inductor|: every step's loss, the evaluation's top-k log-probs, every parameter; "
          "[loss/log-probs/params within Liger's tolerances]", flush=True)
    failed = 0
    for dtype in args.dtypes:
        for arch in args.archs:
            result = compare(arch, dtype, setup)
            print(result.line(), flush=True)
            failed += not result.passed
    print(f"{failed} of {len(args.archs) * len(args.dtypes)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
