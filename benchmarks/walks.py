"""The op's walks counted at its loops: what a step ran (``benchmarks.bench_statistics --graph``; the
graph tests' walk counts). Not a benchmark of its own, and imports nothing of ``benchmarks.harness``
(whose import sets ``KINETO_LOG_LEVEL`` for the process).

    walks = counted_walks()                      # or counted_walks(monkeypatch.setattr) in a test
    step()
    walks   # Counter({"statistics_walk": 1, "statistics_gradients": 1})
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from compile_pass.op import loops, statistics_loops


def counted_walks(patch: Callable[[object, str, Callable], None] = setattr) -> collections.Counter:
    """The op's walks from now on, by loop: the loss op's forward and backward
    (``chunked_forward``, ``chunked_backward``), the statistics op's (``statistics_walk``,
    ``statistics_gradients``). ``patch(module, name, counting)`` installs each counter
    (``setattr``: for the process; a test passes ``monkeypatch.setattr``)."""
    walks = collections.Counter()
    for module, name in ((loops, "chunked_forward"), (loops, "chunked_backward"),
                         (statistics_loops, "statistics_walk"), (statistics_loops, "statistics_gradients")):
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            walks[_name] += 1
            return _real(*args, **kwargs)
        patch(module, name, counted)
    return walks
