"""Warm-start compile time: what the compile caches save a restarted training job.

    python -m benchmarks.warm_start                       # toy and Llama, inductor and chunkce
    python -m benchmarks.warm_start --models llama --llama-layers 8 --repeats 3

Per (model, backend): a fresh cache directory (``TORCHINDUCTOR_CACHE_DIR``), one
process that compiles and runs the first training step from scratch (cold), then
``--repeats`` processes that run the same first step with that directory
(warm), each a fresh Python process. Reported: the first step's wall time
(compile + one forward and backward; imports and model construction excluded),
warm / cold, the AOTAutograd and FX graph cache hits / misses / bypasses of the
warm run, and the ratio of chunkce's warm / cold to Inductor's (1.0 = chunkce
gains from the caches exactly what stock Inductor gains).

The rewritten graph holds only ``torch.ops.chunkce.*`` and torch ops, so
AOTAutograd's cache accepts it (``tests/integration/test_compile_cache.py`` asserts the hits
with its own fresh processes). Every process here comes from ``benchmarks.isolate``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

from benchmarks import isolate
from benchmarks.tables import markdown

MODELS = ("toy", "llama")
BACKENDS = ("inductor", "chunkce")
_CACHE_COUNTERS = ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")
_FX_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def _build(model_name: str, llama_layers: int = 2):
    """(loss function of one batch, the model, the batch): a toy head with label smoothing
    (a float the per-chunk kernels take) or a config-built transformers Llama."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    vocab, batch, seq = 1000, 2, 64
    ids = torch.randint(0, vocab, (batch, seq))
    if model_name == "toy":
        class Toy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(vocab, 64)
                self.body = nn.Linear(64, 64)
                self.lm_head = nn.Linear(64, vocab, bias=False)

            def forward(self, input_ids, labels):
                hidden_states = torch.relu(self.body(self.embed(input_ids)))  # [B, T, H]
                logits = self.lm_head(hidden_states).float()  # [B, T, V]
                return F.cross_entropy(logits.view(-1, vocab), labels.view(-1), label_smoothing=0.1)

        model = Toy()
        return (lambda input_ids: model(input_ids, input_ids)), model, ids
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=llama_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    model = LlamaForCausalLM(config)
    return (lambda input_ids: model(input_ids=input_ids, labels=input_ids).loss), model, ids


def _worker(model_name: str, backend: str, options: dict | None = None, llama_layers: int = 2) -> dict:
    """One process's first training step; what the caches did."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.codecache import PyCodeCache

    import compile_pass  # noqa: F401 - registers the backend and the ops

    loss_fn, model, ids = _build(model_name, llama_layers)
    compiled = torch.compile(loss_fn, backend=backend, options=options or None)
    start = time.perf_counter()
    loss = compiled(ids)
    loss.backward()
    seconds = time.perf_counter() - start
    sources = []
    for module in list(PyCodeCache.modules):
        try:
            with open(module.__file__) as f:
                sources.append(f.read())
        except (OSError, AttributeError, TypeError):
            continue
    return {
        "seconds": seconds,
        "loss": loss.item(),
        "grad_sum": sum(p.grad.double().sum().item() for p in model.parameters() if p.grad is not None),
        "aot_autograd": {k: counters["aot_autograd"][k] for k in _CACHE_COUNTERS},
        "inductor": {k: counters["inductor"][k] for k in _FX_COUNTERS},
        "chunkce": dict(counters["chunkce"]),
        "op_in_code": any("chunkce.linear_cross_entropy" in source for source in sources),
    }


def run_in_fresh_process(model_name: str, backend: str, cache_dir: str, options: dict | None = None,
                         llama_layers: int = 2, timeout: float = 900) -> dict:
    """Run :func:`_worker` in a new Python process whose compile caches live in ``cache_dir``.

    ``options`` are the backend's (``torch.compile(..., options=...)``), JSON-serialisable.

    Returns the worker's dict: ``seconds`` (first step's wall time), ``loss``,
    ``grad_sum``, the ``aot_autograd`` / ``inductor`` cache counters, chunkce's
    counters and ``op_in_code`` (the op's name in the Inductor code it loaded).

    Raises:
        RuntimeError: the worker failed (the end of its output is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="chunkce-warm-log-") as tmp:
        child = isolate.run(["-m", "benchmarks.warm_start", "--worker", model_name, backend,
                             "--options", json.dumps(options or {}), "--llama-layers", str(llama_layers)],
                            env={"TORCHINDUCTOR_CACHE_DIR": cache_dir}, timeout=timeout,
                            log=os.path.join(tmp, "log.txt"))
    if not child.ok or not child.records:
        raise RuntimeError(f"warm_start worker {model_name}/{backend} failed ({child.status}):\n"
                           f"{child.output_tail}")
    return child.records[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--repeats", type=int, default=2, help="warm processes per (model, backend)")
    parser.add_argument("--llama-layers", type=int, default=2, help="decoder layers of the llama model")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    isolate.add_result_argument(parser)
    args = parser.parse_args()
    if args.worker:
        isolate.Reporter(args.result_json).record(_worker(*args.worker, json.loads(args.options), args.llama_layers))
        return
    body, relative = [], []
    for model_name in args.models:
        ratios = {}
        for backend in BACKENDS:
            with tempfile.TemporaryDirectory(prefix="chunkce-warm-") as cache_dir:
                run = functools.partial(run_in_fresh_process, model_name, backend, cache_dir,
                                        llama_layers=args.llama_layers)
                cold = run()
                warms = [run() for _ in range(args.repeats)]
            warm_s = statistics.median(w["seconds"] for w in warms)
            ratios[backend] = warm_s / cold["seconds"]
            caches = {**warms[-1]["aot_autograd"], **warms[-1]["inductor"]}
            body.append([model_name, backend, f"{cold['seconds']:.2f}", f"{warm_s:.2f}", f"{ratios[backend]:.3f}",
                         ", ".join(f"{k.replace('_cache', '')} {v}" for k, v in caches.items() if v)])
            print(f"  {model_name} / {backend}: cold {cold['seconds']:.2f} s, warm {warm_s:.2f} s", flush=True)
        relative.append(f"{model_name}: chunkce's warm / cold relative to inductor's: "
                        f"{ratios['chunkce'] / ratios['inductor']:.3f}")
    print("\n" + markdown(["model", "backend", "cold s", "warm s", "warm / cold", "warm run's caches"], body))
    print("\n" + "\n".join(relative))


if __name__ == "__main__":
    main()
