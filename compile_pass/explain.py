"""``explain(model, *args, options=None, **kwargs)``: what the pass would do, site by site.

    print(compile_pass.explain(model, input_ids=ids, labels=ids, options={"returned_logits": "keep"}))

One forward through Dynamo with a capturing backend that runs the pass on a copy of each
graph (the forward runs the original, uncompiled). Dynamo is not reset: afterwards only the
code caches holding the capture's entries are dropped (its root function; where the graph
broke, the model's frames, whose entries for other backends recompile on their next call).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import compile_pass.torch_internals as internals
from compile_pass import dynamo_scope
from compile_pass.graph.pipeline import run_pass
from compile_pass.graph.report import PassReport
from compile_pass.options import Options

log = logging.getLogger(__name__)


def explain(model: Callable[..., Any], *args: Any, options: Mapping[str, Any] | Options | None = None,
            **kwargs: Any) -> PassReport:
    """Report every cross-entropy site ``model(*args, **kwargs)`` reaches, as the ``chunkce``
    backend with ``options`` (:class:`compile_pass.options.Options`) would rewrite it.

    Returns a :class:`compile_pass.graph.report.PassReport` (``str()``: a table), with the graph
    breaks Dynamo gave and the projections to the vocabulary no site reads; nothing is logged.

    Raises:
        ValueError / TypeError: a bad option. NotImplementedError: ``strict`` and a refused site
        (the backend's error).
    """
    opts = Options.from_mapping(options)
    reports: list[PassReport] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        copy = torch.fx.GraphModule(gm, graph)
        reports.append(run_pass(copy.graph, opts, take_out=True, publish=False).report)  # as the backend
        return gm.forward

    def root(*args: Any, **kwargs: Any) -> Any:
        # Dynamo's root frame. Not ``torch.compile(model)``: that roots every module
        # at one wrapper code object, whose cache the user's compiled modules share.
        return model(*args, **kwargs)

    dynamo_scope.mark(capture)  # trace as the chunkce backend does (transformers' one-shot logging skipped)
    dynamo_scope.install()
    breaks_before = dict(internals.counters.get()["graph_break"])
    try:
        torch.compile(root, backend=capture)(*args, **kwargs)
    except internals.backend_compiler_failed.get() as exc:  # strict=True and a refused site: the pass's own error
        raise exc.inner_exception from exc
    finally:
        _forget(capture)
    breaks = [reason for reason, n in internals.counters.get()["graph_break"].items() if n > breaks_before.get(reason, 0)]
    return PassReport([record for r in reports for record in r.records], graph_breaks=breaks,
                      unmatched=[record for r in reports for record in r.unmatched],
                      returned=[record for r in reports for record in r.returned])


def _forget(backend: Callable[..., Any]) -> None:
    """Drop Dynamo's caches of every code object holding an entry compiled for ``backend``,
    and Dynamo's reference to ``backend`` (only ``torch._dynamo.reset()`` clears it)."""
    def compiled_for(entry_backend: Any) -> bool:
        return any(b is backend for b in dynamo_scope.unwrapped(entry_backend))

    with internals.compile_lock.get():
        for ref in list(internals.input_codes.get().seen):
            code = ref()
            entries = internals.cache_entry_list(code) if code is not None else []
            ours = sum(compiled_for(e.backend) for e in entries)
            if not ours:
                continue
            if ours < len(entries):
                log.debug("chunkce.explain: dropping Dynamo's cache of %s (%s:%s), with %d entries of other "
                          "backends; they recompile on their next call", code.co_name, code.co_filename,
                          code.co_firstlineno, len(entries) - ours)
            internals.reset_code(code)
        cached_backends = internals.cached_backends.get()
        for key, cached in list(cached_backends.items()):
            if compiled_for(cached):
                del cached_backends[key]
