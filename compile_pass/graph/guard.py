"""Whether a matched cross-entropy site may be rewritten: None, or a one-line reason.

Refusing is normal: the site is left as it is. The rewrite must reproduce the
captured graph exactly, so everything between the projection and the loss has to
be shape- or dtype-only or one scaling by a constant the op takes (``logits * s``,
``logits / s``: :func:`compile_pass.graph.sites.read_scale`), the head has to be a
plain floating tensor, and the targets have to be class indices the op can take.
"""

from __future__ import annotations

import operator
import re
from collections import deque

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx import Node
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from compile_pass.graph.forms import as_projection
from compile_pass.graph.nodes import example_value, is_tensor_node, op_name
from compile_pass.graph.sites import Site, cast_chains

_PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOSSLESS = {  # widening casts: every value of the first dtype is exact in the second
    (torch.float16, torch.float32), (torch.float16, torch.float64), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float32, torch.float64),
}
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.setitem,
}
_MODE_SWITCHES = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast",
                  "_enter_inference_mode", "_exit_inference_mode"}
_SOFT_CAPS = {"tanh", "tanh_", "softcap"}
_HINTS = {
    "add": "an added tensor, e.g. LoRA on the head (the op has no low-rank branch); with PEFT, leave lm_head "
           "out of target_modules (modules_to_save=['lm_head'] trains the head itself and is rewritten) or merge "
           "the adapter first (merge_and_unload)",
    "sub": "an added tensor",
    "detach": "it cuts the gradient", "clamp": "logit clipping",
    **dict.fromkeys(("to_local", "redistribute", "full_tensor"),
                    "DTensor logits of a tensor parallel (vocabulary-sharded) head, gathered on the way; "
                    "chunkce takes plain tensors only"),
}
_PROJECTION_LIKE = ("mm", "linear", "matmul", "einsum", "conv", "tensordot", "module ")
_UPSTREAM_DEPTH = 8


class Reason(str):
    """A one-line reason for refusing a site; ``key`` names it in the counters."""

    key: str

    def __new__(cls, key: str, text: str) -> Reason:
        reason = super().__new__(cls, text)
        reason.key = key
        return reason


def check(site: Site, order: dict[Node, int]) -> Reason | None:
    """None when ``site`` may be rewritten, else why not.

    Args:
        site: a site from :func:`compile_pass.graph.sites.find_sites`.
        order: position of every node of the graph (to look between projection and loss).
    """
    if site.stop_kind == "internal_error":
        return internal_error(site.error)
    return (_check_call(site) or _check_stop(site) or _check_projection(site)
            or _check_casts(site) or _check_between(site, order))


def internal_error(what: str | None) -> Reason:
    """The pass could not analyse a site (a bug or an unforeseen graph): refuse it."""
    return Reason("internal_error", f"chunkce could not analyse this site ({what}); please report it")


def _check_call(site: Site) -> Reason | None:
    call = site.call
    if call is None:
        return Reason("call_module", "nn.CrossEntropyLoss as a call_module node (Dynamo normally inlines it)")
    if call.unsupported:  # an older loss spelling (spellings.py) the op cannot reproduce
        return Reason("loss_spelling", f"{call.form}: {call.unsupported}")
    if not is_tensor_node(call.target):
        return Reason("target", "target is not a tensor computed in this graph")
    target = example_value(call.target)
    if target.is_floating_point():
        return Reason("probability_target", f"probability (floating) targets of dtype {target.dtype} "
                                            "are not supported: the op takes class indices")
    if target.dtype != torch.int64:
        return Reason("target", f"target dtype {target.dtype}: the op takes int64 class indices")
    # (a gather's labels: the reader checked them against its index, spellings.py)
    if call.class_dim == 1 and is_tensor_node(call.input) and target.dim() != example_value(call.input).dim() - 1:
        return Reason("target", f"class-index target of shape {tuple(target.shape)} for logits of shape "
                                f"{tuple(example_value(call.input).shape)}")
    if call.reduction not in ("mean", "sum", "none"):
        return Reason("argument", f"reduction {call.reduction!r} is not a constant 'mean', 'sum' or 'none'")
    if isinstance(call.ignore_index, bool) or not isinstance(call.ignore_index, int):
        return Reason("argument", f"ignore_index {call.ignore_index!r} is not a constant int")
    if isinstance(call.label_smoothing, bool) or not isinstance(call.label_smoothing, (int, float)):
        return Reason("argument", f"label_smoothing {call.label_smoothing!r} is not a constant float")
    if call.weight is not None:
        if not is_tensor_node(call.weight):
            return Reason("argument", "class weight is not a tensor computed in this graph")
        problem = _not_plain_floating(example_value(call.weight))
        if problem:
            return Reason("class_weight", f"class weight is {problem}")
    return None


def _check_stop(site: Site) -> Reason | None:
    kind, stop = site.stop_kind, site.stop
    if kind is None:
        return None
    name = op_name(stop) if stop is not None else "?"
    if kind == "graph_input":
        return Reason("graph_break", f"logits enter this graph as an input (`{stop.target}`): the graph broke "
                                     f"between the projection and the loss{_graph_break_cause(stop)}")
    if kind == "subgraph_input":
        return Reason("subgraph_input", f"logits enter this higher-order op's body (e.g. a checkpoint region) as "
                                        f"its input `{stop.target}`: the projection is outside it")
    if kind == "class_dim_1":
        shape = tuple(example_value(stop).shape)
        return Reason("class_dim_1", f"logits of shape {shape} with the class dim at 1 that are not a "
                                     "transpose of [B, T, V] logits")
    if kind == "vocab_dim":
        return Reason("vocab_dim", f"`{name}` on the vocab dim between projection and loss")
    if kind == "advanced_index":
        return Reason("advanced_index", f"`{name}` with tensor indices between projection and loss "
                                        "(data-dependent token selection)")
    if kind == "symbolic_reshape":
        return Reason("symbolic_reshape", f"`{name}` on token dims after a reshape to several symbolic sizes")
    if kind == "unreadable":
        return Reason("unreadable", "cross_entropy input is not a tensor computed in this graph")
    if kind in ("scale_operand", "scale_requires_grad", "scale_twice", "in_place_scale"):
        return _scale_reason(kind, name, site.stop_detail)
    return _opaque_reason(stop)


def _scale_reason(kind: str, name: str, detail: str | None) -> Reason:
    """A scaling of the logits the op cannot take (the stop kinds of ``sites.read_scale``)."""
    if kind == "scale_requires_grad":
        return Reason("scale_requires_grad", f"`{name}` scales the logits by {detail}, which requires grad: the "
                                             "op does not differentiate the scale. Fix: detach it "
                                             "(`logits * scale.detach()`) or freeze it "
                                             "(`scale.requires_grad_(False)`)")
    if kind == "scale_twice":
        return Reason("scale_twice", f"`{name}` scales the logits a second time between projection and loss: "
                                     "the op takes one scaling. Fix: fold them into one constant, "
                                     "e.g. `logits * (a / b)`")
    if kind == "in_place_scale":
        return Reason("mutation", f"in-place `{name}` between projection and loss (logits scaled in place; "
                                  "written out of place, `logits = logits * s`, the op takes the scale)")
    return Reason("scale_operand", f"`{name}` between projection and loss is not a scaling the op takes "
                                   f"({detail}): it takes `logits * s` or `logits / s` with s a Python number "
                                   "or a 0-d tensor that does not require grad")


_DYNAMO_INPUT = re.compile(r"[LG]_")  # Dynamo names its inputs by source: L_logits_, L_stack0_, G_...
_CALL_RESULT = re.compile(r"L_stack\d+_")  # a resume function's stack value: the result of the breaking call


def _graph_break_cause(stop: Node) -> str:
    """What broke the graph, where the distributed wrappers make it knowable: "" or "; <cause and fix>"."""
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
        from torch._dynamo.utils import get_optimize_ddp_mode
        from torch.nn.parallel import DistributedDataParallel

        return (get_optimize_ddp_mode() == "ddp_optimizer"
                and DistributedDataParallel._get_active_ddp_module() is not None)
    except Exception:  # noqa: BLE001 - only the wording of a refusal depends on it
        return False


def _fsdp2_in_use() -> bool:
    """Some module of this process has FSDP2 (``fully_shard``) applied (read from the composable-API
    registry of every module with such state, ``_module_state_mapping``)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(module, FSDPModule) for module in list(_module_state_mapping.keys()))
    except Exception:  # noqa: BLE001 - only the wording of a refusal depends on it
        return False


def _opaque_reason(stop: Node) -> Reason:
    """Name the op that blocks the walk, and say whether a projection lies beyond it."""
    name = op_name(stop)
    if any(word in name for word in _PROJECTION_LIKE):
        return Reason("producer", f"producer `{name}` is not a plain linear/matmul with a 2-D weight")
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
        return Reason("soft_cap", f"soft-capped logits: `{op_name(found_cap)}` between projection and loss")
    if found_projection:
        hint = _HINTS.get(name)
        suffix = f" ({hint})" if hint else ""
        return Reason(f"op_{name}", f"`{name}` between projection and loss is not shape/dtype-only{suffix}")
    return Reason("no_projection", f"cross_entropy input does not come from a linear/matmul (it comes from `{name}`)")


def _not_plain_floating(t: torch.Tensor) -> str | None:
    if is_traceable_wrapper_subclass(t) or not (type(t) in (torch.Tensor, torch.nn.Parameter) or is_fake(t)):
        name = type(t).__name__
        what = ": a sharded (FSDP2 outside its unit's forward) or tensor parallel weight" if name == "DTensor" else ""
        return f"a tensor subclass ({name}{what})"
    if t.dtype not in _PLAIN_FLOATS:
        return f"of dtype {t.dtype}, not a plain floating dtype"
    return None


def _check_projection(site: Site) -> Reason | None:
    projection = site.projection
    for role, node in (("weight", projection.weight), ("hidden states", projection.hidden),
                       ("bias", projection.bias)):
        if node is None:
            continue
        if not is_tensor_node(node):
            return Reason("producer", f"projection {role} is not a tensor computed in this graph")
        problem = _not_plain_floating(example_value(node))
        if problem:
            key = "weight_dtype" if "dtype" in problem else "subclass"
            return Reason(key, f"projection {role} is {problem} (quantized / non-plain heads are not supported)")
    return None


def _check_casts(site: Site) -> Reason | None:
    """Each chain of casts the op collapses into one (to the scaling's dtype, then to the
    loss's: ``sites.cast_chains``) passes only through widening intermediate dtypes."""
    chains = cast_chains(site)
    for position, dtypes in enumerate(chains):
        for before, after in zip(dtypes, dtypes[1:-1]):
            if (before, after) not in _LOSSLESS:
                chain = " -> ".join(str(d).removeprefix("torch.") for d in dtypes)
                where = "" if len(chains) == 1 else (" before the scaling", " after the scaling")[position]
                return Reason("lossy_cast", f"logits cast through a lossy intermediate dtype ({chain}){where}")
    return None


def _mutates(node: Node) -> bool:
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
    """The op runs where the loss ran: nothing in between may change its inputs or the modes."""
    start, end = order[site.projection.node], order[site.node]
    for node in site.node.graph.nodes:
        position = order[node]
        if position <= start:
            continue
        if position >= end:
            break
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _MODE_SWITCHES:
            return Reason("mode_switch", f"`{op_name(node)}` (autocast / grad mode change) between projection and loss")
        if _mutates(node):
            return Reason("mutation", f"in-place `{op_name(node)}` between projection and loss")
    return None
