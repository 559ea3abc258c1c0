"""The ``chunkce`` torch.compile backend: the pass, then an inner backend (docs/api.md).

    model = torch.compile(model, backend="chunkce", options={"inner_backend": "aot_eager"})
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import compile_pass.torch_internals as internals
from compile_pass import cache_key, dynamo_scope
from compile_pass.graph.pipeline import run_pass
from compile_pass.graph.report import publish
from compile_pass.lazy_logits import computed_where_input, wrap_compiled
from compile_pass.options import Options

log = logging.getLogger(__name__)


def chunkce_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | Options | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Rewrite the ``linear -> cross_entropy`` sites of Dynamo's graph ``gm``, compile it with the
    inner backend, and wrap it to return ``LazyLogits`` where logits were taken out.
    ``options``: :class:`compile_pass.options.Options` or torch.compile's ``options=`` dict;
    ``mode``: torch.compile's, for the Inductor inner backend.

    Raises:
        ValueError / TypeError: a bad option (at the compiled model's first call: torch hands
            ``options=`` over only then), or ``mode`` / ``inductor_config`` with another inner backend.
        NotImplementedError: ``strict=True`` and a site the pass must refuse.
    """
    try:
        opts = Options.from_mapping(options)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} ({_WHEN_CHECKED})") from None
    if not opts.inductor and (opts.inductor_config or mode not in (None, "default")):
        raise ValueError(f"chunkce: mode / inductor_config apply to the Inductor inner backend only, got "
                         f"inner_backend={opts.inner_backend!r}")
    dynamo_scope.install()  # for this thread's next frame: its set may predate the first use, or be new
    computed_where_input(example_inputs)  # a piece of DDP's split graph taking an earlier piece's lazy logits
    result = run_pass(gm.graph, opts, take_out=True, publish=False)
    gm.recompile()
    # reported only once compiled: a graph the inner backend fails on is traced again by Dynamo
    compiled = _compile_inner(gm, example_inputs, opts, mode)
    publish(result.report, opts.strict)
    return wrap_compiled(compiled, result.returned) if result.returned is not None else compiled


def _compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Options,
                   mode: str | None) -> Callable[..., Any]:
    """The rewritten graph compiled by the inner backend, under chunkce's cache key tag."""
    inner = opts.inner_backend
    with torch.compiler.config.patch(cache_key_tag=_cache_key_tag(opts)):
        if opts.inductor:
            patches = dict(internals.list_mode_options(mode)) if mode not in (None, "default") else {}
            patches.update(opts.inductor_config)
            compiled = internals.compile_fx(gm, example_inputs, config_patches=patches or None)
        else:
            backend = internals.lookup_backend(inner) if isinstance(inner, str) else inner
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
