"""One test per refusal key the guard can return.

Each case is the smallest graph that produces its key. The site is left as stock
compile leaves it: no op node in the graph the inner backend got, the key counted
(``refused_<key>``) and in the report's record, the reason naming the cause in the
record and in the log, and loss and every gradient bit for bit those of stock
compile. ``test_every_key_of_the_guard_has_a_case`` parses guard.py: a new key
without a case here fails.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

import compile_pass
from compile_pass.graph import guard, sites
from compile_pass.graph.driver import fuse_linear_cross_entropy

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

B, T, H, V = 2, 5, 16, 23
GUARD = Path(guard.__file__)


class Head(nn.Module):
    """An lm_head and a loss written by ``loss(module, hidden, labels, *extra)``."""

    def __init__(self, loss: Callable):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.bigram = nn.Parameter(torch.randn(V, V))  # a logits table: no projection
        self.register_buffer("int_weight", torch.randint(-3, 4, (V, H)))
        weight = torch.randn(V, H)
        self.register_buffer("two_weight", TwoTensor(weight, weight.clone()))
        class_weight = torch.rand(V) + 0.5
        self.register_buffer("two_class_weight", TwoTensor(class_weight, class_weight.clone()))
        self.loss = loss

    def forward(self, h, labels, *extra):
        return self.loss(self, h, labels, *extra)


def hidden(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=gen).to(dtype).requires_grad_()


def labels(seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed + 1))


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


CASES = {
    "soft_cap": Case(lambda m, h, y: flat(torch.tanh(m.lm_head(h) / 30.0) * 30.0, y),
                     "soft-capped logits: `tanh` between projection and loss"),
    "op_*": Case(lambda m, h, y: flat(m.lm_head(h).clamp(-1.0, 1.0), y),
                 "`clamp` between projection and loss is not shape/dtype-only (logit clipping)"),
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
                         inputs=lambda: (torch.randint(-3, 4, (B, T, H)), labels())),
    "subclass": Case(lambda m, h, y: flat(F.linear(h, m.two_weight), y),
                     "projection weight is a tensor subclass (TwoTensor)"),
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
    "advanced_index": Case(lambda m, h, y: F.cross_entropy(m.lm_head(h).reshape(-1, V)[y.reshape(-1) % 4],
                                                           y.reshape(-1)[: B * T]),
                           "`getitem` with tensor indices between projection and loss"),
    "symbolic_reshape": Case(symbolic_reshape_loss, "`getitem` on token dims after a reshape to several symbolic",
                             inputs=lambda: (hidden().detach().reshape(B * T, H).requires_grad_(), labels()),
                             dynamic=True),
    "lossy_cast": Case(lambda m, h, y: flat(m.lm_head(h).to(torch.bfloat16).float(), y),
                       "logits cast through a lossy intermediate dtype (float32 -> bfloat16 -> float32)"),
    "mutation": Case(in_place_loss, "in-place `mul_` between projection and loss"),
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


def test_every_key_of_the_guard_has_a_case():
    keys = guard_keys()
    assert {"soft_cap", "lossy_cast", "op_*", "weight_dtype", "subclass"} <= keys  # the parser reads them
    covered = set(CASES) | set(NOT_FROM_DYNAMO)
    assert keys - covered == set(), f"refusal keys without a case in tests/test_refusals.py: {keys - covered}"
    assert covered - keys == set(), f"cases for keys guard.py no longer has: {covered - keys}"


def assert_refused(key, words, logs, records=None):
    stats = counters["chunkce"]
    assert stats["sites_rewritten"] == 0 and stats["sites_refused"] >= 1, dict(stats)
    assert stats[f"refused_{key}"] == stats["sites_refused"], dict(stats)
    records = records if records is not None else compile_pass.last_report().records
    assert [r.reason_key for r in records] == [key]
    assert words in records[0].reason, records[0].reason
    messages = [r.getMessage() for r in logs.records if r.name.startswith("compile_pass")]
    assert any(words in m for m in messages), messages


@pytest.mark.parametrize("key", sorted(CASES))
def test_refused_site_is_left_as_stock_compile_leaves_it(key, chunkce_logs):
    case = CASES[key]
    recorder, _ = compare_with_stock(Head(case.loss), *case.inputs(), inner=case.inner, dynamic=case.dynamic,
                                     exact=True)
    recorder.assert_untouched()
    if key == "op_*":
        key = "op_clamp"
    assert_refused(key, case.words, chunkce_logs)
    if key == "graph_break":
        assert compile_pass.last_report().records[0].fix == compile_pass.graph.report.GRAPH_BREAK_FIX


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


def test_internal_error_in_the_matcher(monkeypatch, chunkce_logs):
    """Only a bug produces ``internal_error``: one injected into the walk back from the loss."""
    def broken(node):
        raise RuntimeError("injected")

    monkeypatch.setattr(sites, "_classify", broken)
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


# sites.py's stop kinds reach the guard as these keys (the rest are opaque: op_* / producer / ...).
_STOP_KINDS = {"graph_input": "graph_break", "subgraph_input": "subgraph_input",
               "class_dim_1": "class_dim_1", "vocab_dim": "vocab_dim", "advanced_index": "advanced_index",
               "symbolic_reshape": "symbolic_reshape", "unreadable": "unreadable", "call_module": "call_module",
               "internal_error": "internal_error", "opaque": "op_*", "scale_operand": "scale_operand",
               "scale_requires_grad": "scale_requires_grad", "scale_twice": "scale_twice",
               "in_place_scale": "mutation"}


def test_every_stop_kind_of_the_matcher_maps_to_a_covered_key():
    source = Path(sites.__file__).read_text()
    kinds = {c.value for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Assign, ast.Return, ast.Call))
             for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in _STOP_KINDS}
    assert kinds == set(_STOP_KINDS)
    covered = set(CASES) | set(NOT_FROM_DYNAMO)
    assert all(any(fnmatch.fnmatch(key, pattern) for pattern in covered) for key in _STOP_KINDS.values())
