"""The sweep's tables, docs/tables/sweep_<family>.md (``python -m benchmarks.sweep_models [--family F] --write``)
against the installed transformers and against live runs.

When the installed transformers is the version a table was generated with, the table
lists exactly its registry's model types (causal LM, seq2seq, masked LM, image-text-to-text,
speech seq2seq), with their classes, and none differs; with another version (pyproject
admits a range), the architectures run live here are still registered, with the table's
classes. A representative subset of each family runs live, one
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

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "docs" / "tables"
OUTCOMES = ("rewritten", "differs", "refused", "graph_break", "no_site", "error", "not_built")
ROW = re.compile(r"^\| (\S+) \| `(\w+)` \| (\w+) \| `?([\w,-]*)`? \| (.*) \|$", flags=re.MULTILINE)
# family -> the transformers registry its section lists (benchmarks.tiny_families.FAMILIES)
REGISTRIES = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}

# Causal: plain heads (Llama; GPT-2's tied head and one-shot logging), a soft cap (Gemma 2),
# scaled logits (Cohere, Granite), a mixture of experts (Qwen2-MoE), another head layout (OPT's
# project_out before a tied head), a decoder of an encoder-decoder family (BART). The other
# families: BART's and Marian's final_logits_bias, T5, masked LMs' transform before the decoder,
# LLaVA's and Qwen2-VL's image tokens, Whisper's audio features.
LIVE = {
    "causal_lm": ("llama", "gpt2", "gemma2", "cohere", "granite", "qwen2_moe", "opt", "bart"),
    "seq2seq": ("bart", "marian", "t5"),
    "masked_lm": ("bert", "roberta"),
    "image_text": ("llava", "qwen2_vl"),
    "speech": ("whisper",),
}
CASES = [(family, model_type) for family, types in LIVE.items() for model_type in types]


def committed_section(family: str = "causal_lm") -> str:
    path = TABLES / f"sweep_{family}.md"
    assert path.is_file(), f"no {path.relative_to(ROOT)}: python -m benchmarks.sweep_models --family {family} --write"
    return path.read_text()


def committed_rows(family: str = "causal_lm") -> dict[str, dict[str, str]]:
    """The first table of the family's section: model type -> its cells."""
    section = committed_section(family).split("Inductor inside chunkce", 1)[0]
    rows = {}
    for model_type, model_class, outcome, key, what in ROW.findall(section):
        assert model_type not in rows, f"{model_type} listed twice"
        rows[model_type] = {"model_class": model_class, "outcome": outcome,
                            "reason_key": "" if key in ("", "-") else key, "what": what}
    return rows


def installed_registry(family: str = "causal_lm") -> tuple[str, dict[str, str]]:
    import transformers
    from transformers.models.auto import modeling_auto

    return transformers.__version__, dict(getattr(modeling_auto, REGISTRIES[family]))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(REGISTRIES))
def test_table_agrees_with_the_installed_registry(family):
    rows = committed_rows(family)
    assert all(r["outcome"] in (*OUTCOMES, "pending") for r in rows.values()), rows
    assert not [t for t, r in rows.items() if r["outcome"] == "differs"], "a rewrite unequal to stock"
    (built_with,) = re.findall(r"transformers ([\w.+-]+);", committed_section(family))
    version, registry = installed_registry(family)
    if version == built_with:  # the same registry: the table is all of it, nothing else
        assert sorted(rows) == sorted(registry), sorted(set(rows) ^ set(registry))
        assert {t: r["model_class"] for t, r in rows.items()} == registry
    # Any version: what runs live below is registered, with the class the table names.
    live = LIVE[family]
    assert {t: registry.get(t) for t in live} == {t: rows[t]["model_class"] for t in live}, (version, built_with)


@pytest.fixture(scope="session")
def live_dir(tmp_path_factory) -> Path:
    """A folder all of the session's pytest-xdist workers share (their base temps' parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def live_family_rows(family: str, live_dir: Path) -> dict[str, dict]:
    """The benchmark's rows of ``family``'s :data:`LIVE` types, run once a session whichever worker asks
    first (a fresh process, the sweep's own; the other workers wait for its file and read it)."""
    from filelock import FileLock

    out = live_dir / f"sweep_live_{family}.json"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
            written = out.with_suffix(".part.json")
            done = subprocess.run([sys.executable, "-m", "benchmarks.sweep_models", "--family", family,
                                   "--only", *LIVE[family], "--rows", str(written)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
            written.replace(out)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("family", "model_type"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_live_outcome_equals_the_committed_row(family, model_type, live_dir):
    row = live_family_rows(family, live_dir)[model_type]  # every one ran: a missing row fails here
    assert row["outcome"] != "differs", row  # a rewrite unequal to stock, or not proven on the graph
    assert row["outcome"] != "error" or row.get("stock_fails"), row  # an error only chunkce hits
    expected = committed_rows(family)[model_type]
    assert (row["outcome"], row.get("reason_key") or "") == (expected["outcome"], expected["reason_key"]), row
    if row["outcome"] == "rewritten":  # proven on the graph and against stock inside run_architecture
        assert row["max_abs_diff"] < 1e-4 and row["sites"] >= 1, row
