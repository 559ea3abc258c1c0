"""Every private torch name chunkce reaches is an entry of ``compile_pass/torch_internals.py``, and
each entry resolves on the installed torch to the kind of thing chunkce uses: a release that moves
one fails here, by its name."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch

from compile_pass import torch_internals as internals

PACKAGE = Path(internals.__file__).parent
Kind = internals.PrivateKind
KINDS = {
    Kind.CALLABLE: callable,
    Kind.CLASS: lambda obj: isinstance(obj, type),
    Kind.MODULE: lambda obj: isinstance(obj, types.ModuleType),
    Kind.MAPPING: lambda obj: hasattr(obj, "items") and hasattr(obj, "__getitem__"),
    Kind.OBJECT: lambda obj: obj is not None,
}


def test_each_kind_of_private_object_has_its_probe():
    assert set(KINDS) == set(Kind)


@pytest.mark.parametrize("name", sorted(internals.ENTRIES))
def test_each_private_torch_name_resolves_on_this_torch(name):
    entry = internals.ENTRIES[name]
    assert entry.use and entry.public, name
    if isinstance(entry, internals.Private):
        obj = entry.get()
        assert KINDS[entry.kind](obj), f"{name}: {entry.path} on torch {torch.__version__} is {obj!r}, not {entry.kind.value}"
    else:
        assert entry.resolves(), f"{name}: torch {torch.__version__}'s {entry.owner} has no attribute {entry.name}"


def test_a_moved_name_raises_naming_it_and_the_torch_version():
    moved = internals.Private("torch._dynamo.utils:no_such_name", "a test")
    with pytest.raises(internals.TorchInternalMissing, match=rf"torch {re.escape(torch.__version__)} has no "
                                                             r"torch\._dynamo\.utils:no_such_name"):
        moved.get()
    with pytest.raises(internals.TorchInternalMissing, match=r"has no Tensor\.no_such_attr"):
        internals.PrivateAttribute("no_such_attr", "torch:Tensor", "a test").read(torch.zeros(1))


def test_an_attribute_a_release_added_reads_its_older_stand_in_only_on_the_releases_before_it():
    """Before ``older.release`` an undeclared attribute reads what the older torch keeps (or the
    stand-in's value of nothing); from it on, it raises like any moved name."""
    def attribute(release, name):
        return internals.PrivateAttribute("_no_such_attr", "torch:Tensor", "a test",
                                          older=internals.Older(release, name, lambda value: ("older", value)))

    t = torch.zeros(1)
    assert attribute("999.0", "_version").read(t) == ("older", t._version)
    assert attribute("999.0", None).read(t) == ("older", None)
    assert attribute("999.0", "_version").resolves() and not attribute("999.0", "_no_such_older").resolves()
    with pytest.raises(internals.TorchInternalMissing, match=r"has no Tensor\._no_such_attr"):
        attribute("2.0", "_version").read(t)
    assert not attribute("2.0", "_version").resolves()


def test_a_dtensor_method_dynamo_records_as_a_function_reads_as_the_method():
    """torch 2.11's Dynamo records ``x.to_local()`` / ``x.redistribute(...)`` as functions so named; 2.12 and later
    record the method calls, which tensor_op_name reads as it reads any tensor method."""
    def prim_to_local(x):
        return x

    def redistribute(x):
        return x

    prim_redistribute = lambda x: x  # noqa: E731 - renamed below, as Dynamo names its function
    prim_redistribute.__name__ = "prim_redistribute"
    assert internals.dtensor_prim(prim_to_local) == "to_local"
    assert internals.dtensor_prim(prim_redistribute) == "redistribute"
    assert internals.dtensor_prim(redistribute) is None and internals.dtensor_prim(torch.Tensor.to) is None


def test_config_patches_per_thread_says_whether_a_patch_in_another_thread_is_seen_here():
    import threading

    config, patched, release = torch._dynamo.config, threading.Event(), threading.Event()
    before = config.verbose

    def patch_elsewhere():
        with config.patch(verbose=not before):
            patched.set()
            release.wait()

    thread = threading.Thread(target=patch_elsewhere)
    thread.start()
    patched.wait()
    seen_here = config.verbose
    release.set()
    thread.join()
    assert internals.config_patches_per_thread() == (seen_here == before) and config.verbose == before


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; through calls and subscripts (``a.get()._b`` is ``["a", "get", "_b"]``)."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        else:
            node = node.func if isinstance(node, ast.Call) else node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_torch_names(source: str) -> list[str]:
    """The private torch names ``source`` reaches: imports of a private module or name, attribute
    chains through a private name from a name bound to torch or to torch_internals (through calls:
    ``internals.compile_lock.get()._is_owned``; through a module's name assigned such a chain:
    ``_aten = torch.ops.aten``), aten's private overloads (``torch.ops.aten._to_copy``), the
    private attribute names declared in torch_internals (as attributes, as strings or as a method
    a class defines over torch's). aten's public ops (the core ATen IR's names) are public."""
    tree = ast.parse(source)
    found, torch_names = [], set()
    declared = {e.name for e in internals.ENTRIES.values() if isinstance(e, internals.PrivateAttribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" or alias.name == "compile_pass.torch_internals":
                    torch_names.add(alias.asname or alias.name.split(".")[0])
                    if _private(alias.name.split(".")):
                        found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and ((node.module or "").split(".")[0] == "torch"
                                                   or [node.module, node.names[0].name] == ["compile_pass",
                                                                                           "torch_internals"]):
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if _private([*node.module.split("."), alias.name]):
                    found.append(f"from {node.module} import {alias.name}")
    for node in tree.body:  # a module's name bound to a chain from torch is torch's too (``_aten = torch.ops.aten``)
        if isinstance(node, ast.Assign) and (chain := _chain(node.value)) and chain[0] in torch_names:
            torch_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    parents = {id(child) for node in ast.walk(tree) if isinstance(node, ast.Attribute) for child in [node.value]}
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) and id(node) not in parents else None
        if chain and chain[0] in torch_names and _private(chain[1:]):
            found.append(".".join(chain))
        elif isinstance(node, ast.Attribute) and node.attr in declared:
            found.append(f".{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in declared:
            found.append(repr(node.value))  # getattr(obj, "_name")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in declared:
            found.append(f"def {node.name}")  # a method over torch's private one
    return found


def test_the_scan_sees_each_way_of_reaching_a_private_name():
    source = ("import torch\nimport torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
              "from torch._C import _nn\nx = torch._C._nn.linear\ny = torch.ops.aten._to_copy\n"
              "z = t._version\nw = getattr(p, '_unsharded_param', None)\nv = torch.nn.functional.linear\n"
              "u = torch.ops.aten.view.default\n")
    assert private_torch_names(source) == [
        "import torch._dynamo", "from torch.utils._pytree import tree_map", "from torch._C import _nn",
        "torch._C._nn.linear", "torch.ops.aten._to_copy", "._version", "'_unsharded_param'"]


def test_the_scan_sees_aliases_calls_lock_internals_and_overridden_methods():
    source = ("import torch\nimport compile_pass.torch_internals as internals\n_aten = torch.ops.aten\n"
              "a = _aten._softmax.default\nb = _aten.softmax.default\nc = internals.compile_lock.get()._is_owned()\n"
              "d = internals.compile_lock.get().acquire()\nclass T(torch.Tensor):\n"
              "    def _typed_storage(self):\n        return self._value\n")
    assert sorted(private_torch_names(source)) == sorted([
        "_aten._softmax.default", "internals.compile_lock.get._is_owned", "def _typed_storage"])


def test_no_module_but_torch_internals_reaches_a_private_torch_name():
    reached = {str(path.relative_to(PACKAGE)): names for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "torch_internals.py" and (names := private_torch_names(path.read_text()))}
    assert not reached, f"reach these through compile_pass/torch_internals.py: {reached}"
