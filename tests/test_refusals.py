"""One test per refusal key the guard can return (and a few other spellings of one).

Each case is the smallest graph that produces its key. The site is left as stock
compile leaves it: no op node in the graph the inner backend got, the key counted
(``refused_<key>``) and in the report's record, the reason naming the cause in the
record and in the log, and loss and every gradient bit for bit those of stock
compile (aot_eager; a few under Inductor too). ``test_every_key_of_the_guard_has_a_case``
parses guard.py: a new key without a case here fails; the matcher's stop kinds are
read from sites.py and each case checks the kind it stops at reaches the guard as
the key ``_STOP_KINDS`` says.

Keys no Dynamo graph produces are shown on the FX graphs that do have them:
``call_module`` and ``target`` on ``torch.fx.symbolic_trace`` graphs (Dynamo inlines
``nn.CrossEntropyLoss``; torch itself refuses a class-index target that is not
int64 under fake tensors: int32 eagerly, uint8 in the meta kernel), ``unreadable`` on
a captured graph whose loss input lost its fake value; ``internal_error`` by a fault
injected into the matcher.
"""

from __future__ import annotations

import ast
import fnmatch
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import B, H, T, V, Head, flat_loss
from conftest import hidden_states as hidden
from conftest import labels_of as labels
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

import compile_pass
from compile_pass.graph import guard, sites
from compile_pass.graph.driver import fuse_linear_cross_entropy

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

GUARD = Path(guard.__file__)


class RefusedHead(Head):
    """:class:`conftest.Head`, with the tensors a refused loss reads besides the lm_head."""

    def __init__(self, loss: Callable):
        super().__init__(loss)
        self.bigram = nn.Parameter(torch.randn(V, V))  # a logits table: no projection
        self.register_buffer("int_weight", torch.randint(-3, 4, (V, H)))
        weight = torch.randn(V, H)
        self.register_buffer("two_weight", TwoTensor(weight, weight.clone()))
        class_weight = torch.rand(V) + 0.5
        self.register_buffer("two_class_weight", TwoTensor(class_weight, class_weight.clone()))
        self.lora_a = nn.Linear(H, 4, bias=False)
        self.lora_b = nn.Linear(4, V, bias=False)


_TWO_WEIGHT = TwoTensor(*[torch.randn(V, H, generator=torch.Generator().manual_seed(3))] * 2)  # not a buffer


def flat(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def graph_break_loss(m, h, y):
    logits = m.lm_head(h)
    torch._dynamo.graph_break()
    return flat(logits, y)


def in_place_loss(m, h, y):
    logits = m.lm_head(h)
    logits.mul_(2.0)
    return flat(logits, y)


def autocast_loss(m, h, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m.lm_head(h)
    return flat(logits.float(), y)


def checkpointed_loss(m, h, y):
    return checkpoint(flat, m.lm_head(h), y, use_reentrant=False)


def symbolic_reshape_loss(m, h, y):  # h: [N, H] flat tokens; logits viewed as [B, T, V], then shifted
    logits = m.lm_head(h).view(y.shape[0], y.shape[1], V)
    return flat(logits[:, :-1], y[:, 1:])


def ignore_index_loss(m, h, y, ignore_index):
    return F.cross_entropy(m.lm_head(h).reshape(-1, V), y.reshape(-1), ignore_index=ignore_index)


@dataclass
class Case:
    loss: Callable
    words: str  # in the reason: names the cause
    inputs: Callable[[], tuple] = lambda: (hidden(), labels())
    dynamic: bool | None = None
    inner: str = "aot_eager"
    key: str = ""  # the refusal key; "": the case's name


def int_inputs():
    return torch.randint(-3, 4, (B, T, H)), labels()


CASES = {
    "soft_cap": Case(lambda m, h, y: flat(torch.tanh(m.lm_head(h) / 30.0) * 30.0, y),
                     "soft-capped logits: `tanh` between projection and loss"),
    "soft_cap_inductor": Case(lambda m, h, y: flat(torch.tanh(m.lm_head(h) / 30.0) * 30.0, y),
                              "soft-capped logits: `tanh` between projection and loss", inner="inductor",
                              key="soft_cap"),
    "op_clamp": Case(lambda m, h, y: flat(m.lm_head(h).clamp(-1.0, 1.0), y),
                     "`clamp` between projection and loss is not shape/dtype-only (logit clipping)"),
    "op_add": Case(lambda m, h, y: flat(m.lm_head(h) + m.lora_b(m.lora_a(h)) * 2.0, y),
                   "`add` between projection and loss is not shape/dtype-only (an added tensor, e.g. LoRA",
                   inner="inductor"),
    "scale_requires_grad": Case(lambda m, h, y, s: flat(m.lm_head(h) * s, y),
                                "which requires grad: the op does not differentiate the scale. Fix: detach it",
                                inputs=lambda: (hidden(), labels(), torch.tensor(0.5, requires_grad=True))),
    "scale_operand": Case(lambda m, h, y: flat(m.lm_head(h) * torch.linspace(0.5, 1.5, V), y),
                          "not a scaling the op takes (a multiplier of shape (23,), broadcast over the logits"),
    "scale_twice": Case(lambda m, h, y: flat(m.lm_head(h) * 2.0 / 3.0, y),
                        "`mul` scales the logits a second time between projection and loss"),
    "no_projection": Case(lambda m, h, y: flat(F.embedding(y, m.bigram), y),
                          "does not come from a linear/matmul (it comes from `embedding`)"),
    "producer": Case(lambda m, h, y: flat(torch.einsum("bth,vh->btv", h, m.lm_head.weight), y),
                     "producer `einsum` is not a plain linear/matmul with a 2-D weight"),
    "weight_dtype": Case(lambda m, h, y: flat((h @ m.int_weight.t()).float(), y),
                         "projection weight is of dtype torch.int64, not a plain floating dtype",
                         inputs=int_inputs),
    "weight_dtype_input": Case(lambda m, h, y, w: flat((h @ w.t()).float(), y),
                               "projection weight is of dtype torch.int64, not a plain floating dtype",
                               inputs=lambda: (*int_inputs(), torch.randint(-3, 4, (V, H))), key="weight_dtype"),
    "subclass": Case(lambda m, h, y: flat(F.linear(h, m.two_weight), y),
                     "projection weight is a tensor subclass (TwoTensor)"),
    "subclass_global": Case(lambda m, h, y: flat(F.linear(h, _TWO_WEIGHT), y),
                            "projection weight is a tensor subclass (TwoTensor)", key="subclass"),
    "class_weight": Case(lambda m, h, y: F.cross_entropy(m.lm_head(h).reshape(-1, V), y.reshape(-1),
                                                         weight=m.two_class_weight),
                         "class weight is a tensor subclass (TwoTensor)"),
    "probability_target": Case(lambda m, h, p: F.cross_entropy(m.lm_head(h).reshape(-1, V), p.reshape(-1, V)),
                               "probability (floating) targets of dtype torch.float32",
                               inputs=lambda: (hidden(), torch.softmax(torch.randn(B, T, V), -1))),
    "argument": Case(ignore_index_loss, "ignore_index", dynamic=True,  # a symbolic int
                     inputs=lambda: (hidden(), labels(), 3)),
    "graph_break": Case(graph_break_loss, "logits enter this graph as an input (`L_logits_`): the graph broke"),
    "subgraph_input": Case(checkpointed_loss, "logits enter this higher-order op's body"),
    "class_dim_1": Case(lambda m, h, y: F.cross_entropy(m.lm_head(h).permute(0, 2, 1).contiguous(), y),
                        "logits of shape (2, 23, 5) with the class dim at 1 that are not a transpose"),
    "vocab_dim": Case(lambda m, h, y: F.cross_entropy(m.lm_head(h)[..., :V - 3].reshape(-1, V - 3),
                                                      y.clamp(max=V - 4).reshape(-1)),
                      "`getitem` on the vocab dim between projection and loss"),
    "vocab_dim_contiguous": Case(lambda m, h, y: F.cross_entropy(
        m.lm_head(h)[..., :V - 3].contiguous().reshape(-1, V - 3), y.clamp(max=V - 4).reshape(-1)),
        "`getitem` on the vocab dim between projection and loss", key="vocab_dim"),
    "advanced_index": Case(lambda m, h, y: F.cross_entropy(m.lm_head(h).reshape(-1, V)[y.reshape(-1) % 4],
                                                           y.reshape(-1)[: B * T]),
                           "`getitem` with tensor indices between projection and loss"),
    "symbolic_reshape": Case(symbolic_reshape_loss, "`getitem` on token dims after a reshape to several symbolic",
                             inputs=lambda: (hidden().detach().reshape(B * T, H).requires_grad_(), labels()),
                             dynamic=True),
    "lossy_cast": Case(lambda m, h, y: flat(m.lm_head(h).to(torch.bfloat16).float(), y),
                       "logits cast through a lossy intermediate dtype (float32 -> bfloat16 -> float32)"),
    "lossy_cast_method": Case(lambda m, h, y: flat(m.lm_head(h).bfloat16().float(), y),
                              "float32 -> bfloat16 -> float32", key="lossy_cast"),
    "mutation": Case(in_place_loss, "in-place `mul_` between projection and loss"),
    "mutation_scale": Case(lambda m, h, y: flat(m.lm_head(h).mul_(2.0), y),
                           "in-place `mul_` between projection and loss (logits scaled in place", key="mutation"),
    "mode_switch": Case(autocast_loss, "`_exit_autocast` (autocast / grad mode change) between projection and loss"),
    "loss_spelling": Case(lambda m, h, y: F.nll_loss(torch.log(torch.softmax(m.lm_head(h), -1)).reshape(-1, V),
                                                     y.reshape(-1)),
                          "nll_loss: log(softmax(logits)) is not torch's log_softmax"),
}
# Keys no Dynamo graph has (shown on other FX graphs below) or that only a bug produces.
NOT_FROM_DYNAMO = ("call_module", "target", "unreadable", "internal_error")


def guard_keys() -> set[str]:
    """Every key guard.py can give a Reason: string literals, the strings a variable passed as
    the key is assigned, and f-string keys as patterns (``op_*``)."""
    tree = ast.parse(GUARD.read_text())
    assigned: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, set()).update(_values(node.value))
    keys = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Reason"):
            continue
        key = node.args[0]
        if isinstance(key, ast.Constant):
            keys.add(key.value)
        elif isinstance(key, ast.JoinedStr):
            keys.add("".join(p.value if isinstance(p, ast.Constant) else "*" for p in key.values))
        elif isinstance(key, ast.Name):
            keys |= assigned[key.id]
        else:
            pytest.fail(f"guard.py line {node.lineno}: a Reason key this test cannot read")
    return keys


def _values(expr: ast.expr) -> set[str]:
    """The strings ``expr`` can evaluate to: a literal, or either branch of ``a if cond else b``."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.IfExp):
        return _values(expr.body) | _values(expr.orelse)
    return set()


def case_key(name: str) -> str:
    return CASES[name].key or name


def test_every_key_of_the_guard_has_a_case():
    keys = guard_keys()
    assert {"soft_cap", "lossy_cast", "op_*", "weight_dtype", "subclass"} <= keys  # the parser reads them
    covered = {case_key(name) for name in CASES} | set(NOT_FROM_DYNAMO)
    uncovered = {key for key in keys if not any(fnmatch.fnmatch(case, key) for case in covered)}
    assert uncovered == set(), f"refusal keys without a case in tests/test_refusals.py: {uncovered}"
    stale = {case for case in covered if not any(fnmatch.fnmatch(case, key) for key in keys)}
    assert stale == set(), f"cases for keys guard.py no longer has: {stale}"


def assert_refused(key, words, logs, records=None):
    stats = counters["chunkce"]
    assert stats["sites_rewritten"] == 0 and stats["sites_refused"] >= 1, dict(stats)
    assert stats["sites_found"] == stats["sites_refused"] == stats[f"refused_{key}"], dict(stats)
    records = records if records is not None else compile_pass.last_report().records
    assert [r.reason_key for r in records] == [key]
    assert words in records[0].reason, records[0].reason
    messages = [r.getMessage() for r in logs.records if r.name.startswith("compile_pass")]
    assert any(words in m for m in messages), messages


@pytest.fixture
def stops(monkeypatch):
    """Every (stop kind of a site, key of the reason the guard words for that stop)."""
    seen = []
    real = guard._check_stop

    def check_stop(site):
        reason = real(site)
        seen.append((site.stop_kind, reason.key if reason is not None else None))
        return reason

    monkeypatch.setattr(guard, "_check_stop", check_stop)
    return seen


def assert_stops_map_as_listed(stops):
    """Each site the matcher stopped at reached the guard as the key ``_STOP_KINDS`` gives its kind."""
    for kind, key in stops:
        if kind is not None:
            assert kind in _STOP_KINDS, f"stop kind {kind!r} is not in _STOP_KINDS"
            patterns = _OPAQUE_KEYS if kind == "opaque" else (_STOP_KINDS[kind],)
            assert any(fnmatch.fnmatch(key, p) for p in patterns), f"stop kind {kind!r} worded as {key!r}"


@pytest.mark.parametrize("name, case", sorted(CASES.items()), ids=sorted(CASES))
def test_refused_site_is_left_as_stock_compile_leaves_it(name, case, chunkce_logs, stops):
    recorder, _ = compare_with_stock(RefusedHead(case.loss), *case.inputs(), inner=case.inner,
                                     dynamic=case.dynamic, exact=True)
    recorder.assert_untouched()
    assert_refused(case_key(name), case.words, chunkce_logs)
    assert_stops_map_as_listed(stops)
    if name == "graph_break":
        assert compile_pass.last_report().records[0].fix == compile_pass.graph.report.GRAPH_BREAK_FIX


def test_strict_raises_with_the_reason():
    model = torch.compile(Head(CASES["soft_cap"].loss), backend="chunkce",
                          options={"strict": True, "inner_backend": "eager"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match="soft-capped logits: `tanh` between projection and loss") as info:
        model(hidden(), labels())
    assert isinstance(info.value.inner_exception, NotImplementedError)
    assert "strict=True" in str(info.value)


def test_call_module_loss_on_a_symbolically_traced_graph(chunkce_logs):
    """Dynamo inlines ``nn.CrossEntropyLoss`` (even with ``inline_inbuilt_nn_modules=False``);
    ``torch.fx.symbolic_trace`` keeps it as a ``call_module`` node."""
    class ModuleLoss(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lm_head = nn.Linear(H, V, bias=False)
            self.loss_fct = nn.CrossEntropyLoss()

        def forward(self, h, y):
            return self.loss_fct(self.lm_head(h).view(-1, V), y.view(-1))

    _refused_on_symbolic_trace(ModuleLoss(), "call_module", "nn.CrossEntropyLoss as a call_module node",
                               chunkce_logs)


def test_target_without_a_fake_value_on_a_symbolically_traced_graph(chunkce_logs):
    """A graph with no fake values (``torch.fx.symbolic_trace``): the target cannot be read."""
    class FunctionalLoss(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, h, y):
            return F.cross_entropy(self.lm_head(h).view(-1, V), y.view(-1))

    _refused_on_symbolic_trace(FunctionalLoss(), "target", "target is not a tensor computed in this graph",
                               chunkce_logs)


def _refused_on_symbolic_trace(model, key, text, chunkce_logs):
    """The pass leaves ``model``'s ``symbolic_trace`` graph unchanged, refusing with ``key``."""
    gm = torch.fx.symbolic_trace(model)
    before = str(gm.graph)
    result = fuse_linear_cross_entropy(gm.graph)
    gm.recompile()
    assert str(gm.graph) == before
    assert_refused(key, text, chunkce_logs, result.records)
    h, y = hidden(), labels()
    torch.testing.assert_close(gm(h, y), model(h, y), atol=0, rtol=0)


def _captured(model, *inputs):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture)(*inputs)
    torch._dynamo.reset()
    ((gm, example_inputs),) = graphs
    return gm, example_inputs


def test_unreadable_loss_input(chunkce_logs):
    """A graph from a tracer that leaves no fake value on the loss input (Dynamo and Inductor's
    pre-grad graph always have one): the site is refused, the graph unchanged."""
    model = Head(lambda m, h, y: F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1)))
    h, y = hidden(), labels()
    gm, example_inputs = _captured(model, h, y)
    expected = gm(*example_inputs)
    (call,) = [n for n in gm.graph.nodes if n.target is F.cross_entropy]
    del call.args[0].meta["example_value"]
    before = str(gm.graph)
    result = fuse_linear_cross_entropy(gm.graph)
    assert str(gm.graph) == before
    assert_refused("unreadable", "cross_entropy input is not a tensor computed in this graph", chunkce_logs,
                   result.records)
    gm.recompile()
    torch.testing.assert_close(gm(*example_inputs), expected, atol=0, rtol=0)
    torch.testing.assert_close(expected, (model(h, y),), atol=0, rtol=0)


@pytest.mark.parametrize("broken", [sites._classify, sites.match_site, guard.check],
                         ids=lambda f: f"{f.__module__.rsplit('.', 1)[1]}.{f.__name__}")
def test_internal_error_in_the_pass(broken, monkeypatch, chunkce_logs):
    """Only a bug produces ``internal_error``: one injected into the walk back from the loss,
    the matcher or the guard. The site is refused, the compile does not fail."""
    def injected(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(sys.modules[broken.__module__], broken.__name__, injected)
    recorder, _ = compare_with_stock(Head(lambda m, h, y: flat(m.lm_head(h).float(), y)), hidden(), labels(),
                                     exact=True)
    recorder.assert_untouched()
    assert_refused("internal_error", "chunkce could not analyse this site (RuntimeError: injected)", chunkce_logs)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_narrow_then_widen_is_refused_and_exact(narrow, chunkce_logs):
    """fp32 -> bf16 / fp16 -> fp32: the op would round once (logits_dtype fp32), the graph
    rounds to the narrow dtype on the way; refused, so exact."""
    name = str(narrow).removeprefix("torch.")
    recorder, _ = compare_with_stock(Head(lambda m, h, y: flat(m.lm_head(h).to(narrow).float(), y)),
                                     hidden(), labels(), exact=True)
    recorder.assert_untouched()
    assert_refused("lossy_cast", f"(float32 -> {name} -> float32)", chunkce_logs)


# sites.py's stop kinds reach the guard as these keys (the rest are opaque: op_* / producer / ...);
# test_refused_site_is_left_as_stock_compile_leaves_it checks each case's on the guard itself.
_STOP_KINDS = {"graph_input": "graph_break", "subgraph_input": "subgraph_input",
               "class_dim_1": "class_dim_1", "vocab_dim": "vocab_dim", "advanced_index": "advanced_index",
               "symbolic_reshape": "symbolic_reshape", "unreadable": "unreadable", "call_module": "call_module",
               "internal_error": "internal_error", "opaque": "op_*", "scale_operand": "scale_operand",
               "scale_requires_grad": "scale_requires_grad", "scale_twice": "scale_twice",
               "in_place_scale": "mutation"}
_OPAQUE_KEYS = ("op_*", "producer", "no_projection", "soft_cap")  # how the guard words an opaque node
_STEP_KINDS = {"reshape", "copy", "cast", "index", "log_softmax", "neg"}  # what the walk passes through


def matcher_stop_kinds() -> set[str]:
    """Every string sites.py can store in a stop kind, read from its source (not from
    ``_STOP_KINDS``): the values assigned to a ``stop_kind`` attribute or passed as a
    ``stop_kind`` field (by keyword or by position), followed through local variables,
    conditional expressions, ``or``, the returns of sites.py's own functions, tuple
    unpacking and another object's ``stop_kind``; less the kinds of steps the walk passes."""
    tree = ast.parse(Path(sites.__file__).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    fields = {node.name: [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)]
              for node in tree.body if isinstance(node, ast.ClassDef)}
    sinks: list[tuple[ast.expr, ast.FunctionDef | None, int | None]] = []  # (expression, its function, element)

    def scope_of(target):
        return next((f for f in functions.values() if any(n is target for n in ast.walk(f))), None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                for i, element in enumerate(elements):
                    if isinstance(element, ast.Attribute) and element.attr == "stop_kind":
                        value = node.value.elts[i] if isinstance(target, ast.Tuple) else node.value
                        sinks.append((value, scope_of(node), None))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and "stop_kind" in fields.get(
                node.func.id, ()):
            sinks += [(k.value, scope_of(node), None) for k in node.keywords if k.arg == "stop_kind"]
            position = fields[node.func.id].index("stop_kind")
            for i, arg in enumerate(node.args):
                if isinstance(arg, ast.Starred):  # f(a, *pair): pair's element position - i
                    sinks.append((arg.value, scope_of(node), position - i))
                elif i == position:
                    sinks.append((arg, scope_of(node), None))

    def values(expr, scope, element=None) -> set[str]:
        if isinstance(expr, ast.Constant):
            return {expr.value} if isinstance(expr.value, str) and element is None else set()
        if isinstance(expr, ast.Tuple):
            return values(expr.elts[element], scope) if element is not None and element < len(expr.elts) else set()
        if isinstance(expr, ast.IfExp):
            return values(expr.body, scope, element) | values(expr.orelse, scope, element)
        if isinstance(expr, ast.BoolOp):
            return set().union(*(values(v, scope, element) for v in expr.values))
        if isinstance(expr, ast.Name) and scope is not None:
            return set().union(*(values(n.value, scope, element) for n in ast.walk(scope)
                                 if isinstance(n, ast.Assign) and any(
                                     isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)))
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in functions:
            function = functions[expr.func.id]
            return set().union(*(values(n.value, function, element) for n in ast.walk(function)
                                 if isinstance(n, ast.Return) and n.value is not None))
        if isinstance(expr, ast.Attribute) and expr.attr == "stop_kind":  # another reading's kind
            return set().union(*(values(e, f, i) for e, f, i in sinks if e is not expr))
        return set()

    kinds = set().union(*(values(expr, scope, element) for expr, scope, element in sinks))
    return kinds - _STEP_KINDS


def test_every_stop_kind_of_the_matcher_maps_to_a_covered_key():
    kinds = matcher_stop_kinds()
    assert {"graph_input", "opaque", "in_place_scale", "scale_requires_grad"} <= kinds  # the reader follows them
    assert kinds == set(_STOP_KINDS)
    covered = {case_key(name) for name in CASES} | set(NOT_FROM_DYNAMO)
    uncovered = {key for key in _STOP_KINDS.values() if not any(fnmatch.fnmatch(case, key) for case in covered)}
    assert uncovered == set(), f"stop kinds' keys without a case: {uncovered}"
