"""The package's names: state is a type, and one name means one thing.

- No module-level string constant of ``compile_pass/`` (``NAME = "..."``) is compared with
  ``==``, ``!=``, ``in`` or ``not in`` anywhere in the package: a state is an ``Enum`` member or a
  field, never a string compared with another string.
- No name is defined with two meanings: a class, function or module-level name, public or
  private, defined in two modules of the package is the same object (one imports it from the
  other) or an equal constant (the same tuple of functions built twice). Not counted: each
  module's ``log``, dunders (``__all__``), and ``_``, torch.library's name for a function
  registered on an op.
"""

import ast
import importlib
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "compile_pass"


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        trees[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(path.read_text())
    return trees


def _string_constants(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to string literals (``A = "a"``, ``A, B = "a", "b"``)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                pairs = ([(target, node.value)] if not isinstance(target, ast.Tuple) else
                         list(zip(target.elts, node.value.elts)) if isinstance(node.value, ast.Tuple) else [])
                names.update(t.id for t, v in pairs if isinstance(t, ast.Name) and isinstance(v, ast.Constant)
                             and isinstance(v.value, str))
    return names


def _compared_names(tree: ast.Module) -> set[str]:
    """Names (``X`` or ``module.X``) that are an operand of ``==``, ``!=``, ``in`` or ``not in``,
    or an element of a tuple, list or set such an operand is."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            for operand in (node.left, *node.comparators):
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                for item in items:
                    if isinstance(item, ast.Name):
                        names.add(item.id)
                    elif isinstance(item, ast.Attribute):
                        names.add(item.attr)
    return names


def test_the_check_sees_a_string_state():
    tree = ast.parse('LAZY = "lazy"\nOK, NO = "ok", "no"\ndef f(x):\n    return x.fate == LAZY or x in (NO,)\n')
    assert _string_constants(tree) == {"LAZY", "OK", "NO"}
    assert _string_constants(tree) & _compared_names(tree) == {"LAZY", "NO"}


def test_no_string_constant_is_a_state():
    trees = _modules()
    constants = {name: module for module, tree in trees.items() for name in _string_constants(tree)}
    compared = set().union(*(_compared_names(tree) for tree in trees.values()))
    states = {f"{constants[name]}.{name}" for name in constants.keys() & compared}
    assert states == set(), f"string constants compared as states (make them an Enum's members): {sorted(states)}"


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level: classes, functions, assigned names (imports excluded)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
    # each module's logger is its own; `_`: a function registered on an op; `__all__` and other dunders
    return {name for name in names if not (name.startswith("__") and name.endswith("__"))} - {"log", "_"}


def _same_meaning(value, first) -> bool:
    return value is first or (isinstance(value, (tuple, frozenset, str, int, float)) and value == first)


def test_no_name_has_two_meanings():
    where = defaultdict(list)
    for module, tree in _modules().items():
        for name in _defined(tree):
            where[name].append(module)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    clashes = {}
    for name, modules in twice.items():
        values = [getattr(importlib.import_module(module), name) for module in modules]
        if not all(_same_meaning(value, values[0]) for value in values[1:]):
            clashes[name] = modules
    assert clashes == {}, f"names defined with two meanings (rename one): {clashes}"
