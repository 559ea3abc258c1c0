"""The package's layering: the op never imports the graph pass, the pass never the entry points.

    compile_pass/op/      the op (public function, custom ops, loops, gradient products, kernels,
                          kernel runner, chunking, settings)
    compile_pass/graph/   the pass (nodes, forms, spellings, sites, dtype chains, scale, refusals, guard,
                          diagnostics, rewrite, driver, returned_logits, report, publish)
    compile_pass/lazy_logits/  returned logits at run time (recipe, staleness, tensor, wrap)
    compile_pass/*.py     the entry points (backend, pre_grad, explain) and what they share

Read from the source (every ``import`` statement, at any depth), so a lazy import
inside a function counts too. Every module is small enough to read at once (at most
300 lines), and each module of ``graph/`` and ``lazy_logits/`` is listed in its ``__init__.py``.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "compile_pass"
# What each sub-package may import of the project (besides itself).
ALLOWED = {
    "op": (),
    "lazy_logits": (),
    "graph": ("compile_pass.op", "compile_pass.lazy_logits", "compile_pass.options"),
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
    files = sorted((PACKAGE / package).glob("*.py"))
    assert files, f"no modules in {own}"
    for path in files:
        for name in _project_imports(path):
            # "compile_pass" alone is importing the package root, which imports the entry points.
            assert any(name == a or name.startswith(a + ".") for a in allowed), (
                f"{path.relative_to(PACKAGE.parent)} imports {name}; {own} may import only {allowed}")


def test_every_module_is_in_a_layer():
    """A new top-level module must be an entry point or shared by them, never a sub-package's helper."""
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == {"__init__", "backend", "pre_grad", "explain", "options", "dynamo_scope", "cache_key", "memory"}
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and not path.name.startswith("__")} == {
        "op", "graph", "lazy_logits"}


MAX_LINES = 300


def test_no_module_is_over_300_lines():
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split where one holds two things): {long}"


@pytest.mark.parametrize("package", ["graph", "lazy_logits"])
def test_the_package_lists_its_modules(package):
    listed = (PACKAGE / package / "__init__.py").read_text()
    modules = {path.name for path in (PACKAGE / package).glob("*.py")} - {"__init__.py"}
    assert {name for name in modules if f"    {name} " not in listed} == set()


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
