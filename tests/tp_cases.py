"""Per-rank cases for ``tests/integration/test_tensor_parallel.py``: a vocabulary-sharded (tensor-parallel) lm_head.

Run by :func:`distributed_cases.run_rank` in each spawned process (gloo, CPU), on 2 or 4 ranks.
Every rank of a tensor-parallel group sees the same batch (the global one of
:func:`distributed_cases.global_batch`); each case compiles the same TP model twice, with
``backend="chunkce"`` (aot_eager inside) and stock ``aot_eager``, and runs the unsharded model
eagerly as the single-process reference. ``pairs``: loss and every gradient (a DTensor's local
shard) against stock TP; ``fp32_pairs``: the same against the reference's rows of this rank's
shard (DTensor's own offsets: uneven shards). ``peak``: this rank's measured peak bytes of the
step (forward and backward), chunkce and stock.
"""

from __future__ import annotations

import copy
from typing import Any

import distributed_cases as dc
import torch
import torch.distributed as dist
from torch import nn

from compile_pass.memory import measure_peak_bytes

HIDDEN_SIZE = 24  # the blocks' 4 * H = 96 is no shard's V_local: a [..., V_local] node is logits
MEMORY_VOCAB = 8191  # the memory cases: N = 2 * 2 * 512 = 2048 tokens, above the op's CPU tile (512 rows)
MEMORY_SEQ_LEN = 512


def _plan(layout: str) -> dict[str, Any]:
    """``parallelize_module``'s plan for ``layout``: "rep" (HF's colwise_rep), "loss_parallel"
    (torchtitan's), "sequence_parallel" (Shard(1) hidden states into the head), "rowwise" (refused)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if layout == "rep":
        return {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    if layout == "loss_parallel":
        return {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    if layout == "sequence_parallel":  # the norm's output sequence-sharded, gathered by the head's plan
        return {"model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    if layout == "rowwise":  # the head sharded over H: a Partial sum, not the vocabulary
        return {"lm_head": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    raise ValueError(layout)


def _parallelize(model: dc.ToyLM, mesh: Any, layout: str, tied: bool) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    plan = _plan(layout)
    if tied:  # the embedding sharded over the vocabulary too, then one DTensor for both (tied again)
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


class TPGraphRecorder(dc.GraphRecorder):
    """:class:`distributed_cases.GraphRecorder` that also counts the vocabulary-parallel op's nodes and
    every node shaped ``[..., V]`` or ``[..., V_local]`` (DTensor values by their local shape too)."""

    def __init__(self, vocab_size: int, local_vocab: int):
        super().__init__(vocab_size)
        self.local_vocab = local_vocab

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        ops = {op for packet in (torch.ops.chunkce.vocab_parallel_statistics, torch.ops.chunkce.vocab_parallel_loss)
               for op in (packet, packet.default)}  # the traced call names the packet
        description = dc.describe_graph(gm, self.vocab_size)
        description["vocab_parallel_nodes"] = sum(node.target in ops for node in gm.graph.nodes)
        description["logits_shaped"] = [
            f"{node.name}: {tuple(value.shape)}" for node in gm.graph.nodes
            if node.op != "placeholder" and isinstance(value := node.meta.get("example_value"), torch.Tensor)
            and value.dim() >= 2 and value.shape[-1] in (self.vocab_size, self.local_vocab)
            and any(value.stride())]  # all strides 0: the stand-in of logits taken out (no memory)
        description["code"] = gm.code
        self.graphs.append(description)
        return aot_eager(gm, example_inputs)


def _local_rows(full: torch.Tensor, like: Any) -> torch.Tensor:
    """The part of ``full`` that DTensor ``like`` holds on this rank (its own shape and offsets)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _local(grad: Any) -> torch.Tensor:
    return (grad.to_local() if hasattr(grad, "to_local") else grad).detach().float().clone()


def _read(logits: torch.Tensor) -> torch.Tensor:
    """The values of ``logits``, read now (an op on them: a LazyLogits' ``clone()`` is a lazy copy, and
    so is ``* 1``, a temperature)."""
    return logits.detach().float().add(0)


def _plain(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().float().clone()


def case_tp(rank: int, layout: str = "rep", tied: bool = False, vocab_size: int = dc.VOCAB_SIZE,
            chunk_size: int | None = None, seq_len: int = dc.SEQ_LEN, mesh: Any = None) -> dict[str, Any]:
    """One step of a TP head (``layout``: :func:`_plan`), chunkce against stock TP and the reference;
    on ``mesh``, default a new 1-D mesh over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    world = dist.get_world_size()
    mesh = mesh or init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = dc.ToyLM(vocab_size, HIDDEN_SIZE, tied=tied)
    reference = copy.deepcopy(model)
    stock = copy.deepcopy(model)
    for module in (model, stock):
        _parallelize(module, mesh, layout, tied)
    recorder = TPGraphRecorder(vocab_size, model.lm_head.weight.to_local().shape[0])
    options = {"chunk_size": chunk_size} if chunk_size else {}
    compiled = dc.compile_chunkce(model, recorder, **options)
    stock_compiled = torch.compile(stock, backend="aot_eager")
    input_ids, labels = dc.global_batch(seq_len, vocab_size)  # every TP rank: the same batch
    num_items_in_batch = (labels != dc.IGNORE_INDEX).sum()
    if layout == "sequence_parallel":  # this rank's sequence shard into the body (per-token blocks)
        input_ids = input_ids.tensor_split(world, dim=1)[rank]
    context = loss_parallel if layout == "loss_parallel" else torch.enable_grad

    def step(fn) -> torch.Tensor:
        with context():
            loss = fn(input_ids, labels, num_items_in_batch)
            loss.backward()
        return loss

    compiled_warm = step(compiled)  # compile outside the measured steps
    stock_warm = step(stock_compiled)
    for module in (model, stock):
        module.zero_grad(set_to_none=True)
    loss, peak = measure_peak_bytes(step, compiled)
    stock_loss, stock_peak = measure_peak_bytes(step, stock_compiled)
    expected_loss = dc.reference_step(reference, *dc.global_batch(seq_len, vocab_size))
    pairs = {"loss": (_plain(loss), _plain(stock_loss)), "first loss": (_plain(compiled_warm), _plain(stock_warm))}
    fp32_pairs = {"loss": (_plain(loss), expected_loss)}
    stock_params, ref_params = dict(stock.named_parameters()), dict(reference.named_parameters())
    for name, param in model.named_parameters():
        pairs[f"{name}.grad"] = (_local(param.grad), _local(stock_params[name].grad))
        expected = ref_params[name].grad
        if hasattr(param.grad, "to_local"):
            expected = _local_rows(expected, param.grad)
        if layout != "sequence_parallel" or name.startswith("lm_head"):  # SP: the body sees a sequence shard
            fp32_pairs[f"{name}.grad"] = (_local(param.grad), expected.detach().float().clone())
    return {"pairs": pairs, "fp32_pairs": fp32_pairs, "peak": peak, "stock_peak": stock_peak,
            "local_vocab": model.lm_head.weight.to_local().shape[0], "vocab_size": vocab_size,
            **dc.pass_outcome(recorder)}


def _shard_fsdp_tp(model: dc.ToyLM, mesh: Any, tied: bool = False, policy: Any = None) -> None:
    """The head colwise_rep over ``mesh["tp"]``, then ``fully_shard`` each block and the root over
    ``mesh["dp"]`` (with ``policy``, a ``MixedPrecisionPolicy``, if given)."""
    from torch.distributed.fsdp import fully_shard

    _parallelize(model, mesh["tp"], "rep", tied)
    options = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], **options)
    fully_shard(model, mesh=mesh["dp"], **options)


def case_fsdp_tp(rank: int, tied: bool = False, bf16: bool = False) -> dict[str, Any]:
    """A 2-D mesh (dp x tp = 2 x 2, 4 ranks): FSDP2 over "dp" (each block and the root), the lm_head
    colwise over "tp". Each dp group trains on its own batch; the loss is normalised by the global count.
    ``bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every unit, chunkce
    and stock alike (``pairs``); ``fp32_pairs`` still against the fp32 single-process reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    model = dc.ToyLM(dc.VOCAB_SIZE, HIDDEN_SIZE, tied=tied)
    reference = copy.deepcopy(model)
    stock = copy.deepcopy(model)
    for module in (model, stock):
        _shard_fsdp_tp(module, mesh, tied, policy)
    recorder = TPGraphRecorder(dc.VOCAB_SIZE, model.lm_head.weight.to_local().shape[0])
    compiled = dc.compile_chunkce(model, recorder)
    stock_recorder = dc.GraphRecorder(dc.VOCAB_SIZE)  # aot_eager; proves stock compiled its own graphs
    stock_compiled = torch.compile(stock, backend=stock_recorder)
    input_ids, labels = dc.make_batch(dp_rank)  # this dp group's batch
    count = (labels != dc.IGNORE_INDEX).sum() * (mesh["tp"].get_local_rank() == 0)
    dist.all_reduce(count)  # once per dp group: the global number of valid labels
    pairs = {}
    losses = []
    for fn in (compiled, stock_compiled):
        loss = fn(input_ids, labels, count) * dp_size
        loss.backward()
        losses.append(loss.detach())
    pairs["loss"] = tuple(losses)
    global_loss = losses[0].clone()
    dist.all_reduce(global_loss)
    expected_loss = dc.reference_step(reference, *dc.global_batch())
    fp32_pairs = {"loss": (global_loss / dist.get_world_size(), expected_loss)}
    stock_params, ref_params = dict(stock.named_parameters()), dict(reference.named_parameters())
    for name, param in model.named_parameters():
        pairs[f"{name}.grad"] = (_local(param.grad), _local(stock_params[name].grad))
        fp32_pairs[f"{name}.grad"] = (_local(param.grad), _local_rows(ref_params[name].grad, param.grad).float())
    return {"pairs": pairs, "fp32_pairs": fp32_pairs, "stock_graphs": stock_recorder.graphs,
            **dc.pass_outcome(recorder)}


def case_tp_logits(rank: int, vocab_size: int = dc.VOCAB_SIZE, seq_len: int = dc.SEQ_LEN,
                   read_backward: bool = True) -> dict[str, Any]:
    """A colwise_rep head of a model returning ``(loss, logits)``, as a Hugging Face causal LM does.
    ``peak``: this rank's peak of a step whose logits are returned and not read, chunkce and stock.
    ``pairs``: the loss and the logits read on every rank (a collective), against stock TP's;
    ``read_pairs`` (``read_backward``): every gradient of ``loss + (logits * probe).sum()`` (backward
    through a read); ``fused_pairs`` and ``fused_calls`` (``read_backward``): :func:`_fused_reads`. ``stale``: what a read after ``optimizer.step()`` raised."""
    from torch.distributed.device_mesh import init_device_mesh

    from compile_pass import LazyLogits, StaleLogitsError

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = dc.ToyLM(vocab_size, HIDDEN_SIZE, returns_logits=True)
    stock = copy.deepcopy(model)
    for module in (model, stock):
        _parallelize(module, mesh, "rep", tied=False)
    recorder = TPGraphRecorder(vocab_size, model.lm_head.weight.to_local().shape[0])
    compiled = dc.compile_chunkce(model, recorder)
    stock_compiled = torch.compile(stock, backend="aot_eager")
    input_ids, labels = dc.global_batch(seq_len, vocab_size)  # every TP rank: the same batch
    num_items_in_batch = (labels != dc.IGNORE_INDEX).sum()

    def train_step(fn) -> torch.Tensor:  # logits returned, not read
        loss, _ = fn(input_ids, labels, num_items_in_batch)
        loss.backward()
        return loss

    train_step(compiled), train_step(stock_compiled)  # compile outside the measured steps
    for module in (model, stock):
        module.zero_grad(set_to_none=True)
    _, peak = measure_peak_bytes(train_step, compiled)
    _, stock_peak = measure_peak_bytes(train_step, stock_compiled)
    for module in (model, stock):
        module.zero_grad(set_to_none=True)
    probe = torch.randn(*labels.shape, vocab_size, generator=torch.Generator().manual_seed(3))
    read, kinds = [], []
    for fn in (compiled, stock_compiled):
        loss, logits = fn(input_ids, labels, num_items_in_batch)
        kinds.append(type(logits).__name__)
        read.append((loss.detach().clone(), _read(logits)))
        if read_backward:
            (loss + (logits.float() * probe).sum()).backward()  # backward through a read of the logits
    pairs = {"loss": (read[0][0], read[1][0]), "logits": (read[0][1], read[1][1])}
    read_pairs = {}
    if read_backward:
        stock_params = dict(stock.named_parameters())
        for name, param in model.named_parameters():
            read_pairs[f"{name}.grad"] = (_local(param.grad), _local(stock_params[name].grad))
    fused_pairs, fused_calls = _fused_reads(compiled, stock_compiled, model, stock, input_ids, labels,
                                            num_items_in_batch) if read_backward else ({}, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, logits = compiled(input_ids, labels, num_items_in_batch)
    kinds.append(type(logits).__name__)
    loss.backward()
    optimizer.step()  # the DTensor head weight stepped: the logits of its shard can no longer be made
    try:
        logits.sum()
        stale = ""
    except StaleLogitsError as exc:
        stale = str(exc)
    return {"pairs": pairs, "read_pairs": read_pairs, "fused_pairs": fused_pairs, "fused_calls": fused_calls,
            "peak": peak, "stock_peak": stock_peak, "kinds": kinds,
            "stale": stale, "local_vocab": model.lm_head.weight.to_local().shape[0], "vocab_size": vocab_size,
            **dc.pass_outcome(recorder)}


def _fused_reads(compiled, stock_compiled, model, stock, input_ids, labels, num_items_in_batch):
    """TRL's log-probs and entropy at temperature 0.7 and an argmax of each step's returned logits, on
    every rank, then backward of ``logps.sum() + 0.01 * entropy.sum()``: values and every gradient
    (``pairs``, chunkce's against stock TP's) and chunkce's op walks and recipe runs (``calls``)."""
    from lazy_reads import counting
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    ids = labels.clamp(min=0)
    results = []
    for module, fn in ((model, compiled), (stock, stock_compiled)):
        module.zero_grad(set_to_none=True)
        with counting() as calls:
            _, logits = fn(input_ids, labels, num_items_in_batch)
            z = logits / 0.7
            logps, entropy = selective_log_softmax(z, ids), entropy_from_logits(z)
            argmax = logits.argmax(-1)
            (logps.sum() + 0.01 * entropy.sum()).backward()
        grads = {f"{name}.grad": _local(param.grad) for name, param in module.named_parameters()
                 if param.grad is not None}
        results.append(({"logps": logps.detach(), "entropy": entropy.detach(), "argmax": argmax, **grads},
                        (calls.walks, calls.recipes)))
    (got, calls), (expected, _) = results
    return {name: (got[name], expected[name]) for name in expected}, calls


def case_fsdp_tp_logits(rank: int) -> dict[str, Any]:
    """:func:`case_fsdp_tp`'s 2 x 2 mesh, the model returning ``(loss, logits)``: the logits read
    before backward (FSDP2 frees the unsharded head after it) against stock's; a read after
    backward raises StaleLogitsError."""
    from torch.distributed.device_mesh import init_device_mesh

    from compile_pass import StaleLogitsError

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = dc.ToyLM(dc.VOCAB_SIZE, HIDDEN_SIZE, returns_logits=True)
    stock = copy.deepcopy(model)
    for module in (model, stock):
        _shard_fsdp_tp(module, mesh)
    recorder = TPGraphRecorder(dc.VOCAB_SIZE, model.lm_head.weight.to_local().shape[0])
    compiled = dc.compile_chunkce(model, recorder)
    stock_compiled = torch.compile(stock, backend="aot_eager")
    input_ids, labels = dc.make_batch(mesh["dp"].get_local_rank())
    count = (labels != dc.IGNORE_INDEX).sum()
    read, kinds = [], []
    for fn in (compiled, stock_compiled):
        loss, logits = fn(input_ids, labels, count)
        kinds.append(type(logits).__name__)
        read.append((loss.detach().clone(), _read(logits)))  # before backward
        loss.backward()
    loss, logits = compiled(input_ids, labels, count)
    loss.backward()
    try:
        logits.sum()
        stale = ""
    except StaleLogitsError as exc:
        stale = str(exc)
    return {"pairs": {"loss": (read[0][0], read[1][0]), "logits": (read[0][1], read[1][1])}, "kinds": kinds,
            "stale": stale, **dc.pass_outcome(recorder)}


def case_fsdp_tp_tied_stock(rank: int) -> dict[str, Any]:
    """:func:`case_fsdp_tp`'s 2 x 2 mesh, tied (the embedding rowwise over "tp", one DTensor for both),
    compiled stock (``aot_eager``), no chunkce: what the first step raised (torch 2.13: AOTAutograd's
    "Mixing fake modes NYI" on the root's graph), or "" if it ran."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    stock = dc.ToyLM(dc.VOCAB_SIZE, HIDDEN_SIZE, tied=True)
    _shard_fsdp_tp(stock, mesh, tied=True)
    input_ids, labels = dc.make_batch(mesh["dp"].get_local_rank())
    try:
        torch.compile(stock, backend="aot_eager")(input_ids, labels, (labels != dc.IGNORE_INDEX).sum()).backward()
        raised = ""
    except Exception as exc:  # noqa: BLE001 - the text is the result; every rank raises at the same point
        raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised}


TP_CASES = {
    "tp_rep": case_tp,
    "tp_rep_tied": lambda rank: case_tp(rank, tied=True),
    "tp_rep_even": lambda rank: case_tp(rank, vocab_size=512),
    "tp_loss_parallel": lambda rank: case_tp(rank, "loss_parallel"),
    "tp_sequence_parallel": lambda rank: case_tp(rank, "sequence_parallel"),
    "tp_rowwise": lambda rank: case_tp(rank, "rowwise"),
    "tp_rep_chunked": lambda rank: case_tp(rank, chunk_size=8),  # several tiles per rank
    "tp_memory": lambda rank: case_tp(rank, vocab_size=MEMORY_VOCAB, seq_len=MEMORY_SEQ_LEN),
    # the same V as tp_loss_parallel: torch 2.13 fails to compile a loss_parallel model of another V on a new
    # mesh in the same process, stock or chunkce (test_tensor_parallel_graph.py: ..._torch_fails_to_compile_...)
    "tp_memory_loss_parallel": lambda rank: case_tp(rank, "loss_parallel", seq_len=MEMORY_SEQ_LEN),
    "tp_logits": case_tp_logits,
    "tp_memory_logits": lambda rank: case_tp_logits(rank, vocab_size=MEMORY_VOCAB, seq_len=MEMORY_SEQ_LEN,
                                                    read_backward=False),
}
TP_CASES_4 = {
    "tp4_rep": case_tp,
    "fsdp_tp": case_fsdp_tp,
    "fsdp_tp_bf16": lambda rank: case_fsdp_tp(rank, bf16=True),
    "tp4_logits": case_tp_logits,  # uneven: V = 509 is 128 / 128 / 128 / 125
    "fsdp_tp_logits": case_fsdp_tp_logits,
    # last: a rank's FSDP2 state after a failed compile is no other case's concern
    "fsdp_tp_tied_stock": case_fsdp_tp_tied_stock,
}

