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
- docs/design.md's module map lists exactly the modules of ``compile_pass/``, each with its
  docstring's first line (generated: ``python tests/test_docs_names.py``), and its walk of one
  training step names each module once;
- ``compile_pass.__all__`` (what docs/api.md calls importable from ``compile_pass``) resolves;
- in each docstring and comment of ``compile_pass/``, a dotted name that starts at the package
  (``compile_pass.graph.stages.tolerant``) or at one of its sub-packages (``op.tiling.resolve_tiles``,
  ``graph.find.unmatched_projections``) imports and resolves, module then attributes; and a dotted
  name ending in a function or class the package defines (``x.cast_chains``) starts at the module
  that defines it.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
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


def _summary(path: Path) -> str:
    """The first line of a module's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def module_map(folder: Path = PACKAGE, depth: int = 0) -> list[str]:
    """docs/design.md's module map of ``folder``: each module with its docstring's first line, then
    each sub-package, indented two spaces a level (``python tests/test_docs_names.py`` prints it)."""
    lines = [f"{'  ' * depth}{folder.name}/"]
    modules = sorted(folder.glob("*.py"))
    width = max(len(path.name) for path in modules) + 2
    lines += [f"{'  ' * (depth + 1)}{path.name:<{width}}{_summary(path)}".rstrip() for path in modules]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        lines += module_map(sub, depth + 1)
    return lines


def _design_module_map() -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    return text.split("## Module map", 1)[1].split("```", 2)[1].strip("\n").splitlines()


def test_design_module_map_is_the_tree():
    """The map lists every module of ``compile_pass/`` with its docstring's first line: it is
    generated (``python tests/test_docs_names.py``), and cannot go stale."""
    expected = module_map()
    assert any(line.strip().startswith("apply.py") for line in expected)  # the check reads the tree
    assert _design_module_map() == expected, "docs/design.md's module map is stale:\n" + "\n".join(expected)


def test_design_walks_a_step_through_every_module_once():
    """docs/design.md's walk of one training step names each module of ``compile_pass/`` exactly
    once (a backticked path: ``compile_pass/x.py``, or ``graph/``, ``op/``, ``lazy_logits/`` ones)."""
    text = (ROOT / "docs" / "design.md").read_text()
    walk = text.split("## One training step, module by module", 1)[1].split("\n## ", 1)[0]
    named = [name if name.startswith("compile_pass/") else f"compile_pass/{name}"
             for name in re.findall(r"`((?:compile_pass/|graph/|op/|lazy_logits/)[\w/]*\.py)`", walk)]
    tree = sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))
    assert sorted(named) == tree, {"twice": sorted({n for n in named if named.count(n) > 1}),
                                   "missing": sorted(set(tree) - set(named)), "unknown": sorted(set(named) - set(tree))}


@pytest.mark.parametrize("name", importlib.import_module("compile_pass").__all__)
def test_everything_in_all_is_importable(name):
    import compile_pass

    assert getattr(compile_pass, name) is not None


if __name__ == "__main__":
    print("\n".join(module_map()))


SUBPACKAGES = {path.parent.name for path in PACKAGE.rglob("__init__.py")} - {"compile_pass"}
_OUTSIDE = {"F", "torch", "nn", "chunkce"}  # torch's names and the op's namespace (``chunkce.linear_cross_entropy:``)
_DOTTED = re.compile(r"(?<![\w./])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of ``source``."""
    tree = ast.parse(source)
    texts = [(node.body[0].lineno, node.body[0].value.value) for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
             and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
             and isinstance(node.body[0].value.value, str)]
    texts += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT]
    return texts


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attr in parts[end:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _defined_names() -> dict[str, set[str]]:
    """Top-level functions and classes of the package, by name: the modules defining each."""
    names: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                names.setdefault(node.name, set()).add(module)
    return names


def dead_references(source: str, defined: dict[str, set[str]]) -> list[str]:
    """The dotted names of ``source``'s prose that point nowhere, as ``line: name``."""
    dead = []
    for line, text in _prose(source):
        for dotted in _DOTTED.findall(text):
            first, last = dotted.split(".")[0], dotted.split(".")[-1]
            if first == "compile_pass" or first in SUBPACKAGES:
                qualified = dotted if first == "compile_pass" else f"compile_pass.{dotted}"
                if not _resolves(qualified) and not _resolves(f"compile_pass.graph.{dotted}"):
                    dead.append(f"{line}: {dotted}")
            elif first not in _OUTSIDE and last in defined and not any(m.endswith(f".{first}") or m == first for m in defined[last]) \
                    and not _resolves(dotted):
                dead.append(f"{line}: {dotted}")
    return dead


def test_the_check_sees_a_dead_reference():
    source = ('"""See :func:`compile_pass.graph.stages.tolerant`, op.chunking.resolve_tiles and\n'
              ':func:`compile_pass.graph.sites.find_sites`, ``dtype_chains.cast_chains``;\n'
              'graph.find.find_sites and guard.cast_chains are there."""\n'
              'x = 1  # op.function.planned_tiles, op.tiling.resolve_tiles\n')
    assert sorted(dead_references(source, _defined_names())) == [
        "1: compile_pass.graph.sites.find_sites", "1: dtype_chains.cast_chains", "1: op.chunking.resolve_tiles",
        "4: op.function.planned_tiles"]


def test_every_reference_of_the_package_resolves():
    defined = _defined_names()
    dead = {str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
            if (found := dead_references(path.read_text(), defined))}
    assert dead == {}, f"docstrings / comments citing what does not exist: {dead}"
