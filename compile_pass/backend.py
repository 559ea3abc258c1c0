"""The ``chunkce`` torch.compile backend: the pass, then an inner backend.

    model = torch.compile(model, backend="chunkce")
    model = torch.compile(model, backend="chunkce", options={"chunk_size": 1024, "inner_backend": "aot_eager"})

Registered under the name ``chunkce`` twice over: by the ``torch_dynamo_backends``
entry point of the installed distribution, and on ``import compile_pass`` (so a
source checkout without install metadata works too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import EntryPoint
from typing import Any

import torch
from torch._dynamo.backends import registry

from compile_pass import dynamo_scope
from compile_pass.graph import logits_drop
from compile_pass.graph import fuse_linear_cross_entropy
from compile_pass.options import Options

log = logging.getLogger(__name__)

BACKEND_NAME = "chunkce"


def chunkce_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | Options | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Rewrite ``linear -> cross_entropy`` sites of a Dynamo graph, then compile it.

    Args:
        gm: the graph Dynamo captured (torch-level ops).
        example_inputs: its (fake) example inputs.
        options: see :class:`compile_pass.options.Options`; torch.compile passes
            its ``options=`` dict here.
        mode: torch.compile's ``mode=``; with the Inductor inner backend it
            selects Inductor's mode options (e.g. ``"max-autotune"``).

    Raises:
        ValueError: an unknown option key, or ``mode`` / ``inductor_config`` with
            a non-Inductor inner backend.
        NotImplementedError: ``strict=True`` and a site the pass must refuse.
    """
    opts = Options.from_mapping(options)
    inner = opts.inner_backend
    if inner == BACKEND_NAME:
        raise ValueError("chunkce: inner_backend cannot be 'chunkce' itself; use 'inductor', 'aot_eager' or 'eager'")
    if inner != "inductor" and (opts.inductor_config or mode not in (None, "default")):
        raise ValueError(
            f"chunkce: mode / inductor_config apply to the Inductor inner backend only, got inner_backend={inner!r}"
        )
    dynamo_scope.install()  # for the next frame, should someone have replaced Dynamo's ignore set since
    fuse_linear_cross_entropy(gm.graph, opts)
    gm.recompile()
    dropped = logits_drop.dropped_positions(gm.graph)  # only with drop_unused_logits
    if inner == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
        patches.update(opts.inductor_config)
        compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    else:
        backend = registry.lookup_backend(inner) if isinstance(inner, str) else inner
        compiled = backend(gm, example_inputs)
    return logits_drop.wrap(compiled, dropped) if dropped else compiled


dynamo_scope.mark(chunkce_backend)  # transformers' one-shot logging does not break its graphs


def register() -> None:
    """Register ``chunkce`` with Dynamo unless the entry point already does; make
    Dynamo's logging-ignore set chunkce-scoped (:mod:`compile_pass.dynamo_scope`).

    Dynamo's ``lookup_backend`` registers an entry-point backend itself after
    loading it (and refuses a second registration of the name), so when Dynamo
    already knows ``chunkce`` from the entry point, registering here would break
    that lookup: leave it to the entry point.
    """
    dynamo_scope.install()
    if BACKEND_NAME in registry._COMPILER_FNS or isinstance(registry._BACKENDS.get(BACKEND_NAME), EntryPoint):
        return
    registry.register_backend(chunkce_backend, name=BACKEND_NAME)
