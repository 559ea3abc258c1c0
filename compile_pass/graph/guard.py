"""The guard: whether a matched site may be rewritten (None), or a :class:`Reason` why not.

Refusing is normal: the site is left as it is. The rewrite must reproduce the captured graph
exactly, so everything between the projection and the loss has to be shape- or dtype-only or one
scaling by a constant the op takes (:func:`compile_pass.graph.projection.read_scale`), the head
a plain floating tensor, the dtypes the logits pass through (:func:`cast_chains`, which the
rewrite reads too) widening only, and the targets class indices the op can take. Every reason
is worded from :mod:`compile_pass.graph.refusals`' table; what it says beyond the site (its cause
and fix) comes from :func:`name_opaque` (the op that stopped the walk, named by what lies upstream
of it: a soft cap, a projection the op cannot take, LoRA on the head under PEFT, a DTensor gather)
and :func:`graph_break_cause` (why the logits arrive as a graph input: DDP's graph split, an FSDP2
unit). Only the wording depends on those two, never whether a site is refused.
"""

from __future__ import annotations

import operator
import re
from collections import deque

import torch
from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph.nodes import CALLS, example_value, is_tensor_node, op_name
from compile_pass.graph.projection import as_projection
from compile_pass.graph.refusals import Reason, Refusal
from compile_pass.graph.sites import Site, StepKind
from compile_pass.graph.spellings.call import LossCall
from compile_pass.graph.tensor_parallel import local_value, loss_parallel_problem
from compile_pass.op.checks import LOSS_REDUCTIONS, holds

_PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.setitem,
}
_VIEWS = {"view", "reshape", "getitem", "transpose", "t", ".T", ".mT", "permute", "expand", "squeeze", "unsqueeze",
          "narrow", "select", "flatten", "unflatten", "view_as", "reshape_as", "expand_as", "contiguous", "detach",
          "as_strided", "movedim", "swapaxes", "swapdims", "unfold", "diagonal", "split", "chunk", "unbind"}
_ALLOCATIONS = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros", "ones", "full", "empty", "zeros_like",
                "ones_like", "full_like", "empty_like", "clone", "arange"}
_MODE_SWITCHES = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast",
                  "_enter_inference_mode", "_exit_inference_mode"}


def check(site: Site, order: dict[Node, int]) -> Reason | None:
    """None when ``site`` may be rewritten, else why not.

    Args:
        site: a site from :func:`compile_pass.graph.find.find_sites`.
        order: position of every node of the graph (to look between projection and loss).
    """
    if site.call is None:  # a site with no call to read stopped (call_module, internal_error)
        return stop_reason(site)
    return (_check_call(site) or stop_reason(site) or _check_projection(site)
            or _check_casts(site) or _check_between(site, order))


def internal_error(what: str | None) -> Reason:
    """The pass could not analyse a site (a bug or an unforeseen graph): refuse it."""
    return Reason(Refusal.INTERNAL_ERROR, error=what)


def _check_call(site: Site) -> Reason | None:
    call = site.call
    if call.unsupported:  # a spelling the op cannot reproduce
        return Reason(Refusal.LOSS_SPELLING, spelling=call.spelling.name, detail=call.unsupported)
    if not isinstance(call, LossCall):  # a row statistic: no target, no loss argument
        return None
    if not is_tensor_node(call.target):
        return Reason(Refusal.TARGET, detail="target is not a tensor computed in this graph")
    target = example_value(call.target)
    if target.is_floating_point():
        return Reason(Refusal.PROBABILITY_TARGET, dtype=target.dtype)
    if target.dtype != torch.int64:
        return Reason(Refusal.TARGET, detail=f"target dtype {target.dtype}: the op takes int64 class indices")
    # (a gather's labels: its reader checked them against its index)
    if call.class_dim == 1 and is_tensor_node(call.input) and target.dim() != example_value(call.input).dim() - 1:
        return Reason(Refusal.TARGET, detail=f"class-index target of shape {tuple(target.shape)} for logits of "
                                             f"shape {tuple(example_value(call.input).shape)}")
    if call.reduction not in LOSS_REDUCTIONS:
        return Reason(Refusal.ARGUMENT, what=f"reduction {call.reduction!r}",
                      expected="a constant 'mean', 'sum' or 'none'")
    if isinstance(call.ignore_index, bool) or not isinstance(call.ignore_index, int):
        return Reason(Refusal.ARGUMENT, what=f"ignore_index {call.ignore_index!r}", expected="a constant int")
    if isinstance(call.label_smoothing, bool) or not isinstance(call.label_smoothing, (int, float)):
        return Reason(Refusal.ARGUMENT, what=f"label_smoothing {call.label_smoothing!r}", expected="a constant float")
    if call.weight is not None:
        if not is_tensor_node(call.weight):
            return Reason(Refusal.ARGUMENT, what="class weight", expected="a tensor computed in this graph")
        problem = _not_plain_floating(example_value(call.weight))
        if problem:
            return Reason(Refusal.CLASS_WEIGHT, problem=problem[1])
    return None


def stop_reason(site: Site) -> Reason | None:
    """The reason for the matcher's stop (None: it reached a projection): its kind, worded with
    the stop's fields."""
    kind, stop = site.stop_kind, site.stop
    if kind is None:
        return None
    if kind is Refusal.OPAQUE:
        return name_opaque(stop)
    fields = {"op": op_name(stop) if stop is not None else "?", "detail": site.stop_detail, "error": site.error}
    if kind in (Refusal.GRAPH_INPUT, Refusal.SUBGRAPH_INPUT):
        fields["input"] = stop.target
    if kind is Refusal.GRAPH_INPUT:
        fields["cause"] = graph_break_cause(stop)
    if kind is Refusal.CLASS_DIM_1:
        fields["shape"] = tuple(example_value(stop).shape)
    return Reason(kind, **fields)


def _not_plain_floating(t: torch.Tensor) -> tuple[Refusal, str] | None:
    """What is wrong with ``t`` for the op (its kind, ``SUBCLASS`` or ``WEIGHT_DTYPE``, and its
    words), None: a plain floating tensor."""
    if internals.is_traceable_wrapper_subclass(t) or not (type(t) in (torch.Tensor, torch.nn.Parameter)
                                                          or internals.is_fake(t)):
        name = type(t).__name__
        what = ": a sharded (FSDP2 outside its unit's forward) or tensor parallel weight" if name == "DTensor" else ""
        return Refusal.SUBCLASS, f"a tensor subclass ({name}{what})"
    if t.dtype not in _PLAIN_FLOATS:
        return Refusal.WEIGHT_DTYPE, f"of dtype {t.dtype}, not a plain floating dtype"
    return None


def _check_projection(site: Site) -> Reason | None:
    """The head's tensors are plain floating ones (a vocabulary-sharded head's: their local
    shards, and its loss as the layout makes it: :mod:`compile_pass.graph.tensor_parallel`)."""
    projection = site.projection
    if projection.sharded is not None and projection.sharded.loss_parallel:
        problem = loss_parallel_problem(site.node, projection)
        if problem:
            return Reason(Refusal.TENSOR_PARALLEL, detail=problem)
    for role, node in (("weight", projection.weight), ("hidden states", projection.hidden),
                       ("bias", projection.bias)):
        if node is None:
            continue
        if not is_tensor_node(node):
            return Reason(Refusal.PRODUCER, what=f"projection {role}", expected="a tensor computed in this graph")
        value = example_value(node)
        problem = _not_plain_floating(local_value(value) if projection.sharded is not None else value)
        if problem:
            kind, words = problem
            return Reason(kind, role=role, problem=words)
    return None


def _check_casts(site: Site) -> Reason | None:
    """Each chain of casts the op collapses into one (to the scaling's dtype, then to the
    loss's: :func:`cast_chains`) passes only through widening intermediate dtypes."""
    chains = cast_chains(site)
    for position, dtypes in enumerate(chains):
        for before, after in zip(dtypes, dtypes[1:-1]):
            if not holds(after, before):  # a narrowing cast on the way
                chain = " -> ".join(str(d).removeprefix("torch.") for d in dtypes)
                where = "" if len(chains) == 1 else (" before the scaling", " after the scaling")[position]
                return Reason(Refusal.LOSSY_CAST, chain=chain, where=where)
    return None


def mutates(node: Node) -> bool:
    if "out" in node.kwargs:
        return True
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def _check_between(site: Site, order: dict[Node, int]) -> Reason | None:
    """The op runs where the loss ran: nothing in between may change its inputs or the modes.
    A mutation of a tensor that is none of the head's tensors or the logits changes nothing the
    op reads earlier: one the graph allocated (ProphetNet fills its targets in place) or an
    integer / bool graph input (labels masked in place: ``labels[labels == pad] = -100``)."""
    start, end = order[site.projection.node], order[site.node]
    projection = site.projection
    read = {_storage(node) for node in (projection.hidden, projection.weight, projection.bias, projection.node,
                                        *projection.inner, *(step.node for step in site.steps))
            if isinstance(node, Node)}
    for node in site.node.graph.nodes:
        position = order[node]
        if position <= start:
            continue
        if position >= end:
            break
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _MODE_SWITCHES:
            return Reason(Refusal.MODE_SWITCH, op=op_name(node))
        if mutates(node) and not _fresh_and_unread(node, read):
            return Reason(Refusal.MUTATION, op=op_name(node))
    return None


def _storage(node: Node) -> Node:
    """The node whose memory ``node`` views (itself when it is no view of another node; an
    in-place op's result is its input)."""
    while node.op in CALLS and (op_name(node) in _VIEWS or mutates(node)) \
            and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _fresh_and_unread(node: Node, read: set[Node]) -> bool:
    """Whether the tensor ``node`` mutates views memory that is none of ``read``'s and that the
    graph allocated (a factory call, a clone) or is an integer / bool graph input (labels, a
    mask: no view of the head's floating tensors)."""
    mutated = node.kwargs.get("out") if "out" in node.kwargs else (node.args[0] if node.args else None)
    if not isinstance(mutated, Node):
        return False
    storage = _storage(mutated)
    if storage in read:
        return False
    if storage.op == "placeholder":
        value = example_value(storage)
        return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
    return op_name(storage) in _ALLOCATIONS


def logits_dtypes(site: Site) -> list[torch.dtype]:
    """The dtypes the logits pass through: the projection's, each cast's, the scaling's,
    and the dtype the loss is computed in (the cross-entropy output's: fp32 under
    autocast). Consecutive repeats are dropped."""
    chain = [example_value(site.projection.node).dtype]
    chain += [example_value(step.node).dtype for step in site.steps if step.kind in (StepKind.CAST, StepKind.SCALE)]
    chain.append(example_value(site.node).dtype)
    return _dedupe(chain)


def cast_chains(site: Site) -> list[list[torch.dtype]]:
    """The dtype chains between the points where the op rounds the logits: :func:`logits_dtypes`,
    split at the scaling's dtype when there is one."""
    if site.scale is None:
        return [logits_dtypes(site)]
    chains: list[list[torch.dtype]] = [[example_value(site.projection.node).dtype]]
    for step in site.steps:
        if step.kind is StepKind.CAST:
            chains[-1].append(example_value(step.node).dtype)
        elif step.kind is StepKind.SCALE:
            chains[-1].append(site.scale.dtype)
            chains.append([site.scale.dtype])
    chains[-1].append(example_value(site.node).dtype)
    return [_dedupe(chain) for chain in chains]


def _dedupe(chain: list[torch.dtype]) -> list[torch.dtype]:
    """``chain`` without consecutive repeats."""
    return [dtype for i, dtype in enumerate(chain) if i == 0 or dtype != chain[i - 1]]


_SOFT_CAPS = {"tanh", "tanh_", "softcap"}
_HINTS = {  # " (<hint>)" after an op between projection and loss
    "add": "an added tensor, e.g. LoRA on the head (the op has no low-rank branch); with PEFT, leave lm_head "
           "out of target_modules (modules_to_save=['lm_head'] trains the head itself and is rewritten) or merge "
           "the adapter first (merge_and_unload)",
    "sub": "an added tensor",
    "detach": "it cuts the gradient", "clamp": "logit clipping",
    **dict.fromkeys(("to_local", "redistribute", "full_tensor"),
                    "DTensor logits, gathered on the way, that are not a vocabulary-sharded linear head's "
                    "(graph/tensor_parallel.py takes ColwiseParallel heads: docs/distributed.md)"),
}
_PROJECTION_LIKE = ("mm", "linear", "matmul", "einsum", "conv", "tensordot", "module ")
_UPSTREAM_DEPTH = 8  # nodes upstream of the stop searched for a projection or a soft cap

_DYNAMO_INPUT = re.compile(r"[LG]_")  # Dynamo names its inputs by source: L_logits_, L_stack0_, G_...
_CALL_RESULT = re.compile(r"L_stack\d+_")  # a resume function's stack value: the result of the breaking call


def name_opaque(stop: Node) -> Reason:
    """The reason for a walk stopped at ``stop`` (``Refusal.OPAQUE``): ``PRODUCER`` when
    ``stop`` looks like a projection, ``SOFT_CAP`` when a ``tanh`` lies between it and a
    projection upstream, ``OPAQUE`` (``op_<name>``) when a projection lies upstream,
    else ``NO_PROJECTION``."""
    name = op_name(stop)
    if any(word in name for word in _PROJECTION_LIKE):
        return Reason(Refusal.PRODUCER, what=f"producer `{name}`", expected="a plain linear/matmul with a 2-D weight")
    found_projection, found_cap = False, None
    queue, seen = deque([(stop, 0)]), {stop}
    while queue:
        node, depth = queue.popleft()
        if op_name(node) in _SOFT_CAPS:
            found_cap = node
        if as_projection(node) is not None:
            found_projection = True
            continue
        if depth == _UPSTREAM_DEPTH or node.op == "placeholder":
            continue
        for arg in node.all_input_nodes:
            if arg not in seen and is_tensor_node(arg):
                seen.add(arg)
                queue.append((arg, depth + 1))
    if found_cap is not None and found_projection:
        return Reason(Refusal.SOFT_CAP, op=op_name(found_cap))
    if found_projection:
        hint = _HINTS.get(name)
        return Reason(Refusal.OPAQUE, op=name, hint=f" ({hint})" if hint else "")
    return Reason(Refusal.NO_PROJECTION, op=name)


def graph_break_cause(stop: Node) -> str:
    """What broke the graph before the logits input ``stop``, where the distributed
    wrappers make it knowable: "" or "; <cause and fix>"."""
    name = str(stop.target)
    if not _DYNAMO_INPUT.match(name) and _in_ddp_optimizer():
        return ("; DDP's graph split (torch._dynamo.config.optimize_ddp) put a bucket boundary there, at a "
                "parameter used between the projection and the loss. Fix: compute that before the lm_head or "
                "after the loss, raise DDP's bucket_cap_mb, or set torch._dynamo.config.optimize_ddp = False")
    if not _CALL_RESULT.fullmatch(name):
        return ""
    if _fsdp2_in_use():
        return ("; the lm_head call itself broke it, and FSDP2 is in use: an lm_head that is its own "
                "fully_shard unit always does (FSDP2's hooks run under torch._dynamo.disable, so each unit's "
                "call is a graph break). Fix: keep lm_head in the root group (the final fully_shard(model) "
                "covers it; tied embeddings stay in one group with it), or make the head's unit also compute "
                "the loss (one module whose forward runs lm_head and the loss, passed to fully_shard)")
    return ("; the call that returned the logits broke it (e.g. an lm_head that is its own FSDP2 fully_shard "
            "unit, or a module whose hooks Dynamo does not trace)")


def _in_ddp_optimizer() -> bool:
    """This compile runs inside a DDP forward whose graphs DDPOptimizer splits at bucket boundaries."""
    try:
        return (internals.get_optimize_ddp_mode() == "ddp_optimizer"
                and internals.active_ddp_module() is not None)
    except Exception:  # noqa: BLE001 - only the wording of a refusal depends on it
        return False


def _fsdp2_in_use() -> bool:
    """Some module of this process has FSDP2 (``fully_shard``) applied (read from the composable-API
    registry of every module with such state, ``_module_state_mapping``)."""
    try:
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(module, FSDPModule) for module in list(internals.module_state.get().keys()))
    except Exception:  # noqa: BLE001 - only the wording of a refusal depends on it
        return False
