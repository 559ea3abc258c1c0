"""The sweep over every causal LM transformers registers (``benchmarks/sweep_models.py``)
and its generated table in docs/models.md.

Fast: the committed table lists exactly the installed transformers' causal-LM model
types, with their classes; its totals agree with its rows; it is what the saved
results (``benchmarks/results/sweep_models.json``) render to; it has no ``differs``
and no error that only chunkce hits. Slow: a representative subset runs live (one
training step each, chunkce with aot_eager inside vs stock aot_eager) and must reach
the committed row's outcome and reason key.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import sweep_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

ROW = re.compile(r"^\| (\S+) \| `(\w+)` \| (\w+) \| `?([\w,-]*)`? \| (.*) \|$", flags=re.MULTILINE)

# Plain heads (Llama; GPT-2's tied head and one-shot logging), a soft cap (Gemma 2), scaled
# logits (Cohere, Granite), a mixture of experts (Qwen2-MoE), another head layout (OPT's
# project_out before a tied head), a decoder of an encoder-decoder family (BART).
LIVE = ("llama", "gpt2", "gemma2", "cohere", "granite", "qwen2_moe", "opt", "bart")


def committed_section() -> str:
    doc = sweep_models.DOC.read_text()
    assert sweep_models.BEGIN in doc and sweep_models.END in doc, "docs/models.md lacks the sweep's markers"
    return doc[doc.index(sweep_models.BEGIN): doc.index(sweep_models.END) + len(sweep_models.END)]


def committed_rows() -> dict[str, dict[str, str]]:
    """The first table of the section (the aot_eager sweep): model type -> its cells."""
    section = committed_section().split("Inductor inside chunkce", 1)[0]
    rows = {}
    for model_type, model_class, outcome, key, what in ROW.findall(section):
        assert model_type not in rows, f"{model_type} listed twice"
        rows[model_type] = {"model_class": model_class, "outcome": outcome, "reason_key": "" if key in ("", "-") else key, "what": what}
    return rows


def test_table_lists_exactly_the_installed_causal_lm_architectures():
    rows = committed_rows()
    registry = sweep_models.causal_lm_architectures()
    assert sorted(rows) == sorted(registry), (sorted(set(rows) ^ set(registry)))
    assert {t: r["model_class"] for t, r in rows.items()} == registry
    assert all(r["outcome"] in (*sweep_models.OUTCOMES, sweep_models.PENDING) for r in rows.values())


def test_every_architecture_has_a_result():
    """No ``pending`` row: the sweep reached every architecture (else: ``--resume --write``)."""
    assert [t for t, r in committed_rows().items() if r["outcome"] == sweep_models.PENDING] == []


def test_totals_agree_with_rows():
    rows = committed_rows()
    (line,) = [line for line in committed_section().splitlines() if line.startswith("**Totals**")]
    count = {o: sum(r["outcome"] == o for r in rows.values()) for o in sweep_models.OUTCOMES}
    stated = dict(re.findall(r"(rewritten|differs|refused|graph break|no site|error|not built) (\d+)", line))
    assert {k.replace(" ", "_"): int(v) for k, v in stated.items()} == count, line
    pending = sum(r["outcome"] == sweep_models.PENDING for r in rows.values())
    assert (f"PENDING {pending}" in line) == bool(pending), line
    assert f"{len(rows)} architectures, {len(rows) - count['not_built'] - pending} built" in line
    keys = {}
    for row in rows.values():
        if row["outcome"] == "refused":
            keys[row["reason_key"]] = keys.get(row["reason_key"], 0) + 1
    assert dict((k, int(n)) for k, n in re.findall(r"`([\w,-]+)` (\d+)", line)) == keys, line


def test_table_is_what_the_saved_results_render_to():
    results = sweep_models.load_results()
    assert results["aot_eager"], f"{sweep_models.RESULTS} is missing or empty"
    assert sweep_models.render(results) == committed_section(), "run python -m benchmarks.sweep_models --render --write"


def test_no_row_differs_and_no_error_is_chunkce_only():
    """A rewritten site whose loss or gradients differ from stock, or a compile only chunkce
    fails, is a bug of the pass: the sweep must find none."""
    rows = sweep_models.load_results()["aot_eager"]
    bugs = {t: sweep_models._what(r) for t, r in rows.items()
            if r["outcome"] == "differs" or (r["outcome"] == "error" and not r.get("stock_fails"))}
    assert bugs == {}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", LIVE)
def test_live_outcome_equals_the_committed_row(model_type):
    expected = committed_rows()[model_type]
    row = sweep_models.run_architecture(model_type)
    assert (row["outcome"], row.get("reason_key") or "") == (expected["outcome"], expected["reason_key"]), row
    if row["outcome"] == "rewritten":  # proven on the graph and against stock inside run_architecture
        assert row["max_abs_diff"] < 1e-4 and row["sites"] >= 1, row
