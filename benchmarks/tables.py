"""The one table renderer of the benchmarks: markdown, printed and pasted into the docs alike.

    print(markdown(["provider", "ms"], [["`chunkce`", "12.5"]]))
    header, body = pivot(rows, ("shape", "tokens"), "impl", cell)   # one column per provider

Rows handed to the table builders may come from memory (numbers) or from a CSV file
(strings, ``""`` for missing): :func:`num` reads both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


def cell(value: Any, width: int = 0) -> str:
    """A cell's text: whitespace folded, ``|`` escaped, cut to ``width`` characters (0: whole)."""
    text = " ".join(str("" if value is None else value).split()).replace("|", "\\|")
    return text if not width or len(text) <= width else text[: width - 3] + "..."


def markdown(header: Sequence[Any], body: Iterable[Sequence[Any]], width: int = 0) -> str:
    """A GitHub markdown table; every cell through :func:`cell` (``width``: 0, whole)."""
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(cell(c, width) for c in row) + " |" for row in body])


def num(value: Any) -> float | None:
    """``value`` as a float, None when it is empty or not a number (a CSV's ``""``, ``"failed"``)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def fmt(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, ``""`` when it is no number."""
    number = num(value)
    return "" if number is None else format(number, spec)


def ratio(value: Any, base: Any, spec: str = ".2f") -> str:
    """``"1.23x"``: value / base, ``""`` when either is missing or base is 0."""
    value, base = num(value), num(base)
    return f"{value / base:{spec}}x" if value is not None and base else ""


def pivot(rows: Sequence[dict[str, Any]], row_keys: Sequence[str], column_key: str,
          render: Callable[[dict[str, Any], dict[str, Any] | None], str],
          baseline: str | None = None) -> tuple[list[str], list[list[str]]]:
    """Rows keyed by ``row_keys`` against one column per value of ``column_key``.

    ``render(row, baseline_row)`` renders a cell; ``baseline_row`` is the row of the
    same key whose ``column_key`` equals ``baseline`` (None if absent).
    """
    columns = list(dict.fromkeys(r[column_key] for r in rows))
    grid: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        grid.setdefault(tuple(r[k] for k in row_keys), {})[r[column_key]] = r
    body = []
    for key, by_column in grid.items():
        base = by_column.get(baseline) if baseline is not None else None
        body.append([*key, *(render(by_column[c], base) if c in by_column else "" for c in columns)])
    return [*row_keys, *columns], body
