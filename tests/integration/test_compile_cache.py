"""Warm restarts hit the compile caches, as for stock Inductor.

The rewritten graph holds only ``torch.ops.chunkce.*`` and torch ops, so
AOTAutograd's cache accepts it (a Python callable in the graph makes it bypass
the cache, so every new process recompiled from scratch). Each case runs the
first training step in two fresh processes sharing one cache directory (the toy's a third, with
other options)
(:func:`first_step_in_fresh_process`, this file's own; ``benchmarks/warm_start.py``
times the same thing) and asserts the cache counters of the second one, and that
what it loaded is the rewritten graph.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# One process's first training step under backend="chunkce" (Inductor inside), then what
# the caches did, as one JSON line. argv: model ("toy" or "llama"), the backend's options.
FIRST_STEP = r'''
import json, sys
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.codecache import PyCodeCache
import compile_pass  # registers the backend and the ops

model_name, options = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
V, H = 1000, 64
ids = torch.randint(0, V, (2, 64))  # [B, T]
if model_name == "toy":  # label smoothing: the op's per-chunk kernels take a float
    embed, body, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, H), torch.nn.Linear(H, V, bias=False)
    params = [*embed.parameters(), *body.parameters(), *head.parameters()]

    def loss_fn(input_ids):
        logits = head(torch.relu(body(embed(input_ids)))).float()  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), input_ids.flatten(), label_smoothing=0.1)
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    params = list(llama.parameters())

    def loss_fn(input_ids):
        return llama(input_ids=input_ids, labels=input_ids).loss

loss = torch.compile(loss_fn, backend="chunkce", options=options or None)(ids)
loss.backward()
code = []
for module in list(PyCodeCache.modules):
    try:
        code.append(open(module.__file__).read())
    except (OSError, AttributeError, TypeError):
        pass
print(json.dumps({
    "loss": loss.item(),
    "grad_sum": sum(p.grad.double().sum().item() for p in params if p.grad is not None),
    "aot_autograd": {k: counters["aot_autograd"][k]
                     for k in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")},
    "inductor": {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
    "chunkce": dict(counters["chunkce"]),
    "op_in_code": any("chunkce.linear_cross_entropy" in c for c in code),
}))
'''


def first_step_in_fresh_process(model: str, cache_dir: str, options: dict | None = None) -> dict:
    """:data:`FIRST_STEP` in a new interpreter whose Inductor caches live in ``cache_dir``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", FIRST_STEP, model, json.dumps(options or {})], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"first step of {model} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_loaded_from_the_caches(cold: dict, warm: dict) -> None:
    """The second process (``warm``) ran the rewritten graph, every graph of it from the caches."""
    for run in (cold, warm):
        assert run["chunkce"]["sites_rewritten"] == 1, run
        assert run["op_in_code"], run  # Inductor's code calls the op: the site is rewritten in what ran
    assert cold["aot_autograd"]["autograd_cache_bypass"] == 0, cold
    assert cold["aot_autograd"]["autograd_cache_miss"] >= 1, cold
    # Every graph (the model's and the op's per-chunk kernels) comes from the caches.
    assert warm["aot_autograd"] == {"autograd_cache_hit": cold["aot_autograd"]["autograd_cache_miss"],
                                    "autograd_cache_miss": 0, "autograd_cache_bypass": 0}, warm
    assert warm["inductor"]["fxgraph_cache_miss"] == 0 and warm["inductor"]["fxgraph_cache_hit"] >= 1, warm
    assert warm["loss"] == cold["loss"] and warm["grad_sum"] == cold["grad_sum"]


def test_second_process_loads_the_rewritten_llama_from_the_caches(tmp_path):
    check_loaded_from_the_caches(first_step_in_fresh_process("llama", str(tmp_path)),
                                 first_step_in_fresh_process("llama", str(tmp_path)))


def test_second_process_loads_the_toy_from_the_caches_and_other_options_do_not_answer(tmp_path):
    """The toy's warm process as the Llama's; then a third with ``strict=True``, which leaves the
    rewritten graph as it was: the backend tags the inner compile with its options and source, so
    the model's graph misses; the per-chunk kernels, compiled outside the backend, still hit."""
    cold = first_step_in_fresh_process("toy", str(tmp_path))
    check_loaded_from_the_caches(cold, first_step_in_fresh_process("toy", str(tmp_path)))
    strict = first_step_in_fresh_process("toy", str(tmp_path), options={"strict": True})
    misses = cold["aot_autograd"]["autograd_cache_miss"]  # the model and the two kernels
    assert strict["aot_autograd"] == {"autograd_cache_hit": misses - 1, "autograd_cache_miss": 1,
                                      "autograd_cache_bypass": 0}, strict
    assert strict["loss"] == cold["loss"]
