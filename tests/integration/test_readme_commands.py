"""Every command README.md gives runs here as written, at its size, and prints what the README says of it.

The commands and the numbers are read from the README's text, so a README number that
drifts from what the code prints fails here: the results table's peak step memory of each
backend (within PEAK_MARGIN) and their ratio (within RATIO_MARGIN), the loss agreement (the
script's own OK line at the tolerance the README names, the measured difference within
LOSS_FACTOR of the README's), and each command's "about N minutes" (the command is killed,
and the test fails, past TIME_FACTOR times that: this machine may be busier than the
README's). tokens/s is a timing that varies from run to run: it is not compared.
"""

import re
import shlex
import time
from pathlib import Path

import pytest
from test_example import check_ranks, run_example

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PEAK_MARGIN, RATIO_MARGIN, LOSS_FACTOR, TIME_FACTOR = 0.10, 0.03, 10, 3
PARALLEL = ("ddp", "fsdp2", "tp")
OFFLINE = {"HF_HUB_OFFLINE": "1"}  # the examples use no network; the tokenizer cache goes under tmp_path


def _minutes(paragraph: str) -> int | None:
    found = re.search(r"about (\d+|a) minutes?", paragraph)
    return None if found is None else 1 if found.group(1) == "a" else int(found.group(1))


def readme_commands() -> list[tuple[list[str], int]]:
    """``(argv after the interpreter, stated minutes)`` of each ``.venv/bin/python ... examples/...``
    command of the README, a trailing ``# or a, b`` expanded into one command per ``--parallel``
    value. The minutes are stated in the command's paragraph or the one before it. A command given
    again (the set-up's, after torch's CPU build) is listed once."""
    paragraphs = README.read_text().split("\n\n")
    commands = []
    for i, paragraph in enumerate(paragraphs):
        for span in re.findall(r"\.venv/bin/python [^`&\n]*examples/[^`&\n]*", paragraph):
            command, _, alternatives = span.partition("#")
            argv = shlex.split(command)[1:]
            if any(argv == listed for listed, _ in commands):
                continue
            minutes = _minutes(paragraph) or _minutes(paragraphs[i - 1])
            assert minutes, f"README.md states no 'about N minutes' for {span!r}"
            commands.append((argv, minutes))
            for value in re.findall(r"[\w-]+", alternatives.removeprefix(" or")):
                other = list(argv)
                other[other.index("--parallel") + 1] = value
                commands.append((other, minutes))
    return commands


def _key(argv: list[str]) -> tuple[str, str | None]:
    script = next(a for a in argv if a.startswith("examples/"))
    return script, argv[argv.index("--parallel") + 1] if "--parallel" in argv else None


def run_readme_command(tmp_path, script: str, parallel: str | None = None) -> str:
    """Run the README's command for ``script`` (and ``--parallel``) as written; its stdout."""
    [(argv, minutes)] = [(a, m) for a, m in readme_commands() if _key(a) == (script, parallel)]
    at = argv.index(script)
    start = time.monotonic()
    out = run_example(tmp_path, *argv[at + 1:], launcher=argv[:at], script=ROOT / script, env=OFFLINE,
                      timeout=TIME_FACTOR * 60 * minutes)
    print(f"{' '.join(argv)}: {time.monotonic() - start:.0f} s (README: about {minutes} min)")
    return out


def test_every_readme_command_is_run_here():
    expected = {("examples/train_compiled.py", None), ("examples/train_hf_trainer.py", None),
                *(("examples/train_compiled.py", parallel) for parallel in PARALLEL)}
    assert sorted((_key(argv) for argv, _ in readme_commands()), key=repr) == sorted(expected, key=repr)


def _readme_results() -> dict[str, list[str]]:
    """The README's results table: backend -> its cells after the name."""
    rows = re.findall(r"^\| `(\w+)` \|(.*)\|$", README.read_text(), re.MULTILINE)
    return {name: [cell.strip() for cell in cells.split("|")] for name, cells in rows}


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text, re.MULTILINE)
    assert found, f"{pattern!r} not in:\n{text}"
    return float(found.group(1))


@pytest.mark.slow
@pytest.mark.pinned
def test_the_example_prints_the_readme_results(tmp_path):
    """The set-up command's example, its defaults: each backend's peak, their ratio, the losses' agreement."""
    out = run_readme_command(tmp_path, "examples/train_compiled.py")
    table = _readme_results()
    assert table.keys() == {"inductor", "chunkce"}, table
    printed = re.search(r"^peak step memory MiB\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE)
    assert printed, out
    for backend, peak in zip(("inductor", "chunkce"), map(float, printed.groups())):
        stated = float(table[backend][0].split()[0])
        assert peak == pytest.approx(stated, rel=PEAK_MARGIN), f"{backend}: printed {peak} MiB, README {stated}"
    ratio = _number(r"^peak memory chunkce/inductor: ([\d.]+)x", out)
    assert ratio == pytest.approx(_number(r"\(([\d.]+)x\)", table["chunkce"][0]), abs=RATIO_MARGIN)

    text = README.read_text()
    stated_diff = _number(r"^Per-step losses: at most (\S+) apart", text)
    tolerance = re.search(r"the script fails beyond (\S+)\)", text).group(1)
    diff = _number(rf"^max \|loss diff\| over \d+ steps: (\S+) \(tolerance {re.escape(tolerance)}\): OK$", out)
    assert diff <= LOSS_FACTOR * stated_diff, f"losses {diff} apart, README: at most {stated_diff}"
    assert re.search(r"^chunkce counters: .*'sites_rewritten': 1, .*'logits_lazy': 1", out, re.MULTILINE), out


@pytest.mark.slow
@pytest.mark.pinned
@pytest.mark.parametrize("parallel", PARALLEL)
def test_the_torchrun_command(tmp_path, parallel):
    """What check_ranks asserts, at the README's size; one tokenizer, trained by rank 0 and read by rank 1."""
    out = run_readme_command(tmp_path, "examples/train_compiled.py", parallel)
    check_ranks(out, parallel)
    assert len(list((tmp_path / "cache" / "chunkce").glob("bpe-*.json"))) == 1


@pytest.mark.slow
@pytest.mark.pinned
def test_the_trainer_command(tmp_path):
    """The Trainer example's defaults: chunkce beside stock Inductor, the same losses (the script's
    exit code), the site rewritten, chunkce's training peak the lower."""
    out = run_readme_command(tmp_path, "examples/train_hf_trainer.py")
    peak = {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(chunkce|inductor) +([\d.]+) ", out, re.MULTILINE)}
    assert peak.keys() == {"chunkce", "inductor"} and peak["chunkce"] < peak["inductor"], out
    assert re.search(r"^chunkce: counters .*'sites_rewritten': [1-9]", out, re.MULTILINE), out
    assert re.search(r"^max per-step loss difference vs chunkce: \S+ \(tol \S+\)$", out, re.MULTILINE), out
