"""What a case will need before it runs: the memory of a provider's op call, of a training step.

    op_bytes("unfused-compiled", tokens=4096, hidden=2048, vocab=128256)   # the process's peak
    step_bytes(REAL_MODELS["llama3.2-1b"], layers=2, tokens=4096, backend="inductor")
    too_big(need, cap_gib=14.0)    # "needs ~18.2 GiB (predicted; over --mem-cap-gib 14), not run" or None

``benchmarks.real_heads`` and ``benchmarks.budget`` never start a case predicted above the
machine's share (``--mem-cap-gib``): an out-of-memory kill on a shared machine takes other
processes with it. Such a case is a result row, "out of memory: needs ~X GiB (predicted ...)".

Estimates of a whole process, generous on purpose, in the element size of fp32:

* op call: the interpreter and compiler (``PROCESS``), the inputs and their gradients
  (``[N, H]`` + ``[V, H]`` twice), and the provider's working set
  ``logits x N V + hidden x N H + weight x V H`` (``OP_WORKING_SET``): the unfused loss
  holds whole ``[N, V]`` buffers (Inductor's compiled one: the logits, one buffer, as
  measured); the chunkers hold chunks sized to about the hidden states' bytes, and those
  that compute the gradients in forward a weight gradient's buffer besides;
* training step: the process, parameters + AdamW's two states + gradients, then the
  larger of backward's share (the layers' saved activations, :func:`activations`, and the
  backend's ``[N, V]`` buffers, ``STEP_LOGITS``: Inductor's compiled HF loss holds about
  three) and the single-tensor AdamW's temporaries (two of the largest parameter, the
  embedding: 2.00x measured in a step after the first on CPU).
"""

from __future__ import annotations

from benchmarks.real_models import RealModel

GiB = 2**30
FP32 = 4
OOM = "out of memory"  # the status of a case not run for its predicted memory
PROCESS = 1.5 * GiB  # torch, transformers, Inductor's compiler and its generated code
TILES = 256 * 2**20  # a chunked provider's tiles (chunkce: 47 MiB at 4096 x 2048 x 128256)
# provider -> multiples of N x V, N x H and V x H bytes of working set beyond the gradients
OP_WORKING_SET = {
    "unfused-eager": (3.0, 0.0, 0.0),
    "unfused-compiled": (1.1, 0.0, 0.0),  # 1.00 measured at 2048 x 256 x 32768 and 4096 x 2048 x 128256
    "autochunk": (1.1, 0.0, 0.0),  # unchunked where it refuses; see AUTOCHUNK_AMPLIFY
    "autochunk-forced": (0.25, 4.0, 1.5),  # 2 / num_chunk x N V measured (num_chunk 4); 8 at N 4096
    "torch-lce": (0.0, 4.0, 1.5),  # a weight gradient's buffer besides the result (1.05x V x H measured)
    "torch-lce-compiled": (0.0, 4.0, 2.5),
    "chunkce": (0.0, 4.0, 0.0),
    "chunkce-compiled": (0.0, 4.0, 0.0),
    "chunkce-gif": (0.0, 4.0, 0.0),
    "floor-recompute": (0.0, 4.0, 0.0),
    "floor-four": (2.0, 0.0, 0.0),
    "floor-unfused": (2.0, 0.0, 0.0),
}
# Inductor's auto-chunker at its defaults chunks (into 8) only where the matmul's [N, V] output is
# more than auto_chunker.amplify_ratio_threshold (8) times its inputs' [N, H] + [V, H]
# (torch/_inductor/fx_passes/auto_chunker/core.py, find_amplifier_node): refused at a ratio of
# 7.5 (2048 x 256 x 32768), 0.25x N V measured at 21 (4096 x 128 x 8192).
AUTOCHUNK_AMPLIFY = 8
STEP_LOGITS = {"eager": 4.0, "inductor": 3.0}  # other backends (chunkce's): tiles, under ACTIVATIONS' margin


def op_bytes(provider: str, tokens: int, hidden: int, vocab: int, element: int = FP32) -> int:
    """Predicted peak of a process running ``provider``'s forward + backward at ``[N, H] x [V, H]``."""
    logits, hidden_states, weight = OP_WORKING_SET[provider]
    if provider == "autochunk" and tokens * vocab > AUTOCHUNK_AMPLIFY * (tokens + vocab) * hidden:
        logits = 2.0 / 8
    inputs = (tokens * hidden + vocab * hidden) * element
    working = (logits * tokens * vocab + hidden_states * tokens * hidden + weight * vocab * hidden) * element
    return int(PROCESS + 2 * inputs + working + TILES)


def activations(model: RealModel, tokens: int, element: int = FP32) -> int:
    """Saved activations of one decoder layer at ``tokens`` tokens (generous: every projection's
    input and output, the MLP's three ``[N, I]`` twice over)."""
    attention = (model.heads + 2 * model.kv_heads) * model.head_dim
    return tokens * element * (8 * model.hidden_size + 2 * attention + 6 * model.intermediate_size)


def step_bytes(model: RealModel, layers: int, tokens: int, backend: str, element: int = FP32) -> int:
    """Predicted peak of a process running one training step (forward, backward, AdamW): parameters,
    AdamW's state and the gradients, then the larger of backward's activations and ``[N, V]``
    buffers and AdamW's temporaries (the optimizer runs after backward has freed them)."""
    params = model.parameters(layers) * element
    embedding = model.vocab_size * model.hidden_size * element
    logits = STEP_LOGITS.get(backend, 0.0) * tokens * model.vocab_size * element
    backward = layers * activations(model, tokens, element) + logits
    return int(PROCESS + 4 * params + max(backward, 2 * embedding))


def too_big(need: int, cap_gib: float) -> str | None:
    """The row's note when ``need`` bytes are over ``cap_gib``, else None."""
    if need <= cap_gib * GiB:
        return None
    return f"needs ~{need / GiB:.1f} GiB (predicted; over --mem-cap-gib {cap_gib:g}), not run"
