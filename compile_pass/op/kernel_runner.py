"""How the walks and their per-chunk kernels run: on which threads, compiled by Inductor or eagerly.

The walk threads (:class:`WalkThreads`, :func:`split`, :func:`run_parts`): on CPU a walk's tiles
split over threads of the op's own, each on one intra-op thread (docs/op.md, "Walk threads").
How the per-chunk kernels run: compiled by Inductor for the input's device once per variant
(dynamic shapes, ``emulate_precision_casts``), or eagerly where Inductor cannot compile for the device
(:func:`inductor_compiles_for`) or keep their casts to half precision, under ``CHUNKCE_EAGER_KERNELS=1``,
a dispatch mode or a functorch transform. Why each setting: docs/op.md, "Per-chunk kernels".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import logging
import os
import queue
import re
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import compile_pass.torch_internals as internals
from compile_pass.op import kernels

if TYPE_CHECKING:
    from compile_pass.op.schema import ResolvedCall

_log = logging.getLogger(__name__)
_MODULES = (kernels,)  # the kernels' modules, searched by function name
_RECORDS = (kernels.KernelArgs, kernels.StatisticsArgs)  # their constants' records
_RUN_HOOKS: list[Callable[[str, tuple], None]] = []
_CALLED: set = set()  # the one-thread kernels that have run once (compiled: later calls find them)
# Held by a walk thread's first call of a kernel (two would both compile it), and by every call through torch.compile
# where config patches are the process's (2.11); a part's first call waits in it for the earlier parts (_PartOrder).
_FIRST_CALL = threading.Condition()


class _WalkThread(threading.local):
    """The calling thread's walk state (:func:`mark_walk_thread`, :class:`_PartOrder`); class defaults: no read misses."""

    active, order, part = False, None, 0


_WALK_THREAD = _WalkThread()


def in_walk_thread() -> bool:
    """Whether the calling thread runs a walk's parts (a :class:`WalkThreads`
    thread, or a caller running them itself): its kernels are the one-thread variants."""
    return _WALK_THREAD.active


def mark_walk_thread(active: bool) -> None:
    """Mark the calling thread as running a walk's parts (a walk thread, for good; a caller that runs
    them itself, while it does), or no longer."""
    _WALK_THREAD.active = active


def _kernel(fn_name: str):
    return next(getattr(module, fn_name) for module in _MODULES if hasattr(module, fn_name))


@contextlib.contextmanager
def hooked_runs(hook: Callable[[str, tuple], None]) -> Iterator[None]:
    """Call ``hook(fn_name, variant)`` each time :func:`run` is about to run a compiled kernel,
    while the block runs (to look, or to inject a fault: what the hook raises, ``run`` raises)."""
    _RUN_HOOKS.append(hook)
    try:
        yield
    finally:
        _RUN_HOOKS.remove(hook)


def compiled(fn_name: str, variant: tuple, one_thread: bool = False):
    """The kernel ``fn_name`` compiled for ``variant``, once (one code object per variant: its
    own Dynamo cache and recompile limit); ``one_thread``: the variant a walk thread runs, whose
    C++ has no parallel region (``cpp.threads=1``). Thread-safe: two walk threads asking at once get
    one kernel (two would each compile). ``cache_info`` / ``cache_clear`` as ``functools.cache``'s."""
    with _COMPILED_LOCK:
        return _compiled(fn_name, variant, one_thread)


@functools.cache
def _compiled(fn_name: str, variant: tuple, one_thread: bool):
    fn = _kernel(fn_name)
    suffix = re.sub(r"\W+", "_", "_".join(map(str, (*variant, "one_thread") if one_thread else variant)))
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{suffix}")
    clone = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__)
    # emulate_precision_casts: a cast to half precision rounds as it does eagerly
    options = {"emulate_precision_casts": True, **({"cpp.threads": 1} if one_thread else {})}
    if direct_calls_unavailable() is not None:  # logged: every call through torch.compile
        return torch.compile(clone, dynamic=True, fullgraph=True, options=options)
    graphs = KernelGraphs(clone, options, (fn_name, variant, one_thread))  # Inductor with these options
    kernel = torch.compile(clone, backend=graphs, dynamic=True, fullgraph=True)
    _GRAPHS[kernel] = graphs
    return kernel


def _cache_clear() -> None:
    _compiled.cache_clear()
    _GRAPHS.clear()
    _DIRECT.clear()


_COMPILED_LOCK = threading.Lock()
_GRAPHS: dict[Callable, KernelGraphs] = {}  # a compiled kernel's graphs and direct call
_DIRECT: dict[tuple, GraphCall] = {}  # (fn_name, variant, one_thread): its resolved direct call, found without a lock
compiled.cache_info, compiled.cache_clear = _compiled.cache_info, _cache_clear


inductor_compiles_for = internals.inductor_compiles_for  # whether Inductor compiles the kernels for a device


def graph_call(fn_name: str, variant: tuple, one_thread: bool = False) -> GraphCall | None:
    """The compiled kernel's :class:`GraphCall`, None before its first call or where it has none."""
    return _DIRECT.get((fn_name, variant, one_thread))


@functools.cache
def _hot_path() -> tuple:
    """The private torch names each kernel call reaches, resolved once per process (a per-tile lookup
    cost more than the tile's own bookkeeping): dispatch mode, functorch, fx config, autograd guard,
    grad mode setter, counters."""
    return (internals.get_current_dispatch_mode.get(), internals.are_functorch_transforms_active.get(),
            internals.fx_config.get(), internals.below_autograd.get(), internals.set_grad_enabled.get(),
            internals.counters.get())


def plain_context() -> bool:
    """False under a dispatch mode or a functorch transform (the kernel runs eagerly there, and a
    walk stays on its caller's thread: both are the thread's own state)."""
    dispatch_mode, functorch_active = _hot_path()[:2]
    return dispatch_mode() is None and not functorch_active()


def _symbolic(args: tuple) -> list:
    """The kernel's arguments as its compiled graph takes them: tensors and records detached,
    the logits' token dim unbacked (docs/op.md, "Per-chunk kernels")."""
    args = [arg.detach() if isinstance(arg, Tensor) else
            arg.detached() if isinstance(arg, _RECORDS) else arg for arg in args]
    internals.mark_unbacked(args[0], 0)  # the logits: [n, V] or [n, Vb]
    return args


def run(fn_name: str, variant: tuple, eager: bool, *args):
    """Run the kernel ``fn_name`` of :mod:`compile_pass.op.kernels` on ``args``; ``variant`` is its
    compile key (device type first). Once compiled, its graph is called directly where its guards
    hold (:class:`GraphCall`), else through ``torch.compile``. Errors propagate unchanged and leave
    no state behind."""
    if eager or not inductor_compiles_for(variant[0]) or not plain_context():
        return _kernel(fn_name)(*args)
    if in_walk_thread():  # below autograd already; the walk's owner keeps Dynamo's stats (dynamo_stats_kept)
        return _run_compiled(fn_name, variant, True, args)
    # below autograd, no grad, whoever calls: the guards on dispatch keys and grad mode never differ (a recompile)
    below_autograd, set_grad_enabled, grad_mode = *_hot_path()[3:5], torch.is_grad_enabled()
    with below_autograd():
        set_grad_enabled(False)  # torch.no_grad() costs more than the rest of this call
        try:
            return _run_compiled(fn_name, variant, False, args)
        finally:
            set_grad_enabled(grad_mode)


def _run_compiled(fn_name: str, variant: tuple, one_thread: bool, args: tuple):
    """:func:`run` of a compiled kernel: its direct call, on ``args`` as they are, then detached (a guard
    holds a tensor's requires_grad), where it has one and its guards hold; else through ``torch.compile``."""
    for hook in _RUN_HOOKS:
        hook(fn_name, variant)
    direct = _DIRECT.get((fn_name, variant, one_thread))
    if direct is not None and (direct(args) or direct(_symbolic(args))):
        return None
    kernel = compiled(fn_name, variant, one_thread)
    serial = _FIRST_CALL if one_thread and not internals.config_patches_per_thread() else contextlib.nullcontext()
    with serial:  # no config patch held while a first call waits
        if one_thread and kernel not in _CALLED:
            _first_call(kernel, args)
        with _shape_settings(), contextlib.nullcontext() if one_thread else dynamo_stats_kept():
            return _through_compile(kernel, args)


def _shape_settings() -> contextlib.AbstractContextManager:
    """The kernels' shape settings while one compiles (a patch is the calling thread's own from torch 2.12)."""
    return _hot_path()[2].patch(use_duck_shape=False, backed_size_oblivious=True)


def _through_compile(kernel, args: tuple):
    """``kernel`` called through ``torch.compile`` (compiling where no guards hold), then resolved."""
    args, graphs = _symbolic(args), _GRAPHS.get(kernel)
    if graphs is None or graphs.call is not None or graphs.refused is not None:
        return kernel(*args)
    tensors = [t for arg in args for t in ((*arg, arg.transform.tensor) if isinstance(arg, _RECORDS) else (arg,))
               if isinstance(t, Tensor)]  # the graph's tensors, its records' included
    before = internals.aot_wrapper_state(tensors)
    result = kernel(*args)
    graphs.resolve(result, (args, tensors, before, internals.aot_wrapper_state(tensors)))
    return result


def _first_call(kernel, args: tuple) -> None:
    """A one-thread kernel's first call, which compiles it: once (the other walk threads wait for it, then find
    it), by the earliest part of the walk that calls it whichever thread gets there first (:class:`_PartOrder`),
    on copies of its tensors at storage offset 0. So the graph compiled, and its cache keys, are the same in every
    process: Dynamo takes its symbols' hints (a tile's ``vocab_start``, its width) and a tensor's storage offset
    from the first call, and AOTAutograd's cache key holds the hints (torch 2.15); a later part's starts further on."""
    order, part = _WALK_THREAD.order, _WALK_THREAD.part
    with _FIRST_CALL:
        if order is not None:
            _FIRST_CALL.wait_for(lambda: kernel in _CALLED or order.earlier_parts_ended(part))
        if kernel not in _CALLED:
            with _shape_settings():
                kernel(*_symbolic([arg.clone() if isinstance(arg, Tensor) else arg for arg in args]))
            _CALLED.add(kernel)
            _FIRST_CALL.notify_all()


class _PartOrder:
    """Which parts of one walk on :class:`WalkThreads` have ended (returned or raised): a part's first call of a
    kernel waits for the earlier parts to call it or to end (:func:`_first_call`). No cycle: none waits on a later."""

    def __init__(self, count: int):
        self._ended = [False] * count

    def earlier_parts_ended(self, part: int) -> bool:
        return all(self._ended[:part])

    @contextlib.contextmanager
    def running(self, part: int) -> Iterator[None]:
        """The calling thread runs ``part`` while the block runs; ended after it, however it ends."""
        _WALK_THREAD.order, _WALK_THREAD.part = self, part
        try:
            yield
        finally:
            _WALK_THREAD.order = None
            with _FIRST_CALL:
                self._ended[part] = True
                _FIRST_CALL.notify_all()


@contextlib.contextmanager
def dynamo_stats_kept() -> Iterator[None]:
    """Dynamo's ``counters["stats"]`` (unique_graphs, calls_captured) as before the block: a kernel's
    compile is chunkce's own, not a graph of the user's (who counts recompiles with them); its graphs
    are counted in ``counters["chunkce"]["kernel_graphs"]``. Entered by the thread that owns a call
    (the counters are the process's), around its walk threads' runs."""
    counters = _hot_path()[5]
    stats = counters["stats"]
    saved = stats.copy()
    try:
        yield
    finally:
        if stats["unique_graphs"] != saved["unique_graphs"]:
            counters["chunkce"]["kernel_graphs"] += stats["unique_graphs"] - saved["unique_graphs"]
        stats.clear()
        stats.update(saved)


# ---- a compiled kernel's graph called directly (docs/op.md, "Per-chunk kernels") -----------------
# KernelGraphs, a kernel's backend (Inductor's, as torch.compile(options=...) builds it), notes each graph,
# its inputs' sources and Inductor's own call; after a call through torch.compile, resolve() pairs the code's
# one compiled entry with its graph: GraphCall checks the entry's guards (Dynamo's own), reads the inputs as
# Dynamo's bytecode does and runs Inductor's call. A kernel returns None and writes only its tensor arguments.

_PARTS = ("inductor_wrapper", "local_source", "attr_source", "tensor_property_source", "tensor_property",
          "as_tensor_fullprec", "cache_entry_list", "cache_entry_guards")


@functools.cache
def direct_calls_unavailable() -> str | None:
    """Why this torch allows no direct calls (a name they need moved; logged once: every call goes
    through ``torch.compile``), else None."""
    missing = internals.missing(_PARTS)
    if missing is not None:
        _log.info("chunkce: the per-chunk kernels run through torch.compile's call path: %s", missing)
    return missing


class GraphCall:
    """A kernel's compiled graph called directly: ``call(args)`` runs it and returns True where its
    guards hold for ``args`` (``check``, Dynamo's, of the arguments by ``names``), else False, having run
    nothing. Its graph's inputs, ``reads(*args)``, go to ``inductor``, Inductor's own callable, after the
    version counters of those it writes (``written``) are bumped, as AOTAutograd's wrapper does, where no
    Dynamo frame callback is set; else (or None) to ``compiled``, the backend's. ``calls`` counts runs."""

    def __init__(self, names: tuple[str, ...], check: Callable, reads: Callable, compiled: Callable,
                 inductor: Callable | None = None, written: tuple[int, ...] = ()):
        self.names, self.check, self.reads, self.compiled = names, check, reads, compiled
        self.inductor, self.written, self.calls = inductor, written, 0
        self._frame_callback = internals.eval_frame_callback.get() if inductor is not None else None

    def __call__(self, args) -> bool:
        if len(args) != len(self.names) or not self.check(dict(zip(self.names, args))):
            return False
        inputs = self.reads(*args)
        if self.inductor is not None and self._frame_callback() is None:
            if self.written:
                torch.autograd.graph.increment_version([inputs[i] for i in self.written])
            self.inductor(inputs)  # boxed: it clears the list
        else:
            self.compiled(*inputs)
        self.calls += 1
        return True


class KernelGraphs:
    """One kernel's ``torch.compile`` backend; :attr:`call` its :class:`GraphCall` once resolved, else
    :attr:`refused` says why none."""

    compiler_name = "inductor"

    def __init__(self, fn: Callable, options: dict, key: tuple):
        self._fn, self._inductor = fn, internals.inductor_wrapper.get()(None, options, True)
        self._graphs: dict[int, tuple] = {}  # id(Inductor's graph): (it, what the backend returned, reads, Inductor's call)
        self._key = key  # (fn_name, variant, one_thread): where run() finds :attr:`call`
        self.call, self.refused = None, None  # its GraphCall once resolved, or why none (a str)

    def __call__(self, gm, example_inputs):
        compiled = self._inductor(gm, example_inputs)
        inner = inspect.unwrap(compiled)  # what Dynamo's own wrapper of it unwraps to
        self._graphs[id(inner)] = (inner, compiled, internals.graph_input_reads(gm, self._fn),
                                   internals.inductor_call(compiled))
        return compiled

    def resolve(self, result: Any, observed: tuple) -> None:
        """After a call through ``torch.compile`` on ``args`` that returned ``result``, ``observed``: ``(args,
        tensors, before, after)``, their state around the call (``torch_internals.aot_wrapper_state``): :attr:`call`
        or :attr:`refused` (once; counted, and a refusal logged at debug level, as is a call that runs
        AOTAutograd's wrapper: where it did more than bump the version counters of the inputs Inductor writes)."""
        with _COMPILED_LOCK:  # two walk threads' calls through torch.compile may both end here: one resolves
            if self.call is None and self.refused is None:
                call = self._resolve(result, observed)
                outcome = "kernel_graph_calls" if isinstance(call, GraphCall) else "kernel_graph_calls_refused"
                internals.counters.get()["chunkce"][outcome] += 1
                if isinstance(call, GraphCall):
                    self.call = _DIRECT[self._key] = call
                else:
                    self.refused = call
                    _log.debug("chunkce: %s runs through torch.compile at each call: %s", self._fn.__code__.co_name, call)

    def _resolve(self, result: Any, observed: tuple) -> GraphCall | str:
        entries = internals.cache_entry_list(self._fn.__code__)
        if result is not None or len(entries) != 1:
            return "it returns a value" if result is not None else f"{len(entries)} compiled entries, not one"
        graph = next((self._graphs[id(inner)] for name in entries[0].code.co_names
                      if callable(obj := self._fn.__globals__.get(name))
                      and id(inner := inspect.unwrap(obj)) in self._graphs), None)
        if graph is None or isinstance(graph[2], str):
            return "its entry calls no graph of this backend" if graph is None else graph[2]
        inductor = graph[3] if isinstance(graph[3], str) else internals.as_observed(graph[3], graph[2], *observed)
        if isinstance(inductor, str):
            _log.debug("chunkce: %s's direct call runs AOTAutograd's wrapper: %s", self._fn.__code__.co_name, inductor)
        internals.counters.get()["chunkce"]["kernel_inductor_calls"] += not isinstance(inductor, str)
        code, guards = self._fn.__code__, internals.cache_entry_guards.read(entries[0]).root
        return GraphCall(code.co_varnames[:code.co_argcount], guards.check, graph[2], graph[1],
                         *(() if isinstance(inductor, str) else inductor))


# ---- walk threads (docs/op.md, "Walk threads") ----------------------------------------------------


class WalkThreads:
    """``count`` threads of this process that run a walk's parts (docs/op.md, "Walk threads"),
    each with one intra-op thread: a tile's matmuls and kernel run on the thread that took it, so
    a walk waits once, when its parts end, instead of at every parallel region of every tile (a
    wait that costs a scheduler slice whenever another process holds a core). Started once per
    process and count (:func:`thread_pool`); daemons, blocked on their queues between walks."""

    def __init__(self, count: int):
        self.count = count
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(count)]
        started = threading.Barrier(count + 1)
        intra_op = torch.get_num_threads()
        for index, tasks in enumerate(self._queues):
            threading.Thread(target=self._serve, args=(tasks, started), name=f"chunkce-walk-{index}",
                             daemon=True).start()
        started.wait()
        torch.set_num_threads(intra_op)  # each thread's set_num_threads(1) also set torch's default for new threads

    @staticmethod
    def _serve(tasks: queue.SimpleQueue, started: threading.Barrier) -> None:
        torch.get_num_threads()  # ATen's lazy per-thread init first: run later, it would set torch's default again
        torch.set_num_threads(1)  # this thread's OpenMP and MKL threads: the walk's parallelism is the threads'
        mark_walk_thread(True)
        started.wait()
        while True:
            future, work = tasks.get()
            try:
                future.set_result(work())
            except BaseException as error:  # re-raised, unchanged, by run()
                future.set_exception(error)

    def run(self, works: Sequence[Callable[[], Any]]) -> list:
        """Each of ``works`` (at most ``count``) on its own thread, in :func:`_walk_context`; returns
        their results in order, after all have ended. Raises what the first of them that raised raised."""
        context, order = _walk_context(), _PartOrder(len(works))
        futures = []
        for part, (tasks, work) in enumerate(zip(self._queues, works, strict=False)):
            future: concurrent.futures.Future = concurrent.futures.Future()
            tasks.put((future, functools.partial(_run_in, context, work, order.running(part))))
            futures.append(future)
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]


def _walk_context() -> Callable[[], contextlib.AbstractContextManager]:
    """The state a walk's part runs in, whichever thread runs it, taken from the caller: its
    inference mode, no grad, below autograd (one state, so a kernel compiles once for it)."""
    inference, below_autograd = torch.is_inference_mode_enabled(), internals.below_autograd.get()

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with torch.inference_mode(inference), torch.no_grad(), below_autograd():
            yield

    return context


def _run_in(context: Callable[[], contextlib.AbstractContextManager], work: Callable[[], Any],
            part: contextlib.AbstractContextManager | None = None) -> Any:
    with context(), part or contextlib.nullcontext():
        return work()


_POOLS: dict[tuple[int, int], WalkThreads] = {}
_POOLS_LOCK = threading.Lock()


def thread_pool(count: int) -> WalkThreads:
    """This process's :class:`WalkThreads` of ``count`` threads (a forked child starts its own)."""
    key = (os.getpid(), count)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = WalkThreads(count)
        return _POOLS[key]


def _after_fork_in_child() -> None:
    """A forked child runs only the thread that forked: a lock another thread held at the fork (a walk's, a
    kernel's first call) would stay held for ever, and the parent's walk threads are not the child's: new ones."""
    global _POOLS_LOCK, _COMPILED_LOCK, _FIRST_CALL
    _POOLS_LOCK, _COMPILED_LOCK, _FIRST_CALL = threading.Lock(), threading.Lock(), threading.Condition()
    _POOLS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def split(op_call: ResolvedCall, items: Sequence, parts: int | None = None) -> list[list]:
    """A walk's items in parts, one a walk thread: ``P = min(op_call.threads, parts, len(items))`` (at
    least 1), part ``p`` every ``P``-th item. The split is static, so a walk's arithmetic does not
    depend on which thread ran first. ``[items]`` where ``op_call`` has one thread."""
    count = max(1, min(op_call.threads, op_call.threads if parts is None else parts, len(items)))
    return [list(items[part::count]) for part in range(count)]


def run_parts(op_call: ResolvedCall, work: Callable[[int], Any], count: int, whole: bool = False) -> list:
    """``work(part)`` for each of ``count`` parts (:func:`split`); returns their results in order.

    Where ``op_call`` has walk threads: on :class:`WalkThreads` where the caller may leave its thread
    (:func:`_may_leave_thread`), else one after another on the caller's thread in the same state (one
    intra-op thread, :func:`_walk_context`): either way a call's kernels are the one-thread variants
    (Dynamo guards on the thread count: another variant would be a second compile), a walk of one
    part included. ``whole`` (one part) or a call of one thread: ``work(0)`` here, as the caller is."""
    if op_call.threads <= 1 or whole:
        return [work(0)]
    works = [functools.partial(work, part) for part in range(count)]
    with dynamo_stats_kept():
        if _may_leave_thread():
            return thread_pool(op_call.threads).run(works)
        return _run_here(works)


def _run_here(works: Sequence[Callable[[], Any]]) -> list:
    """``works`` one after another on this thread as a walk thread runs them (one intra-op thread,
    :func:`_walk_context`, the one-thread kernels); this thread's settings restored after."""
    if in_walk_thread():  # a walk thread's own walk: already so
        return [work() for work in works]
    intra_op, context = torch.get_num_threads(), _walk_context()
    torch.set_num_threads(1)
    mark_walk_thread(True)
    try:
        return [_run_in(context, work) for work in works]
    finally:
        mark_walk_thread(False)
        torch.set_num_threads(intra_op)


def _may_leave_thread() -> bool:
    """Whether a walk's parts may run on :class:`WalkThreads`: not from one of them, and not where
    they would leave this thread's own state behind: a dispatch mode or functorch transform, an
    active profiler (it sees this thread's ops and allocations only), Dynamo's compile lock (a walk
    thread's first kernel compiles under it)."""
    return (not in_walk_thread() and plain_context()
            and not internals.profiler_enabled() and not internals.compile_lock_owned())
