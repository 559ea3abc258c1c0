"""Every name the docs state as code exists where they say (README.md and docs/*.md).

Read from the docs' text, no network, no compile:

- a dotted ``compile_pass.x.y`` in backticks imports and resolves (module, then attributes);
- a backticked path of the project (``compile_pass/...``, ``tests/...``, ``benchmarks/...``,
  ``examples/...``, or ``graph/x.py`` / ``op/x.py`` / ``lazy_logits/x.py`` inside the package)
  is a file, and ``tests/test_x.py::test_name`` names a test defined in that file; a
  backticked ``test_name`` alone is defined in some test file;
- every ``CHUNKCE_*`` variable is read somewhere in the package or the tests;
- a ``python -m benchmarks.x --flag`` / ``python examples/x.py --flag`` command's script
  exists and declares each ``--flag`` it is given;
- docs/design.md's module map lists exactly the modules of ``compile_pass/`` (no more, no less);
- ``compile_pass.__all__`` (what docs/api.md calls importable from ``compile_pass``) resolves.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = ROOT / "compile_pass"


def _backticked():
    """(doc, line number, text) of every backticked span of the docs."""
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for text in re.findall(r"`([^`]+)`", line):
                yield f"{doc.relative_to(ROOT)}:{number}", text


def _resolve(dotted: str) -> str | None:
    """None when ``dotted`` names a module or an attribute chain of one; else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return f"{'.'.join(parts[:cut])} has no {name}"
            obj = getattr(obj, name)
        return None
    return "no such module"


def test_dotted_names_resolve():
    wrong = [f"{where}: {m} ({why})" for where, text in _backticked()
             for m in re.findall(r"\bcompile_pass(?:\.\w+)+", text) if (why := _resolve(m))]
    assert wrong == []


def _project_file(path: str) -> Path | None:
    if path.startswith(("compile_pass/", "tests/", "benchmarks/", "examples/", "docs/")):
        return ROOT / path
    if path.startswith(("graph/", "op/", "lazy_logits/")):
        return PACKAGE / path
    return None


def test_paths_and_tests_exist():
    wrong = []
    for where, text in _backticked():
        for path, test in re.findall(r"((?:[\w-]+/)+[\w-]+\.py)(?:::(\w+))?", text):
            file = _project_file(path)
            if file is None:
                continue  # not ours (torch/..., a site-packages path)
            if not file.is_file():
                wrong.append(f"{where}: {path} is not a file")
            elif test and not re.search(rf"^\s*def {test}\(", file.read_text(), re.M):
                wrong.append(f"{where}: {path} defines no {test}")
    assert wrong == []


def _named_tests(spans):
    """The (where, text) of the backticked spans that name a test alone (``test_x``)."""
    return [(where, text) for where, text in spans if re.fullmatch(r"test_\w+", text)]


def test_named_tests_exist():
    assert _named_tests([("a", "test_x"), ("b", "tests/t.py"), ("c", "test_x()")]) == [("a", "test_x")]  # the reader
    defined = {m for p in (ROOT / "tests").rglob("*.py") for m in re.findall(r"^\s*def (test_\w+)\(", p.read_text(), re.M)}
    assert [f"{where}: {text}" for where, text in _named_tests(_backticked()) if text not in defined] == []


def test_environment_variables_are_read():
    source = "\n".join(p.read_text() for d in ("compile_pass", "tests") for p in (ROOT / d).rglob("*.py"))
    named = {(where, v) for where, text in _backticked() for v in re.findall(r"\bCHUNKCE_[A-Z_]+", text)}
    assert [f"{where}: {v}" for where, v in sorted(named) if f'"{v}"' not in source] == []


def _commands():
    """(doc:line, script path, arguments) of each documented benchmark / example command,
    a shell continuation (trailing backslash) and an inline code span over several lines joined."""
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        number = 0
        while number < len(lines):
            found = re.search(r"python\S* (?:-m (benchmarks|examples)\.(\w+)|(benchmarks|examples)/(\w+)\.py)(.*)",
                              lines[number])
            if found:
                rest, in_span = found.group(5), lines[number][:found.start()].count("`") % 2
                while rest.rstrip().endswith("\\") and number + 1 < len(lines):
                    number += 1
                    rest = rest.rstrip()[:-1] + " " + lines[number]
                # an inline code span (odd backticks before the command) that goes on to the next lines
                while in_span and "`" not in rest and number + 1 < len(lines):
                    number += 1
                    rest += " " + lines[number]
                folder, name = (found.group(1), found.group(2)) if found.group(1) else (found.group(3), found.group(4))
                yield f"{doc.relative_to(ROOT)}:{number + 1}", ROOT / folder / f"{name}.py", re.split(r"[`#;)]", rest)[0]
            number += 1


def test_documented_commands_have_their_flags():
    commands = list(_commands())
    assert len(commands) > 20  # the reader still finds the docs' commands
    wrong = []
    for where, script, arguments in commands:
        if not script.is_file():
            wrong.append(f"{where}: no {script.relative_to(ROOT)}")
            continue
        source = script.read_text()
        wrong += [f"{where}: {script.relative_to(ROOT)} has no {flag}"
                  for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", arguments) if f'"{flag}"' not in source]
    assert wrong == []


def _design_module_map() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    modules, folder = set(), ""
    for line in block.splitlines():
        entry = re.match(r"(\s*)(\S+)", line)
        if not entry or entry.group(2) == "compile_pass/":
            continue
        name, depth = entry.group(2), len(entry.group(1))
        if name.endswith("/") and depth == 2:
            folder = name
        elif name.endswith(".py"):
            modules.add(name if depth == 2 else folder + name)
    return modules


def test_design_module_map_is_the_tree():
    tree = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert _design_module_map() == tree


@pytest.mark.parametrize("name", importlib.import_module("compile_pass").__all__)
def test_everything_in_all_is_importable(name):
    import compile_pass

    assert getattr(compile_pass, name) is not None
