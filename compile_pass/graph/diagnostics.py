"""What a refusal's reason can say beyond the site itself: the cause and its fix.

Only the wording of a refusal depends on this module, never whether a site is refused:

- :func:`name_opaque`: the op that stopped the walk, named by what lies upstream of it
  (a soft cap, a projection the op cannot take, no projection at all, or an op between
  projection and loss with a hint: LoRA on the head under PEFT, a DTensor gather, ...);
- :func:`graph_break_cause`: why the logits arrive as a graph input, read from the
  process's distributed state (DDP's graph split, an FSDP2 unit).
"""

from __future__ import annotations

import re
from collections import deque

from torch.fx import Node

import compile_pass.torch_internals as internals
from compile_pass.graph.forms import as_projection
from compile_pass.graph.nodes import is_tensor_node, op_name
from compile_pass.graph.refusals import Reason, Refusal

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
