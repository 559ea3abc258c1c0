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


# Strings that are torch's or Python's own vocabulary, compared where chunkce reads them: an FX
# node's op, target and arguments, an op's or a function's name, a device type, torch's loss
# reduction, torch.compile's mode, a Dynamo backend's registered name, Inductor's cpu_backend,
# DDP's optimize mode, a byte unit.
_EXTERNAL_STRINGS = {"op", "target", "args", "name", "tensor_op_name", "op_name", "getattr", "type", "device_type",
                     "reduction", "mode", "inner_backend", "cpu_backend", "get_optimize_ddp_mode", "unit"}


def _operand_name(node: ast.AST) -> str | None:
    """The name an operand ends in: ``x`` of ``a.b.x``, ``f`` of ``f(...)`` / ``a.f(...)``, of a subscript its base's."""
    while isinstance(node, (ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _strings(node: ast.AST) -> bool:
    """Whether ``node`` is a string literal, or a tuple / list / set of them (None among them allowed)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    constants = [item for item in items if isinstance(item, ast.Constant) and item.value is not None]
    return bool(items) and all(isinstance(item, ast.Constant) for item in items) and bool(constants) and all(
        isinstance(item.value, str) for item in constants)


def inline_string_states(tree: ast.Module) -> list[str]:
    """``x == "a"``, ``x != "a"``, ``x in ("a", "b")``: a string literal compared with a value
    of chunkce's own (not one of :data:`_EXTERNAL_STRINGS`), as ``line: name``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or not any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            # ``"out" in kwargs`` asks for a key: only ``value in ("a", "b")`` compares a state
            pairs = [(left, right)] if isinstance(op, (ast.In, ast.NotIn)) else [(left, right), (right, left)]
            for value, literal in pairs:
                name = _operand_name(value)
                if _strings(literal) and not _strings(value) and name not in _EXTERNAL_STRINGS:
                    found.append(f"{node.lineno}: {name}")
    return found


def test_the_check_sees_inline_string_states():
    tree = ast.parse('if options.returned_logits != "lazy" or mode in ("lazy", "drop") or inner == "inductor":\n'
                     '    pass\nif record.reason_key == "soft_cap" or node.op in ("call_function", "call_method"):\n'
                     '    pass\nif reduction == "sum" or mode not in (None, "default"):\n    pass\n')
    assert inline_string_states(tree) == ["1: returned_logits", "1: inner", "3: reason_key"]


def test_no_string_literal_is_compared_as_a_state():
    found = {module: names for module, tree in _modules().items() if (names := inline_string_states(tree))}
    assert found == {}, f"string literals compared as states (make them an Enum's members): {found}"


def _tables(module: str, tree: ast.Module) -> list[tuple[frozenset, str, int | None]]:
    """The tables ``module`` writes: its top-level tuples, lists, sets and dicts of at least two
    entries (their entries, a dict's keys), and the literal tuples / sets of strings it compares with."""
    tables, value = [], importlib.import_module(module)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            table = getattr(value, target.id, None) if isinstance(target, ast.Name) else None
            if isinstance(table, (tuple, list, set, frozenset, dict)) and len(table) >= 2:
                try:
                    tables.append((frozenset(table), f"{module}.{target.id}", id(table)))
                except TypeError:  # entries that do not hash: not a table of names
                    pass
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                if isinstance(operand, (ast.Tuple, ast.Set, ast.List)) and len(operand.elts) >= 2 and all(
                        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in operand.elts):
                    tables.append((frozenset(e.value for e in operand.elts), f"{module}:{operand.lineno}", None))
    return tables


def test_no_table_is_written_twice():
    """A table (the same entries, in any order, under any name) is written once and imported
    where else it is read: the reduction tuple, the softmax functions, the shape-only ops."""
    where = defaultdict(list)
    seen_objects = set()
    for module, tree in _modules().items():
        for entries, name, obj in _tables(module, tree):
            if obj is not None:  # a named table imported elsewhere is the same object: counted once
                if obj in seen_objects:
                    continue
                seen_objects.add(obj)
            where[entries].append(name)
    twice = {tuple(sorted(map(str, entries)))[:4]: names for entries, names in where.items() if len(names) > 1}
    assert twice == {}, f"tables written twice (define one where the lowest layer needs it, import it): {twice}"


# The type each of these names holds wherever a parameter or a class's field is so named and
# annotated: one name, one concept (``plan`` is a site's plan, never an op call's resolved options;
# ``form`` a lazy tensor's form, never a spelling's name).
_ONE_TYPE = {"plan": "SitePlan", "form": "Form"}


def _annotated(tree: ast.Module) -> list[tuple[int, str, str]]:
    """``(line, name, annotation)`` of every annotated parameter and class field, ``| None`` dropped."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            found += [(a.lineno, a.arg, a.annotation) for a in (*arguments.posonlyargs, *arguments.args,
                                                                *arguments.kwonlyargs) if a.annotation is not None]
        elif isinstance(node, ast.ClassDef):
            found += [(n.lineno, n.target.id, n.annotation) for n in node.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return [(line, name, ast.unparse(annotation).strip("'\"").removesuffix(" | None"))
            for line, name, annotation in found]


def names_of_another_type(tree: ast.Module) -> list[str]:
    """``line: name: annotation`` where a name of :data:`_ONE_TYPE` is annotated with another type."""
    return [f"{line}: {name}: {annotation}" for line, name, annotation in _annotated(tree)
            if name in _ONE_TYPE and annotation != _ONE_TYPE[name]]


def test_the_check_sees_a_name_of_another_type():
    tree = ast.parse("def walk(plan: ResolvedCall, x: int) -> None:\n    pass\n"
                     "def apply(plan: SitePlan | None) -> None:\n    pass\n"
                     "class Result:\n    plan: 'LazyOutputs'\n")
    assert names_of_another_type(tree) == ["1: plan: ResolvedCall", "6: plan: LazyOutputs"]


def test_each_concept_name_holds_one_type():
    found = {module: names for module, tree in _modules().items() if (names := names_of_another_type(tree))}
    assert found == {}, f"names annotated with a type other than theirs (_ONE_TYPE; rename them): {found}"


def test_no_two_modules_share_a_name():
    """Two ``statistics.py`` (the op's, the spellings') read as one module in an import, a
    traceback or the module map: every module of the package has a file name of its own."""
    where = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            where[path.name].append(str(path.relative_to(PACKAGE)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert twice == {}, f"modules named alike (rename one): {twice}"


# The head's scale is one type, compile_pass.op.kernels.HeadScale, from the graph to the kernels: no
# other class has a field of its parts, and a class field or parameter named ``transform`` holds it.
_SCALE_PARTS = {"divides", "scale_divides", "scale_dtype", "scale_input", "logit_scale", "logit_scale_tensor"}


def other_shapes_of_the_scale(tree: ast.Module) -> list[str]:
    """``line: Class.field`` of a part of the scale outside ``HeadScale``, ``line: transform: annotation``
    of a ``transform`` of another type (its type arguments dropped)."""
    found = [f"{n.lineno}: {node.name}.{n.target.id}" for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) and node.name != "HeadScale" for n in node.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id in _SCALE_PARTS]
    return found + [f"{line}: {name}: {annotation}" for line, name, annotation in _annotated(tree)
                    if name == "transform" and annotation.split("[")[0] != "HeadScale"]


def test_the_check_sees_another_shape_of_the_scale():
    tree = ast.parse("class Head:\n    scale_input: int\n    divides: bool = False\n"
                     "def call(transform: tuple, scale: HeadScale[int] | None) -> None:\n    pass\n"
                     "class HeadScale:\n    divides: bool\n    transform: 'HeadScale[Node]'\n")
    assert other_shapes_of_the_scale(tree) == ["2: Head.scale_input", "3: Head.divides", "4: transform: tuple"]


def test_the_head_scale_has_one_shape():
    found = {module: shapes for module, tree in _modules().items() if (shapes := other_shapes_of_the_scale(tree))}
    assert found == {}, f"the head's scale spelled outside compile_pass.op.kernels.HeadScale (use it): {found}"


# LazyLogits owns its fields: its private attributes (``self._x`` it assigns, ``_x`` methods and
# properties it defines) are read and written in compile_pass/lazy_logits/tensor.py alone; other
# modules use its public methods (``rows``, ``inputs()``, ``root_storage``, ``add_edit``, ...).
_LAZY_MODULE = "compile_pass.lazy_logits.tensor"


def _private_members(tree: ast.Module, class_name: str) -> set[str]:
    """The single-underscore names class ``class_name`` assigns on ``self`` or defines."""
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.attr for n in ast.walk(cls)
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else [])
              for t in (t.elts if isinstance(t, ast.Tuple) else [t])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def uses_of(tree: ast.Module, names: set[str]) -> list[str]:
    """``line: name`` of each attribute ``x.name`` and each ``getattr`` / ``hasattr`` / ``setattr`` of
    the string ``"name"`` in ``tree``."""
    found = [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in names]
    found += [(n.lineno, n.args[1].value) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr", "setattr")
              and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and n.args[1].value in names]
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_the_check_sees_a_private_field_used_elsewhere():
    tree = ast.parse("def f(t):\n    t._rows\n    return getattr(t._root(), '_storage', None)\n")
    assert uses_of(tree, {"_rows", "_root", "_storage"}) == ["2: _rows", "3: _root", "3: _storage"]


def test_lazy_logits_fields_are_its_own():
    modules = _modules()
    private = _private_members(modules[_LAZY_MODULE], "LazyLogits")
    assert {"_value", "_copy_of", "_edits", "_root", "_storage"} <= private, private
    found = {module: uses for module, tree in modules.items() if module != _LAZY_MODULE
             if (uses := uses_of(tree, private))}
    assert found == {}, f"LazyLogits' private fields used outside {_LAZY_MODULE} (add a method there): {found}"
