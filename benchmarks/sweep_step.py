"""One architecture through the pass: a tiny model's training step eager, under stock
``inner`` and under ``backend="chunkce"`` (``inner`` inside), and the outcome.

    row = run_architecture("llama")    # {"outcome": "rewritten", "max_abs_diff": ..., ...}
    row = run_architecture("bart", family="seq2seq")    # BartForConditionalGeneration

One outcome per architecture (:data:`OUTCOMES`); "rewritten" means the op's node is
in the graph the inner backend was given (:class:`GraphRecorder`), no ``[N, V]``
node is (``returned_logits="drop"``), and the loss and every parameter gradient equal
stock's (``torch.testing.assert_close``, fp32). Never raises for a model's failure:
that is the row. The models and batches come from ``benchmarks.tiny_families``.
"""

from __future__ import annotations

import copy
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any

from benchmarks.tiny_families import architectures, batch_for, build
from benchmarks.tiny_models import BATCH, SEQ, VOCAB_SIZE

OUTCOMES = ("rewritten", "differs", "refused", "graph_break", "no_site", "error", "not_built")


@dataclass
class Step:
    loss: Any
    grads: dict[str, Any]


def train_step(model, batch: dict[str, Any]) -> Step:
    import torch

    torch.manual_seed(0)
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss for labels=")
    loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad for name, p in model.named_parameters() if p.grad is not None}
    return Step(loss.detach(), grads)


def _exception(error: BaseException) -> str:
    text = " ".join(str(error).split())  # a validation error's cause is on its second line
    return f"{type(error).__name__}: {text[:300]}".rstrip(": ")


def _largest(difference) -> float:
    """The largest element of ``difference`` (0.0 for an empty one: a parameter of no elements)."""
    return difference.abs().max().item() if difference.numel() else 0.0


def _max_abs_diff(got: Step, expected: Step) -> float:
    diffs = [_largest(got.loss - expected.loss)]
    diffs += [_largest(got.grads[n] - expected.grads[n]) for n in expected.grads if n in got.grads]
    return max(diffs)


def _fp64_error(step: Step, truth: Step) -> float:
    """Max abs difference of the loss and every gradient from the float64 run's."""
    errors = [_largest(step.loss.double() - truth.loss)]
    errors += [_largest(step.grads[n].double() - truth.grads[n]) for n in truth.grads if n in step.grads]
    return max(errors)


def _compare(got: Step, expected: Step) -> str:
    """'' when loss and every gradient are close (torch's fp32 tolerances), else what differs."""
    import torch

    if got.grads.keys() != expected.grads.keys():
        return f"gradients of different parameters: {sorted(got.grads.keys() ^ expected.grads.keys())[:5]}"
    try:
        torch.testing.assert_close(got.loss, expected.loss, msg=lambda m: f"loss: {m}")
        for name in expected.grads:
            torch.testing.assert_close(got.grads[name], expected.grads[name],
                                       msg=lambda m, name=name: f"{name}.grad: {m}")
    except AssertionError as error:
        return " ".join(str(error).split())[:400]
    return ""


LOSS_OPS = re.compile(r"nll_loss|log_softmax|logsumexp|cross_entropy|CrossEntropyLoss")


class GraphRecorder:
    """An inner backend: notes what each graph holds (op nodes, ``[N, V]`` nodes, loss-like
    calls) and the pass's report for it, then compiles it with ``inner``."""

    def __init__(self, inner: str, tokens: int, vocab: int) -> None:
        import compile_pass

        self.inner, self.tokens, self.vocab = inner, tokens, vocab
        self.graphs = 0
        self.op_nodes = 0
        self.logits_nodes: list[str] = []
        self.loss_calls: list[str] = []
        self.reports: list[Any] = []
        self._seen = compile_pass.last_report()

    def __call__(self, gm, example_inputs):
        import torch
        from torch._dynamo.backends.registry import lookup_backend
        from torch.fx import GraphModule

        import compile_pass

        self.graphs += 1
        op = torch.ops.chunkce.linear_cross_entropy.default
        for module in gm.modules():
            if not isinstance(module, GraphModule):
                continue
            for node in module.graph.nodes:
                self.op_nodes += node.target is op
                target = str(getattr(node.target, "__name__", node.target))
                if node.op in ("call_function", "call_method", "call_module") and LOSS_OPS.search(target):
                    self.loss_calls.append(target)
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor) and self._is_logits(value):
                    self.logits_nodes.append(f"{node.name} {tuple(value.shape)}")
        compiled = lookup_backend(self.inner)(gm, example_inputs)
        return self._noting_report(compiled)

    def _noting_report(self, compiled):
        """``compiled``, noting the pass's report for its graph at its first call: chunkce
        publishes a graph's report once this inner backend has compiled it (a compile that
        Dynamo restarts publishes nothing), and Dynamo runs a graph right after compiling it."""
        import compile_pass

        noted = False

        def run(*args):
            nonlocal noted
            if not noted:
                noted = True
                report = compile_pass.last_report()
                if report is not None and report is not self._seen and all(report is not r for r in self.reports):
                    self.reports.append(report)
            return compiled(*args)

        return run

    def _is_logits(self, value) -> bool:
        from compile_pass.graph.nodes import size_hint

        shape = [size_hint(s) for s in value.shape]
        if not shape or shape[-1] != self.vocab:
            return False
        if any(size_hint(st) == 0 and size > 1 for st, size in zip(value.stride(), shape)):
            return False  # a broadcast stand-in (dropped logits): no memory
        numel = 1
        for size in shape:
            numel *= size
        return numel >= BATCH * (SEQ - 1) * self.vocab  # the logits or their shifted part


def run_architecture(model_type: str, inner: str = "aot_eager", progress=lambda stage: None,
                     family: str = "causal_lm") -> dict[str, Any]:
    """One training step of the tiny model of ``model_type``'s class in ``family``
    (``benchmarks.tiny_families.FAMILIES``): eager, stock ``inner`` and chunkce (``inner``
    inside); returns the result row (``outcome`` one of :data:`OUTCOMES`, with the fields
    that explain it). Never raises for a model's failure: that is the row."""
    import torch
    import transformers
    from torch._dynamo.utils import counters

    started = time.perf_counter()
    model_class = architectures(family)[model_type]
    row: dict[str, Any] = {"model_type": model_type, "model_class": model_class, "inner": inner}
    if family != "causal_lm":
        row["family"] = family

    def done(outcome: str, **fields: Any) -> dict[str, Any]:
        row.update(outcome=outcome, seconds=round(time.perf_counter() - started, 1), **fields)
        return row

    torch._dynamo.reset()
    counters.clear()
    progress("build")
    try:
        model = build(family, model_type)
    except Exception as error:  # noqa: BLE001 - the row says why
        return done("not_built", detail=f"build: {_exception(error)}")
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None and hasattr(head, "weight") else VOCAB_SIZE
    row["parameters"] = sum(p.numel() for p in model.parameters())
    try:
        batch = batch_for(family, model_type, model, min(vocab, VOCAB_SIZE))
    except Exception as error:  # noqa: BLE001
        return done("not_built", detail=f"batch: {_exception(error)}")
    stock_model, chunkce_model = copy.deepcopy(model), copy.deepcopy(model)
    progress("eager step")
    try:
        eager = train_step(model, batch)
    except Exception as error:  # noqa: BLE001
        return done("not_built", detail=f"eager step: {_exception(error)}")

    progress(f"stock {inner}")
    stock_recorder = GraphRecorder(inner, BATCH * SEQ, vocab)
    try:
        stock = train_step(torch.compile(stock_model, backend=stock_recorder), batch)
        stock_error = ""
    except Exception as error:  # noqa: BLE001
        stock, stock_error = None, _exception(error)
    stock_breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    counters.clear()

    progress(f"chunkce ({inner} inside)")
    recorder = GraphRecorder(inner, BATCH * SEQ, vocab)
    options = {"inner_backend": recorder, "returned_logits": "drop"}
    try:
        got = train_step(torch.compile(chunkce_model, backend="chunkce", options=options), batch)
    except Exception as error:  # noqa: BLE001
        if stock_error:
            return done("error", stock_fails=True, detail=f"stock {inner}: {stock_error}; chunkce: "
                                                          f"{_exception(error)}")
        return done("error", stock_fails=False, detail=f"only chunkce fails: {_exception(error)}",
                    traceback=traceback.format_exc()[-3000:])
    if stock_error:
        return done("error", stock_fails=True, detail=f"only stock {inner} fails: {stock_error}")
    stats = dict(counters["chunkce"])
    breaks = [f"{reason} (x{n})" for reason, n in counters["graph_break"].items()]
    records = [record for report in recorder.reports for record in report.records]
    row.update(sites=len(records), graph_breaks=breaks, stock_graph_breaks=stock_breaks,
               eager_vs_stock=_max_abs_diff(stock, eager), max_abs_diff=_max_abs_diff(got, stock))
    rewritten = [r for r in records if r.decision == "rewritten"]
    refused = [r for r in records if r.decision != "rewritten"]
    mismatch = _compare(got, stock)
    if (len(rewritten), len(refused)) != (stats.get("sites_rewritten", 0), stats.get("sites_refused", 0)):
        return done("differs", detail=f"the reports ({len(rewritten)} rewritten, {len(refused)} refused) "
                                      f"disagree with counters {stats}")
    if mismatch:  # summation order inside the op can be amplified by the model: measure against float64
        progress("float64 eager step")
        truth = train_step(build(family, model_type).double(),
                           {k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
        chunkce_error, stock_error64 = _fp64_error(got, truth), _fp64_error(stock, truth)
        row.update(fp64_error={"chunkce": chunkce_error, "stock": stock_error64})
        if chunkce_error > 2 * stock_error64 + 1e-7:
            return done("differs", detail=f"not equal to stock {inner} and farther from the float64 run "
                                          f"({chunkce_error:.1e} vs stock's {stock_error64:.1e}): {mismatch}",
                        reason_key=",".join(sorted({r.reason_key for r in refused})))
        row["note"] = (f"not within assert_close of stock (max diff {row['max_abs_diff']:.1e}) but as close to "
                       f"the float64 run as stock ({chunkce_error:.1e} vs {stock_error64:.1e})")
    if refused:
        keys = sorted({r.reason_key for r in refused})
        outcome = "graph_break" if "graph_break" in keys else "refused"
        if recorder.op_nodes != len(rewritten):
            return done("differs", detail=f"{recorder.op_nodes} op node(s) for {len(rewritten)} rewritten site(s)")
        return done(outcome, reason_key=",".join(keys), reason=" | ".join(dict.fromkeys(r.reason for r in refused)),
                    fix=" | ".join(dict.fromkeys(r.fix for r in refused if r.fix)),
                    rewritten_sites=len(rewritten))
    if not records:
        calls = sorted(set(recorder.loss_calls))
        if not calls and not stock_recorder.loss_calls:  # e.g. Dynamo fell back to eager for the loss's frame
            return done("no_site", detail="no compiled graph computes the loss (stock's neither): Dynamo ran the "
                                          "frame that computes it eagerly")
        return done("no_site", detail=f"loss-like calls in the graph: {', '.join(calls) or 'none'}")
    if recorder.op_nodes != len(rewritten):
        return done("differs", detail=f"{recorder.op_nodes} op node(s) in the graph for {len(rewritten)} "
                                      f"rewritten site(s)")
    if stats.get("logits_dropped", 0) == len(rewritten) and len(recorder.logits_nodes) >= len(
            stock_recorder.logits_nodes):  # other [N, V] tensors (e.g. BLT's patcher logits) may remain
        return done("differs", detail=f"as many [N, V] nodes as stock's after the rewrite: {recorder.logits_nodes[:3]}")
    if recorder.logits_nodes:
        row["other_logits_nodes"] = recorder.logits_nodes[:4]
    logits = "dropped" if stats.get("logits_dropped", 0) == len(rewritten) else "kept"
    return done("rewritten", logits=logits,
                reason=" | ".join(dict.fromkeys(r.reason for r in rewritten if r.reason)))
