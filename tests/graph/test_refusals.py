"""One test per kind of refusal (``compile_pass.graph.refusals.Refusal``), and a few other spellings of one.

Each case is the smallest graph that produces its kind. The site is left as stock
compile leaves it: no op node in the graph the inner backend got, the key counted
(``refused_<key>``, spelled out in the case: the keys users count) and in the report's
record, the reason naming the cause in the record and in the log, and loss and every
gradient bit for bit those of stock compile (aot_eager; a few under Inductor too). The
guard's reason is of the case's kind; where the matcher stopped, the guard worded the
stop as its own kind (an ``OPAQUE`` stop: as it or a kind of ``OPAQUE_NAMED``).
``test_every_refusal_kind_has_a_case`` reads the enum: a new kind without a case fails.

Keys no Dynamo graph produces are shown on the FX graphs that do have them:
``call_module`` and ``target`` on ``torch.fx.symbolic_trace`` graphs (Dynamo inlines
``nn.CrossEntropyLoss``; torch itself refuses a class-index target that is not
int64 under fake tensors: int32 eagerly, uint8 in the meta kernel), ``unreadable`` on
a captured graph whose loss input lost its fake value; ``internal_error`` by a fault
injected into the matcher (a stage of :mod:`compile_pass.graph.stages`).
"""

from __future__ import annotations

import fnmatch
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from builders import B, H, T, V, Head, flat_loss
from builders import hidden_states as hidden
from builders import labels_of as labels
from rewrite_proof import compare_with_stock
from torch import nn
from torch._dynamo.utils import counters
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

import compile_pass
from compile_pass.graph import guard, refusals, stages
from compile_pass.graph.pipeline import fuse_linear_cross_entropy
from compile_pass.graph.refusals import OPAQUE_NAMED, STOPS, Refusal

pytestmark = pytest.mark.usefixtures("fresh_compile", "eager_kernels")

DOCS = Path(__file__).resolve().parents[2] / "docs"


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
    key: str = ""  # the refusal (counter) key; "": the case's name
    kind: Refusal | None = None  # the guard's reason's kind; None: the one named as the key


def int_inputs():
    return torch.randint(-3, 4, (B, T, H)), labels()


CASES = {
    "soft_cap": Case(lambda m, h, y: flat(torch.tanh(m.lm_head(h) / 30.0) * 30.0, y),
                     "soft-capped logits: `tanh` between projection and loss"),
    "soft_cap_inductor": Case(lambda m, h, y: flat(torch.tanh(m.lm_head(h) / 30.0) * 30.0, y),
                              "soft-capped logits: `tanh` between projection and loss", inner="inductor",
                              key="soft_cap"),
    "op_clamp": Case(lambda m, h, y: flat(m.lm_head(h).clamp(-1.0, 1.0), y),
                     "`clamp` between projection and loss is not shape/dtype-only (logit clipping)", kind=Refusal.OPAQUE),
    "op_add": Case(lambda m, h, y: flat(m.lm_head(h) + m.lora_b(m.lora_a(h)) * 2.0, y),
                   "`add` between projection and loss is not shape/dtype-only (an added tensor, e.g. LoRA",
                   inner="inductor", kind=Refusal.OPAQUE),
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
    "graph_break": Case(graph_break_loss, "logits enter this graph as an input (`L_logits_`): the graph broke",
                        kind=Refusal.GRAPH_INPUT),
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
                           "in-place `mul_` between projection and loss (logits scaled in place", key="mutation",
                           kind=Refusal.IN_PLACE_SCALE),
    "mode_switch": Case(autocast_loss, "`_exit_autocast` (autocast / grad mode change) between projection and loss"),
    "loss_spelling": Case(lambda m, h, y: F.nll_loss(torch.log(torch.softmax(m.lm_head(h), -1)).reshape(-1, V),
                                                     y.reshape(-1)),
                          "nll_loss: log(softmax(logits)) is not torch's log_softmax"),
}
# Kinds no Dynamo graph has (shown on other FX graphs below) or that only a bug produces.
NOT_FROM_DYNAMO = (Refusal.CALL_MODULE, Refusal.TARGET, Refusal.UNREADABLE, Refusal.INTERNAL_ERROR)
# Kinds whose graphs need a process group (DTensor): produced on spawned ranks, tests/integration/test_tensor_parallel.py.
NEEDS_PROCESS_GROUP = (Refusal.TENSOR_PARALLEL,)
# The counter keys users count (docs/api.md, docs/design.md): a change here is a change of the docs.
USER_KEYS = {
    "op_{op}", "graph_break", "subgraph_input", "class_dim_1", "vocab_dim", "advanced_index", "symbolic_reshape",
    "unreadable", "call_module", "internal_error", "scale_operand", "scale_requires_grad", "scale_twice",
    "mutation", "soft_cap", "producer", "no_projection", "loss_spelling", "target", "probability_target",
    "argument", "class_weight", "weight_dtype", "subclass", "lossy_cast", "mode_switch", "tensor_parallel",
}


def case_key(name: str) -> str:
    return CASES[name].key or name


def case_kind(name: str) -> Refusal:
    return CASES[name].kind or Refusal[case_key(name).upper()]


def key_pattern(kind: Refusal) -> str:
    """``kind``'s counter key with each field as ``*`` (``op_{op}`` -> ``op_*``)."""
    return re.sub(r"\{[^}]*\}", "*", kind.key)


def test_every_refusal_kind_has_a_case():
    covered = {case_kind(name) for name in CASES} | set(NOT_FROM_DYNAMO) | set(NEEDS_PROCESS_GROUP)
    assert set(Refusal) - covered == set(), "refusal kinds without a case in tests/graph/test_refusals.py"
    for name in CASES:  # each case's key is its kind's (the table's mapping, spelled out in the cases)
        assert fnmatch.fnmatch(case_key(name), key_pattern(case_kind(name))), (name, case_kind(name).key)


def test_the_counter_keys_are_the_documented_ones():
    assert {kind.key for kind in Refusal} == USER_KEYS
    documented = (DOCS / "design.md").read_text() + (DOCS / "api.md").read_text()
    for kind in Refusal:
        assert f"`{key_pattern(kind).replace('*', '<name>')}`" in documented, kind


def test_every_kind_is_worded_from_its_fields():
    """Each message and key formats from the fields its templates name, and each stop kind is a kind."""
    assert STOPS <= set(Refusal) and not set(OPAQUE_NAMED) & STOPS
    for kind in Refusal:
        fields = {name for template in (kind.key, kind.message)
                  for _, name, _, _ in string.Formatter().parse(template) if name}
        reason = refusals.Reason(kind, **dict.fromkeys(fields, "x"))
        assert (reason.kind, reason.fix) == (kind, kind.fix) and str(reason) and "{" not in reason.key


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
def reasons():
    """What the guard says of each site the pass checks (the guard is pure: asked again at the
    ``check`` stage): ``checked``, every (site, reason); ``stops``, every (stop kind of a site,
    the reason the guard words that stop as)."""
    seen = {"checked": [], "stops": []}

    def check(site):
        order = {node: i for i, node in enumerate(site.node.graph.nodes)}
        seen["checked"].append((site, guard.check(site, order)))
        if site.stop_kind is not None:
            seen["stops"].append((site.stop_kind, guard.stop_reason(site)))

    with stages.hooked("check", check):
        yield seen


def assert_stops_worded_as_their_kind(stops):
    """Each stop of the matcher is a kind of ``STOPS``, worded by the guard as that kind (an
    ``OPAQUE`` stop: or as a kind of ``OPAQUE_NAMED``), counted under that kind's key."""
    for kind, reason in stops:
        if kind is None:
            continue
        assert kind in STOPS, f"stop kind {kind} is not in refusals.STOPS"
        allowed = (kind, *OPAQUE_NAMED) if kind is Refusal.OPAQUE else (kind,)
        assert reason.kind in allowed, f"stop {kind} worded as {reason.kind}"
        assert fnmatch.fnmatch(reason.key, key_pattern(reason.kind)), (reason.key, reason.kind)


@pytest.mark.parametrize("name, case", [  # a case that compiles with Inductor is slow
    pytest.param(name, case, id=name, marks=pytest.mark.slow if case.inner == "inductor" else ())
    for name, case in sorted(CASES.items())])
def test_refused_site_is_left_as_stock_compile_leaves_it(name, case, chunkce_logs, reasons):
    recorder, _ = compare_with_stock(RefusedHead(case.loss), *case.inputs(), inner=case.inner,
                                     dynamic=case.dynamic, exact=True)
    recorder.assert_untouched()
    assert_refused(case_key(name), case.words, chunkce_logs)
    kind = case_kind(name)
    assert {reason.kind for _, reason in reasons["checked"]} == {kind}
    stopped = {site.stop_kind for site, _ in reasons["checked"]}
    if kind in STOPS:  # the matcher stopped with the case's kind
        assert stopped == {kind}
    elif kind in OPAQUE_NAMED:
        assert stopped == {Refusal.OPAQUE}
    assert_stops_worded_as_their_kind(reasons["stops"])
    assert compile_pass.last_report().records[0].fix == kind.fix
    if name == "graph_break":
        assert compile_pass.last_report().records[0].fix == refusals.GRAPH_BREAK_FIX


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


@pytest.mark.parametrize("point", ["walk", "read", "check"])
def test_internal_error_in_the_pass(point, chunkce_logs):
    """Only a bug produces ``internal_error``: one injected into the walk back from the loss,
    the matcher or the guard (:mod:`compile_pass.graph.stages`). The site is refused, the
    compile does not fail."""
    def injected(value):
        raise RuntimeError("injected")

    with stages.hooked(point, injected):
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
