"""Model-level benchmark: one training step, eager vs Inductor vs chunkce.

    python -m benchmarks.bench_model --device cpu --configs cpu-small --isolate
    python -m benchmarks.bench_model --configs gpu-1b --isolate --csv model.csv   # on a GPU: bf16
    python -m benchmarks.bench_model --compile model --configs cpu-example cpu-example-128k --isolate \
        --backends inductor chunkce chunkce-drop chunkce-keep     # the whole model, no options vs the others
    python -m benchmarks.bench_model --configs cpu-example --isolate --backends inductor chunkce \
        --step eval eval-read --steps 3    # evaluation steps (no_grad, labels), logits unread / read

A ``transformers`` ``LlamaForCausalLM`` built from a registry config (random
weights, same seed everywhere; the ``<name>-2l`` configs build the published model of
``benchmarks.real_models``, its family and tied head, at two decoder layers), trained on one fixed random batch. Per backend:
``--warmup`` steps (compilation), one step under ``compile_pass.memory.PeakMemory``
(forward + backward + AdamW step, gradients freed before it), one more with the
forward + backward alone measured, then ``--steps`` timed steps. Reported: peak
step memory above the parameters and optimizer state (and of forward + backward),
median step time, tokens/s, and each step's loss against eager's.

``--isolate`` runs every (config, backend) in a fresh process, so neither compile
caches nor allocator state of one run colour the next one's numbers. The tables are
markdown (``benchmarks.tables``), the docs' own (``run_cpu``); a backend that fails
makes the exit status 1.

``--step eval`` / ``eval-read``: instead of training, the evaluation step
(``model.eval()``; under ``torch.no_grad()`` ``out = model(input_ids=ids, labels=ids)``, the
whole model compiled), with the logits left unread (``eval``: a loss-only evaluation
loop, ``Trainer.evaluate()`` without ``compute_metrics``) or read after the step
(``eval-read``: ``out.logits.argmax(-1)``, what ``preprocess_logits_for_metrics``
usually does). Peak is that of one step (the output dropped before the next), above the
parameters; time is the median step.

``--busy N`` (``--busy-kind matmul|python``): after the idle timed steps, the same number of steps
again with ``N`` competing busy processes running (``benchmarks.busy``: another user's job on the
machine); a second table prints each backend's busy and idle ratio to Inductor side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks import busy, harness, isolate
from benchmarks.real_models import REAL_MODELS
from benchmarks.tables import fmt, markdown, num, ratio

MiB = harness.MiB
BACKENDS = ("eager", "inductor", "chunkce", "chunkce-keep", "chunkce-drop", "chunkce-gif")
# chunkce with no options (returned logits lazy), the other two returned_logits behaviours, and the
# gradients computed during forward (three matmuls a chunk where the recompute runs four)
CHUNKCE_OPTIONS = {"chunkce": {}, "chunkce-keep": {"returned_logits": "keep"},
                   "chunkce-drop": {"returned_logits": "drop"}, "chunkce-gif": {"grads_in_forward": True}}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    seq_len: int
    dtype: str  # parameters (and so activations) dtype
    model: str = ""  # a published model of benchmarks.real_models ("": Llama, the fields above, untied)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def transformers_config(self):
        """The transformers config: the published model's at ``layers`` layers, or a Llama."""
        from transformers import AutoConfig

        if self.model:
            real = REAL_MODELS[self.model]
            return AutoConfig.for_model(real.model_type, **real.transformers_kwargs(self.layers),
                                        max_position_embeddings=self.seq_len, use_cache=False,
                                        attn_implementation="sdpa")
        return AutoConfig.for_model("llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                    intermediate_size=self.intermediate_size, num_hidden_layers=self.layers,
                                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                    max_position_embeddings=self.seq_len, use_cache=False,
                                    tie_word_embeddings=False, attn_implementation="sdpa")


def real_config(name: str, layers: int = 2, batch: int = 1, seq_len: int = 4096) -> ModelConfig:
    """A published model (``benchmarks.real_models``) at ``layers`` layers, fp32, one batch shape."""
    m = REAL_MODELS[name]
    return ModelConfig(m.vocab_size, m.hidden_size, m.intermediate_size, layers, m.heads, m.kv_heads,
                       batch=batch, seq_len=seq_len, dtype="fp32", model=name)


CONFIGS = {
    "cpu-small": ModelConfig(32000, 256, 688, 2, 4, 4, batch=2, seq_len=512, dtype="fp32"),
    "cpu-micro": ModelConfig(4096, 64, 172, 1, 2, 2, batch=2, seq_len=128, dtype="fp32"),  # checks, seconds
    # the example's model and batch (examples/train_compiled.py), and the same at a 128k vocabulary
    "cpu-example": ModelConfig(32000, 256, 688, 2, 4, 4, batch=8, seq_len=256, dtype="fp32"),
    "cpu-example-128k": ModelConfig(128256, 256, 688, 2, 4, 4, batch=8, seq_len=256, dtype="fp32"),
    # Llama-3.2-1B's widths and vocabulary, fewer layers (compile time), untied head.
    "gpu-1b": ModelConfig(128256, 2048, 8192, 4, 32, 8, batch=4, seq_len=2048, dtype="bf16"),
    "gpu-1b-16k": ModelConfig(128256, 2048, 8192, 4, 32, 8, batch=8, seq_len=2048, dtype="bf16"),
    # the published models (benchmarks.real_models) at two decoder layers, 1 x 4096 tokens, fp32
    **{f"{name}-2l": real_config(name) for name in REAL_MODELS},
}


def build(config: ModelConfig, device: torch.device, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config.transformers_config()).to(DTYPES[config.dtype])
    model.train()
    gen = torch.Generator(device).manual_seed(seed + 1)
    input_ids = torch.randint(0, config.vocab_size, (config.batch, config.seq_len), device=device,
                              generator=gen)  # [B, T]; HF shifts the labels inside
    return model, input_ids


def loss_function(model, backend: str, compile_what: str, chunk_size: int | None):
    """The step's loss of ``ids`` under ``backend``. ``compile_what="model"``: the whole model is
    compiled and its output object (loss and logits) is held until the next call returns, as a
    training loop's ``out = model(...); out.loss.backward()`` holds it."""
    def loss(ids):
        return model(input_ids=ids, labels=ids).loss
    if backend == "eager":
        return loss
    kwargs = {}
    if backend in CHUNKCE_OPTIONS:  # registered by ``import compile_pass``; torch.compile raises if it is not
        import compile_pass  # noqa: F401

        options = {**CHUNKCE_OPTIONS[backend], **({"chunk_size": chunk_size} if chunk_size else {})}
        kwargs = {"options": options} if options else {}
        backend = "chunkce"
    if compile_what == "model":
        compiled = torch.compile(model, backend=backend, **kwargs)
        held = {}

        def step_loss(ids):
            out = compiled(input_ids=ids, labels=ids)
            held["out"] = out  # the previous step's output lives until this one is returned
            return out.loss

        return step_loss
    return torch.compile(loss, backend=backend, **kwargs)


def eval_function(model, backend: str, read: bool, chunk_size: int | None):
    """One evaluation step under ``backend`` (the whole model compiled): ``no_grad``,
    ``model(input_ids=ids, labels=ids)``; ``read``: ``out.logits.argmax(-1)`` after it.
    Returns the loss; the output object is dropped when the step returns."""
    model.eval()
    compiled = model
    if backend != "eager":
        kwargs = {}
        if backend in CHUNKCE_OPTIONS:
            import compile_pass  # noqa: F401

            options = {**CHUNKCE_OPTIONS[backend], **({"chunk_size": chunk_size} if chunk_size else {})}
            kwargs = {"options": options} if options else {}
            backend = "chunkce"
        compiled = torch.compile(model, backend=backend, **kwargs)

    def step(ids):
        with torch.no_grad():
            out = compiled(input_ids=ids, labels=ids)
            if read:
                out.logits.argmax(-1)  # [B, T]: reads every logit
            return out.loss

    return step


def run_eval(name: str, backend: str, args: argparse.Namespace) -> dict:
    """One (config, backend) evaluation run (``--step eval`` / ``eval-read``) in this process."""
    config, device = CONFIGS[name], args.device
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, ids = build(config, device, args.seed)
    step = eval_function(model, backend, args.step == "eval-read", args.chunk_size)
    losses = []
    start = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(step(ids))
    harness.synchronize(device)
    warmup_s = time.perf_counter() - start
    harness.release_memory(device)
    with harness.PeakMemory(device) as mem:
        losses.append(step(ids))
    stats = harness.time_region(lambda _: losses.append(step(ids)), lambda: None, device, warmup=0,
                                reps=args.steps)
    busy_stats = _busy_time(lambda _: step(ids), lambda: None, args)
    chunkce_counters = dict(torch._dynamo.utils.counters.get("chunkce", {}))
    static = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "config": name, "backend": backend, "step": args.step, "compile": "model" if backend != "eager" else "-",
        "device": device.type, "dtype": config.dtype, "tokens": config.tokens,
        "chunk_size": (args.chunk_size or "auto") if backend in CHUNKCE_OPTIONS else "",
        "vocab": config.vocab_size, "hidden": config.hidden_size, "layers": config.layers,
        "step_ms_p20": stats.p20, "step_ms_p50": stats.p50, "step_ms_p80": stats.p80,
        "tokens_per_s": config.tokens / (stats.p50 / 1e3), "peak_mib": mem.peak_bytes / MiB,
        "peak_fwd_bwd_mib": "", "static_mib": static / MiB, "warmup_s": warmup_s,
        "sites_rewritten": chunkce_counters.get("sites_rewritten", ""),
        "losses": [float(x) for x in losses], **busy_stats,
    }


def _busy_time(run, prepare, args: argparse.Namespace) -> dict:
    """``--busy``: the median of ``args.steps`` steps with the busy processes running, else nothing."""
    if not args.busy:
        return {}
    with busy.competing(args.busy, args.busy_kind):
        stats = harness.time_region(run, prepare, args.device, warmup=1, reps=args.steps)
    return {"busy": f"{args.busy} {args.busy_kind}", "busy_step_ms_p50": stats.p50}


def setup_step(config: ModelConfig, backend: str, args: argparse.Namespace):
    """A fresh Dynamo, the config's model and batch, AdamW and the loss function to step
    (``args``: ``device``, ``seed``, ``lr``, ``compile``, ``chunk_size``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, ids = build(config, args.device, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, ids, optimizer, loss_function(model, backend, args.compile, args.chunk_size)


def static_bytes(model, optimizer) -> int:
    """Parameters plus the optimizer's state tensors."""
    tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                      if isinstance(t, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_one(name: str, backend: str, args: argparse.Namespace) -> dict:
    """One (config, backend) training run in this process; every number measured."""
    config, device = CONFIGS[name], args.device
    model, ids, optimizer, loss_fn = setup_step(CONFIGS[name], backend, args)

    def step(_=None) -> float:
        loss = loss_fn(ids)
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = []
    start = time.perf_counter()
    for _ in range(args.warmup):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step())
    harness.synchronize(device)
    warmup_s = time.perf_counter() - start

    static = static_bytes(model, optimizer)
    peak, loss = peak_of(optimizer, device, step)
    losses.append(loss)

    def forward_backward():  # without the optimizer step, whose temporaries can set a small model's peak
        loss = loss_fn(ids)
        loss.backward()
        return loss.detach()

    peak_fwd_bwd, loss = peak_of(optimizer, device, forward_backward)
    optimizer.step()
    losses.append(loss)

    def prepare():
        optimizer.zero_grad(set_to_none=True)

    def timed(_):
        losses.append(step())

    stats = harness.time_region(timed, prepare, device, warmup=0, reps=args.steps)
    busy_stats = _busy_time(lambda _: step(), prepare, args)
    chunkce_counters = dict(torch._dynamo.utils.counters.get("chunkce", {}))
    return {
        "config": name, "backend": backend, "step": "train", "compile": args.compile if backend != "eager" else "-",
        "device": device.type, "dtype": config.dtype, "tokens": config.tokens,
        "chunk_size": (args.chunk_size or "auto") if backend in CHUNKCE_OPTIONS else "",
        "vocab": config.vocab_size, "hidden": config.hidden_size, "layers": config.layers,
        "step_ms_p20": stats.p20, "step_ms_p50": stats.p50, "step_ms_p80": stats.p80,
        "tokens_per_s": config.tokens / (stats.p50 / 1e3),
        "peak_mib": peak / MiB, "peak_fwd_bwd_mib": peak_fwd_bwd / MiB,
        "static_mib": static / MiB,
        "warmup_s": warmup_s,
        "sites_rewritten": chunkce_counters.get("sites_rewritten", ""),
        "losses": [float(x) for x in losses], **busy_stats,
    }


def peak_of(optimizer, device: torch.device, run):
    """``(peak bytes, result)`` of ``run()``, measured with the gradients freed before it."""
    optimizer.zero_grad(set_to_none=True)
    harness.release_memory(device)
    with harness.PeakMemory(device) as mem:
        result = run()
    return mem.peak_bytes, result


def _step_total_mib(model, optimizer, loss_fn, ids, device, static: int) -> tuple[float, float]:
    """``(peak above static, static + peak)`` in MiB of one training step, gradients freed before it."""
    def step() -> None:
        loss_fn(ids).backward()
        optimizer.step()

    peak, _ = peak_of(optimizer, device, step)
    return peak / MiB, (static + peak) / MiB


def search_cap(name: str, backend: str, args: argparse.Namespace) -> dict:
    """The largest batch (at the config's sequence length) whose training step fits ``--cap-mib``.

    Memory is what a step needs in all: parameters + AdamW state (both allocated
    before the search, by a warm-up step at batch 1) plus the step's measured peak
    above them (``compile_pass.memory``: allocator statistics, or on CPU the
    profiler's allocation events). Batches double from 1 until a step does not
    fit, then bisect between the last that fit and the first that did not; every
    tried batch is a row (its measured memory), so the answer is measured on both
    sides, never extrapolated. Compiled with ``dynamic=None``: one recompile, at
    the second batch size.
    """
    config, device = CONFIGS[name], args.device
    model, _, optimizer, loss_fn = setup_step(CONFIGS[name], backend, args)
    gen = torch.Generator(device).manual_seed(args.seed + 2)

    def batch_ids(batch: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (batch, config.seq_len), device=device, generator=gen)

    loss_fn(batch_ids(1)).backward()  # compiles, and makes AdamW's state
    optimizer.step()
    static = static_bytes(model, optimizer)
    trials: dict[int, tuple[float, float]] = {}

    def fits(batch: int) -> bool:
        if batch not in trials:
            trials[batch] = _step_total_mib(model, optimizer, loss_fn, batch_ids(batch), device, static)
            print(f"    {backend} batch {batch} ({batch * config.seq_len} tokens): "
                  f"{trials[batch][1]:.0f} MiB", flush=True)
        return trials[batch][1] <= args.cap_mib

    low, high = 0, 1
    while high <= args.max_batch and fits(high):
        low, high = high, high * 2
    while high - low > 1 and low > 0:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    rows = [{"config": name, "backend": backend, "batch": b, "seq_len": config.seq_len,
             "tokens": b * config.seq_len, "peak_mib": p, "static_mib": static / MiB, "total_mib": t,
             "fits": t <= args.cap_mib, "cap_mib": args.cap_mib} for b, (p, t) in sorted(trials.items())]
    return {"config": name, "backend": backend, "cap_mib": args.cap_mib, "max_batch": low,
            "max_tokens": low * config.seq_len, "trials": rows,
            "sites_rewritten": torch._dynamo.utils.counters.get("chunkce", {}).get("sites_rewritten", ""),
            "losses": []}


def run_isolated(name: str, backend: str, args: argparse.Namespace) -> dict:
    """``run_one`` (or ``search_cap``) in a fresh interpreter; its output streams through."""
    child = isolate.run(["-m", "benchmarks.bench_model", "--configs", name, "--backends", backend,
                         "--device", str(args.device), "--warmup", str(args.warmup), "--steps", str(args.steps),
                         "--lr", str(args.lr), "--seed", str(args.seed), "--compile", args.compile,
                         "--step", args.step, "--busy", str(args.busy), "--busy-kind", args.busy_kind,
                         *(["--chunk-size", str(args.chunk_size)] if args.chunk_size else []),
                         *(["--cap-mib", str(args.cap_mib), "--max-batch", str(args.max_batch)]
                           if args.cap_mib else [])], timeout=args.run_timeout)
    if not child.records:
        raise RuntimeError(f"child process ended ({child.status}) with no result")
    return child.records[0]  # a failure inside the child comes back as its note


COLUMNS = ("config", "backend", "step", "compile", "chunk_size", "device", "dtype", "tokens", "vocab", "hidden", "layers",
           "step_ms_p20", "step_ms_p50", "step_ms_p80", "tokens_per_s", "peak_mib", "peak_fwd_bwd_mib",
           "static_mib",
           "warmup_s", "loss_first", "loss_last", "max_loss_diff_vs_eager", "max_loss_diff_vs_inductor",
           "sites_rewritten", "busy", "busy_step_ms_p50", "note")


def summarize(results: list[dict]) -> list[dict]:
    """CSV rows: losses reduced to first, last and the largest per-step gap to eager's and Inductor's."""
    rows = []
    for r in results:
        row = {c: r.get(c, "") for c in COLUMNS}
        if r.get("losses"):
            row["loss_first"], row["loss_last"] = r["losses"][0], r["losses"][-1]
            for other in ("eager", "inductor"):
                ref = next((x["losses"] for x in results if x["backend"] == other and x["config"] == r["config"]
                            and x.get("step") == r.get("step") and x.get("losses")), None)
                if ref is not None and r["backend"] != other:
                    row[f"max_loss_diff_vs_{other}"] = max(abs(a - b) for a, b in zip(r["losses"], ref))
        rows.append(row)
    return rows


def step_table(rows: list[dict]) -> str:
    """The training-step runs as markdown (``summarize``'s rows, from memory or a CSV); the docs' model table."""
    base = {(r["config"], r.get("step", "train")): r for r in rows
            if r["backend"] == "inductor" and num(r["peak_mib"])}
    body = []
    for r in rows:
        if not num(r["peak_mib"]):
            body.append([r["config"], r.get("step", "train"), r["backend"], r["tokens"], f"failed: {r['note']}",
                         *[""] * 9])
            continue
        b = base.get((r["config"], r.get("step", "train")))

        def vs(key: str) -> str:
            return f" ({ratio(r[key], b[key])})" if b is not None and b is not r else ""

        body.append([r["config"], r.get("step", "train"), r["backend"], r["tokens"],
                     fmt(r["step_ms_p50"], ".0f") + vs("step_ms_p50"),
                     fmt(r["tokens_per_s"], ".0f"), fmt(r["peak_mib"], ".1f") + vs("peak_mib"),
                     fmt(r["peak_fwd_bwd_mib"], ".1f"), fmt(r["static_mib"], ".1f"), fmt(r["warmup_s"], ".0f"),
                     fmt(r["loss_first"], ".5f"), r["sites_rewritten"] or "-",
                     fmt(r["max_loss_diff_vs_eager"], ".1e") or "-", fmt(r["max_loss_diff_vs_inductor"], ".1e") or "-"])
    return markdown(["config", "step", "backend", "tokens", "step ms (p50)", "tokens/s", "step peak MiB (above params + AdamW)",
                     "fwd + bwd peak MiB", "params + AdamW MiB", "warm-up s", "loss[0]", "sites rewritten",
                     "max loss diff vs eager", "max loss diff vs inductor"], body)


CAP_COLUMNS = ("config", "backend", "batch", "seq_len", "tokens", "peak_mib", "static_mib", "total_mib", "fits",
               "cap_mib")


def cap_table(trials: list[dict]) -> str:
    """The ``--cap-mib`` search as markdown (every tried batch, from memory or a CSV), then per
    backend the largest step that fit (and how many times Inductor's); the docs' cap table."""
    body = [[t["backend"], t["batch"], t["tokens"], fmt(t["total_mib"], ".0f"), str(t["fits"])] for t in trials]
    best: dict[str, int] = {}
    for t in trials:
        if str(t["fits"]) == "True":
            best[t["backend"]] = max(best.get(t["backend"], 0), int(t["tokens"]))
    base = best.get("inductor")
    summary = ", ".join(f"{b}: {n} tokens" + (f" ({n / base:.1f}x inductor's)" if base and b != "inductor" else "")
                        for b, n in best.items())
    return markdown(["backend", "batch", "tokens", "MiB in all", "fits"], body) + \
        f"\n\nLargest step that fits: {summary or 'none'}."


def report_cap(results: list[dict], args: argparse.Namespace) -> int:
    """The ``--cap-mib`` search: every trial, and per backend the largest batch that fit."""
    trials = [t for r in results for t in r.get("trials", [])]
    print("\n" + cap_table(trials))
    for r in results:
        if "max_tokens" not in r:
            print(f"{r['config']} / {r['backend']}: failed: {r.get('note', '')}")
    if args.csv:
        harness.write_csv([{c: t.get(c, "") for c in CAP_COLUMNS} for t in trials], args.csv)
        print(f"wrote {len(trials)} rows to {args.csv}")
    if args.plot:
        from benchmarks.plots import plot_model_cap
        name = results[0]["config"]
        c = CONFIGS[name]
        plot_model_cap(trials, args.cap_mib, args.plot,
                       title=f"Llama {c.layers} layer{'s' * (c.layers != 1)}, hidden {c.hidden_size}, vocab {c.vocab_size}, "
                             f"seq {c.seq_len}, {c.dtype}, {args.device.type}")
        print(f"wrote {args.plot}")
    return 0 if all("max_tokens" in r for r in results) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.argument_parser(__doc__)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                   help="default: gpu-1b on an accelerator, cpu-small on cpu")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["eager", "inductor", "chunkce"])
    p.add_argument("--compile", choices=("loss", "model"), default="loss",
                   help="compile a function returning only the loss (logits dead) or the whole model "
                        "(its output, loss and logits, held across backward until the next step)")
    p.add_argument("--step", nargs="+", choices=("train", "eval", "eval-read"), default=["train"],
                   help="the step measured: training; evaluation under no_grad with labels, the logits unread "
                        "(eval) or read after it (eval-read: out.logits.argmax(-1)); the whole model compiled")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="chunkce's chunk_size option; default: the op's automatic size")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones (compilation)")
    p.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (cpu 3)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolate", action="store_true", help="a fresh process per (config, backend)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per isolated run")
    p.add_argument("--cap-mib", type=float, default=None,
                   help="instead of the timed runs: the largest batch whose step fits this many MiB "
                        "(parameters + optimizer state + step peak)")
    p.add_argument("--max-batch", type=int, default=256, help="upper end of the --cap-mib search")
    p.add_argument("--plot", default=None, help="with --cap-mib: PNG of memory against tokens per step")
    p.add_argument("--busy", type=int, default=0,
                   help="also time the steps with this many competing busy processes (benchmarks.busy)")
    p.add_argument("--busy-kind", choices=busy.KINDS, default="matmul",
                   help="the busy process: a 1-thread torch matmul loop, or a pure-Python spin")
    p.add_argument("--csv", default=None)
    isolate.add_result_argument(p)  # child -> parent
    args = p.parse_args(argv)
    args.device = torch.device(args.device) if args.device else harness.default_device()
    cpu = args.device.type == "cpu"
    args.configs = args.configs or (["cpu-small"] if cpu else ["gpu-1b"])
    args.steps = args.steps if args.steps is not None else (3 if cpu else 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.result_json is None:
        harness.print_environment(args.device)
    child = args.result_json is not None
    results = []
    kinds = args.step
    for name, kind, backend in ((n, k, b) for n in args.configs for k in kinds for b in args.backends):
        args.step = kind
        if not child and kind == kinds[0] and backend == args.backends[0]:
            print(f"config {name}: {asdict(CONFIGS[name])}", flush=True)
        if not child:
            print(f"  {name} / {kind} / {backend} ...", flush=True)
        try:
            if args.isolate:
                result = run_isolated(name, backend, args)
            elif args.cap_mib:
                result = search_cap(name, backend, args)
            else:
                result = (run_one if kind == "train" else run_eval)(name, backend, args)
        except Exception as e:  # noqa: BLE001 - one failing backend must not end the sweep
            message = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"  {name} / {kind} / {backend} failed: {message}", flush=True)
            result = {"config": name, "backend": backend, "step": kind, "note": message}
        results.append(result)
        harness.release_memory(args.device)
        if args.csv and not child and not args.cap_mib:  # after each run: a sweep cut short keeps its rows
            harness.write_csv(summarize(results), args.csv)
    if child:
        for result in results:
            isolate.Reporter(args.result_json).record(result)
        return 0 if all("losses" in r for r in results) else 1
    if args.cap_mib:
        return report_cap(results, args)
    rows = summarize(results)
    print("\n" + step_table(rows))
    if args.busy:
        print("\n" + busy.busy_table(rows))
    if args.csv:
        print(f"\nwrote {len(rows)} rows to {args.csv}")
    return 0 if all(r.get("losses") for r in results) else 1  # every backend must run


if __name__ == "__main__":
    sys.exit(main())
