"""The ``chunkce`` backend, its options, the pre-grad pass for stock Inductor, explain()."""

import contextlib
import copy
import dataclasses
from importlib.metadata import entry_points

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.registry import list_backends, lookup_backend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import compile_pass
from builders import OP, ToyLM
from rewrite_proof import compare_with_stock
from compile_pass import ChunkcePreGradPass, Options, cache_key, chunkce_backend

pytestmark = pytest.mark.usefixtures("fresh_compile")

B, T, H, V = 2, 6, 16, 29
OP_NAME = "chunkce.linear_cross_entropy"


def make_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[1, -2:] = -100
    return torch.randn(B, T, H, generator=gen).requires_grad_(), labels


class Toy(ToyLM):
    def __init__(self):
        super().__init__(H, V)


def test_backend_is_registered_by_entry_point_and_on_import():
    """The installed entry point, which ``import compile_pass`` leaves to Dynamo (a source
    checkout's stand-in is resolved in a fresh process by tests/integration/test_entry_points.py)."""
    (entry,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "chunkce"]
    assert entry.value == "compile_pass.backend:chunkce_backend"
    assert compile_pass.BACKEND_ENTRY_POINT == entry
    assert "chunkce" in list_backends()
    assert lookup_backend("chunkce") is chunkce_backend


@pytest.mark.slow
def test_toy_model_matches_inductor(eager_kernels):
    recorder, code = compare_with_stock(Toy(), *make_inputs(), inner="inductor")
    recorder.assert_rewritten(B * T, V)
    assert OP_NAME in code and "linear_cross_entropy_backward" in code
    assert counters["chunkce"]["sites_rewritten"] == 1


def test_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown option 'chunk_sise'"):
        Options.from_mapping({"chunk_sise": 128})
    model = torch.compile(Toy(), backend="chunkce", options={"chunk_sise": 128})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="chunk_sise") as info:
        model(*make_inputs())
    assert isinstance(info.value.inner_exception, ValueError)


@pytest.mark.parametrize("bad", [{"chunk_size": 0}, {"strict": "yes"}, {"inner_backend": 3}])
def test_bad_option_values_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        Options.from_mapping(bad)


@pytest.mark.parametrize("bad,error", [({"chunk_size": -3}, ValueError), ({"strict": "yes"}, TypeError),
                                       ({"inner_backend": "chunkce"}, ValueError)])
def test_bad_options_are_rejected_at_the_first_call_with_when_and_how_to_check_earlier(bad, error):
    """torch.compile stores options= and hands them to the backend only at the first call (no hook
    to check them earlier): the error says so, and Options(...) checks them where they are built."""
    model = torch.compile(Toy(), backend="chunkce", options=bad)  # accepted: nothing checks it yet
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        model(*make_inputs())
    assert isinstance(info.value.inner_exception, error)
    message = str(info.value.inner_exception)
    assert message.startswith("chunkce: expected option") and "first call" in message
    assert "options=compile_pass.Options(...)" in message
    with pytest.raises(error, match="chunkce: expected option"):
        Options(**bad)


def test_options_object_is_taken_by_torch_compile(eager_kernels):
    model = torch.compile(Toy(), backend="chunkce", options=Options(inner_backend="aot_eager", chunk_size=5))
    torch.testing.assert_close(model(*make_inputs()), Toy()(*make_inputs()))
    assert counters["chunkce"]["sites_rewritten"] == 1 and compile_pass.last_report().records[0].chunk_size == 5


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_debug_inner_backends(inner, eager_kernels):
    model, reference = Toy(), Toy()
    loss = torch.compile(model, backend="chunkce", options={"inner_backend": inner, "chunk_size": 5})(*make_inputs())
    loss.backward()
    expected = reference(*make_inputs())
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad)
    assert counters["chunkce"]["sites_rewritten"] == 1
    assert compile_pass.last_report().records[0].chunk_size == 5


def test_inductor_config_and_mode_are_forwarded_to_compile_fx(monkeypatch, eager_kernels):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen["config_patches"] = config_patches
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    chunkce_backend(gm, [torch.randn(2)], options={"inductor_config": {"max_autotune": True}}, mode="reduce-overhead")
    assert seen["config_patches"]["max_autotune"] is True
    assert seen["config_patches"]["triton.cudagraphs"] is True
    with pytest.raises(ValueError, match="Inductor inner backend only"):
        chunkce_backend(gm, [torch.randn(2)], options={"inner_backend": "eager", "inductor_config": {"a": 1}})


@pytest.mark.slow
def test_pre_grad_pass_rewrites_under_stock_inductor_and_the_cache_cannot_serve_the_unrewritten_graph(
        eager_kernels, fresh_inductor_cache):
    h, labels = make_inputs()
    with torch._inductor.config.patch(fx_graph_cache=True):
        # 1. Stock Inductor fills the caches with the unrewritten graph.
        stock_model = Toy()
        stock_loss = torch.compile(stock_model, backend="inductor")(h, labels)
        stock_loss.backward()
        assert counters["chunkce"]["sites_found"] == 0
        # 2. Same graph, now with the pass: it must run, and no cache may answer for it.
        hits = counters["inductor"]["fxgraph_cache_hit"]
        model = Toy()
        with torch._inductor.config.patch(pre_grad_custom_pass=ChunkcePreGradPass()):
            compiled = torch.compile(model, backend="inductor")
            loss, code = run_and_get_code(compiled, h, labels)
        loss.backward()
    assert counters["chunkce"]["sites_rewritten"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == hits
    assert OP_NAME in "\n".join(code)
    torch.testing.assert_close(loss, stock_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), stock_model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_pre_grad_pass_uuid_follows_options_and_source(monkeypatch):
    assert ChunkcePreGradPass().uuid() == ChunkcePreGradPass().uuid()
    assert ChunkcePreGradPass({"chunk_size": 256}).uuid() != ChunkcePreGradPass().uuid()
    assert ChunkcePreGradPass({"strict": True}).uuid() != ChunkcePreGradPass().uuid()
    assert isinstance(ChunkcePreGradPass(), torch._inductor.custom_graph_pass.CustomGraphPass)
    before = ChunkcePreGradPass().uuid()
    monkeypatch.setattr(cache_key, "source_hash", lambda: "another source")
    assert ChunkcePreGradPass().uuid() != before


def test_source_hash_covers_every_py_file_of_the_package_walked(monkeypatch, tmp_path):
    from torch._inductor.custom_graph_pass import get_hash_for_files

    def uncached():  # a new process's hash (Inductor's helper keeps its last answer)
        get_hash_for_files.cache_clear()
        return cache_key.source_hash.__wrapped__()

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not source\n")
    monkeypatch.setattr(cache_key, "PACKAGE_DIR", tmp_path)
    hashes = [uncached()]
    (tmp_path / "notes.txt").write_text("still not source\n")
    assert uncached() == hashes[0]
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    hashes.append(uncached())
    (tmp_path / "a.py").write_text("x = 3\n")
    hashes.append(uncached())
    (tmp_path / "a.py").rename(tmp_path / "c.py")  # the same source under another name
    hashes.append(uncached())
    assert len(set(hashes)) == 4
    monkeypatch.undo()
    assert cache_key.source_hash() == uncached()  # the package's own, cached


def test_backend_tags_the_inner_compile_with_source_and_options(eager_kernels):
    seen = []

    def inner(gm, example_inputs):
        seen.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    options = {"inner_backend": inner, "chunk_size": 7}
    ours = f"chunkce:{cache_key.source_hash()}:{Options.from_mapping(options).cache_key()}"
    chunkce_backend(gm, [torch.randn(2)], options=options)
    assert seen == [ours] and torch.compiler.config.cache_key_tag == ""
    with torch.compiler.config.patch(cache_key_tag="users-own-tag"):
        chunkce_backend(gm, [torch.randn(2)], options=options)
        assert torch.compiler.config.cache_key_tag == "users-own-tag"
    assert seen[1] == f"users-own-tag|{ours}"
    assert torch.compiler.config.cache_key_tag == ""


def test_cache_key_is_every_field_and_equal_for_equal_options():
    """Options.cache_key names every field (a new option cannot be left out of the cache key),
    and equal options, spelled differently, give one key."""
    changed = {"chunk_size": 7, "strict": True, "inner_backend": "aot_eager", "inductor_config": {"x": 1},
               "returned_logits": "keep", "chunk_bytes": 1024, "grads_in_forward": True}
    assert set(changed) == {f.name for f in dataclasses.fields(Options)}
    default = Options().cache_key()
    assert [part.split("=", 1)[0] for part in default.split(";")] == [f.name for f in dataclasses.fields(Options)]
    for name, value in changed.items():
        assert Options(**{name: value}).cache_key() != default, name
    assert Options(returned_logits=None).cache_key() == default and Options(returned_logits=None) == Options()
    assert (Options.from_mapping({"inductor_config": {"b": 1, "a": 2}}).cache_key()
            == Options(inductor_config={"a": 2, "b": 1}).cache_key())
    assert hash(Options(chunk_size=3)) == hash(Options.from_mapping({"chunk_size": 3}))


class TwoHeads(nn.Module):
    """One rewritable loss, one soft-capped one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.aux_head = nn.Linear(H, V, bias=False)

    def forward(self, h, labels):
        main = F.cross_entropy(self.lm_head(h).view(-1, V), labels.view(-1))
        capped = torch.tanh(self.aux_head(h) / 10.0) * 10.0
        return main + F.cross_entropy(capped.view(-1, V), labels.view(-1))


def test_explain_reports_every_site(eager_kernels):
    report = compile_pass.explain(TwoHeads(), *make_inputs())
    rewritten, refused = report.records
    assert (rewritten.decision, rewritten.module) == ("rewritten", "lm_head")
    assert rewritten.logits_bytes_avoided == 3 * B * T * V * 4  # logits, log-softmax, their gradient
    assert isinstance(rewritten.chunk_size, int) and rewritten.chunk_size >= 1
    assert "test_backend.py" in rewritten.source and "main = F.cross_entropy" in rewritten.source
    assert refused.decision == "refused" and "`tanh` between projection and loss" in refused.reason
    table = str(report)
    assert table.splitlines()[0] == "chunkce: 2 cross-entropy site(s), 1 rewritten, 1 refused"
    assert "soft-capped logits" in table and "lm_head" in table


class ReturnsLogits(Toy):
    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h)))
        return F.cross_entropy(logits.view(-1, V), labels.view(-1)), logits


def test_explain_runs_the_pass_with_the_users_options(eager_kernels):
    """explain reports what the backend would do with the same options: the returned logits'
    fate, the tiles; ``strict`` raises the backend's error for a refused site."""
    from compile_pass.graph.report import LOGITS_KEPT, LOGITS_LAZY

    (lazy,) = compile_pass.explain(ReturnsLogits(), *make_inputs()).records
    (kept,) = compile_pass.explain(ReturnsLogits(), *make_inputs(),
                                   options={"returned_logits": "keep", "chunk_size": 5}).records
    assert (lazy.reason, kept.reason) == (LOGITS_LAZY, LOGITS_KEPT)
    assert kept.chunk_size == 5 and lazy.chunk_size != 5
    assert kept.logits_bytes_avoided < lazy.logits_bytes_avoided  # the kept logits are still computed
    with pytest.raises(NotImplementedError, match="soft-capped logits.*strict=True"):
        compile_pass.explain(TwoHeads(), *make_inputs(), options=Options(strict=True))
    with pytest.raises(ValueError, match="unknown option 'chunk'"):
        compile_pass.explain(Toy(), *make_inputs(), options={"chunk": 5})


def test_explain_names_a_graph_break_between_projection_and_loss(eager_kernels):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, h, labels):
            logits = self.lm_head(h)
            torch._dynamo.graph_break()
            return F.cross_entropy(logits.view(-1, V), labels.view(-1))

    report = compile_pass.explain(Broken(), *make_inputs())
    (record,) = report.records
    assert record.decision == "refused" and "graph broke between the projection and the loss" in record.reason
    assert record.fix.startswith("fix: remove the graph break")
    assert report.graph_breaks and "graph broke" in str(report) and "graph break:" in str(report)


@contextlib.contextmanager
def kernel_cache_entries():
    """Dynamo's compiled entries of each per-chunk kernel variant run so far."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from compile_pass.op import kernel_runner

    run = {}
    with kernel_runner.hooked_runs(lambda name, variant: run.setdefault(
            (name, variant, kernel_runner.in_walk_thread()), None)):  # a walk thread's: the one-thread variant
        yield run
    for name, variant, one_thread in run:
        code = kernel_runner.compiled(name, variant, one_thread)._torchdynamo_orig_callable.__code__
        run[name, variant, one_thread] = len(_debug_get_cache_entry_list(code))


def test_explain_leaves_the_op_kernels_compiled(monkeypatch):
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)
    h, labels = make_inputs()
    weight = torch.randn(V, H)
    with kernel_cache_entries() as before:
        expected = compile_pass.linear_cross_entropy(h.detach().view(-1, H), weight, labels.view(-1))
    assert before and all(n >= 1 for n in before.values()), before  # the per-chunk kernels, compiled by Dynamo
    report = compile_pass.explain(TwoHeads(), *make_inputs())
    assert [r.decision for r in report.records] == ["rewritten", "refused"]
    with kernel_cache_entries() as after:
        loss = compile_pass.linear_cross_entropy(h.detach().view(-1, H), weight, labels.view(-1))
    assert after == before, "explain dropped a kernel's compiled code, or the kernel compiled again"
    torch.testing.assert_close(loss, expected)


@pytest.mark.slow
def test_dynamo_stats_are_stocks(monkeypatch):
    """Dynamo's counters["stats"] (unique_graphs, calls_captured) after two compiled training steps are
    what a stock Inductor compile of the same model leaves: the op's per-chunk kernels, which
    chunkce compiles with Dynamo too, are not counted."""
    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)

    def stats(backend):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(Toy(), backend=backend, dynamic=False)
        for seed in (0, 1):
            compiled(*make_inputs(seed)).backward()
        return dict(counters["stats"]), dict(counters["chunkce"])

    stock, _ = stats("inductor")
    ours, chunkce = stats("chunkce")
    assert chunkce["sites_rewritten"] == 1, chunkce
    assert ours == stock and stock["unique_graphs"] == 1, (ours, stock)


def test_explain_many_times_reports_each_time_and_keeps_the_users_compile(eager_kernels):
    model = TwoHeads()
    compiled = torch.compile(model, backend="aot_eager")
    expected = compiled(*make_inputs())
    graphs = counters["stats"]["unique_graphs"]

    class Broken(TwoHeads):
        def forward(self, h, labels):
            logits = self.lm_head(h)
            torch._dynamo.graph_break()
            return F.cross_entropy(logits.view(-1, V), labels.view(-1))

    broken = Broken()
    with torch._dynamo.config.patch(recompile_limit=2):  # a low limit: three calls are over it
        for _ in range(torch._dynamo.config.recompile_limit + 1):  # more than Dynamo's recompile limit
            assert [r.decision for r in compile_pass.explain(model, *make_inputs()).records] == ["rewritten", "refused"]
            (record,) = compile_pass.explain(broken, *make_inputs()).records
            assert record.decision == "refused" and "graph broke" in record.reason
    graphs_by_explain = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(compiled(*make_inputs()), expected)
    assert counters["stats"]["unique_graphs"] == graphs_by_explain > graphs  # no recompile of the user's model


def test_explain_leaves_the_counters_and_the_last_report_alone(eager_kernels):
    compiled = torch.compile(Toy(), backend="chunkce", options={"inner_backend": "aot_eager"})
    compiled(*make_inputs())
    before, last = dict(counters["chunkce"]), compile_pass.last_report()
    assert before["sites_rewritten"] == 1
    report = compile_pass.explain(TwoHeads(), *make_inputs())
    assert [r.decision for r in report.records] == ["rewritten", "refused"]
    assert dict(counters["chunkce"]) == before and compile_pass.last_report() is last


class Float64Temperature(nn.Module):
    """``logits / buffer`` with a float64 0-d buffer: Dynamo traces the frame twice on a cold
    cache ([0/0], then [0/0_1] after AOTAutograd's tensorify pass restarts it), as for stock."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.register_buffer("temperature", torch.tensor(0.7, dtype=torch.float64))

    def forward(self, h, labels):
        return F.cross_entropy((self.lm_head(h) / self.temperature).float().view(-1, V), labels.view(-1))


def test_a_frame_dynamo_traces_again_is_counted_and_logged_once(eager_kernels, chunkce_logs):
    model = Float64Temperature()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
    torch.testing.assert_close(compiled(*make_inputs()), model(*make_inputs()))
    assert counters["stats"]["unique_graphs"] == 1
    stats = counters["chunkce"]
    assert (stats["sites_found"], stats["sites_rewritten"], stats["sites_refused"]) == (1, 1, 0), dict(stats)
    assert stats["logits_bytes_avoided"] == compile_pass.last_report().records[0].logits_bytes_avoided
    rewrote = [r for r in chunkce_logs.records if r.getMessage().startswith("chunkce: rewrote")]
    assert len(rewrote) == 1


def test_a_graph_the_inner_backend_fails_on_is_not_counted(eager_kernels):
    """An inner backend that fails on a data-dependent op (as aot_eager on ``nonzero``): Dynamo
    breaks the graph and traces again; only the graphs it then compiles are reported."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    compiled_graphs = []

    def inner(gm, example_inputs):
        if not compiled_graphs and not getattr(inner, "failed", False):
            inner.failed = True
            raise DynamicOutputShapeException(torch.ops.aten.nonzero.default)
        compiled_graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    model = Toy()
    compiled = torch.compile(model, backend="chunkce", options={"inner_backend": inner})
    torch.testing.assert_close(compiled(*make_inputs()), model(*make_inputs()))
    assert inner.failed
    op_nodes = sum(node.target is OP for gm in compiled_graphs for node in gm.graph.nodes)
    stats = counters["chunkce"]
    assert (stats["sites_found"], stats["sites_rewritten"]) == (op_nodes, op_nodes), (dict(stats), op_nodes)


@pytest.mark.slow
def test_llama_loss_and_every_gradient_match_inductor(eager_kernels):
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_of(m):
        return lambda input_ids: m(input_ids=input_ids, labels=input_ids).loss

    loss, code = run_and_get_code(torch.compile(loss_of(model), backend="chunkce"), ids)
    loss.backward()
    expected = torch.compile(loss_of(reference), backend="inductor")(ids)
    expected.backward()
    assert OP_NAME in "\n".join(code)
    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["sites_refused"], stats["logits_kept"]) == (1, 0, 0)
    torch.testing.assert_close(loss, expected)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_dynamic_true_compiles_the_models_frame_as_often_as_stock(monkeypatch):
    """``dynamic=True`` over six sequence lengths: the model's frame is compiled once, as stock's is
    (``counters["stats"]["unique_graphs"]`` 1 for both: the op's kernels leave Dynamo's stats as stock's),
    the op's two per-tile kernels (``chunk_forward``, ``chunk_backward``) are compiled once each for
    every length (``counters["chunkce"]["kernel_graphs"]`` 2), and no length after the first compiles
    anything again (``error_on_recompile``). Loss and every gradient as stock's.

    Frames are counted by Dynamo (``counters["frames"]["ok"]``), not by backend calls: the first
    compile of the model's code in a process is traced twice (Dynamo restarts its analysis for
    ``_tensorify_python_scalars``, ``[0/0]`` then ``[0/0_1]``), whichever backend compiles it first."""
    import transformers

    from compile_pass.op import kernel_runner

    monkeypatch.delenv("CHUNKCE_EAGER_KERNELS", raising=False)  # the kernels compiled, as a user runs them
    kernel_runner.compiled.cache_clear()
    config = transformers.LlamaConfig(vocab_size=2053, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="chunkce", dynamic=True, options={"inner_backend": "aot_eager"})
    stock = torch.compile(reference, backend="aot_eager", dynamic=True)
    lengths = (5, 9, 13, 17, 24, 31)

    def train(module, ids):
        module.zero_grad(set_to_none=True)
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in module.named_parameters()}

    def run(module):
        steps, graphs, frames = [], counters["stats"]["unique_graphs"], counters["frames"]["ok"]
        kernels = counters["chunkce"]["kernel_graphs"]
        for i, seq in enumerate(lengths):
            ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                steps.append(train(module, ids))
        return (steps, counters["stats"]["unique_graphs"] - graphs, counters["frames"]["ok"] - frames,
                counters["chunkce"]["kernel_graphs"] - kernels)

    (got, graphs, frames, kernels), (expected, stock_graphs, stock_frames, _) = run(compiled), run(stock)
    assert frames == stock_frames == 1
    assert kernel_runner.compiled.cache_info().currsize == 2
    assert (graphs, stock_graphs, kernels) == (1, 1, 2)
    for (loss, grads), (expected_loss, expected_grads) in zip(got, expected, strict=True):
        torch.testing.assert_close(loss, expected_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], msg=lambda m, name=name: f"{name}: {m}")
