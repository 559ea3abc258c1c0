"""Per-rank cases for ``tests/integration/test_distributed.py``: chunkce under DDP and FSDP2 (tensor parallelism:
``tests/tp_cases.py``, run by :func:`run_rank` too).

Run by :func:`run_rank` in each of ``WORLD_SIZE`` spawned processes (gloo, CPU).
Every case builds its model from one seed, so each rank also holds the unsharded
single-process reference. Each rank trains on its own batch with its own number
of ignored labels (``-100``): a gradient that holds only the local contribution
cannot match the reference.

Loss normalisation (HF's ``num_items_in_batch`` / ``average_tokens_across_devices``):
each rank's loss is ``sum of its token losses / global number of valid tokens *
world_size``, the global count all-reduced before the step. DDP and FSDP2 average
gradients over ranks, so the average is the gradient of the mean over every
valid token of the concatenated batch, which is what the reference computes.

A case returns plain data (floats, strings, CPU tensors): ``pairs`` maps a name
(``"loss"``, ``"<param>.grad"``) to ``(got, expected)`` on this rank, compared by
the test in the parent process; ``graphs`` describes every graph the chunkce
backend compiled on this rank (after the pass); the rest is case-specific.
"""

from __future__ import annotations

import copy
import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD_SIZE = 2
IGNORE_INDEX = -100
VOCAB_SIZE, HIDDEN_SIZE = 509, 32  # odd vocabulary: FSDP2 shards it 255 / 254
BATCH, SEQ_LEN = 2, 8
IGNORED_PER_RANK = (1, 5)  # ignored labels in rank 0's batch, rank 1's batch
SEQ_LENS = (8, 11, 6, 13, 9, 16)  # the dynamic-shapes case: six lengths
GLOO_TIMEOUT_S = 60


# --- models ------------------------------------------------------------------------------------

class Block(nn.Module):
    """A residual MLP block (one FSDP2 unit in the sharded layouts)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.up = nn.Linear(hidden_size, 4 * hidden_size)
        self.down = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.down(F.gelu(self.up(hidden_states)))


class Body(nn.Module):
    """Embedding -> blocks -> norm, like HF's ``model.model`` (the loop lives here, as in HF)."""

    def __init__(self, vocab_size: int, hidden_size: int, num_blocks: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(Block(hidden_size) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's loss before normalisation: fp32 cross-entropy summed over valid tokens."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class HeadWithLoss(nn.Module):
    """The lm_head and the loss in one module: as one FSDP2 unit its compiled forward holds the site."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor,
                num_items_in_batch: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(self.lm_head(hidden_states), labels) / num_items_in_batch


class ToyLM(nn.Module):
    """A causal-LM-shaped toy: ``loss = sum CE(lm_head(model(input_ids)), labels) / num_items_in_batch``.

    Args:
        tied: the head's weight is the embedding's.
        head_with_loss: the head and the loss live in a :class:`HeadWithLoss` child ``head``.
        aux_size: if set, an auxiliary linear head of that width runs between the lm_head and the
            loss, and its outputs' sum, normalised as the loss is, is added to the loss (a parameter
            user between projection and loss).
        returns_logits: return ``(loss, logits)``, as an HF causal LM returns ``outputs.logits`` beside
            ``outputs.loss`` (not with ``head_with_loss`` nor ``aux_size``).
        after_loss: if set, a linear map of the logits to that width runs after the loss, and its outputs'
            sum, normalised as the loss is, is added to the loss (a parameter user reading the logits).
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden_size: int = HIDDEN_SIZE, num_blocks: int = 2,
                 tied: bool = False, head_with_loss: bool = False, aux_size: int = 0, returns_logits: bool = False,
                 after_loss: int = 0):
        super().__init__()
        self.returns_logits = returns_logits
        self.after_loss = nn.Linear(vocab_size, after_loss, bias=False) if after_loss else None
        self.model = Body(vocab_size, hidden_size, num_blocks)
        if head_with_loss:
            self.head = HeadWithLoss(vocab_size, hidden_size)
        else:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tied:
            self.head_linear().weight = self.model.embed_tokens.weight
        self.aux_head = nn.Linear(hidden_size, aux_size) if aux_size else None

    def head_linear(self) -> nn.Linear:
        """The projection to the vocabulary."""
        return self.head.lm_head if hasattr(self, "head") else self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                num_items_in_batch: torch.Tensor) -> torch.Tensor:
        hidden_states = self.model(input_ids)  # [B, T, H]
        if hasattr(self, "head"):
            return self.head(hidden_states, labels, num_items_in_batch)
        logits = self.lm_head(hidden_states)  # [B, T, V]
        aux = self.aux_head(hidden_states).sum() if self.aux_head is not None else None
        loss = token_loss_sum(logits, labels) / num_items_in_batch
        if self.after_loss is not None:
            loss = loss + self.after_loss(logits).sum() / num_items_in_batch
        if self.returns_logits:
            return loss, logits
        return loss if aux is None else loss + aux / num_items_in_batch


# --- data and reference ------------------------------------------------------------------------

def make_batch(rank: int, seq_len: int = SEQ_LEN, vocab_size: int = VOCAB_SIZE,
               step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch: its own tokens and ``IGNORED_PER_RANK[rank]`` ignored labels."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    input_ids = torch.randint(3, vocab_size, (BATCH, seq_len), generator=gen)  # [B, T]
    labels = input_ids.clone()
    labels.view(-1)[torch.randperm(BATCH * seq_len, generator=gen)[:IGNORED_PER_RANK[rank]]] = IGNORE_INDEX
    return input_ids, labels


def global_batch(seq_len: int = SEQ_LEN, vocab_size: int = VOCAB_SIZE,
                 step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch, concatenated: what the single-process reference trains on."""
    batches = [make_batch(r, seq_len, vocab_size, step) for r in range(WORLD_SIZE)]
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def global_num_items(labels: torch.Tensor) -> torch.Tensor:
    """Valid labels summed over ranks (all-reduced): the ``num_items_in_batch`` of every rank."""
    count = (labels != IGNORE_INDEX).sum()
    dist.all_reduce(count)
    return count


def reference_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   **kwargs: Any) -> torch.Tensor:
    """One eager single-process step on the global batch; returns the loss (grads left in ``model``)."""
    num_items_in_batch = (labels != IGNORE_INDEX).sum()
    loss = model(input_ids, labels, num_items_in_batch, **kwargs)
    loss.backward()
    return loss.detach()


def distributed_loss(loss: torch.Tensor) -> torch.Tensor:
    """The global loss from the per-rank ``loss * world_size`` terms: their mean over ranks."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / WORLD_SIZE


# --- compiling and reading graphs --------------------------------------------------------------

class GraphRecorder:
    """A chunkce ``inner_backend`` that describes each graph it is given, then compiles it with aot_eager."""

    def __init__(self, vocab_size: int = VOCAB_SIZE):
        self.vocab_size = vocab_size
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(describe_graph(gm, self.vocab_size))
        return aot_eager(gm, example_inputs)


def describe_graph(gm: torch.fx.GraphModule, vocab_size: int) -> dict[str, Any]:
    """Op nodes, cross_entropy calls and ``[..., V]`` activations (not inputs, not the expanded scalar
    that stands in for dropped logits) of a graph the pass has run on."""
    op = torch.ops.chunkce.linear_cross_entropy.default
    logits_shaped = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op != "placeholder" and isinstance(value, torch.Tensor) and value.dim() >= 2 \
                and value.shape[-1] == vocab_size and any(value.stride()):  # all strides 0: a dropped stand-in
            logits_shaped.append(f"{node.name}: {tuple(value.shape)}")
    return {
        "op_nodes": sum(node.target is op for node in gm.graph.nodes),
        "cross_entropy_nodes": sum(node.target is F.cross_entropy for node in gm.graph.nodes),
        "logits_shaped": logits_shaped,
        "placeholders": [node.name for node in gm.graph.find_nodes(op="placeholder")],
    }


def compile_chunkce(model: nn.Module, recorder: GraphRecorder, dynamic: bool | None = None, **options: Any):
    """``torch.compile(model, backend="chunkce", dynamic=dynamic)`` with ``recorder`` as inner backend,
    and ``options``."""
    return torch.compile(model, backend="chunkce", dynamic=dynamic, options={"inner_backend": recorder, **options})


def pass_outcome(recorder: GraphRecorder) -> dict[str, Any]:
    """This rank's chunkce counters, the reasons it logged, and its recorded graphs."""
    from torch._dynamo.utils import counters

    from compile_pass.graph.report import last_report

    report = last_report()
    return {
        "counters": dict(counters["chunkce"]),
        "records": [(r.decision, r.reason_key, r.reason, r.fix) for r in report.records] if report else [],
        "graphs": recorder.graphs,
        "unique_graphs": counters["stats"]["unique_graphs"],
    }


def grad_pairs(model: nn.Module, reference: nn.Module, rank: int) -> dict[str, tuple]:
    """``(this rank's gradient, the reference's)`` for every parameter; for DTensor gradients the
    local shard against the reference's rows of that shard (FSDP2 and colwise TP shard dim 0)."""
    pairs = {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        got = param.grad
        expected = ref_params[name].grad
        if hasattr(got, "to_local"):  # a DTensor
            placement = got.placements[0]
            if placement.is_shard():
                expected = expected.chunk(WORLD_SIZE, dim=placement.dim)[rank]
            got = got.to_local()
        pairs[f"{name}.grad"] = (got.detach().float().clone(), expected.detach().float().clone())
    return pairs


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (a DTensor's local shard), as an fp32 copy."""
    return (grad.to_local() if hasattr(grad, "to_local") else grad).detach().float().clone()


# --- cases -------------------------------------------------------------------------------------

def case_ddp(rank: int, bucket_cap_mb: float = 25, aux_size: int = 0, vocab_size: int = VOCAB_SIZE,
             hidden_size: int = HIDDEN_SIZE) -> dict[str, Any]:
    """DDP, then torch.compile(backend="chunkce"): one step against the single-process reference."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = ToyLM(vocab_size, hidden_size, aux_size=aux_size)
    reference = copy.deepcopy(model)
    recorder = GraphRecorder(vocab_size)
    compiled = compile_chunkce(DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb), recorder)
    input_ids, labels = make_batch(rank, vocab_size=vocab_size)
    loss = compiled(input_ids, labels, global_num_items(labels)) * WORLD_SIZE
    loss.backward()
    expected_loss = reference_step(reference, *global_batch(vocab_size=vocab_size))
    return {"pairs": {"loss": (distributed_loss(loss), expected_loss)} | grad_pairs(model, reference, rank),
            **pass_outcome(recorder)}


def case_ddp_aux_between(rank: int) -> dict[str, Any]:
    """DDP with 1 MiB buckets and a 1 MiB parameter user between the lm_head and the loss."""
    return case_ddp(rank, bucket_cap_mb=1, aux_size=2048, vocab_size=1024, hidden_size=128)


def case_ddp_llama(rank: int) -> dict[str, Any]:
    """A tiny transformers LlamaForCausalLM under DDP, as HF's Trainer calls it (labels, num_items_in_batch),
    compiled with no options: the returned logits are not computed in the step (lazy, the default); read after
    backward, they are this rank's rows of the single-process reference's logits."""
    import transformers
    from torch.nn.parallel import DistributedDataParallel

    vocab_size = 512
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, pad_token_id=0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    recorder = GraphRecorder(vocab_size)
    compiled = compile_chunkce(DistributedDataParallel(model), recorder)
    input_ids, labels = make_batch(rank, vocab_size=vocab_size)
    num_items_in_batch = global_num_items(labels[:, 1:])  # HF shifts labels inside the loss
    outputs = compiled(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch)
    logits_type = type(outputs.logits).__name__
    loss = outputs.loss * WORLD_SIZE
    loss.backward()
    ref_input_ids, ref_labels = global_batch(vocab_size=vocab_size)
    expected = reference(input_ids=ref_input_ids, labels=ref_labels)  # HF's mean over valid tokens
    expected.loss.backward()
    rows = slice(rank * BATCH, (rank + 1) * BATCH)  # this rank's batch in the global one
    logits = outputs.logits.detach() + 0.0  # an op that reads values (`* 1.0` is a lazy temperature): now
    return {"pairs": {"loss": (distributed_loss(loss), expected.loss.detach()),
                      "logits": (logits, expected.logits[rows].detach())}
            | grad_pairs(model, reference, rank),
            "logits_type": logits_type, **pass_outcome(recorder)}


def case_ddp_split_logits(rank: int, model_name: str, bucket_cap_mb: float) -> dict[str, Any]:
    """DDP's split graph (``optimize_ddp``, ``bucket_cap_mb``) over a model returning ``(loss, logits)``,
    chunkce with no options against stock DDP compile (aot_eager) from the same weights: the loss, every
    gradient, and reads of the returned logits after backward (argmax; the log-probs of the tokens, as
    ``log_softmax().gather()`` and as TRL's selective log-softmax)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model, vocab_size, shifted, call = SPLIT_MODELS[model_name]()
    stock_model = copy.deepcopy(model)
    input_ids, labels = make_batch(rank, vocab_size=vocab_size)
    num_items_in_batch = global_num_items(labels[:, 1:] if shifted else labels)
    recorder = GraphRecorder(vocab_size)
    compiled = compile_chunkce(DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb), recorder)
    got = _logits_step(call(compiled, input_ids, labels, num_items_in_batch), input_ids)
    outcome = pass_outcome(recorder)
    torch._dynamo.reset()
    stock = torch.compile(DistributedDataParallel(stock_model, bucket_cap_mb=bucket_cap_mb), backend="aot_eager")
    expected = _logits_step(call(stock, input_ids, labels, num_items_in_batch), input_ids)
    pairs = {name: (got[name], expected[name]) for name in expected if name != "logits_type"}
    return {"pairs": pairs | grad_pairs(model, stock_model, rank), "logits_type": got["logits_type"], **outcome}


def _logits_step(outputs: tuple[torch.Tensor, torch.Tensor], input_ids: torch.Tensor) -> dict[str, Any]:
    """Backward of the loss, then the reads of the logits."""
    loss, logits = outputs
    loss.backward()
    targets = input_ids[..., None]  # [B, T, 1]
    with torch.no_grad():
        return {"loss": loss.detach(), "argmax": logits.argmax(-1), "logits_type": type(logits).__name__,
                "log_softmax_gather": torch.log_softmax(logits.float(), -1).gather(-1, targets).squeeze(-1),
                "selective_log_softmax": logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, -1)}


def _split_llama() -> tuple[nn.Module, int, bool, Callable]:
    """A tiny transformers LlamaForCausalLM (vocab 8192, hidden 128, 2 layers: an 4 MiB lm_head), called
    as HF's Trainer calls it; HF shifts the labels inside its loss."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, pad_token_id=0, attention_dropout=0.0)

    def call(module, input_ids, labels, num_items_in_batch):
        outputs = module(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch)
        return outputs.loss, outputs.logits

    return transformers.LlamaForCausalLM(config).train(), config.vocab_size, True, call


def _split_after_loss() -> tuple[nn.Module, int, bool, Callable]:
    """A :class:`ToyLM` returning ``(loss, logits)`` whose 1 MiB ``after_loss`` map of the logits fills
    DDP's first bucket: the logits leave the piece of the head and the loss for the next piece."""
    return (ToyLM(1024, 128, returns_logits=True, after_loss=256), 1024, False,
            lambda module, input_ids, labels, num_items_in_batch: module(input_ids, labels, num_items_in_batch))


SPLIT_MODELS: dict[str, Callable[[], tuple[nn.Module, int, bool, Callable]]] = {
    "llama": _split_llama, "after_loss": _split_after_loss}


def case_ddp_dynamic(rank: int, mark_dynamic: bool = False, dynamic: bool | None = None) -> dict[str, Any]:
    """Six sequence lengths under DDP + chunkce: how many graphs are compiled; each step exact.

    Args:
        mark_dynamic: ``torch._dynamo.mark_dynamic`` on the sequence dim of input_ids and labels.
        dynamic: torch.compile's ``dynamic=``.
    """
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = ToyLM()
    reference = copy.deepcopy(model)
    recorder = GraphRecorder()
    compiled = compile_chunkce(DistributedDataParallel(model), recorder, dynamic=dynamic)
    pairs, graphs_after = {}, []
    for step, seq_len in enumerate(SEQ_LENS):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        input_ids, labels = make_batch(rank, seq_len, step=step)
        if mark_dynamic:
            torch._dynamo.mark_dynamic(input_ids, 1)
            torch._dynamo.mark_dynamic(labels, 1)
        loss = compiled(input_ids, labels, global_num_items(labels)) * WORLD_SIZE
        loss.backward()
        expected = reference_step(reference, *global_batch(seq_len, step=step))
        pairs[f"T={seq_len} loss"] = (distributed_loss(loss), expected)
        for name, pair in grad_pairs(model, reference, rank).items():
            pairs[f"T={seq_len} {name}"] = pair
        graphs_after.append(len(recorder.graphs))
    return {"pairs": pairs, "graphs_after_each_length": graphs_after, **pass_outcome(recorder)}


def case_fsdp(rank: int, layout: str, tied: bool = False, bf16: bool = False,
              reshard_after_forward: bool | None = None) -> dict[str, Any]:
    """FSDP2 per-block sharding; the lm_head in the root group (``"root"``), its own group (``"own"``),
    or its own group together with the loss (``"head_with_loss"``). One step.

    fp32: compared with the unsharded single-process reference. ``bf16``
    (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``): compared with the same
    FSDP2 + policy model run eagerly (``pairs``), and with the fp32 reference (``fp32_pairs``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    torch.manual_seed(0)
    model = ToyLM(tied=tied, head_with_loss=layout == "head_with_loss")
    reference = copy.deepcopy(model)
    eager = copy.deepcopy(model) if bf16 else None

    def shard(module: ToyLM) -> None:
        for layer in module.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        if layout == "own":
            fully_shard(module.lm_head, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        elif layout == "head_with_loss":
            fully_shard(module.head, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)  # the root group: embedding, norm (and lm_head)

    shard(model)
    recorder = GraphRecorder()
    compiled = compile_chunkce(model, recorder)
    input_ids, labels = make_batch(rank)
    num_items_in_batch = global_num_items(labels)
    loss = compiled(input_ids, labels, num_items_in_batch) * WORLD_SIZE
    loss.backward()
    expected_loss = reference_step(reference, *global_batch())
    fp32_pairs = {"loss": (distributed_loss(loss), expected_loss)} | grad_pairs(model, reference, rank)
    result = {"pairs": fp32_pairs, **pass_outcome(recorder)}
    if eager is not None:
        shard(eager)
        eager_loss = eager(input_ids, labels, num_items_in_batch) * WORLD_SIZE
        eager_loss.backward()
        pairs = {"loss": (loss.detach(), eager_loss.detach())}
        eager_params = dict(eager.named_parameters())
        for name, param in model.named_parameters():
            pairs[f"{name}.grad"] = (_local(param.grad), _local(eager_params[name].grad))
        result |= {"pairs": pairs, "fp32_pairs": fp32_pairs}
    return result


def case_fsdp_root_lazy_logits(rank: int) -> dict[str, Any]:
    """FSDP2 per-block sharding, the lm_head in the root group, a model returning ``(loss, logits)`` as HF's
    do, compiled with no options: the returned logits are lazy, over the root's unsharded lm_head weight.
    Three steps of SGD, against the single-process reference stepped alike:

    * step 1: the logits read before backward are this rank's rows of the reference's;
    * step 2: read after backward, which reshards the root group (frees the unsharded weight's storage):
      ``StaleLogitsError``, whose text is kept in ``errors``;
    * step 3: after ``optimizer.step()`` and step 3's forward, which all-gathers the updated weight into the
      unsharded parameter again (its version counter preserved), step 2's logits still raise; step 3's own,
      read before backward, are the reference's after two steps.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compile_pass import LazyLogits, StaleLogitsError

    def read(logits: torch.Tensor) -> torch.Tensor | str:
        """The values (an op that reads them), or the text of the StaleLogitsError raised."""
        try:
            return logits.detach() + 0.0  # (`* 1.0` would be a lazy temperature)
        except StaleLogitsError as exc:
            return str(exc)

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    model = ToyLM(returns_logits=True)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root group: embedding, norm, lm_head
    recorder = GraphRecorder()
    compiled = compile_chunkce(model, recorder)  # no options
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)  # this rank's batch in the global one
    pairs, errors, types, kept = {}, {}, set(), None
    for step in (1, 2, 3):
        input_ids, labels = make_batch(rank, step=step)
        loss, logits = compiled(input_ids, labels, global_num_items(labels))
        types.add(type(logits).__name__)
        ref_input_ids, ref_labels = global_batch(step=step)
        ref_loss, ref_logits = reference(ref_input_ids, ref_labels, (ref_labels != IGNORE_INDEX).sum())
        if step == 3:
            errors["step 2's logits after optimizer.step() and step 3's forward"] = read(kept)
        if step != 2:
            pairs[f"step {step} logits read before backward"] = (read(logits), ref_logits[rows].detach())
        (loss * WORLD_SIZE).backward()
        ref_loss.backward()
        pairs[f"step {step} loss"] = (distributed_loss(loss * WORLD_SIZE), ref_loss.detach())
        pairs |= {f"step {step} {name}": pair for name, pair in grad_pairs(model, reference, rank).items()}
        if step == 2:
            errors["step 2's logits after backward"] = read(logits)
            kept = logits
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    lazy = types == {LazyLogits.__name__}
    return {"pairs": pairs, "errors": errors, "logits_types": sorted(types), "lazy": lazy, **pass_outcome(recorder)}


CASES: dict[str, Callable[[int], dict[str, Any]]] = {
    "ddp": case_ddp,
    "ddp_aux_between": case_ddp_aux_between,
    "ddp_llama": case_ddp_llama,
    "ddp_dynamic_default": case_ddp_dynamic,
    "ddp_dynamic_marked": lambda rank: case_ddp_dynamic(rank, mark_dynamic=True),
    "ddp_dynamic_true": lambda rank: case_ddp_dynamic(rank, dynamic=True),
    "fsdp_root": lambda rank: case_fsdp(rank, "root"),
    "fsdp_root_tied": lambda rank: case_fsdp(rank, "root", tied=True),
    "fsdp_root_bf16": lambda rank: case_fsdp(rank, "root", bf16=True),
    "fsdp_root_tied_bf16": lambda rank: case_fsdp(rank, "root", tied=True, bf16=True),
    "fsdp_own": lambda rank: case_fsdp(rank, "own"),
    "fsdp_own_keep_unsharded": lambda rank: case_fsdp(rank, "own", reshard_after_forward=False),
    "fsdp_head_with_loss": lambda rank: case_fsdp(rank, "head_with_loss"),
    "fsdp_root_lazy_logits": case_fsdp_root_lazy_logits,
}


# DDP's split graph over models returning logits (spawned apart: each compiles the model twice)
SPLIT_DDP_CASES: dict[str, Callable[[int], dict[str, Any]]] = {
    "ddp_split_llama_1mb": lambda rank: case_ddp_split_logits(rank, "llama", bucket_cap_mb=1),
    "ddp_split_llama_25mb": lambda rank: case_ddp_split_logits(rank, "llama", bucket_cap_mb=25),
    "ddp_split_logits_cross": lambda rank: case_ddp_split_logits(rank, "after_loss", bucket_cap_mb=1),
}


# --- the per-rank entry ------------------------------------------------------------------------

def _case(name: str) -> Callable[[int], dict[str, Any]]:
    """The case ``name``: of :data:`CASES` or :data:`SPLIT_DDP_CASES`, or a tensor-parallel one (``tests/tp_cases.py``)."""
    if name in CASES or name in SPLIT_DDP_CASES:
        return {**CASES, **SPLIT_DDP_CASES}[name]
    import tp_cases

    return {**tp_cases.TP_CASES, **tp_cases.TP_CASES_4}[name]


def run_rank(rank: int, world_size: int, out_dir: str, case_names: list[str]) -> None:
    """Entry of each spawned process: join the gloo group, run ``case_names`` in order, and after each
    write every result so far to ``out_dir/rank<rank>.pt``. An exception is written there with its
    traceback (under its case's name), then raised, so that the parent sees this rank fail."""
    os.environ["CHUNKCE_EAGER_KERNELS"] = "1"  # the per-chunk math eagerly: no Inductor compile per rank
    import torch._dynamo
    from torch._dynamo.utils import counters

    import compile_pass  # noqa: F401 - registers the chunkce ops and backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    results: dict[str, Any] = {}
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        for name in case_names:
            torch._dynamo.reset()
            counters.clear()
            try:
                results[name] = _case(name)(rank)
            except BaseException:
                results[name] = {"error": traceback.format_exc()}
                raise
            finally:
                torch.save(results, f"{path}.part")
                os.replace(f"{path}.part", path)  # a rank killed while writing leaves the last whole file
            dist.barrier()
    finally:
        dist.destroy_process_group()
