"""benchmarks/gpu_check.sh's CPU fallback runs end to end and writes its report with every section."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.pinned, pytest.mark.oldest]  # oldest: a GPU machine's torch may be 2.11

ROOT = Path(__file__).parents[2]
SECTIONS = ("## versions and peers", "## GPU tests (pytest -m gpu)", "## calls per op, dry run",
            "## anchors: chunkce (default, grads_in_forward)", "## anchor 16384 x 2048 x 248320",
            "## accelerator tile curve")


def test_cpu_fallback_writes_the_report(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    assert "TIMED OUT" not in report and "s left" not in report, report[-3000:]  # no section cut short
    assert "chunkce backend registered: True" in report
    assert "| `chunkce` |" in report and "| `chunkce-gif` |" in report  # both timed, with peak memory
    assert "largest overhead share" in report
    assert "status: rc=0" in report.split("## accelerator tile curve")[1]
