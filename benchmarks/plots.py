"""The benchmark plots (matplotlib, PNG): scaling of every provider, and the model under a memory cap.

    plot_scaling(rows, "docs/img/scaling_cpu.png")        # rows of benchmarks.scaling
    plot_model_cap(rows, cap_mib, "cap.png")             # rows of bench_model --cap-mib
    plot_budget(trials, best, cap_mib, "docs/img/budget_cpu.png")  # records of benchmarks.budget

matplotlib is imported here only (the ``Agg`` backend: no display needed); the
benchmarks run without it when no plot is asked for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

# Line styles: the unfused family dashed, torch's and Inductor's chunkers dotted, chunkce solid.
_STYLE = {"unfused": "--", "autochunk": ":", "torch-lce": "-.", "chunkce": "-", "floor": (0, (1, 3))}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _style(impl: str) -> object:
    return next((s for prefix, s in _STYLE.items() if impl.startswith(prefix)), "-")


def plot_scaling(rows: Sequence[dict], path: str, *, title: str = "", axis: str = "tokens") -> None:
    """Two panels against tokens N (log 2; the vocabulary V with ``axis="vocab"``): working set
    beyond the gradients (MiB) and s per call.

    Every measured point of every provider; a skipped or failed size is simply absent
    (the table beside the plot says why). Working sets under 0.1 MiB are drawn at 0.1
    (log scale).
    """
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(14, 5.4))
    colors = plt.get_cmap("tab20").colors
    for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows)):
        points = sorted((int(r[axis]), float(r["beyond_grads_mib"]), float(r["ms"]))
                        for r in rows if r["impl"] == impl and r["metric"] == "measured")
        if not points:
            continue
        n, mem, ms = zip(*points)
        kwargs = {"label": impl, "linestyle": _style(impl), "marker": "o", "markersize": 4,
                  "color": colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]}
        if not impl.startswith("floor"):
            mem_ax.plot(n, [max(m, 0.1) for m in mem], **kwargs)
        time_ax.plot(n, [t / 1e3 for t in ms], **kwargs)
    label = "tokens N" if axis == "tokens" else "vocabulary V"
    mem_ax.set(yscale="log", xlabel=label, ylabel="MiB beyond the inputs' gradients (allocator peak)",
               title="working set (the floors: no loss, omitted)")
    time_ax.set(yscale="log", xlabel=label, ylabel="s per forward + backward", title="time")
    ticks = sorted({int(r[axis]) for r in rows})
    for ax in (mem_ax, time_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = time_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_model_cap(rows: Sequence[dict], cap_mib: float, path: str, *, title: str = "") -> None:
    """Measured step memory against tokens per step, per backend, with the cap and each backend's largest fit."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((int(r["tokens"]), float(r["total_mib"])) for r in rows
                        if r["backend"] == backend and r.get("total_mib") not in ("", None))
        if not points:
            continue
        tokens, total = zip(*points)
        line, = ax.plot(tokens, total, marker="o", label=backend, linestyle=_style(backend))
        fits = [t for t, m in points if m <= cap_mib]
        if fits:
            ax.axvline(max(fits), color=line.get_color(), alpha=0.4, linestyle=":")
            ax.annotate(f"{backend}: {max(fits)} tokens", (max(fits), cap_mib), textcoords="offset points",
                        xytext=(4, -14 if backend == "inductor" else 6), color=line.get_color(), fontsize=9)
    ax.axhline(cap_mib, color="black", linewidth=1)
    ax.text(ax.get_xlim()[0], cap_mib, f" cap {cap_mib:.0f} MiB", va="bottom", fontsize=9)
    ax.set(xlabel="tokens per training step (batch x sequence)",
           ylabel="MiB: parameters + optimizer state + step peak", title=title or "training step under a memory cap")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget(trials: Sequence[dict], best: Sequence[dict], cap_mib: float, path: str, *, title: str = "") -> None:
    """Three panels, per backend: every trial's memory against tokens per step with the cap, the
    largest step that fit, and the tokens/s of that step (``benchmarks.budget``'s records)."""
    plt = _pyplot()
    fig, (mem_ax, fit_ax, speed_ax) = plt.subplots(1, 3, figsize=(15, 4.8))
    colors = {}
    for backend in dict.fromkeys(r["backend"] for r in (*trials, *best)):
        points = sorted((int(r["tokens"]), float(r["total_mib"]) / 1024) for r in trials if r["backend"] == backend)
        color = f"C{len(colors)}"
        colors[backend] = color
        if points:
            mem_ax.plot(*zip(*points), marker="o", label=backend, linestyle=_style(backend), color=color)
    mem_ax.axhline(cap_mib / 1024, color="black", linewidth=1)
    mem_ax.text(mem_ax.get_xlim()[0], cap_mib / 1024, f" cap {cap_mib / 1024:.1f} GiB", va="bottom", fontsize=9)
    mem_ax.set(xlabel="tokens per training step", ylabel="GiB: parameters + AdamW state + step peak",
               title="every trial")
    mem_ax.grid(True, alpha=0.3)
    mem_ax.legend()
    names = [r["backend"] for r in best]
    for ax, key, label, spec in ((fit_ax, "tokens", "tokens per step that fit", "{:.0f}"),
                                 (speed_ax, "tokens_per_s", "tokens/s at that step", "{:.0f}")):
        values = [float(r[key] or 0) for r in best]
        bars = ax.bar(names, values, color=[colors[n] for n in names])
        for bar, value in zip(bars, values):
            ax.annotate(spec.format(value) if value else "not measured", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=9)
        ax.set(ylabel=label, title=label)
        ax.grid(True, axis="y", alpha=0.3)
    speed_ax.set_title("tokens/s at that step\n(one row a step: attention's cost a token grows with it)", fontsize=10)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


_LONG_RUN_COLOR = {"chunkce": "tab:red", "inductor": "tab:blue", "eager": "tab:gray"}


def plot_long_run(records: Sequence[dict], path: str) -> None:
    """``benchmarks.long_run``'s runs, one column each: the loss curves (held-out loss as markers)
    above the per-step gaps to Inductor, chunkce's and eager's (log scale)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(records), figsize=(6.5 * len(records), 8), squeeze=False, sharex="col")
    for column, record in enumerate(records):
        curve_ax, gap_ax = axes[0][column], axes[1][column]
        losses, reference = record["losses"], record["losses"]["inductor"]
        steps = min(len(v) for v in losses.values())
        x = range(1, steps + 1)
        for backend, series in losses.items():
            on_top = backend == "chunkce"   # dashed over the others: the curves coincide
            curve_ax.plot(x, series[:steps], "--" if on_top else "-", lw=0.8, color=_LONG_RUN_COLOR[backend],
                          zorder=3 if on_top else 2, label=f"{backend} (train)")
            evals = len(record["perplexity"][backend])
            curve_ax.plot(record["eval_steps"][:evals], [math.log(p) for p in record["perplexity"][backend]],
                          "o", ms=4, mfc="none", color=_LONG_RUN_COLOR[backend], label=f"{backend} (held-out)")
            if backend != "inductor":
                gaps = [max(abs(a - b), 1e-9) for a, b in zip(series[:steps], reference[:steps])]
                gap_ax.plot(x, gaps, lw=0.8, color=_LONG_RUN_COLOR[backend], label=f"|{backend} - inductor|")
        s = record["setup"]
        curve_ax.set_title(f"{s['dtype']}: Llama, {s['layers']} layers, hidden {s['hidden_size']}, "
                           f"{s['batch_size']} x {s['seq_len']} tokens a step")
        curve_ax.set_ylabel("loss (held-out: log perplexity)")
        curve_ax.legend(fontsize=8)
        gap_ax.set_yscale("log")
        gap_ax.set_xlabel("step")
        gap_ax.set_ylabel("|loss - Inductor's loss| (equal: at 1e-9)")
        gap_ax.legend(fontsize=8)
    fig.suptitle(f"chunkce, Inductor and eager: same weights, same batches\n(CPU, torch {records[0]['torch']})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
