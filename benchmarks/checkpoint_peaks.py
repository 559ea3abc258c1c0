"""Does activation checkpointing lower a compiled step's peak? A forward + backward's peak, per backend, plain
and with transformers' checkpointing on every decoder layer (non-reentrant), each in a fresh process:

    python -m benchmarks.checkpoint_peaks                       # hidden 512, 2 layers, 4096 tokens: ~5 min
    python -m benchmarks.checkpoint_peaks --tokens 512 --hidden-size 64 --backends eager   # a check

Why ``benchmarks.budget``'s ``-ckpt`` backends are not in its table: on torch 2.13 (CPU) the compiled
loss of a Llama checkpointed this way peaks above the plain one under Inductor (364 against 404 MiB at the
defaults) and chunkce (342, 404), where eager cuts it to 0.62x (472, 291) and ``aot_eager`` lowers it (375, 335).
The peak is above the parameters and AdamW's state, gradients freed before it (``bench_model.peak_of``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from benchmarks import bench_model

MiB = 2**20


def one(args: argparse.Namespace) -> float:
    """Child: the peak (MiB) of a forward + backward after a first (compiling) step."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                         vocab_size=1024, max_position_embeddings=args.tokens, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).train()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    if args.checkpointed:
        model.activation_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))

    def loss(ids):
        return model(input_ids=ids, labels=ids).loss

    loss_fn = loss if args.backend == "eager" else torch.compile(loss, backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters())
    loss_fn(ids).backward()
    optimizer.step()
    peak, _ = bench_model.peak_of(optimizer, torch.device("cpu"), lambda: loss_fn(ids).backward())
    return peak / MiB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["eager", "aot_eager", "inductor", "chunkce"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backend", help=argparse.SUPPRESS)  # parent -> child
    p.add_argument("--checkpointed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.backend:
        if args.backend == "chunkce":
            import compile_pass  # noqa: F401  (registers the backend)
        print(json.dumps(one(args)))
        return 0
    print(f"torch {torch.__version__}; Llama, hidden {args.hidden_size}, {args.layers} layers, {args.tokens} tokens: "
          "peak MiB of a forward + backward")
    print("| backend | plain | checkpointed |\n|---|---:|---:|")
    for backend in args.backends:
        peaks = []
        for checkpointed in (False, True):
            child = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_peaks", "--backend", backend,
                                    "--tokens", str(args.tokens), "--hidden-size", str(args.hidden_size),
                                    "--layers", str(args.layers), *(["--checkpointed"] if checkpointed else [])],
                                   capture_output=True, text=True, check=True)
            peaks.append(float(child.stdout.strip().splitlines()[-1]))
        print(f"| {backend} | {peaks[0]:.0f} | {peaks[1]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
