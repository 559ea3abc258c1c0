"""Reads benchmark: RL, DPO and metric reads of a Llama's returned logits, stock Inductor vs chunkce.

    python -m benchmarks.bench_reads                                   # every step, cpu-reads
    python -m benchmarks.bench_reads --steps grpo eval-argmax --configs cpu-micro
    python -m benchmarks.bench_reads --labels       # every forward with labels (a loss in the graph)

The whole model is compiled (``torch.compile(model, backend=...)``), a fresh process per (config,
step, backend) (``benchmarks.isolate``). The RL and DPO forwards are called without labels, as TRL
calls them, the evaluation forward with labels (``--labels`` / ``--no-labels``: every forward).
The steps are the user code of ``benchmarks/rl_steps.py`` (TRL's ``selective_log_softmax`` and
``entropy_from_logits``):

    grpo          fp32: an old-policy forward under no_grad, then the policy's: ``logits[:, :-1]``,
                  ``div_(0.7)``, log-probs, entropy, a clipped-ratio loss with an entropy bonus, backward
    grpo-bf16     bf16 parameters, a per-token temperature ``logits / t.clamp(min=1e-8).unsqueeze(-1)``
    eval-argmax   no_grad: the forward, ``out.logits.argmax(-1)``
    dpo           a reference forward under no_grad, the policy's (chosen then rejected halves), TRL's
                  sigmoid loss, its metrics (``argmax(-1) == labels``, ``logits[mask].mean()``), backward
    generate      ``model.compile(backend=...)``, then greedy ``generate()`` of 32 tokens from 64-token
                  prompts (tokens: the prompts'; the loss column compares the generated ids)

Peak: measured (``compile_pass.memory.PeakMemory``) around one whole step after the warm-up,
gradients freed before it, above the parameters; time: the median of ``--repeats`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks import harness, isolate
from benchmarks.bench_model import CONFIGS as MODEL_CONFIGS
from benchmarks.bench_model import DTYPES, ModelConfig, build
from benchmarks.tables import fmt, markdown, ratio

MiB = harness.MiB
CONFIGS = {
    **{name: MODEL_CONFIGS[name] for name in ("cpu-micro", "cpu-small", "gpu-1b")},
    "cpu-reads": ModelConfig(32000, 128, 344, 1, 4, 4, batch=4, seq_len=256, dtype="fp32"),
}
STEPS = ("grpo", "grpo-bf16", "eval-argmax", "dpo", "generate")
WITH_LABELS = {"grpo": False, "grpo-bf16": False, "eval-argmax": True, "dpo": False, "generate": False}
GENERATED = 32  # new tokens of a generate step (greedy, from the first 64 tokens of each row)
BACKENDS = ("inductor", "chunkce")


def make_step(kind: str, compiled, ids: torch.Tensor, labels: bool):
    """One ``kind`` step of ``compiled`` on ``ids`` ``[B, T]``: returns its loss (a float)."""
    from benchmarks.rl_steps import dpo_loss, eval_argmax, grpo_loss, token_log_probs

    def forward():
        return compiled(input_ids=ids, labels=ids) if labels else compiled(input_ids=ids)

    gen = torch.Generator().manual_seed(1)
    batch, seq = ids.shape
    mask = torch.ones(batch, seq - 1, dtype=torch.bool, device=ids.device)
    mask[:, : seq // 4] = False  # the prompt
    if kind.startswith("grpo"):
        advantages = torch.randn(batch, generator=gen).to(ids.device)
        dtype = next(compiled.parameters()).dtype
        temperature = 0.7 if kind == "grpo" else (torch.rand(batch, seq - 1, generator=gen) + 0.5).to(ids.device, dtype)

        def step():
            with torch.no_grad():
                old_logps = token_log_probs(forward().logits, ids, temperature)
            loss = grpo_loss(forward().logits, ids, old_logps, advantages, mask, temperature)
            loss.backward()
            return float(loss.detach())
    elif kind == "generate":
        def step():  # the "loss" is the sum of the generated ids: equal when the tokens are
            with torch.no_grad():
                out = compiled.generate(ids, max_new_tokens=GENERATED, min_new_tokens=GENERATED, do_sample=False,
                                        pad_token_id=0, use_cache=True)
            return float(out[:, ids.shape[1]:].sum())
    elif kind == "eval-argmax":
        def step():
            with torch.no_grad():
                out = forward()
                eval_argmax(out.logits)
                return float(out.loss) if out.loss is not None else 0.0
    else:
        def step():
            with torch.no_grad():
                reference_logits = forward().logits
            loss, metrics = dpo_loss(forward().logits, reference_logits, ids, mask)
            loss.backward()
            return float(loss.detach())
    return step


def run_one(config_name: str, kind: str, backend: str, args: argparse.Namespace) -> dict:
    """One (config, step, backend) in this process."""
    config = CONFIGS[config_name]
    if kind == "grpo-bf16":
        config = dataclasses.replace(config, dtype="bf16")
    torch._dynamo.reset()
    model, ids = build(config, args.device, args.seed)
    if kind == "dpo":
        ids = torch.cat([ids, ids.flip(1)])  # chosen, rejected
    if backend == "chunkce":
        import compile_pass  # noqa: F401 - registers the backend
    if kind == "generate":  # compiled in place: generate() calls the module itself
        ids = ids[:, :64]
        model.eval()
        model.compile(backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    labels = WITH_LABELS[kind] if args.labels is None else args.labels
    step = make_step(kind, compiled, ids, labels)
    losses = []
    start = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(step())
    harness.synchronize(args.device)
    warmup_s = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    harness.release_memory(args.device)
    with harness.PeakMemory(args.device) as mem:
        losses.append(step())
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        harness.synchronize(args.device)
        begin = time.perf_counter()
        losses.append(step())
        harness.synchronize(args.device)
        times.append((time.perf_counter() - begin) * 1e3)
    return {"config": config_name, "step": kind, "backend": backend, "labels": labels,
            "dtype": config.dtype, "tokens": ids.numel(), "vocab": config.vocab_size,
            "logits_mib": ids.numel() * config.vocab_size * torch.finfo(DTYPES[config.dtype]).bits / 8 / MiB,
            "peak_mib": mem.peak_bytes / MiB, "step_ms": harness.Stats.of(times).p50, "warmup_s": warmup_s,
            "losses": losses}


def run_isolated(config_name: str, kind: str, backend: str, args: argparse.Namespace) -> dict:
    child = isolate.run(["-m", "benchmarks.bench_reads", "--configs", config_name, "--steps", kind,
                         "--backends", backend, "--device", str(args.device), "--warmup", str(args.warmup),
                         "--repeats", str(args.repeats), "--seed", str(args.seed),
                         *(() if args.labels is None else ("--labels" if args.labels else "--no-labels",))],
                        timeout=args.run_timeout)
    if not child.records:
        return {"config": config_name, "step": kind, "backend": backend, "note": f"no result ({child.status})"}
    return child.records[0]


def table(results: list[dict]) -> str:
    """Per (config, step): each backend's peak and time, with the ratio to Inductor's."""
    base = {(r["config"], r["step"]): r for r in results if r["backend"] == "inductor" and "peak_mib" in r}
    body = []
    for r in results:
        if "peak_mib" not in r:
            body.append([r["config"], r["step"], r["backend"], "", f"failed: {r.get('note', '')}", "", "", ""])
            continue
        b = base.get((r["config"], r["step"]))
        other = b if b is not None and b is not r else None
        loss_diff = max(abs(x - y) for x, y in zip(r["losses"], other["losses"])) if other else None
        body.append([r["config"], r["step"], r["backend"], r["tokens"],
                     fmt(r["peak_mib"], ".1f") + (f" ({ratio(r['peak_mib'], b['peak_mib'])})" if other else ""),
                     fmt(r["logits_mib"], ".1f"),
                     fmt(r["step_ms"], ".0f") + (f" ({ratio(r['step_ms'], b['step_ms'])})" if other else ""),
                     fmt(loss_diff, ".1e") if loss_diff is not None else "-"])
    return markdown(["config", "step", "backend", "tokens", "step peak MiB (vs inductor)", "[N, V] logits MiB",
                     "step ms p50 (vs inductor)", "max loss diff vs inductor"], body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.argument_parser(__doc__)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                   help="default: gpu-1b on an accelerator, cpu-reads on cpu")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--labels", action=argparse.BooleanOptionalAction, default=None,
                   help="call every forward with labels (or without); default: as the step's code does")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones (compilation)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true", help="no fresh process per run (debugging)")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds per isolated run")
    isolate.add_result_argument(p)
    args = p.parse_args(argv)
    args.device = torch.device(args.device) if args.device else harness.default_device()
    args.configs = args.configs or (["cpu-reads"] if args.device.type == "cpu" else ["gpu-1b"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    child = args.result_json is not None
    if not child:
        harness.print_environment(args.device)
    results = []
    for name, kind, backend in ((n, k, b) for n in args.configs for k in args.steps for b in args.backends):
        if not child:
            print(f"  {name} / {kind} / {backend} ...", flush=True)
        try:
            run = run_one if child or args.in_process else run_isolated
            result = run(name, kind, backend, args)
        except Exception as e:  # noqa: BLE001 - one failing run must not end the sweep
            result = {"config": name, "step": kind, "backend": backend,
                      "note": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        results.append(result)
        if child:
            isolate.Reporter(args.result_json).record(result)
    if not child:
        print("\n" + table(results))
    return 0 if all("peak_mib" in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
