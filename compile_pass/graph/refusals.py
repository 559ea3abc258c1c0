"""Why a site is refused: every kind of refusal with its counter key, message and fix (one table).

Why a site is refused: every kind of refusal, and for each its counter key
(``counters["chunkce"]["refused_<key>"]``: the kind's name unless the table says otherwise),
message (a ``str.format`` template of the guard's fields) and fix. The keys are documented
(docs/api.md, docs/design.md): a key changes only with the docs.
"""

from __future__ import annotations

import enum
import string
from typing import Any

GRAPH_BREAK_FIX = (
    "fix: remove the graph break between the lm_head and the loss (a print, .item(), "
    "data-dependent Python control flow, or an unsupported call; `torch._dynamo.explain(model)(...)` "
    "names it), or compute the loss inside the compiled region; under DDP's graph split or FSDP2 the reason "
    "names the cause and its fix (docs/distributed.md)"
)
_BIAS_FIX = ("; a bias is taken when passed to the projection (F.linear(h, W, b)) or added to its own "
             "output before any view (logits = h @ W.T; logits += b)")
_MUTATION_FIX = "fix: compute the logits out of place (logits = logits * s, not logits *= s)" + _BIAS_FIX
_OP_FIX = ("fix: compute only shape, dtype or one scaling between the lm_head and the loss; anything else "
           "there stays unfused, exact" + _BIAS_FIX)
_SCALE_TAKEN = ("it takes `logits * s` or `logits / s` with s a Python number or a 0-d tensor that does not "
                "require grad")


@enum.unique
class Refusal(enum.Enum):
    """A kind of refused site: ``(key, message template, fix)``."""

    # -- where the matcher's walk stopped (STOPS) --
    OPAQUE = ("op_{op}", "`{op}` between projection and loss is not shape/dtype-only{hint}", _OP_FIX)
    GRAPH_INPUT = ("graph_break", "logits enter this graph as an input (`{input}`): the graph broke between "
                   "the projection and the loss{cause}", GRAPH_BREAK_FIX)
    SUBGRAPH_INPUT = ("subgraph_input", "logits enter this higher-order op's body (e.g. a checkpoint region) as "
                      "its input `{input}`: the projection is outside it",
                      "fix: compute the lm_head inside the same checkpoint region (higher-order op body) as the "
                      "loss, or the loss outside it")
    CLASS_DIM_1 = ("class_dim_1", "logits of shape {shape} with the class dim at 1 that are not a transpose of "
                   "[B, T, V] logits",
                   "fix: compute the [B, T, V] logits, then move the class dim for the loss with "
                   ".transpose(1, 2), or flatten to [B * T, V]")
    VOCAB_DIM = ("vocab_dim", "`{op}` on the vocab dim between projection and loss",
                 "fix: slice or select token dims only; keep the vocabulary dim whole from the lm_head to the "
                 "loss")
    ADVANCED_INDEX = ("advanced_index", "`{op}` with tensor indices between projection and loss "
                      "(data-dependent token selection)",
                      "fix: select the tokens on the hidden states before the lm_head (h[mask]), or with "
                      "slices on the logits")
    SYMBOLIC_RESHAPE = ("symbolic_reshape", "`{op}` on token dims after a reshape to several symbolic sizes",
                        "fix: flatten the logits with .view(-1, V) before indexing their tokens, or mark one "
                        "token dim dynamic")
    UNREADABLE = ("unreadable", "cross_entropy input is not a tensor computed in this graph",
                  "fix: compute the loss's input from the lm_head's output inside the compiled region")
    CALL_MODULE = ("call_module", "nn.CrossEntropyLoss as a call_module node (Dynamo normally inlines it)",
                   "fix: call F.cross_entropy, or let Dynamo inline nn.CrossEntropyLoss (do not register it "
                   "as a leaf module)")
    INTERNAL_ERROR = ("internal_error", "chunkce could not analyse this site ({error}); please report it",
                      "fix: none on your side (the site stays unfused, exact); please report it, with the "
                      "graph (TORCH_LOGS=graph_code)")
    SCALE_OPERAND = ("scale_operand", "`{op}` between projection and loss is not a scaling the op takes "
                     "({detail}): " + _SCALE_TAKEN,
                     "fix: scale by one Python number or 0-d tensor, before the log_softmax: logits * s or "
                     "logits / s")
    SCALE_REQUIRES_GRAD = ("scale_requires_grad", "`{op}` scales the logits by {detail}, which requires grad: "
                           "the op does not differentiate the scale. Fix: detach it (`logits * scale.detach()`) "
                           "or freeze it (`scale.requires_grad_(False)`)",
                           "fix: detach the scale (logits * s.detach()) or freeze it (s.requires_grad_(False))")
    SCALE_TWICE = ("scale_twice", "`{op}` scales the logits a second time between projection and loss: the op "
                   "takes one scaling. Fix: fold them into one constant, e.g. `logits * (a / b)`",
                   "fix: fold the scalings into one constant, e.g. logits * (a / b)")
    TENSOR_PARALLEL = ("tensor_parallel", "tensor parallel head the vocabulary-parallel op cannot take: {detail}",
                       "fix: shard the lm_head over the vocabulary on a 1-D tensor-parallel mesh (the TP sub-mesh "
                       "of a 2-D one) with replicated or sequence-sharded hidden states: "
                       "ColwiseParallel(output_layouts=Replicate()), or output_layouts=Shard(-1), "
                       "use_local_output=False with the loss under loss_parallel() (docs/distributed.md); "
                       "otherwise the site stays unfused, exact")
    IN_PLACE_SCALE = ("mutation", "in-place `{op}` between projection and loss (logits scaled in place; written "
                      "out of place, `logits = logits * s`, the op takes the scale)", _MUTATION_FIX)
    # -- what the guard names an opaque stop (guard.name_opaque) --
    SOFT_CAP = ("soft_cap", "soft-capped logits: `{op}` between projection and loss",
                "fix: none for soft-capped heads (tanh); the site stays unfused, exact")
    PRODUCER = ("producer", "{what} is not {expected}",
                "fix: project with a plain nn.Linear / F.linear / matmul by a 2-D weight")
    NO_PROJECTION = ("no_projection", "cross_entropy input does not come from a linear/matmul (it comes from "
                     "`{op}`)",
                     "fix: compute the logits with nn.Linear / F.linear / a matmul by a [V, H] (or [H, V]) "
                     "weight inside the compiled region")
    # -- the guard's own checks --
    LOSS_SPELLING = ("loss_spelling", "{spelling}: {detail}",
                     "fix: write the loss as F.cross_entropy(logits.view(-1, V), labels.view(-1), ...) or as "
                     "the reason says")
    TARGET = ("target", "{detail}",
              "fix: pass int64 class indices computed in the compiled region, shaped like the logits without "
              "their class dim")
    PROBABILITY_TARGET = ("probability_target", "probability (floating) targets of dtype {dtype} are not "
                          "supported: the op takes class indices",
                          "fix: none for soft targets (the op takes class indices); the site stays unfused, "
                          "exact")
    ARGUMENT = ("argument", "{what} is not {expected}",
                "fix: pass reduction, ignore_index and label_smoothing as Python constants, class weights as a "
                "tensor of the compiled region")
    CLASS_WEIGHT = ("class_weight", "class weight is {problem}",
                    "fix: pass class weights as a plain floating tensor (float16, bfloat16, float32 or float64)")
    WEIGHT_DTYPE = ("weight_dtype", "projection {role} is {problem} (quantized / non-plain heads are not "
                    "supported)",
                    "fix: none for quantized heads (the op takes float16, bfloat16, float32 or float64 "
                    "weights); the site stays unfused, exact")
    SUBCLASS = ("subclass", "projection {role} is {problem} (quantized / non-plain heads are not supported)",
                "fix: none for tensor-subclass heads (quantized, float8, DTensor); keep the head a plain "
                "tensor (e.g. FSDP2: the head in the root group) or the site stays unfused, exact")
    LOSSY_CAST = ("lossy_cast", "logits cast through a lossy intermediate dtype ({chain}){where}",
                  "fix: cast the logits once, to the dtype the loss needs (a narrowing cast on the way is not "
                  "reproduced)")
    MODE_SWITCH = ("mode_switch", "`{op}` (autocast / grad mode change) between projection and loss",
                   "fix: keep grad mode and autocast unchanged from the lm_head to the loss")
    MUTATION = ("mutation", "in-place `{op}` between projection and loss", _MUTATION_FIX)

    def __init__(self, key: str, message: str, fix: str) -> None:
        self.key = key
        self.message = message
        self.fix = fix

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    @property
    def fields(self) -> set[str]:
        """The names the key and message templates read."""
        parsed = [*string.Formatter().parse(self.key), *string.Formatter().parse(self.message)]
        return {name for _, name, _, _ in parsed if name}


# The kinds the matcher stops its walk with (Site.stop_kind); the guard words each as itself,
# except OPAQUE, which the guard may name more precisely as one of OPAQUE_NAMED.
STOPS = frozenset({
    Refusal.OPAQUE, Refusal.GRAPH_INPUT, Refusal.SUBGRAPH_INPUT, Refusal.CLASS_DIM_1, Refusal.VOCAB_DIM,
    Refusal.ADVANCED_INDEX, Refusal.SYMBOLIC_RESHAPE, Refusal.UNREADABLE, Refusal.CALL_MODULE,
    Refusal.INTERNAL_ERROR, Refusal.SCALE_OPERAND, Refusal.SCALE_REQUIRES_GRAD, Refusal.SCALE_TWICE,
    Refusal.IN_PLACE_SCALE, Refusal.TENSOR_PARALLEL,
})
OPAQUE_NAMED = (Refusal.SOFT_CAP, Refusal.PRODUCER, Refusal.NO_PROJECTION)

_FIX_OF_KEY = {kind.key: kind.fix for kind in Refusal if kind is not Refusal.OPAQUE}  # (tests: shared keys, one fix)
_UNKNOWN_FIX = ("fix: write the loss as F.cross_entropy(lm_head(h).view(-1, V), labels.view(-1)) inside the "
                "compiled region (docs/design.md, The guard)")


class Reason(str):
    """A one-line reason for refusing a site: ``str`` of its kind's message; ``kind``,
    ``key`` (the counter key) and ``fix`` from :class:`Refusal`'s table.

        Reason(Refusal.VOCAB_DIM, op="getitem")   # "`getitem` on the vocab dim between projection and loss"

    Raises:
        KeyError: a field the kind's templates read is not given.
    """

    kind: Refusal
    key: str
    fix: str

    def __new__(cls, kind: Refusal, **fields: Any) -> Reason:
        reason = super().__new__(cls, kind.message.format(**fields))
        reason.kind, reason.key, reason.fix = kind, kind.key.format(**fields), kind.fix
        return reason


def fix_for(reason_key: str) -> str:
    """What to do about a site refused with ``reason_key`` (the table's fix of that key),
    never empty: ``op_<name>`` is an op between projection and loss (``OPAQUE``); a key
    the table does not have gets the generic advice."""
    if reason_key.startswith("op_"):
        return Refusal.OPAQUE.fix
    return _FIX_OF_KEY.get(reason_key, _UNKNOWN_FIX)
