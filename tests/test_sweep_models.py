"""The sweep's table in docs/models.md (``python -m benchmarks.sweep_models --write``) against
the installed transformers and against live runs.

Fast: when the installed transformers is the version the table was generated with,
the table lists exactly its causal-LM model types, with their classes; with another
version (pyproject admits a range), the architectures run live here are still
registered, with the table's classes. Slow: a representative subset runs live, one
training step each (chunkce with aot_eager inside vs stock aot_eager, proven on the
graph), through the benchmark's own command (``--only ... --rows PATH``: run as a
program, not imported, and nothing it has saved is changed), and each must be no
bug (``differs``, an error only chunkce hits) and reach its committed row's outcome
and reason key. The section's own consistency (totals against rows, no pending row)
is checked by ``--write`` before it writes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- sweep_models: begin -->", "<!-- sweep_models: end -->"
OUTCOMES = ("rewritten", "differs", "refused", "graph_break", "no_site", "error", "not_built")
ROW = re.compile(r"^\| (\S+) \| `(\w+)` \| (\w+) \| `?([\w,-]*)`? \| (.*) \|$", flags=re.MULTILINE)

# Plain heads (Llama; GPT-2's tied head and one-shot logging), a soft cap (Gemma 2), scaled
# logits (Cohere, Granite), a mixture of experts (Qwen2-MoE), another head layout (OPT's
# project_out before a tied head), a decoder of an encoder-decoder family (BART).
LIVE = ("llama", "gpt2", "gemma2", "cohere", "granite", "qwen2_moe", "opt", "bart")


def committed_section() -> str:
    doc = DOC.read_text()
    assert BEGIN in doc and END in doc, "docs/models.md lacks the sweep's markers"
    return doc[doc.index(BEGIN): doc.index(END) + len(END)]


def committed_rows() -> dict[str, dict[str, str]]:
    """The first table of the section (the aot_eager sweep): model type -> its cells."""
    section = committed_section().split("Inductor inside chunkce", 1)[0]
    rows = {}
    for model_type, model_class, outcome, key, what in ROW.findall(section):
        assert model_type not in rows, f"{model_type} listed twice"
        rows[model_type] = {"model_class": model_class, "outcome": outcome,
                            "reason_key": "" if key in ("", "-") else key, "what": what}
    return rows


def installed_registry() -> tuple[str, dict[str, str]]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return transformers.__version__, dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.slow
def test_table_agrees_with_the_installed_causal_lm_registry():
    rows = committed_rows()
    assert all(r["outcome"] in (*OUTCOMES, "pending") for r in rows.values()), rows
    (built_with,) = re.findall(r"transformers ([\w.+-]+);", committed_section())
    version, registry = installed_registry()
    if version == built_with:  # the same registry: the table is all of it, nothing else
        assert sorted(rows) == sorted(registry), sorted(set(rows) ^ set(registry))
        assert {t: r["model_class"] for t, r in rows.items()} == registry
    # Any version: what runs live below is registered, with the class the table names.
    assert {t: registry.get(t) for t in LIVE} == {t: rows[t]["model_class"] for t in LIVE}, (version, built_with)


@pytest.fixture(scope="module")
def live_rows(tmp_path_factory) -> dict[str, dict]:
    """The benchmark's rows for :data:`LIVE`, run now (one fresh worker process, the sweep's own)."""
    out = tmp_path_factory.mktemp("sweep") / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "benchmarks.sweep_models", "--only", *LIVE, "--rows", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", LIVE)
def test_live_outcome_equals_the_committed_row(model_type, live_rows):
    row = live_rows[model_type]  # every one ran: a missing row fails here
    assert row["outcome"] != "differs", row  # a rewrite unequal to stock, or not proven on the graph
    assert row["outcome"] != "error" or row.get("stock_fails"), row  # an error only chunkce hits
    expected = committed_rows()[model_type]
    assert (row["outcome"], row.get("reason_key") or "") == (expected["outcome"], expected["reason_key"]), row
    if row["outcome"] == "rewritten":  # proven on the graph and against stock inside run_architecture
        assert row["max_abs_diff"] < 1e-4 and row["sites"] >= 1, row
