"""Train a small Llama on real text with torch.compile, stock Inductor vs chunkce, side by side.

    python examples/train_compiled.py                       # both backends, the whole model, stdlib sources
    python examples/train_compiled.py --compile loss        # compile a function returning only the loss
    python examples/train_compiled.py --backend chunkce --text my.txt --steps 50
    torchrun --nproc-per-node 2 examples/train_compiled.py --parallel ddp     # or fsdp2, tp
    torchrun --nproc-per-node 4 examples/train_compiled.py --parallel fsdp2-tp

Both runs use the same seed, initial weights and batches, so their per-step losses
must agree; the script exits 1 when they do not (beyond --tol). Peak memory of one
training step (forward + backward + optimizer) is measured with compile_pass.memory
after warm-up; tokens/s is timed over the steps after it. No network is used: the
tokenizer is trained on the corpus and cached under ~/.cache/chunkce.

With --parallel (under torchrun), every rank trains on its own rows of each step's
global batch (--batch-size rows per rank); the losses compared are the global ones
(all-reduced mean over ranks; the progress bar shows rank 0's own, labelled "rank 0 loss"),
tokens/s counts all ranks, and rank 0 prints the summary with every rank's measured peak and chunkce counters. With --parallel tp the
ranks form one tensor-parallel group: every rank trains on the same rows, each decoder
layer's projections are sharded as in Megatron / torchtitan and lm_head is sharded over
the vocabulary with its logits gathered (Hugging Face's "colwise_rep"); fsdp2-tp adds
FSDP2 over the data-parallel dimension of a 2-D mesh.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from compile_pass.memory import PeakMemory
from corpus import encode, load_docs, load_tokenizer, sample_batches   # examples/corpus.py

BACKENDS = ("inductor", "chunkce")
PARALLEL_HELP = (
    "data parallel over the processes torchrun starts (gloo on CPU, the accelerator's default "
    "backend elsewhere), each rank on its own --batch-size rows of every step's batch. ddp: "
    "DistributedDataParallel, then compile. fsdp2: fully_shard on each decoder layer and on the "
    "root, lm_head staying in the root's group: in a group of its own, FSDP2's hooks would always "
    "break the Dynamo graph between the head and the loss, and that site could not be rewritten. "
    "tp: tensor parallelism over all ranks (every rank on the same rows): attention and MLP "
    "projections sharded column- then row-wise, lm_head sharded over the vocabulary with its "
    "logits gathered (ColwiseParallel(output_layouts=Replicate()), Hugging Face's colwise_rep). "
    "fsdp2-tp: a 2-D mesh, FSDP2 over data-parallel groups of --tp-size ranks, tp inside them")
# Megatron's split of a Llama decoder layer (what torchtitan and Hugging Face's tp_plan write)
LAYER_PLAN = {**{f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
              "self_attn.o_proj": RowwiseParallel(),
              **{f"mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
              "mlp.down_proj": RowwiseParallel()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    p.add_argument("--steps", type=int, default=6, help="training steps per backend")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured one (compile)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the stdlib's *.py files)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size bound")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--compile", choices=("model", "loss"), default="model",
                   help="compile the model itself, as torch.compile(model) is used (its output, loss and "
                        "logits, is held across backward; chunkce's returned logits are lazy: never "
                        "computed unless read), or a function returning only the loss")
    p.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    p.add_argument("--parallel", choices=("none", "ddp", "fsdp2", "tp", "fsdp2-tp"), default="none",
                   help=PARALLEL_HELP)
    p.add_argument("--tp-size", type=int, default=2,
                   help="ranks per tensor-parallel group with --parallel fsdp2-tp (tp: all ranks)")
    p.add_argument("--tol", type=float, default=1e-3, help="max abs per-step loss difference")
    args = p.parse_args(argv)
    if args.steps < args.warmup + 2:
        p.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2}")
    return args


@dataclass
class Ranks:
    """Where this process stands: rank 0 of 1 without --parallel."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None   # the process group's, e.g. "gloo"; None without one
    mesh: DeviceMesh | None = None   # --parallel tp: ("tp",); fsdp2-tp: ("dp", "tp")
    dp_rank: int = 0             # which rows of a step's batch this rank trains on
    dp_size: int = 1             # data-parallel groups (ranks of a tensor-parallel group share rows)

    def all_gather(self, obj: object) -> list:
        """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
        if self.world_size == 1:
            return [obj]
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered


@dataclass
class Run:
    """One backend's training run; bytes, seconds and tokens/s are measured, not estimated."""

    backend: str
    losses: list[float] = field(default_factory=list)   # global: the mean over ranks
    warmup_s: float = 0.0        # the first --warmup steps, compile included (slowest rank)
    peak_bytes: list[int] = field(default_factory=list)  # per rank: one step after warm-up, above the level before it
    tokens_per_s: float = 0.0    # steps after the measured one, all ranks
    counters: list[dict] = field(default_factory=list)  # per rank: sites found / rewritten / refused


def backend_problem(name: str) -> str | None:
    """Why torch.compile cannot use backend ``name`` here, or None when it can."""
    try:
        torch._dynamo.lookup_backend(name)
    except Exception as e:  # the entry point exists before its module does
        return f"{type(e).__name__}: {e}"
    return None


class CausalLMLoss(torch.nn.Module):
    """``model``'s training loss as a module, for DDP to wrap: Dynamo breaks the graph at DDP's
    own forward and compiles the wrapped module's, which then returns the loss alone, so the
    logits are dead (wrapping the model itself, that frame would return its logits too)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``ids`` [B, T]."""
        return self.model(input_ids=ids, labels=ids).loss


def compiled_loss(model: LlamaForCausalLM, backend: str, args: argparse.Namespace,
                  device: torch.device, ranks: Ranks) -> tuple[Callable[[torch.Tensor], object], torch.nn.Module]:
    """``(step_fn, module)``: the compiled ``ids -> output`` for --compile / --parallel (the
    model's output object, or the loss tensor for --compile loss), and the module whose
    parameters the optimizer steps (after fully_shard: the sharded ones). No chunkce options:
    what ``torch.compile(model, backend="chunkce")`` does is what is measured."""
    if args.parallel == "ddp":
        ddp_ids = None if device.type == "cpu" else [device.index]
        module = DistributedDataParallel(model if args.compile == "model" else CausalLMLoss(model),
                                         device_ids=ddp_ids)
    else:
        module = model
    if args.parallel in ("tp", "fsdp2-tp"):
        tp_mesh = ranks.mesh["tp"]
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, LAYER_PLAN)
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    if args.parallel in ("fsdp2", "fsdp2-tp"):
        dp_mesh = ranks.mesh["dp"] if args.parallel == "fsdp2-tp" else None
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)  # the root group: embeddings, final norm and lm_head (see --help)
        # FSDP2's hooks break the graph at every fully_shard unit, so even with --compile loss
        # the head and the loss are traced in LlamaForCausalLM.forward's own frame, which
        # returns the logits too: chunkce's default leaves them uncomputed (lazy) there as well.
    if args.compile == "model":
        compiled = torch.compile(module, backend=backend)
        return (lambda ids: compiled(input_ids=ids, labels=ids)), module
    if args.parallel == "ddp":
        return torch.compile(module, backend=backend), module
    # HF shifts labels inside the model; loss = CE(lm_head(h)[:, :-1].float(), ids[:, 1:])
    return torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend=backend), module


def train(backend: str, config: LlamaConfig, init_state: dict, batches: list[torch.Tensor],
          args: argparse.Namespace, device: torch.device, ranks: Ranks) -> Run:
    """Train a fresh model from ``init_state`` on ``batches`` (this rank's) with ``backend``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = LlamaForCausalLM(config).to(device)
    model.load_state_dict(init_state)
    model.train()
    loss_fn, module = compiled_loss(model, backend, args, device, ranks)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)

    def step(ids: torch.Tensor) -> float:
        out = loss_fn(ids)      # held across backward, as a training loop holds it
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        optimizer.step()
        return loss.item()     # syncs the device, so the timing is honest; no tensor escapes

    run, losses, peak_bytes, timed_s, timed_tokens = Run(backend), [], 0, 0.0, 0
    bar = tqdm(batches, desc=f"{backend:>8}", unit="step", dynamic_ncols=True, disable=ranks.rank != 0)
    loss_label = "loss" if ranks.world_size == 1 else "rank 0 loss"  # the table's: the mean over ranks
    for i, ids in enumerate(bar):
        ids = ids.to(device)
        optimizer.zero_grad(set_to_none=True)   # outside the measured region: frees last grads
        start = time.perf_counter()
        if i == args.warmup:
            with PeakMemory(device) as mem:
                losses.append(step(ids))
            peak_bytes = mem.peak_bytes
        else:
            losses.append(step(ids))
        elapsed = time.perf_counter() - start
        if i < args.warmup:
            run.warmup_s += elapsed
        elif i > args.warmup:
            timed_s, timed_tokens = timed_s + elapsed, timed_tokens + ids.numel()
        bar.set_postfix({loss_label: f"{losses[-1]:.4f}"})
    counters = dict(torch._dynamo.utils.counters["chunkce"])
    per_rank = ranks.all_gather((losses, peak_bytes, run.warmup_s, timed_s, counters))
    run.losses = [sum(rank_losses) / ranks.world_size for rank_losses in zip(*(r[0] for r in per_rank))]
    run.peak_bytes = [r[1] for r in per_rank]
    run.warmup_s = max(r[2] for r in per_rank)
    run.tokens_per_s = ranks.dp_size * timed_tokens / max(r[3] for r in per_rank)
    run.counters = [r[4] for r in per_rank]
    return run


def report(runs: list[Run], args: argparse.Namespace, tokens_per_step: int, world_size: int = 1,
           dp_size: int | None = None) -> int:
    """Print per-step losses and the summary table; return the exit code."""
    mib = 2**20
    print("\nper-step loss" + (f" (global: mean over {world_size} ranks)" if world_size > 1 else ""))
    print(f"{'step':>5}" + "".join(f"{r.backend:>14}" for r in runs) + ("   |diff|" if len(runs) == 2 else ""))
    for i in range(args.steps):
        row = f"{i:>5}" + "".join(f"{r.losses[i]:>14.6f}" for r in runs)
        if len(runs) == 2:
            row += f"   {abs(runs[0].losses[i] - runs[1].losses[i]):.2e}"
        print(row)

    logits_mib = tokens_per_step * args.vocab_size * 4 / mib
    groups = world_size if dp_size is None else dp_size   # ranks with their own rows (tp: they share them)
    ranks_note = f"{groups} data-parallel ranks x " if groups > 1 else ""
    print(f"\nsummary ({ranks_note}{tokens_per_step} tokens/step, vocab {args.vocab_size}: "
          f"one fp32 logits buffer = {logits_mib:.1f} MiB)")
    print(f"{'':<32}" + "".join(f"{r.backend:>14}" for r in runs))
    print(f"{'warm-up s (compile included)':<32}" + "".join(f"{r.warmup_s:>14.1f}" for r in runs))
    print(f"{'peak step memory MiB':<32}" + "".join(f"{max(r.peak_bytes) / mib:>14.1f}" for r in runs))
    if world_size > 1:        # the row above is the largest of these
        for rank in range(world_size):
            print(f"{f'  rank {rank}':<32}" + "".join(f"{r.peak_bytes[rank] / mib:>14.1f}" for r in runs))
    print(f"{'tokens/s':<32}" + "".join(f"{r.tokens_per_s:>14.0f}" for r in runs))
    print(f"{'final loss':<32}" + "".join(f"{r.losses[-1]:>14.6f}" for r in runs))
    unrewritten = []
    for r in runs:
        for rank, counters in enumerate(r.counters):
            if counters:
                print(f"{r.backend} counters" + (f", rank {rank}" if world_size > 1 else "") + f": {counters}")
            if world_size > 1 and r.backend == "chunkce" and not counters.get("sites_rewritten"):
                unrewritten.append(rank)
    if unrewritten:
        print(f"error: chunkce rewrote no lm_head -> cross_entropy site on rank(s) {unrewritten}")
    if len(runs) != 2:
        return 1 if unrewritten else 0
    base, ours = runs
    base_peak, our_peak = max(base.peak_bytes), max(ours.peak_bytes)
    print(f"peak memory {ours.backend}/{base.backend}: {our_peak / base_peak:.2f}x "
          f"({(base_peak - our_peak) / mib:+.1f} MiB saved)")
    diff = max(abs(a - b) for a, b in zip(base.losses, ours.losses))
    ok = diff <= args.tol
    print(f"max |loss diff| over {args.steps} steps: {diff:.2e} (tolerance {args.tol:.0e}): "
          f"{'OK' if ok else 'MISMATCH'}")
    return 0 if ok and not unrewritten else 1


def init_ranks(args: argparse.Namespace) -> tuple[Ranks, torch.device]:
    """This process's ranks and device; with --parallel, joins the process group torchrun set up."""
    acc = getattr(torch, "accelerator", None)
    device = torch.device(args.device or (acc.current_accelerator() if acc and acc.is_available() else "cpu"))
    if args.parallel == "none":
        return Ranks(), device
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    if args.parallel == "ddp":
        # DDP's forward opens record_function("DistributedDataParallel.forward"); Dynamo says once
        # per rank that it ignores it in the graph. Not about this script or its setup: dropped.
        logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(
            lambda record: record.msg != "Profiler record function %s will be ignored")
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend, device_id=None if device.type == "cpu" else device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.parallel not in ("tp", "fsdp2-tp"):
        return Ranks(rank, world_size, backend, dp_rank=rank, dp_size=world_size), device
    tp_size = world_size if args.parallel == "tp" else args.tp_size
    if world_size % tp_size:
        raise SystemExit(f"error: --tp-size {tp_size} does not divide the {world_size} ranks")
    mesh = init_device_mesh(device.type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return Ranks(rank, world_size, backend, mesh, rank // tp_size, world_size // tp_size), device


def main(argv: list[str] | None = None) -> int:
    """Train with each backend, print the comparison from rank 0; exit code 0, 1 (mismatch) or 2."""
    args = parse_args(argv)
    if args.parallel != "none" and not {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        script = os.path.relpath(__file__)
        print(f"error: --parallel {args.parallel} runs one process per rank; start it with torchrun:\n"
              f"  torchrun --nproc-per-node 2 {script} --parallel {args.parallel}\n"
              f"(or: {os.path.basename(sys.executable)} -m torch.distributed.run --nproc-per-node 2 "
              f"{script} --parallel {args.parallel})", file=sys.stderr)
        return 2
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    for name in backends:
        if problem := backend_problem(name):
            print(f"error: backend {name!r} is not usable: {problem}", file=sys.stderr)
            return 2
    ranks, device = init_ranks(args)
    try:
        return run_all(args, backends, ranks, device)
    finally:
        if ranks.backend is not None:
            dist.destroy_process_group()


def run_all(args: argparse.Namespace, backends: tuple[str, ...], ranks: Ranks, device: torch.device) -> int:
    """Load the corpus, train with every backend and report (rank 0); every rank returns rank 0's code."""
    log = print if ranks.rank == 0 else (lambda *a, **k: None)
    docs = load_docs(args.text, args.max_bytes)
    if ranks.rank == 0:
        tokenizer = load_tokenizer(docs, args.vocab_size)    # trained once, cached on disk
    if ranks.world_size > 1:
        dist.barrier()
    if ranks.rank != 0:
        tokenizer = load_tokenizer(docs, args.vocab_size)
    ids = encode(tokenizer, docs)
    # one global batch a step; data-parallel group d trains on its rows [d * B, (d + 1) * B)
    B = args.batch_size
    batches = [b[ranks.dp_rank * B:(ranks.dp_rank + 1) * B]
               for b in sample_batches(ids, args.steps, B * ranks.dp_size, args.seq_len, args.seed)]
    log(f"corpus: {args.text or 'python stdlib *.py'}, {sum(map(len, docs)) / 1e6:.1f} M chars, "
        f"{ids.numel() / 1e6:.2f} M tokens, tokenizer vocab {tokenizer.get_vocab_size()}")

    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=max(args.seq_len, 512), use_cache=False,
                         tie_word_embeddings=False, dtype=torch.float32)
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    n_params = sum(v.numel() for v in init_state.values())
    log(f"model: Llama, {args.layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
        f"{n_params / 1e6:.1f} M params, fp32, {device}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; compiling the {args.compile}")
    if ranks.world_size > 1:
        groups = f", {ranks.dp_size} data-parallel group(s) of {ranks.world_size // ranks.dp_size}" \
            if ranks.mesh is not None else ""
        log(f"parallel: {args.parallel} over {ranks.world_size} ranks ({ranks.backend}){groups}, "
            f"{B} x {args.seq_len} tokens a rank a step")

    runs = [train(name, config, init_state, batches, args, device, ranks) for name in backends]
    code = [report(runs, args, B * args.seq_len, ranks.world_size, ranks.dp_size) if ranks.rank == 0 else None]
    if ranks.world_size > 1:
        dist.broadcast_object_list(code, src=0)
    return code[0]


if __name__ == "__main__":
    sys.exit(main())
