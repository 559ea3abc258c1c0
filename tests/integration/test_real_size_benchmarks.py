"""The benchmarks at real sizes, at tiny sizes: ``benchmarks.real_heads``, ``benchmarks.budget``,
``benchmarks.predict``, ``benchmarks.real_models`` and ``benchmarks.checkpoint_peaks``.

Fast: the budget's search over a known answer, the predictions that keep a case off a
shared machine, the tables written from results files (resuming, the latest record of a
case, a case not run), and the run's case list. Slow: the published configs against the
models transformers builds from them, and each command end to end at the tiny size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import budget, harness, predict, real_heads
from benchmarks.real_models import REAL_MODELS

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


# ---------------------------------------------------------------- the budget's search


@pytest.mark.parametrize("start", [512, 2560, 3072, 8192, 100_000])
def test_largest_fit_finds_the_largest_multiple_that_fits_from_any_start(start):
    tried = []

    def fits(tokens):
        tried.append(tokens)
        return tokens <= 3000

    assert budget.largest_fit(fits, start, 512, 65536) == 2560
    assert all(t % 512 == 0 and 512 <= t <= 65536 for t in tried)
    assert 2560 in tried and 3072 in tried  # the answer and the next grid point, both measured
    assert len(tried) == len(set(tried)) <= 9  # no point twice; doubling and bisection, not a walk


def test_largest_fit_at_the_ends_of_the_grid():
    assert budget.largest_fit(lambda t: False, 4096, 512, 65536) == 0
    assert budget.largest_fit(lambda t: True, 4096, 512, 65536) == 65536
    assert budget.largest_fit(lambda t: t <= 512, 4096, 512, 65536) == 512
    assert budget.largest_fit(lambda t: t <= 1000, 512, 128, 4096) == 896


def test_largest_fit_settles_a_good_start_in_two_trials():
    for start, answer in ((2560, 2560), (3072, 2560)):  # the answer, or one grid point above it
        tried = []

        def fits(tokens):
            tried.append(tokens)
            return tokens <= 3000

        assert budget.largest_fit(fits, start, 512, 65536) == answer
        assert sorted(tried) == [2560, 3072]


def test_line_start_meets_the_cap_on_the_measured_line():
    # 1000 MiB + 0.5 MiB a token: the cap 5000 MiB is met at 8000 tokens, on a grid of 512: 7680
    assert budget.line_start([(2048, 2024.0), (1024, 1512.0)], 5000.0, 512, 65536) == 7680
    assert budget.line_start([(1024, 1512.0), (2048, 2024.0)], 5000.0, 512, 4096) == 4096
    assert budget.line_start([(1024, 1512.0), (2048, 2024.0)], 1000.0, 512, 65536) == 512
    assert budget.line_start([(1024, 1512.0), (2048, 1512.0)], 5000.0, 512, 65536) is None


# ---------------------------------------------------------------- predictions


def test_predictions_keep_the_whole_logits_off_the_machine_and_let_the_chunked_ops_run():
    gemma, llama = REAL_MODELS["gemma3-1b"], REAL_MODELS["llama3.2-1b"]
    # Inductor's unfused loss at Gemma 3's head, 16384 tokens: the [N, V] logits alone are 16 GiB
    need = predict.op_bytes("unfused-compiled", 16384, gemma.hidden_size, gemma.vocab_size)
    assert need > 16 * GiB
    assert predict.too_big(need, 14.0).startswith(f"needs ~{need / GiB:.1f} GiB")
    for model in REAL_MODELS.values():  # the chunked providers fit every head at 16384 tokens
        for provider in ("chunkce", "floor-recompute", "torch-lce"):
            need = predict.op_bytes(provider, 16384, model.hidden_size, model.vocab_size)
            assert predict.too_big(need, 14.0) is None, (model, provider)
    # the training step at 4096 tokens: the inputs' and logits' bytes order the backends
    assert predict.step_bytes(gemma, 2, 4096, "inductor") > 14 * GiB
    assert predict.step_bytes(llama, 2, 4096, "chunkce") < predict.step_bytes(llama, 2, 4096, "inductor") - 5 * GiB
    assert predict.too_big(predict.step_bytes(llama, 2, 4096, "chunkce"), 14.0) is None


def test_auto_chunker_predicted_chunked_only_where_its_matmul_amplifies_its_inputs_over_8x():
    def working_set(tokens, hidden, vocab):
        return predict.op_bytes("autochunk", tokens, hidden, vocab) - predict.op_bytes("chunkce", tokens, hidden, vocab)

    llama, gemma = REAL_MODELS["llama3.2-1b"], REAL_MODELS["gemma3-1b"]
    # 16384 x 128256 is 7.1x (16384 + 128256) x 2048: refused, so the whole logits
    assert working_set(16384, llama.hidden_size, llama.vocab_size) > 16384 * llama.vocab_size * 4
    # 16384 x 262144 is 13.4x (16384 + 262144) x 1152: chunked into 8
    assert working_set(16384, gemma.hidden_size, gemma.vocab_size) < 16384 * gemma.vocab_size * 4 / 3
    assert working_set(4096, 128, 8192) < working_set(2048, 256, 32768)  # chunked (21x), refused (7.5x)


def test_predicted_step_grows_with_tokens_by_the_logits_for_inductor_only():
    llama = REAL_MODELS["llama3.2-1b"]
    logits = 8192 * llama.vocab_size * 4  # [8192, V] fp32
    for backend, extra in (("inductor", predict.STEP_LOGITS["inductor"] * logits), ("chunkce", 0)):
        grow = predict.step_bytes(llama, 2, 16384, backend) - predict.step_bytes(llama, 2, 8192, backend)
        assert grow == pytest.approx(2 * predict.activations(llama, 8192) + extra)
    # a short step's peak is AdamW's: two temporaries of the embedding, whatever the backend
    assert predict.step_bytes(llama, 2, 512, "chunkce") == predict.step_bytes(llama, 2, 1024, "chunkce")


# ---------------------------------------------------------------- real_heads' table and resumption


def _op(head, tokens, impl, ms, beyond, status="measured", note=""):
    return {"part": "op", "head": head, "tokens": tokens, "impl": impl, "status": status, "ms": ms,
            "peak_mib": beyond + 100, "beyond_grads_mib": beyond, "rss_mib": None, "note": note,
            "env": {"device": "cpu X", "cpu_threads": "2", "torch": "2.13.0+cpu", "transformers": "5.24.0",
                    "commit": "abc1234"}}


def test_op_table_ratios_to_inductor_and_the_floor_and_rows_not_run():
    records = [_op("llama3.2-1b", 4096, "unfused-compiled", 50_000, 2000),
               _op("llama3.2-1b", 4096, "chunkce", 99_000, 47),  # replaced by the later run below
               _op("llama3.2-1b", 4096, "floor-recompute", 100_000, 40),
               _op("llama3.2-1b", 4096, "chunkce", 110_000, 50),
               _op("gemma3-1b", 16384, "unfused-compiled", None, 0, status=predict.OOM,
                   note="needs ~21.3 GiB (predicted; over --mem-cap-gib 14), not run")]
    rows = {line.split("|")[3].strip(): line for line in real_heads.op_table(records).splitlines()[2:]}
    chunkce = [c.strip() for c in rows["`chunkce`"].split("|")]
    assert chunkce[1:9] == ["llama3.2-1b (2048 x 128256, tied)", "4096", "`chunkce`", "110.0", "1.10x", "2.20x",
                            "150", "50"]
    assert chunkce[9] == "0.025x"  # 50 / 2000 MiB of Inductor's working set
    assert "out of memory: needs ~21.3 GiB" in rows["`unfused-compiled`"] and "gemma3-1b" in rows["`unfused-compiled`"]
    page = real_heads.document(records)
    assert "torch 2.13.0+cpu" in page and "commit abc1234" in page and "python -m benchmarks.real_heads" in page
    assert REAL_MODELS["qwen3-0.6b"].source in page


def test_model_table_peak_ratio_and_loss_gap():
    base = {"part": "model", "head": "smollm2-360m", "tokens": 4096, "status": "measured", "static_mib": 800}
    records = [{**base, "impl": "inductor", "step_ms": 20_000, "peak_mib": 4000, "losses": [10.8, 10.5, 10.1]},
               {**base, "impl": "chunkce", "step_ms": 21_000, "peak_mib": 900, "losses": [10.8, 10.5 + 3e-6, 10.1]}]
    line = next(x for x in real_heads.model_table(records).splitlines() if "| chunkce |" in x)
    assert [c.strip() for c in line.split("|")][4:10] == ["21.0", "1.05x", "900", "0.23x", "800", "3.0e-06"]


def test_a_run_skips_cases_it_has_and_predicts_again_those_it_did_not_run(tmp_path):
    args = real_heads.parse_args(["--heads", "llama3.2-1b", "--tokens", "4096", "--providers", "chunkce",
                                  "unfused-compiled", "--backends", "chunkce"])
    todo = real_heads.cases(args)
    assert todo == [("op", "llama3.2-1b", 4096, "chunkce"), ("op", "llama3.2-1b", 4096, "unfused-compiled"),
                    ("model", "llama3.2-1b", 4096, "chunkce")]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        _op("llama3.2-1b", 4096, "chunkce", 1, 1),
        _op("llama3.2-1b", 4096, "unfused-compiled", None, 0, status=predict.OOM))) + "\n")
    records = harness.read_jsonl(str(path))
    assert real_heads.pending(todo, records, redo=False) == todo[1:]
    assert real_heads.pending(todo, records, redo=True) == todo


# ---------------------------------------------------------------- budget's table


def test_budget_summary_takes_the_largest_measured_fit_and_its_timing():
    def trial(backend, tokens, total, kind="trial", **extra):
        return {"kind": kind, "model": "tiny", "layers": 2, "backend": backend, "tokens": tokens,
                "status": "measured", "total_mib": total, **extra}

    records = [trial("inductor", 512, 90), trial("inductor", 1024, 130), trial("chunkce", 2048, 95),
               trial("chunkce", 4096, 120), trial("chunkce", 8192, 160),
               trial("chunkce", 4096, 120, kind="speed", step_ms=2000, tokens_per_s=2048.0),
               {**trial("chunkce", 16384, None), "status": predict.OOM}]
    best = {r["backend"]: r for r in budget.summary(records, "tiny", 2, cap=125)}
    assert best["inductor"]["tokens"] == 512 and best["inductor"]["tokens_per_s"] is None
    assert best["chunkce"]["tokens"] == 4096 and best["chunkce"]["tokens_per_s"] == 2048.0
    args = argparse.Namespace(model="tiny", layers=2, results="r.jsonl", headroom_gib=0.1, granularity=512)
    page = budget.document(records, args, static=22.0, cap=125)
    assert "| chunkce | 4096 | 8.00x | 2.0 | 2048 |" in page
    assert "| chunkce | 8192 | 160 | False |  |" in page
    # checkpointed backends are over Inductor's checkpointed fit; a search stopped at its largest trial, fitting, says >=
    records += [trial("inductor-ckpt", 1024, 100), trial("inductor-ckpt", 2048, 130), trial("chunkce-ckpt", 8192, 110)]
    best = {r["backend"]: r for r in budget.summary(records, "tiny", 2, cap=125)}
    assert not best["chunkce"]["at_least"] and not best["inductor-ckpt"]["at_least"] and best["chunkce-ckpt"]["at_least"]
    page = budget.document(records, args, static=22.0, cap=125)
    assert "| inductor-ckpt | 1024 | 1.00x |" in page and "| chunkce-ckpt | >= 8192 | >= 8.00x |" in page


# ---------------------------------------------------------------- slow: configs and commands


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_published_config_builds_the_model_it_describes(name):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_model import CONFIGS

    config = CONFIGS[f"{name}-2l"].transformers_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = REAL_MODELS[name]
    assert model.lm_head.weight.shape == (real.vocab_size, real.hidden_size)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == real.tied
    assert getattr(config, "final_logit_softcapping", None) is None
    counted = sum(p.numel() for p in model.parameters())
    assert counted == pytest.approx(real.parameters(2), rel=1e-3)


def _run(*argv, tmp_path):
    done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.pinned
def test_real_heads_command_at_the_tiny_head(tmp_path):
    results, table = tmp_path / "r.jsonl", tmp_path / "t.md"
    argv = ["benchmarks.real_heads", "--heads", "tiny", "--tokens", "256", "--providers", "unfused-compiled",
            "chunkce", "--backends", "chunkce", "--steps", "1", "--results", str(results), "--write", str(table)]
    _run(*argv, tmp_path=tmp_path)
    records = harness.read_jsonl(str(results))
    assert [(r["part"], r["impl"], r["status"]) for r in records] == [
        ("op", "unfused-compiled", "measured"), ("op", "chunkce", "measured"), ("model", "chunkce", "measured")]
    op = {r["impl"]: r for r in records if r["part"] == "op"}
    assert op["chunkce"]["beyond_grads_mib"] < op["unfused-compiled"]["beyond_grads_mib"]  # [256, 8192] logits
    assert records[2]["sites_rewritten"] == 1 and len(records[2]["losses"]) >= 3
    text = table.read_text()
    assert "| tiny (128 x 8192) | 256 | `chunkce` |" in text and "| tiny (64 x 4096) | 256 | chunkce |" in text
    out = _run(*argv, tmp_path=tmp_path)  # everything is there: nothing runs again
    assert len(harness.read_jsonl(str(results))) == 3 and "[1/" not in out


@pytest.mark.slow
@pytest.mark.pinned
def test_budget_command_at_the_tiny_model(tmp_path):
    results, table, plot = tmp_path / "b.jsonl", tmp_path / "b.md", tmp_path / "b.png"
    # the cap (13.2 MiB) fits 128 tokens of Inductor's step (12.0 MiB measured) and not 256 (14.5 MiB)
    _run("benchmarks.budget", "--model", "tiny", "--backends", "inductor", "--headroom-gib", "0.006",
         "--granularity", "128", "--max-tokens", "256", "--steps", "1", "--results", str(results),
         "--write", str(table), "--plot", str(plot), tmp_path=tmp_path)
    records = harness.read_jsonl(str(results))
    static, cap = budget.cap_of(argparse.Namespace(model="tiny", layers=2, headroom_gib=0.006))
    trials = {r["tokens"]: r for r in records if r["kind"] == "trial"}
    assert sorted(trials) == [128, 256] and all(r["static_mib"] == pytest.approx(static, rel=0.01)
                                                for r in trials.values())
    assert trials[128]["total_mib"] <= cap < trials[256]["total_mib"]
    # the fitting trial timed its own steps; the misfit did not, and no process of its own timed the fit
    assert trials[128]["tokens_per_s"] > 0 and "tokens_per_s" not in trials[256]
    assert not [r for r in records if r["kind"] == "speed"]
    assert "| inductor | 128 |" in table.read_text() and plot.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.pinned
def test_budget_checkpointed_trial_rewrites_the_head_under_checkpointing(tmp_path):
    results = tmp_path / "b.jsonl"
    _run("benchmarks.budget", "--model", "tiny", "--backends", "chunkce-ckpt", "--headroom-gib", "0.006",
         "--granularity", "128", "--max-tokens", "128", "--steps", "0", "--results", str(results),
         "--write", str(tmp_path / "b.md"), "--plot", "", tmp_path=tmp_path)
    [record] = harness.read_jsonl(str(results))
    assert record["backend"] == "chunkce-ckpt" and record["status"] == "measured" and record["sites_rewritten"] == 1


@pytest.mark.slow  # builds a Hugging Face model
def test_checkpoint_peaks_measures_eager_checkpointing_lowering_the_peak():
    """``benchmarks.checkpoint_peaks``'s child at a tiny Llama, eagerly: checkpointing every layer lowers the
    measured peak (the tool sees what checkpointing saves, so a compiled backend that does not save is real)."""
    from benchmarks import checkpoint_peaks

    def peak(checkpointed: bool) -> float:
        return checkpoint_peaks.one(argparse.Namespace(backend="eager", tokens=256, hidden_size=64, layers=2,
                                                       checkpointed=checkpointed))

    plain, checkpointed = peak(False), peak(True)
    assert 0 < checkpointed < 0.75 * plain, (plain, checkpointed)
