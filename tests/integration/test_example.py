"""examples/train_compiled.py runs end to end, offline, and prints its summary."""

import codecs
import os
import re
import signal
import subprocess
import sys
import this
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the example in a fresh process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_compiled.py"
TINY = ["--steps", "4", "--warmup", "1", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "600",
        "--hidden-size", "32", "--intermediate-size", "64", "--layers", "1", "--heads", "2"]



def run_example(tmp_path, *args, timeout=600, launcher=(), env=None, script=EXAMPLE):
    """Run ``script`` (under ``launcher``, e.g. torchrun) in a fresh process group; its stdout.

    The whole process group is killed when ``timeout`` s pass (torchrun's ranks included).
    Fails unless it exits 0 and prints no stray profiler lines on stdout or stderr.
    """
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **(env or {})}  # tokenizer cache in tmp
    proc = subprocess.Popen([sys.executable, *launcher, str(script), *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\n{stdout}\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    noise = re.findall(r"^.*profiler_(?:start|stop).*$", stdout + stderr, re.MULTILINE)
    assert not noise, noise     # Kineto's lines under compile_pass.memory on CPU
    return stdout


def check_summary(out):
    assert "per-step loss" in out and "summary (" in out
    for line in ("warm-up s (compile included)", "peak step memory MiB", "tokens/s", "final loss"):
        assert re.search(rf"^{re.escape(line)}\s+\S", out, re.MULTILINE), line


def check_ranks(out, parallel):
    """2 ranks on gloo: both backends train, every rank rewrites and keeps no logits, the losses
    agree, rank 0 alone prints the summary with every rank's peak and counters."""
    assert out.count("per-step loss") == 1, out
    assert f"parallel: {parallel} over 2 ranks (gloo)" in out
    assert re.search(r"^peak step memory MiB\s+[\d.]+\s+[\d.]+$", out, re.MULTILINE), out
    for rank in (0, 1):
        assert re.search(rf"^  rank {rank}\s+[\d.]+\s+[\d.]+$", out, re.MULTILINE), out
        assert re.search(rf"^chunkce counters, rank {rank}: .*'sites_rewritten': [1-9]", out, re.MULTILINE), out
        assert re.search(rf"^chunkce counters, rank {rank}: .*'logits_kept': 0", out, re.MULTILINE), out
    assert re.search(r"^max \|loss diff\| over \d+ steps: \S+ \(tolerance \S+\): OK$", out, re.MULTILINE), out


def test_text_file_one_backend(tmp_path):
    text = tmp_path / "zen.txt"
    text.write_text(codecs.decode(this.s, "rot13") * 8)     # the Zen of Python, ~6.6 kB
    out = run_example(tmp_path, *TINY, "--backend", "inductor", "--text", str(text))
    assert "corpus: " + str(text) in out
    check_summary(out)


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_torchrun_fsdp2_tp(tmp_path):
    """FSDP2 over a 2-D mesh: one data-parallel group of 2 tensor-parallel ranks. ddp, fsdp2 and
    tp run as the README gives them (test_readme_commands.py)."""
    text = tmp_path / "zen.txt"
    text.write_text(codecs.decode(this.s, "rot13") * 8)
    args = [*TINY, "--steps", "3", "--text", str(text), "--parallel", "fsdp2-tp"]
    out = run_example(tmp_path, *args, launcher=TORCHRUN, timeout=240,
                      env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})   # no compile pool per rank
    check_ranks(out, "fsdp2-tp")


def test_parallel_without_torchrun_says_how(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--parallel", "fsdp2"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "torchrun --nproc-per-node 2" in proc.stderr and "--parallel fsdp2" in proc.stderr, proc.stderr
