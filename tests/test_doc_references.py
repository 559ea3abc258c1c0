"""Every ``module.name`` the package's docstrings and comments cite resolves.

Read from the source, no compile: in each docstring and comment of ``compile_pass/``, a dotted
name that starts at the package (``compile_pass.graph.stages.tolerant``) or at one of its
sub-packages (``op.kernels.HeadTransform``, ``graph.find.unmatched_projections``,
``lazy_logits.tensor``) imports and resolves, module then attributes; and a dotted name ending in
a function or class the package defines (``x.cast_chains``) starts at the module that defines it.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "compile_pass"
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
