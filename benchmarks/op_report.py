"""How the op benchmark's rows read: markdown tables (``benchmarks.tables``).

    print(op_table(rows))   # one case, every provider, full mode: the docs' op table
    report(rows)            # what ``bench_op`` prints: per mode when several, then op_table per case
    print(targets_table(rows))  # the targets against the measured values

    python -m benchmarks.op_report op.csv [--targets]   # the same from a bench_op CSV

``rows`` are ``bench_op``'s (``COLUMNS``), from memory or read back from its CSV.
"""

from __future__ import annotations

from benchmarks.tables import fmt, markdown, num, pivot, ratio

ERRORS = ("loss_err", "grad_hidden_err", "grad_weight_err")


def _value(rows: list[dict], impl: str, metric: str, runs: tuple[str, ...], mode: str = "full") -> float | None:
    """The p50 of ``impl``'s ``metric`` in the first of ``runs`` that has it (rows from memory or a CSV)."""
    for run in runs:
        for r in rows:
            if r["impl"] == impl and r["run"] == run and r["metric"] == metric and r["mode"] == mode:
                return num(r["p50"])
    return None


def op_table(rows: list[dict], compiled: str = "unfused-compiled", floor: str | None = None) -> str:
    """One case's providers, ``full`` mode, as markdown: time, memory, errors, ratios (the docs' op table).
    ``floor``: the x floor column's reference; None = ``floor-four`` (the four matmuls on the
    whole shape) where it ran, else ``floor-recompute``."""
    if floor is None:
        floor = "floor-four" if any(r["impl"] == "floor-four" for r in rows) else "floor-recompute"
    t_base, t_floor = _value(rows, compiled, "time", ("speed",)), _value(rows, floor, "time", ("speed",))
    w_base = _value(rows, compiled, "beyond_grads", ("memory",))
    body = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        bad = next((r for r in mine if r["metric"] in ("skipped", "failed")), None)
        t = _value(rows, impl, "time", ("speed",))
        if bad and t is None:
            body.append([f"`{impl}`", f"{bad['metric']}: {bad['note']}", *[""] * 8])
            continue
        peak, beyond, rss = (_value(rows, impl, m, ("memory",)) for m in ("peak", "beyond_grads", "rss_peak"))
        errs = [_value(rows, impl, m, ("memory", "error")) for m in ERRORS]
        body.append([f"`{impl}`", fmt(t, ".0f"), ratio(t, t_base), ratio(t, t_floor), fmt(peak, ".0f"),
                     fmt(beyond, ".0f"), ratio(beyond, w_base, ".3f"), fmt(rss, ".0f"),
                     " / ".join(f"{e:.1e}" for e in errs) if None not in errs else "-",
                     next((r["note"] for r in mine if r.get("note")), "")])
    return markdown(["provider", "ms", "x compiled", "x floor", "peak MiB", "beyond grads MiB", "x compiled",
                     "peak RSS MiB", "error vs fp64: loss / grad_hidden / grad_weight", "note"], body)


def report(rows: list[dict], baseline: str = "unfused-compiled") -> None:
    keys = ("shape", "tokens", "chunk_size", "mode")

    def ratio_cell(spec):
        def render(row, base):
            if row["metric"] in ("failed", "skipped"):
                return row["metric"]
            text = fmt(row["p50"], spec)
            if base is not None and row is not base and ratio(row["p50"], base.get("p50")):
                text += f" ({ratio(row['p50'], base['p50'])})"
            return text
        return render

    modes = {r["mode"] for r in rows if r["run"] == "speed"}
    if modes - {"full"}:  # per mode, when modes other than full were run
        tables = [("speed", "time", f"speed: ms per call, median (x = vs {baseline})", ".1f"),
                  ("memory", "peak", f"memory: peak MiB above the inputs (x = vs {baseline})", ".1f"),
                  ("memory", "retained", "memory: MiB a forward keeps for backward", ".1f")]
        for run, metric, title, spec in tables:
            selected = [r for r in rows if r["run"] == run and r["metric"] in (metric, "failed")]
            if not any(r["metric"] == metric for r in selected):
                continue
            header, body = pivot(selected, keys, "impl", ratio_cell(spec), baseline=baseline)
            print(f"\n{title}\n\n{markdown(header, body)}")
    for key in dict.fromkeys((r["shape"], r["tokens"], r["chunk_size"]) for r in rows):
        case_rows = [r for r in rows if (r["shape"], r["tokens"], r["chunk_size"]) == key]
        print(f"\nfull forward + backward, {key[0]} N={key[1]} chunk={key[2]} "
              f"(x compiled: vs unfused-compiled; x floor: vs floor-four, else floor-recompute)\n")
        print(op_table(case_rows))
    failed = [(r["impl"], r["run"], r["note"]) for r in rows if r["metric"] == "failed"]
    for impl, run, note in dict.fromkeys(failed):
        print(f"failed: {impl} {run}: {note}")


# ---------------------------------------------------------------- the time targets

WORKING_SET_MIB = 8.0  # the recompute op's and grads-in-forward's working set beyond the gradients


def targets_table(rows: list[dict]) -> str:
    """The time targets against the measured values, one line per (target, shape), from
    ``bench_op`` rows (``full`` mode; providers ``chunkce``, ``chunkce-compiled``,
    ``chunkce-gif``, ``floor-four``, ``unfused-compiled``, ``torch-lce-compiled``)."""
    body = []
    for shape, tokens in dict.fromkeys((r["shape"], r["tokens"]) for r in rows):
        case = [r for r in rows if (r["shape"], r["tokens"]) == (shape, tokens)]
        hidden, vocab = int(case[0]["hidden"]), int(case[0]["vocab"])
        name = f"{tokens} x {hidden} x {vocab}"

        def get(impl: str, metric: str) -> float | None:
            return _value(case, impl, metric, ("speed",) if metric == "time" else ("memory",))

        def line(target: str, measured: str, met: bool | None) -> None:
            body.append([target, name, measured, "-" if met is None else ("met" if met else "**missed**")])

        ws, gif_ws = get("chunkce", "beyond_grads"), get("chunkce-gif", "beyond_grads")
        t, t_backend, t_gif = get("chunkce", "time"), get("chunkce-compiled", "time"), get("chunkce-gif", "time")
        t_floor, t_unfused, t_lce = get("floor-four", "time"), get("unfused-compiled", "time"), get("torch-lce-compiled", "time")
        peak, peak_lce = get("chunkce", "peak"), get("torch-lce-compiled", "peak")

        def ratio_of(a, b):
            return None if a is None or b is None else a / b

        line(f"chunkce working set <= {WORKING_SET_MIB:.0f} MiB", fmt(ws, ".1f") + " MiB" if ws is not None else "-",
             None if ws is None else ws <= WORKING_SET_MIB)
        r = ratio_of(t, t_floor)
        line("chunkce time <= 1.05x floor-four" + ("" if hidden >= 1024 else " (H < 1024: not a target)"),
             f"{r:.2f}x" if r else "-", None if r is None or hidden < 1024 else r <= 1.05)
        r, m = ratio_of(t, t_lce), ratio_of(peak, peak_lce)
        line("chunkce faster than torch-lce-compiled, peak no more",
             f"time {r:.2f}x, peak {m:.2f}x" if r and m else "-", None if r is None or m is None else r < 1 and m <= 1)
        r = ratio_of(t_gif, t_unfused)
        line("chunkce-gif time <= 1.05x unfused-compiled", f"{r:.2f}x" if r else "-", None if r is None else r <= 1.05)
        line(f"chunkce-gif working set <= {WORKING_SET_MIB:.0f} MiB", fmt(gif_ws, ".1f") + " MiB" if gif_ws is not None else "-",
             None if gif_ws is None else gif_ws <= WORKING_SET_MIB)
        r = ratio_of(t_backend, t)
        line("chunkce-compiled time <= 1.02x chunkce", f"{r:.3f}x" if r else "-", None if r is None else r <= 1.02)
    return markdown(["target", "shape N x H x V", "measured", ""], body)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.op_report CSV [--targets]``: a ``bench_op`` CSV's op tables
    (every case), or the time targets table."""
    import argparse
    import csv

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--targets", action="store_true", help="the time targets against the measured values")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if args.targets:
        print(targets_table(rows))
    else:
        report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
