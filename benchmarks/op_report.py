"""How the op benchmark's rows read: markdown tables (``benchmarks.tables``).

    print(op_table(rows))   # one case, every provider, full mode: the docs' op table
    report(rows)            # what ``bench_op`` prints: per mode when several, then op_table per case

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
