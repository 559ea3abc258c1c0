"""The ``chunkce`` torch.compile backend: the pass, then an inner backend.

    model = torch.compile(model, backend="chunkce")
    model = torch.compile(model, backend="chunkce", options={"chunk_size": 1024, "inner_backend": "aot_eager"})

Dynamo finds it under the name ``chunkce`` through an entry point: the
``torch_dynamo_backends`` one of the installed distribution, or the same one that
``import compile_pass`` adds for a source checkout. Either way Dynamo imports this
module at the first ``torch.compile(..., backend="chunkce")``; that import is
chunkce's first use, and it installs :mod:`compile_pass.dynamo_scope`.

The compiled graph's cache entries are tied to chunkce's source and options: while
the inner backend compiles, ``torch.compiler.config.cache_key_tag`` carries
:func:`compile_pass.cache_key.tag` after the user's own tag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.backends import registry
from torch._dynamo.exc import RestartAnalysis

from compile_pass import cache_key, dynamo_scope
from compile_pass.graph.driver import publish_report, rewrite_losses
from compile_pass.graph.returned_logits import take_out_returned_logits
from compile_pass.lazy_logits import wrap_compiled
from compile_pass.options import Options

log = logging.getLogger(__name__)


def chunkce_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | Options | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Rewrite ``linear -> cross_entropy`` sites of a Dynamo graph, then compile it.

    The losses (:func:`compile_pass.graph.driver.rewrite_losses`), then the returned-logits
    pass (:func:`compile_pass.graph.returned_logits.take_out_returned_logits`), then the
    inner backend; the compiled graph is wrapped (:func:`compile_pass.lazy_logits.wrap_compiled`) when
    logits were taken out, so that the caller gets a ``LazyLogits`` in their place.

    Args:
        gm: the graph Dynamo captured (torch-level ops).
        example_inputs: its (fake) example inputs.
        options: see :class:`compile_pass.options.Options`; torch.compile passes
            its ``options=`` dict here.
        mode: torch.compile's ``mode=``; with the Inductor inner backend it
            selects Inductor's mode options (e.g. ``"max-autotune"``).

    Raises:
        ValueError / TypeError: an unknown option key or a bad value, or ``mode`` /
            ``inductor_config`` with a non-Inductor inner backend. Raised here, at the
            first call of the compiled model (Dynamo wraps it in ``BackendCompilerFailed``):
            ``torch.compile`` stores ``options=`` and hands it over only then, with no
            hook for a backend to check it earlier. ``options=compile_pass.Options(...)``
            is checked where it is built.
        NotImplementedError: ``strict=True`` and a site the pass must refuse.
    """
    try:
        opts = Options.from_mapping(options)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} ({_WHEN_CHECKED})") from None
    inner = opts.inner_backend
    if inner != "inductor" and (opts.inductor_config or mode not in (None, "default")):
        raise ValueError(
            f"chunkce: mode / inductor_config apply to the Inductor inner backend only, got inner_backend={inner!r}"
        )
    dynamo_scope.install()  # for this thread's next frame: its set may predate the first use, or be new
    fused = rewrite_losses(gm.graph, opts)  # the losses
    plan = take_out_returned_logits(gm.graph, fused, opts)  # returned logits only the output reads: lazy, dropped
    gm.recompile()
    retried = False
    try:
        compiled = _compile_inner(gm, example_inputs, opts, mode)
    except RestartAnalysis:  # Dynamo traces the frame again ([0/0] -> [0/0_1]) and calls us again
        retried = True
        raise
    finally:
        if not retried:  # a site is logged and counted once, by the attempt that compiles
            publish_report(fused.report, opts.strict)
    return wrap_compiled(compiled, plan) if plan is not None else compiled


def _compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Options,
                   mode: str | None) -> Callable[..., Any]:
    """The rewritten graph compiled by the inner backend, under chunkce's cache key tag."""
    inner = opts.inner_backend
    with torch.compiler.config.patch(cache_key_tag=_cache_key_tag(opts)):
        if inner == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
            patches.update(opts.inductor_config)
            compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
        else:
            backend = registry.lookup_backend(inner) if isinstance(inner, str) else inner
            compiled = backend(gm, example_inputs)
    return compiled


_WHEN_CHECKED = ("torch.compile hands options= to the backend at the compiled model's first call, so they are "
                 "checked there; pass options=compile_pass.Options(...) to have them checked where you write them")


def _cache_key_tag(opts: Options) -> str:
    """The user's own ``cache_key_tag`` (if any), then chunkce's source hash and options."""
    user_tag = torch.compiler.config.cache_key_tag
    return f"{user_tag}|{cache_key.tag(opts)}" if user_tag else cache_key.tag(opts)


dynamo_scope.mark(chunkce_backend)  # transformers' one-shot logging does not break its graphs
dynamo_scope.install()  # importing this module is chunkce's first use (see the module docstring)
