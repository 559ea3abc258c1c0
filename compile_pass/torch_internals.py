"""Every private torch name chunkce reaches, in one place, each with its use and public stand-in.

Each entry says what chunkce uses it for and which public API stands in for it ("none": torch has none). ``tests/test_torch_internals.py``
resolves each on the installed torch and fails by its name when a release moves one; at run time
a moved one raises :class:`TorchInternalMissing`, naming the entry and torch's version.

    import compile_pass.torch_internals as internals
    internals.are_functorch_transforms_active()     # a function entry is called as the function
    internals.fake_tensor.get()                      # any entry's object: the class, module, ...
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch

__all__ = ["Older", "Private", "PrivateAttribute", "PrivateKind", "TorchInternalMissing", "ENTRIES"]

log = logging.getLogger(__name__)


class TorchInternalMissing(RuntimeError):
    """A private torch name chunkce needs is not where this torch release keeps it."""


def _missing(what: str, exc: BaseException | None = None) -> TorchInternalMissing:
    return TorchInternalMissing(f"chunkce: torch {torch.__version__} has no {what} (a private torch name chunkce "
                                f"reaches, compile_pass/torch_internals.py){f': {exc}' if exc else ''}")


def _resolve(path: str) -> Any:
    """The object at ``path``, looked up each time (a patched torch attribute is seen)."""
    module_name, _, attrs = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for attr in filter(None, attrs.split(".")):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from exc
    return obj


class PrivateKind(Enum):
    """What kind of object a :class:`Private` entry is: what ``tests/test_torch_internals.py`` checks
    the installed torch's object to be."""

    CALLABLE = "a callable"
    CLASS = "a class"
    MODULE = "a module"
    MAPPING = "a mapping"
    OBJECT = "an object"  # anything but None


@dataclass(frozen=True)
class Private:
    """A private torch object at ``path`` (``"module:attribute.attribute"``) of kind ``kind``."""

    path: str
    use: str
    public: str = "none"
    kind: PrivateKind = PrivateKind.CALLABLE

    def get(self) -> Any:
        return _resolve(self.path)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.get()(*args, **kwargs)


@dataclass(frozen=True)
class Older:
    """What releases before ``release`` keep for an attribute: ``name`` (None: nothing), read as ``convert(value)``."""

    release: str
    name: str | None
    convert: Callable[[Any], Any]


@dataclass(frozen=True)
class PrivateAttribute:
    """A private attribute ``name`` of instances of the torch class at ``owner``; ``older``: its older stand-in."""

    name: str
    owner: str
    use: str
    public: str = "none"
    older: Older | None = None

    def read(self, obj: Any) -> Any:
        """``obj.<name>`` (or its older stand-in); :class:`TorchInternalMissing` where ``obj`` has none."""
        name, convert = self.name, None
        if self.older is not None and (older := _older_in_use(self)) is not None:  # no cache lookup for the rest
            if older.name is None:
                return older.convert(None)
            name, convert = older.name, older.convert
        try:
            value = getattr(obj, name)
        except AttributeError as exc:
            raise _missing(f"{type(obj).__name__}.{name}", exc) from exc
        return value if convert is None else convert(value)

    def read_if_set(self, obj: Any) -> Any:
        """``obj.<name>``, or None where this instance has not set it yet; :class:`TorchInternalMissing`
        where the owner class no longer declares it."""
        if not _declared(self):
            raise _missing(f"{self.owner}.{self.name}")
        return getattr(obj, self.name, None)

    def override(self, cls: type, function: Any) -> None:
        """``cls.<name> = function``: a subclass's own version of the private method (checked declared first)."""
        if not _declared(self):
            raise _missing(f"{self.owner}.{self.name}")
        setattr(cls, self.name, function)

    def declared(self, name: str | None = None) -> bool:
        """Whether the owner class declares it (or ``name``): an attribute, annotation or ``self.<name>`` assignment."""
        owner, name = _resolve(self.owner), name or self.name
        classes = owner.__mro__ if isinstance(owner, type) else ()
        assigned = re.compile(rf"self\.{name}\s*[:=]")
        return (hasattr(owner, name) or any(name in getattr(c, "__annotations__", {}) for c in classes)
                or any(assigned.search(_source(c)) for c in classes))

    def resolves(self) -> bool:
        """Whether this torch declares it, or is a release before ``older.release`` declaring its stand-in."""
        older = _older_in_use(self)
        return self.declared() if older is None else older.name is None or self.declared(older.name)


@functools.cache
def _declared(attribute: PrivateAttribute) -> bool:
    return attribute.declared()


@functools.cache
def _older_in_use(attribute: PrivateAttribute) -> Older | None:
    """``attribute.older`` where this torch, a release before it, lacks the attribute (logged once); else None."""
    older = attribute.older
    if older is None or torch.__version__ >= older.release or _declared(attribute):
        return None
    log.debug("chunkce: torch %s lacks %s.%s; reading %s", torch.__version__, attribute.owner, attribute.name, older.name)
    return older


def _source(cls: Any) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


# --- Dynamo ------------------------------------------------------------------------------------
counters = Private("torch._dynamo.utils:counters", "chunkce's counters and the graph breaks explain() reports",
                   kind=PrivateKind.MAPPING)
dynamo_config = Private("torch._dynamo:config", "ignore_logging_functions, read and patched by dynamo_scope",
                        "torch.compiler.config holds other settings", kind=PrivateKind.MODULE)
config_entries = PrivateAttribute("_config", "torch._dynamo:config",
                                  "the default of ignore_logging_functions for every thread")
config_override = PrivateAttribute("user_override", "torch.utils._config_module:_ConfigEntry", "a config patch per thread")
current_tx = Private("torch._dynamo.symbolic_convert:InstructionTranslator.current_tx",
                     "which backend the frame Dynamo traces now is compiled for")
input_codes = Private("torch._dynamo.convert_frame:input_codes", "the code objects Dynamo compiled (explain's "
                      "clean-up)", "torch.compiler.reset() drops every backend's", kind=PrivateKind.OBJECT)
compile_lock = Private("torch._dynamo.convert_frame:compile_lock", "held while explain drops its caches",
                       kind=PrivateKind.OBJECT)
compile_lock_owned = Private("torch._dynamo.convert_frame:compile_lock._is_owned", "whether this thread holds "
                             "Dynamo's compile lock (a walk then stays on it)")
cached_backends = Private("torch._dynamo.eval_frame:cached_backends", "Dynamo's reference to explain's "
                          "backend", "torch.compiler.reset() drops every backend's", kind=PrivateKind.MAPPING)
cache_entry_list = Private("torch._dynamo.eval_frame:_debug_get_cache_entry_list",
                           "a code object's compiled entries and their backends (explain's clean-up)")
reset_code = Private("torch._dynamo:reset_code", "drop one code object's compiled entries",
                     "torch.compiler.reset() drops all")
backend_compiler_failed = Private("torch._dynamo.exc:BackendCompilerFailed", "explain unwraps the pass's "
                                  "own error from it", kind=PrivateKind.CLASS)
register_backend = Private("torch._dynamo.backends.registry:register_backend", "registers 'chunkce' without "
                           "an installed entry point", "the torch_dynamo_backends entry point")
lookup_backend = Private("torch._dynamo.backends.registry:lookup_backend", "the inner backend by name")
get_optimize_ddp_mode = Private("torch._dynamo.utils:get_optimize_ddp_mode", "a refusal's wording under DDP")
saved_tensors_hooks_off = Private("torch._dynamo.utils:_disable_saved_tensors_hooks_during_tracing",
                                  "saved-tensor hooks off while the pass computes an example_value")
mark_unbacked = Private("torch._dynamo.decorators:mark_unbacked", "the per-chunk kernels' token dim unbacked")
local_source = Private("torch._dynamo.source:LocalSource", "a kernel graph's input that is an argument (direct "
                      "calls)", kind=PrivateKind.CLASS)
attr_source = Private("torch._dynamo.source:AttrSource", "a kernel graph's input that is an argument's attribute",
                      kind=PrivateKind.CLASS)
tensor_property_source = Private("torch._dynamo.source:TensorPropertySource", "a kernel graph's input that is a "
                                 "tensor's size, stride or offset", kind=PrivateKind.CLASS)
tensor_property = Private("torch._dynamo.source:TensorProperty", "which of them", kind=PrivateKind.CLASS)
local_is_varargs = PrivateAttribute("is_varargs", "torch._dynamo.source:LocalSource", "a function's *args as a "
                                    "kernel graph's input (refused; before 2.13 too)", older=Older("2.13", None, bool))
local_is_varkw = PrivateAttribute("is_varkw", "torch._dynamo.source:LocalSource", "a function's **kwargs as a "
                                  "kernel graph's input (refused; before 2.13 too)", older=Older("2.13", None, bool))
as_tensor_fullprec = Private("torch:_as_tensor_fullprec", "a Python number Dynamo passes to a graph as a tensor")
cache_entry_guards = PrivateAttribute("guard_manager", "torch._C._dynamo.eval_frame:_CacheEntry", "a kernel's "
                                      "compiled entry's guards, checked before its graph is called directly")
orig_backend = PrivateAttribute("_torchdynamo_orig_backend", "torch._dynamo.convert_frame:ConvertFrameAssert",
                                "the backend a Dynamo-compiled callable wraps")


@functools.cache
def config_patches_per_thread() -> bool:
    """Whether a torch config patch is the patching thread's own (torch 2.12 on), not the whole process's."""
    entry = next(iter(config_entries.read(dynamo_config.get()).values()))
    return isinstance(config_override.read(entry), contextvars.ContextVar)


def dtensor_prim(target: Any) -> str | None:
    """The DTensor method a function torch 2.11's Dynamo made for it (arguments baked in) stands for, else None."""
    return {"prim_to_local": "to_local", "prim_redistribute": "redistribute"}.get(getattr(target, "__name__", None))


def missing(names: Any) -> str | None:
    """Why this torch lacks an entry of ``names`` (the first it lacks), else None."""
    try:
        for entry in (globals()[name] for name in names):
            if isinstance(entry, Private):
                entry.get()
            elif not entry.resolves():
                raise _missing(f"{entry.owner}.{entry.name}")
    except TorchInternalMissing as exc:
        return str(exc)
    return None


def graph_input_reads(gm: Any, fn: Any) -> Any:
    """A function of ``fn``'s arguments returning Dynamo's graph ``gm``'s inputs (a list), each read as Dynamo's
    bytecode reads it (its source, the placeholder's ``grapharg``); or why not (a str), where a
    source is of another kind. Uses the entries just above."""
    code = fn.__code__
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) or code.co_kwonlyargcount:
        return "its arguments are not all positional"
    expressions = []
    for node in gm.graph.find_nodes(op="placeholder"):
        graph_arg = node.meta.get("grapharg")
        expression = _source_expression(getattr(graph_arg, "source", None))
        if expression is None:
            return f"graph input {node.name} comes from {getattr(graph_arg, 'source', None)!r}"
        expressions.append(f"as_tensor({expression})" if graph_arg.pass_arg_as_tensor else expression)
    text = f"lambda {', '.join(code.co_varnames[:code.co_argcount])}: [{', '.join(expressions)}]"
    return eval(text, {"as_tensor": as_tensor_fullprec.get()})  # noqa: S307 - names checked identifiers


def _source_expression(source: Any) -> str | None:
    """``source`` (an argument, an attribute of one, a tensor's size, stride or storage offset) as a
    Python expression over the kernel's argument names; None for any other kind."""
    kind = type(source)
    if kind is local_source.get():
        plain = not (source.is_derefed_cell_contents or local_is_varargs.read(source) or local_is_varkw.read(source))
        return source.local_name if plain and source.local_name.isidentifier() else None
    base = _source_expression(getattr(source, "base", None)) if kind is not type(None) else None
    if kind is attr_source.get():
        return f"{base}.{source.member}" if base and source.member.isidentifier() else None
    if kind is tensor_property_source.get():
        prop = tensor_property.get()
        calls = {prop.SIZE: f"size({source.idx})", prop.STRIDE: f"stride({source.idx})",
                 prop.STORAGE_OFFSET: "storage_offset()"}
        return f"{base}.{calls[source.prop]}" if base and source.prop in calls else None
    return None


# --- Dynamo, AOTAutograd and Inductor under a kernel's graph (kernel_runner.GraphCall) ----------
disable_context = Private("torch._dynamo.eval_frame:DisableContext", "torch._dynamo.disable's wrapper, which a "
                          "kernel's direct call looks through", "torch.compiler.disable", kind=PrivateKind.CLASS)
eval_frame_callback = Private("torch._C._dynamo.eval_frame:get_eval_frame_callback", "whether Dynamo's frame "
                              "callback is set (a direct call below torch._dynamo.disable runs where it is not)")
aot_module_simplified = Private("torch._functorch.aot_autograd:aot_module_simplified", "AOTAutograd's entry, "
                                "whose call wrapper a kernel's direct call looks through", "torch.compile")
create_runtime_wrapper = Private("torch._functorch._aot_autograd.runtime_wrappers:_create_runtime_wrapper",
                                 "AOTAutograd's runtime wrapper, which a kernel's direct call looks through")
rng_wrapper = Private("torch._functorch._aot_autograd.runtime_wrappers:FunctionalizedRngRuntimeWrapper.post_compile",
                      "AOTAutograd's RNG wrapper, looked through where it adds nothing (before 2.13 it is always there)")
effect_tokens_wrapper = Private("torch._functorch._aot_autograd.runtime_wrappers:EffectTokensWrapper.post_compile",
                                "AOTAutograd's effect-token wrapper, looked through as the RNG wrapper is")
serializable_function = Private("torch._functorch._aot_autograd.runtime_wrappers:SerializableCompiledFunction",
                                "AOTAutograd's cacheable wrapper, which a kernel's direct call looks through",
                                kind=PrivateKind.CLASS)
compiled_fx_graph = Private("torch._inductor.output_code:CompiledFxGraph", "a kernel's graph as Inductor compiled it",
                            kind=PrivateKind.CLASS)
current_callable = PrivateAttribute("current_callable", "torch._inductor.output_code:CompiledFxGraph",
                                    "Inductor's generated call(args), which a kernel's direct call runs")
output_strides = PrivateAttribute("output_strides", "torch._inductor.output_code:CompiledFxGraph",
                                  "the compiled graph's outputs (a direct call needs none)")
mutated_input_idxs = PrivateAttribute("mutated_input_idxs", "torch._inductor.output_code:CompiledFxGraph",
                                      "the graph inputs it writes (AOTAutograd bumps their version counters)")


def inductor_call(compiled: Any) -> Any:
    """``(call, written)``: Inductor's own callable under ``compiled`` (what the Inductor backend returned
    for a graph; ``call(inputs)``, boxed: it clears the list) and the positions of the inputs its graph
    writes; else why not (a str; one of the entries just above this torch lacks, too). Only these may
    lie between, each of which adds nothing to a graph with no outputs but state its caller keeps: Dynamo's
    disable wrapper (no frame callback while it runs), AOTAutograd's call wrapper (no parameters or
    buffers to prepend), its runtime wrapper (the written inputs' version counters bumped, grad mode,
    autocast), its cacheable wrapper, and its RNG and effect-token wrappers where they pass the call on (no
    RNG op functionalized, no token); any other (a dedupe, synthetic-base or subclass wrapper) refuses."""
    try:
        return _inductor_call(compiled)
    except TorchInternalMissing as exc:
        return str(exc)


def _inductor_call(compiled: Any) -> Any:
    aot, disable, rng, tokens = (aot_module_simplified.get(), disable_context.get().__call__, rng_wrapper.get(),
                                 effect_tokens_wrapper.get())
    wrappers = {code: outer for outer in (aot, create_runtime_wrapper.get(), disable, rng, tokens)
                for code in _nested_codes(outer.__code__)}
    level = compiled
    while not isinstance(level, compiled_fx_graph.get()):
        outer = wrappers.get(getattr(level, "__code__", None))
        if not hasattr(level, "__wrapped__") or outer is None and not isinstance(level, serializable_function.get()):
            return f"{getattr(level, '__qualname__', type(level).__name__)} lies between (not AOTAutograd's own)"
        cells = _cells(level) if outer is not None else {}
        if outer is aot and cells.get("params_buffers_flat", ()) != []:
            return "AOTAutograd prepends parameters or buffers to its inputs"
        if outer is rng and getattr(cells.get("runtime_metadata"), "is_rng_op_functionalized", True) is not False:
            return "AOTAutograd's RNG wrapper adds a seed and offset to its inputs"
        if outer is tokens and cells.get("num_tokens") != 0:
            return "AOTAutograd's effect-token wrapper adds tokens to its inputs"
        if outer is disable and (getattr(cells.get("self"), "callback", 0) is not None or cells.get("fn") is not level.__wrapped__):
            return "torch._dynamo.disable's wrapper sets a frame callback"
        level = level.__wrapped__
    if output_strides.read(level) != []:
        return "its compiled graph has outputs"
    call = current_callable.read(level)
    return (call, tuple(sorted(mutated_input_idxs.read(level)))) if callable(call) else "no compiled callable"


def aot_wrapper_state(tensors: Any) -> tuple:
    """What AOTAutograd's runtime wrapper may change around its graph's call: grad mode, autocast (on:
    it turns it off for the call), the version counters of ``tensors`` (it bumps its written inputs')."""
    devices = {"cpu", *(t.device.type for t in tensors)}
    return (torch.is_grad_enabled(), any(torch.is_autocast_enabled(device) for device in devices),
            *(None if t.is_inference() else version.read(t) for t in tensors))


def as_observed(inductor: tuple, reads: Any, args: Any, tensors: Any, before: tuple, after: tuple) -> Any:
    """``inductor``, what :func:`inductor_call` returned, where a call through AOTAutograd's wrapper on
    ``args`` (its graph's inputs: ``reads(*args)``) changed only what calling ``inductor`` does:
    ``tensors``' state (:func:`aot_wrapper_state`) went from ``before`` to ``after`` by each written
    input's version counter bumped once (no counter shared with another tensor), grad mode kept,
    autocast off; else why not (a str)."""
    written = {id(tensor) for position, tensor in enumerate(reads(*args)) if position in inductor[1]}
    bumped = (*before[:2], *(v if v is None else v + (id(t) in written) for t, v in zip(tensors, before[2:])))
    if before[1] or after != bumped or not written <= {id(t) for t in tensors}:
        return "autocast is on" if before[1] else "its call changed grad mode or version counters otherwise"
    return inductor


def _cells(fn: Any) -> dict:
    """The variables ``fn`` closes over that are set (a wrapper may close over one it assigns later)."""
    cells = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            cells[name] = cell.cell_contents
    return cells


def _nested_codes(code: Any) -> list:
    """The code objects of the functions defined in ``code``, at any depth."""
    nested = [const for const in code.co_consts if inspect.iscode(const)]
    return [c for const in nested for c in (const, *_nested_codes(const))]


# --- Inductor and FX ---------------------------------------------------------------------------
compile_fx = Private("torch._inductor.compile_fx:compile_fx", "the rewritten graph compiled by Inductor",
                     "torch.compile(backend='inductor'), which takes a model, not a graph")
inductor_wrapper = Private("torch:_TorchCompileInductorWrapper", "Inductor's backend as torch.compile(options=...) "
                           "builds it, wrapped by the kernels' graph-noting backend",
                           "torch.compile(backend='inductor', options=...)", kind=PrivateKind.CLASS)
list_mode_options = Private("torch._inductor:list_mode_options", "torch.compile's mode= as Inductor config")
inductor_config = Private("torch._inductor:config", "the kernels' compiler (cpu_backend) and config patches",
                          kind=PrivateKind.MODULE)
custom_graph_pass = Private("torch._inductor.custom_graph_pass:CustomGraphPass", "the pre-grad pass's "
                            "base, whose uuid() keys the FX graph cache", kind=PrivateKind.CLASS)
get_cpp_compiler = Private("torch._inductor.cpp_builder:get_cpp_compiler", "whether a C++ compiler is present")
get_hash_for_files = Private("torch._inductor.custom_graph_pass:get_hash_for_files",
                             "the package's source hash in the cache key")
invalid_cxx_compiler = Private("torch._inductor.exc:InvalidCxxCompiler", "no C++ compiler", kind=PrivateKind.CLASS)
init_backend_registration = Private("torch._inductor.codegen.common:init_backend_registration",
                                    "Inductor's code generators registered before asking for one")
get_scheduling_for_device = Private("torch._inductor.codegen.common:get_scheduling_for_device",
                                    "whether Inductor generates code for a device")
has_triton = Private("torch.utils._triton:has_triton", "whether Triton is present for CUDA / XPU kernels")
cpp_overrides = Private("torch._inductor.codegen.cpp:CppOverrides", "whether Inductor's C++ code keeps a cast to half "
                        "precision and back (its to_dtype)", kind=PrivateKind.CLASS)
fx_config = Private("torch.fx.experimental._config", "the kernels' shape settings (use_duck_shape, "
                    "backed_size_oblivious)", kind=PrivateKind.MODULE)


@functools.cache
def inductor_compiles_for(device_type: str) -> bool:
    """Whether Inductor can compile the op's kernels for ``device_type`` (decided once, never learnt
    from a failed compile): a code generator is registered for it and its compiler (C++ for
    CPU, Triton for CUDA / XPU) is present. Uses the entries just above."""
    init_backend_registration()
    if get_scheduling_for_device(device_type) is None:
        return False
    if device_type == "cpu" and inductor_config.get().cpu_backend == "cpp":
        try:
            get_cpp_compiler()
        except invalid_cxx_compiler.get():
            return False
    if device_type in ("cuda", "xpu"):
        return has_triton()
    return True


@functools.cache
def inductor_keeps_half_casts(device_type: str) -> bool:
    """Whether Inductor's kernels for ``device_type`` keep a float32 value cast to half precision and back: Triton's
    do; the C++ code's where its to_dtype reads emulate_precision_casts (2.13 on; source unread: not). Logged if not."""
    kept = device_type != "cpu" or "emulate_precision_casts" in _source(cpp_overrides.get().to_dtype)
    if not kept:
        log.info("chunkce: torch %s's Inductor C++ code drops casts to half precision: those kernels run eagerly",
                 torch.__version__)
    return kept


# --- dispatch, autograd and subclasses ---------------------------------------------------------
get_current_dispatch_mode = Private("torch.utils._python_dispatch:_get_current_dispatch_mode",
                                    "kernels run eagerly under a dispatch mode")
are_functorch_transforms_active = Private("torch._C:_are_functorch_transforms_active",
                                          "the op's eager path under vmap / grad")
profiler_enabled = Private("torch._C._autograd:_profiler_enabled", "a profiled walk stays on its caller's "
                          "thread, whose ops and allocations the profiler sees")
below_autograd = Private("torch._C:_AutoDispatchBelowADInplaceOrView", "the compiled kernels below autograd",
                         kind=PrivateKind.CLASS)
set_grad_enabled = Private("torch._C:_set_grad_enabled", "grad mode off around a kernel's call (a tenth of "
                           "torch.no_grad()'s cost)", "torch.no_grad()")
dispatch_key_for_device = Private("torch._C:_dispatch_key_for_device", "a device's dispatch key")
dispatch_has_kernel = Private("torch._C:_dispatch_has_kernel_for_dispatch_key",
                              "whether addmm with an out dtype exists for a device")
disable_torch_function_subclass = Private("torch._C:DisableTorchFunctionSubclass", "LazyLogits' own "
                                          "reads as plain tensors", kind=PrivateKind.CLASS)
make_wrapper_subclass = Private("torch:Tensor._make_wrapper_subclass", "the LazyLogits tensor subclass",
                                "the documented way to write a wrapper subclass")
return_and_correct_aliasing = Private("torch.utils._python_dispatch:return_and_correct_aliasing",
                                      "LazyLogits views alias as torch's ops say")
is_traceable_wrapper_subclass = Private("torch.utils._python_dispatch:is_traceable_wrapper_subclass",
                                        "a subclass weight is refused")
tree_map = Private("torch.utils._pytree:tree_map", "LazyLogits' dispatch maps its arguments")
tree_leaves = Private("torch.utils._pytree:tree_leaves", "the tensors of a node's example value")
fake_tensor = Private("torch._subclasses.fake_tensor:FakeTensor", "a graph's example values", kind=PrivateKind.CLASS)
is_fake = Private("torch._subclasses.fake_tensor:is_fake", "a graph's weight is a plain (fake) tensor")
has_internal_overlap = Private("torch:_debug_has_internal_overlap", "an in-place edit torch would refuse")
assert_async = Private("torch:_assert_async", "the op's target range check without a host sync")
overload_schema = PrivateAttribute("_schema", "torch._ops:OpOverload", "whether an op writes its first argument")
version = PrivateAttribute("_version", "torch:Tensor", "a tensor's version counter (lazy logits' staleness)")
typed_storage = PrivateAttribute("_typed_storage", "torch:Tensor", "LazyLogits' storage as torch's own reads take "
                                 "it (torch.save): the computed values'", "Tensor.untyped_storage()")

# --- aten's private overloads: ops LazyLogits sees below autograd -------------------------------
aten_to_copy = Private("torch:ops.aten._to_copy.default", "a dtype / device cast of LazyLogits (a lazy copy)",
                       "Tensor.to, which dispatches to it", kind=PrivateKind.OBJECT)
aten_unsafe_view = Private("torch:ops.aten._unsafe_view.default", "a reshape of LazyLogits (a lazy view)",
                           "Tensor.reshape, which dispatches to it", kind=PrivateKind.OBJECT)
aten_log_softmax = Private("torch:ops.aten._log_softmax.default", "log_softmax of LazyLogits (a derived form)",
                           "F.log_softmax, which dispatches to it", kind=PrivateKind.OBJECT)
aten_softmax = Private("torch:ops.aten._softmax.default", "softmax of LazyLogits (a derived form)",
                       "F.softmax, which dispatches to it", kind=PrivateKind.OBJECT)

# --- graph targets: what Dynamo records for nn.Linear and the losses ---------------------------
nn_linear = Private("torch._C._nn:linear", "nn.Linear's call in a Dynamo graph", "F.linear (also matched)")
cross_entropy_loss = Private("torch._C._nn:cross_entropy_loss", "an inlined nn.CrossEntropyLoss",
                             "F.cross_entropy (also matched)")
nll_loss_nd = Private("torch._C._nn:nll_loss_nd", "an inlined nn.NLLLoss", "F.nll_loss (also matched)")
nll_loss = Private("torch._C._nn:nll_loss", "nll_loss as Dynamo records it", "F.nll_loss (also matched)")
legacy_reduction = Private("torch.nn._reduction:legacy_get_string", "size_average / reduce as a reduction")

# --- distributed -------------------------------------------------------------------------------
c10d_all_reduce = Private("torch:ops._c10d_functional.all_reduce", "the vocabulary-parallel op's sums",
                          "torch.distributed.all_reduce, which Inductor does not trace functionally")
c10d_wait_tensor = Private("torch:ops._c10d_functional.wait_tensor", "waits for c10d_all_reduce")
local_shape_and_offset = Private("torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
                                 "a vocabulary shard's first row")
local_tensor = PrivateAttribute("_local_tensor", "torch.distributed.tensor:DTensor", "a DTensor's shard, "
                                "with no autograd op", "DTensor.to_local(), which records one")
active_ddp_module = Private("torch.nn.parallel:DistributedDataParallel._get_active_ddp_module",
                            "a refusal's wording under DDP")
module_state = Private("torch.distributed._composable_state:_module_state_mapping", "the modules "
                       "fully_shard applies to (a refusal's wording)", kind=PrivateKind.MAPPING)
fsdp_state = Private("torch.distributed.fsdp:FSDPModule._get_fsdp_state", "an FSDP2 module's state")
fsdp_param_groups = PrivateAttribute("_fsdp_param_groups", "torch.distributed.fsdp._fully_shard._fsdp_state:"
                                     "FSDPState", "an FSDP2 module's parameter groups", older=Older(
                                         "2.12", "_fsdp_param_group", lambda group: [] if group is None else [group]))
unsharded_param = PrivateAttribute("_unsharded_param", "torch.distributed.fsdp._fully_shard._fsdp_param:"
                                   "FSDPParam", "the unsharded parameter FSDP2 all-gathers into")

ENTRIES: dict[str, Private | PrivateAttribute] = {
    name: value for name, value in list(globals().items()) if isinstance(value, (Private, PrivateAttribute))}
