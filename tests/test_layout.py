"""The package's layering: the op never imports the graph pass, the pass never the entry points.

    compile_pass/op/      the ops by op (loss, statistics, vocabulary-parallel) over shared tiling and kernels
    compile_pass/graph/   the pass: find (spellings/, sites, projection) -> plan (guard, the logits' fate) ->
                          apply (returned_logits), then the report (pipeline.py runs them)
    compile_pass/lazy_logits/  returned logits at run time (staleness, tensor, wrap); may import the op
    compile_pass/*.py     the entry points (backend, pre_grad, explain) and what they share

Read from the source (every ``import`` statement, at any depth), so a lazy import
inside a function counts too, and no module imports itself back through others. A module holds one
concept and reads at once (at most 500 lines; compile_pass/graph/ at most 18 modules, compile_pass/
at most 50); docs/design.md's module map lists them (``tests/test_docs_names.py``).

And the prose: docstring and comment lines of ``compile_pass/`` at most 0.35x its code lines,
README.md at most 7000 characters with "Use" before any test mechanics, docs/'s prose (its pages,
not the generated tables of docs/tables/) at most 150 KB, and no issue number or history
narration in the project's code, tests, docs, benchmarks or examples.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "compile_pass"
# What each sub-package may import of the project (besides itself).
ALLOWED = {
    "op": ("compile_pass.torch_internals",),  # the private torch names, below every layer
    "lazy_logits": ("compile_pass.op", "compile_pass.torch_internals"),  # fused reads evaluate through the op
    "graph": ("compile_pass.op", "compile_pass.lazy_logits", "compile_pass.options", "compile_pass.torch_internals"),
}


def _project_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if node.module == "compile_pass")
        elif isinstance(node, ast.ImportFrom):
            pytest.fail(f"{path}: relative import; the layering test reads absolute ones")
    return {name for name in names if name == "compile_pass" or name.startswith("compile_pass.")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_sub_package_imports_only_what_lies_below_it(package):
    own = f"compile_pass.{package}"
    allowed = (own, *ALLOWED[package])
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, f"no modules in {own}"
    for path in files:
        for name in _project_imports(path):
            # "compile_pass" alone is importing the package root, which imports the entry points.
            assert any(name == a or name.startswith(a + ".") for a in allowed), (
                f"{path.relative_to(PACKAGE.parent)} imports {name}; {own} may import only {allowed}")


# What the pass takes of the run-time package: the recipe of returned logits it builds (exported by
# compile_pass.lazy_logits) and the head the recipe holds; the facts both ask (a cast's exactness, the
# vocabulary dim, the reductions the statistics give) live in the op, below both.
GRAPH_FROM_LAZY_LOGITS = {"compile_pass.lazy_logits": {"DROPPED_RECIPE", "DroppedRecipe", "LazyOutputs", "Recipe", "Slot"},
                          "compile_pass.lazy_logits.head": {"Head"}}


def test_the_pass_imports_of_the_run_time_package_only_the_recipe_and_its_head():
    for path in sorted((PACKAGE / "graph").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [(node.module, {alias.name for alias in node.names})]
            else:
                continue
            for module, names in modules:
                if module == "compile_pass" and names and "lazy_logits" in names or (
                        module.startswith("compile_pass.lazy_logits") and (
                        module not in GRAPH_FROM_LAZY_LOGITS or names is None
                        or not names <= GRAPH_FROM_LAZY_LOGITS[module])):
                    pytest.fail(f"{path.relative_to(PACKAGE.parent)} imports {sorted(names or [module])} of "
                                f"{module}; compile_pass.graph may import only {GRAPH_FROM_LAZY_LOGITS}")


def test_every_module_is_in_a_layer():
    """A new top-level module must be an entry point or shared by them, never a sub-package's helper."""
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == {"__init__", "backend", "pre_grad", "explain", "options", "dynamo_scope", "cache_key", "memory",
                   "torch_internals"}
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and not path.name.startswith("__")} == {
        "op", "graph", "lazy_logits"}


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of it that it names in an import statement
    (``from package import name``: the submodule ``name`` when there is one, else the package)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                imported.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                                for a in node.names)
        graph[name] = imported - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "open"
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other)):
                return found
        state[name] = "done"
        path.pop()
        return None

    return next((found for name in sorted(graph) if name not in state and (found := visit(name))), None)


def test_no_import_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]  # the check itself
    assert _cycle(_import_graph()) is None


MAX_LINES = 500
MAX_MODULES = {"graph": 18, "": 50}  # compile_pass/graph/ (sub-packages included), the whole package


def test_no_module_is_over_500_lines():
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split where one holds two things): {long}"


def test_modules_are_few_enough_to_follow():
    """One concept a module: the pass and the package stay within their module counts."""
    for package, most in MAX_MODULES.items():
        count = len(list((PACKAGE / package).rglob("*.py")))
        assert count <= most, f"compile_pass/{package} has {count} modules (at most {most}): merge by concept"


@pytest.mark.parametrize("package", ["op", "graph", "lazy_logits"])
def test_no_exported_name_shadows_a_module(package):
    """``compile_pass.<package>.<module>`` is the module: a name the package imports into
    itself (a function ``wrap`` of ``wrap.py``) would replace the module's attribute."""
    import importlib

    imported = importlib.import_module(f"compile_pass.{package}")
    for path in sorted((PACKAGE / package).glob("*.py")):
        if path.stem != "__init__":
            module = importlib.import_module(f"compile_pass.{package}.{path.stem}")
            assert getattr(imported, path.stem) is module, f"compile_pass.{package}.{path.stem} is not the module"


def test_the_public_names_of_returned_logits_and_reports_are_exported():
    """docs/api.md: everything it lists is importable from ``compile_pass``."""
    import compile_pass
    from compile_pass.graph.report import UnmatchedRecord
    from compile_pass.lazy_logits import DroppedLogits, LazyLogits, StaleLogitsError

    for name, value in {"LazyLogits": LazyLogits, "DroppedLogits": DroppedLogits,
                        "StaleLogitsError": StaleLogitsError, "UnmatchedRecord": UnmatchedRecord}.items():
        assert name in compile_pass.__all__ and getattr(compile_pass, name) is value, name
    assert issubclass(DroppedLogits, LazyLogits) and issubclass(StaleLogitsError, RuntimeError)


ROOT = PACKAGE.parent
PROSE_RATIO = 0.35  # docstring and comment lines at most this share of code lines in compile_pass/
README_CHARS = 7000
DOCS_PROSE_BYTES = 150_000  # docs/*.md; the tables the benchmarks write live in docs/tables/
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
NARRATION = re.compile(r"\bwe used to\b|\bthe old default\b|\bthe issue's\b|\bbefore [\w`.()]+ landed\b", re.IGNORECASE)
SCANNED = ("compile_pass", "tests", "docs", "benchmarks", "examples")


def _prose_and_code(path: Path) -> tuple[int, int]:
    """Lines of a module: prose (inside a module / class / function docstring, or starting with
    ``#``) and code (any other non-blank line)."""
    text = path.read_text()
    docstring_lines = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstring_lines.update(range(first.lineno, first.end_lineno + 1))
    prose = code = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped and (number in docstring_lines or stripped.startswith("#")):
            prose += 1
        elif stripped:
            code += 1
    return prose, code


def test_docstrings_and_comments_are_at_most_035_of_the_code():
    counts = {path: _prose_and_code(path) for path in PACKAGE.rglob("*.py")}
    prose, code = (sum(column) for column in zip(*counts.values()))
    worst = sorted(counts, key=lambda p: counts[p][1] * PROSE_RATIO - counts[p][0])[:5]
    assert prose <= PROSE_RATIO * code, (
        f"compile_pass/ has {prose} prose lines for {code} code lines ({prose / code:.3f} > {PROSE_RATIO}); "
        f"state the contract, move rationale to docs/; most over: "
        f"{[(str(p.relative_to(ROOT)), *counts[p]) for p in worst]}")


def test_readme_is_short_and_starts_with_use():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= README_CHARS, f"README.md is {len(text)} characters (at most {README_CHARS})"
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # the set-up commands may run pytest
    use = re.search(r"^## Use\b", prose, re.MULTILINE)
    assert use, "README.md has no '## Use' heading"
    mechanics = re.search(r"pytest|\btiers?\b", prose, re.IGNORECASE)
    assert mechanics is None or mechanics.start() > use.start(), (
        f"README.md mentions {mechanics.group()!r} before 'Use': test mechanics go to tests/README.md")


def test_docs_prose_is_at_most_150_kb():
    pages = {path.name: len(path.read_bytes()) for path in (ROOT / "docs").glob("*.md")}
    assert pages and sum(pages.values()) <= DOCS_PROSE_BYTES, (
        f"docs/*.md hold {sum(pages.values())} bytes (at most {DOCS_PROSE_BYTES}; generated tables go to "
        f"docs/tables/): {sorted(pages.items(), key=lambda item: -item[1])}")


def test_no_issue_numbers_or_history_narration():
    files = [ROOT / "README.md", *(path for folder in SCANNED for path in (ROOT / folder).rglob("*")
                                   if path.is_file() and "__pycache__" not in path.parts
                                   and path.suffix in (".py", ".md", ".txt", ".csv", ".json", ".sh"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {match.group()}"
             for path in files for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in (*ISSUE_NUMBER.finditer(line), *NARRATION.finditer(line))]
    assert found == [], "say what the code does, not its history: " + "; ".join(found)


TESTS = PACKAGE.parent / "tests"
TEST_LAYERS = ("op", "graph", "lazy_logits", "integration")  # the package's layers, then the whole
TOP_LEVEL_TESTS = {"test_layout.py", "test_docs_names.py", "test_names.py", "test_torch_internals.py"}  # shape, names, docs, torch


def test_tests_live_in_their_layer_and_benchmarks_import_no_test():
    stray = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
                   if p.parent.name not in TEST_LAYERS and not (p.parent == TESTS and p.name in TOP_LEVEL_TESTS))
    assert stray == [], f"test modules outside tests/{{{','.join(TEST_LAYERS)}}}/: {stray}"
    importing = sorted(p.name for p in (PACKAGE.parent / "benchmarks").glob("*.py")
                       if re.search(r"^\s*(from tests\b|import tests\b)", p.read_text(), re.M))
    assert importing == [], f"benchmarks import tests/: {importing} (shared code lives in benchmarks/)"
