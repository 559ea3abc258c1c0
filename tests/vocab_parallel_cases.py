"""Per-rank cases for ``tests/op/test_vocab_parallel_op.py``: the vocabulary-parallel loss on gloo ranks.

:func:`run_rank` runs in each spawned process: it joins a gloo group, makes a one-dimensional
CPU ``DeviceMesh`` (the tensor-parallel group) and runs every case in turn. Each rank builds the
whole head from one seed, takes its ``Shard(0)`` rows as DTensor lays them out
(``distribute_tensor(...).to_local()``, the offset from DTensor's own
``compute_local_shape_and_global_offset``: uneven shards where the vocabulary does not divide,
e.g. 251, 251, 251, 248 of 1001 on 4 ranks), and computes the single-process reference,
``F.cross_entropy(F.linear(...))`` with the whole head. A case returns plain data: ``pairs`` maps
a name to ``(got, expected)`` (this rank's weight and bias rows against the reference's rows of
its shard), compared in the parent process by the test; the rest is case-specific.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100
GLOO_TIMEOUT_S = 60


class Shard:
    """This rank's place in the tensor-parallel group: ``group_name`` and, for a vocabulary of
    ``V``, its rows ``[start, start + size)`` as DTensor's ``Shard(0)`` lays them out."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.group_name = mesh.get_group().group_name

    def rows(self, vocab_size: int, hidden_size: int) -> tuple[int, int]:
        from torch.distributed.tensor import Shard as Shard0
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        (size, _), (start, _) = compute_local_shape_and_global_offset((vocab_size, hidden_size), self.mesh,
                                                                      [Shard0(0)])
        return start, size

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` as DTensor's ``distribute_tensor(full, mesh, [Shard(0)])`` holds them."""
        from torch.distributed.tensor import Shard as Shard0
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.detach(), self.mesh, [Shard0(0)]).to_local()


def problem(vocab_size: int, hidden_size: int = 8, shape=(2, 7), dtype=torch.float64, seed: int = 0):
    """The whole head ``weight [V, H]``, ``bias [V]``, ``hidden_states [*shape, H]``, ``target`` (two
    ignored, others spread over every shard and its boundaries) and ``class_weight [V]``."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab_size, hidden_size, generator=gen, dtype=dtype)
    bias = torch.randn(vocab_size, generator=gen, dtype=dtype)
    hidden = torch.randn(*shape, hidden_size, generator=gen, dtype=dtype)
    target = torch.randint(0, vocab_size, shape, generator=gen)
    flat = target.view(-1)
    flat[1], flat[-2] = IGNORE_INDEX, IGNORE_INDEX
    flat[2], flat[3] = 0, vocab_size - 1
    class_weight = torch.rand(vocab_size, generator=gen, dtype=dtype) + 0.1
    return weight, bias, hidden, target, class_weight


def options(**overrides) -> dict[str, Any]:
    """The op's options as the graph pass gives them (small tiles: several a rank)."""
    return {"ignore_index": IGNORE_INDEX, "label_smoothing": 0.0, "logits_dtype": torch.float64,
            "chunk_size": 4, "chunk_bytes": 4 * 8 * 64, **overrides}


def run_both(shard: Shard, weight, bias, hidden, target, class_weight, *, reduction: str, transform=None,
             projection_dtype=None, loss_fn=None, seed: int = 1, **overrides) -> dict[str, tuple]:
    """The vocabulary-parallel loss on this rank's shard and the reference on the whole head; a random
    upstream gradient; returns ``(got, expected)`` of the loss and every gradient."""
    from compile_pass.op.kernels import HeadScale
    from compile_pass.op.loss import chunked_cross_entropy

    transform = transform or HeadScale()
    start, size = shard.rows(*weight.shape)
    local_weight, local_bias = shard.local(weight), None if bias is None else shard.local(bias)
    torch.testing.assert_close(local_weight, weight[start:start + size], rtol=0, atol=0)  # DTensor's rows
    h, w = hidden.clone().requires_grad_(), local_weight.clone().requires_grad_()
    b = None if bias is None else local_bias.clone().requires_grad_()
    op_options = options(transform=transform, **overrides)

    def loss_of(h, w, t, b, cw):
        return chunked_cross_entropy(h, w, t, b, cw, reduction=reduction, vocab_start=start,
                                            vocab_size=weight.shape[0], group_name=shard.group_name,
                                            projection_dtype=projection_dtype, **op_options)

    loss = (loss_fn or loss_of)(h, w, target, b, class_weight)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    loss.backward(grad.to(loss.dtype))
    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rb = None if bias is None else bias.clone().requires_grad_()
    dtype = projection_dtype or hidden.dtype
    logits = F.linear(rh.to(dtype), rw.to(dtype), None if rb is None else rb.to(dtype))
    if not transform.is_identity:
        scale = transform.number if transform.tensor is None else transform.tensor
        logits = logits.to(transform.dtype or dtype)
        logits = logits / scale if transform.divides else logits * scale
    logits = logits.to(op_options["logits_dtype"])
    expected = F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=class_weight, reduction=reduction,
                               ignore_index=op_options["ignore_index"], label_smoothing=op_options["label_smoothing"])
    expected = expected.view_as(target) if reduction == "none" else expected
    expected.backward(grad.to(expected.dtype))
    pairs = {"loss": (loss.detach(), expected.detach()), "grad_hidden_states": (h.grad, rh.grad),
             "grad_weight": (w.grad, rw.grad[start:start + size])}
    if bias is not None:
        pairs["grad_bias"] = (b.grad, rb.grad[start:start + size])
    return pairs


def _sweep(shard: Shard, dtype: torch.dtype) -> dict[str, Any]:
    from compile_pass.op.kernels import HeadScale

    weight, bias, hidden, target, class_weight = problem(1001, dtype=dtype)
    pairs = {}
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.1):
            for weighted in (False, True):
                for transform in (HeadScale(), HeadScale(0.75), HeadScale(1.5, divides=True)):
                    key = f"{reduction}-eps{smoothing}-cw{int(weighted)}-{transform.variant()}"
                    result = run_both(shard, weight, bias, hidden, target, class_weight if weighted else None,
                                      reduction=reduction, transform=transform, label_smoothing=smoothing,
                                      logits_dtype=dtype)
                    pairs.update({f"{key} {name}": pair for name, pair in result.items()})
    return {"pairs": pairs}


def case_exact_fp64(shard: Shard) -> dict[str, Any]:
    """Every reduction, smoothing, class weights, a scale and a divisor, with bias; fp64. And once
    under ``torch.no_grad()`` (no gradient attaches, the loss is the same)."""
    result = _sweep(shard, torch.float64)
    from compile_pass.op.loss import chunked_cross_entropy

    weight, bias, hidden, target, class_weight = problem(1001)
    start, size = shard.rows(*weight.shape)
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, shard.local(weight), target, shard.local(bias), class_weight,
                                            reduction="mean", vocab_start=start, vocab_size=1001,
                                            group_name=shard.group_name, **options(label_smoothing=0.1))
    expected = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2), target.flatten(), weight=class_weight,
                               ignore_index=IGNORE_INDEX, label_smoothing=0.1)
    result["no_grad"] = {"loss": (loss, expected), "requires_grad": loss.requires_grad}
    target = target.masked_fill(target == IGNORE_INDEX, 600)
    target.view(-1)[4:7] = 600  # ignore_index a class of a shard other than rank 0's: ignored on every rank
    inside = run_both(shard, weight, bias, hidden, target, class_weight, reduction="mean", label_smoothing=0.1,
                      ignore_index=600)
    result["pairs"].update({f"ignore_index 600 {name}": pair for name, pair in inside.items()})
    return result


def case_exact_fp32(shard: Shard) -> dict[str, Any]:
    """The same sweep in fp32."""
    return _sweep(shard, torch.float32)


def case_bf16(shard: Shard) -> dict[str, Any]:
    """A bf16 head projected in bf16, the loss in fp32 (``logits.float()``), and a bf16 head with the
    loss in bf16 against the unfused bf16 path; both without bias (one with), ``sum`` and ``mean``."""
    weight, bias, hidden, target, class_weight = problem(203, hidden_size=16, dtype=torch.bfloat16, seed=3)
    pairs = run_both(shard, weight, None, hidden, target, None, reduction="mean", logits_dtype=torch.float32)
    bf16 = run_both(shard, weight, bias, hidden, target, class_weight, reduction="sum",
                    logits_dtype=torch.bfloat16, label_smoothing=0.05)
    pairs.update({f"bf16-loss {name}": pair for name, pair in bf16.items()})
    fp32 = problem(203, hidden_size=16, dtype=torch.float32, seed=3)  # projection_dtype: bf16 from fp32 inputs
    autocast_like = run_both(shard, fp32[0], None, fp32[2], fp32[3], None, reduction="mean",
                             projection_dtype=torch.bfloat16, logits_dtype=torch.float32)
    pairs.update({f"projection_dtype {name}": pair for name, pair in autocast_like.items()})
    return {"pairs": pairs}


def case_compiled(shard: Shard) -> dict[str, Any]:
    """Under ``torch.compile(backend=aot_eager's compilers, fullgraph=True)``: the collectives are in
    the forward graph Dynamo captured and in AOTAutograd's forward and backward graphs."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    from compile_pass.op.kernels import HeadScale
    from compile_pass.op.loss import chunked_cross_entropy

    graphs: dict[str, list[str]] = {"dynamo": [], "forward": [], "backward": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            graphs[kind] += [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
            return gm.forward if kind != "dynamo" else gm
        return compiler

    aot = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))

    def backend(gm, example_inputs):
        recorder("dynamo")(gm, example_inputs)
        return aot(gm, example_inputs)

    weight, bias, hidden, target, class_weight = problem(1001, dtype=torch.float32)
    start, _ = shard.rows(*weight.shape)

    op_options = options(label_smoothing=0.1, logits_dtype=torch.float32, transform=HeadScale(0.75))

    @torch.compile(backend=backend, fullgraph=True)
    def loss_fn(h, w, t, b, cw):
        return chunked_cross_entropy(h, w, t, b, cw, reduction="mean", vocab_start=start, vocab_size=1001,
                                            group_name=shard.group_name, **op_options)

    torch._dynamo.reset()
    pairs = run_both(shard, weight, bias, hidden, target, class_weight, reduction="mean", loss_fn=loss_fn,
                     label_smoothing=0.1, logits_dtype=torch.float32, transform=HeadScale(0.75))
    return {"pairs": pairs, "graphs": graphs}


def traced_loss(group_name: str, fakes: list, **kwargs) -> torch.fx.GraphModule:
    """A graph module of :func:`chunked_cross_entropy` with a shard emitted as the graph pass emits a site
    (:func:`compile_pass.graph.nodes.trace_into`: FX proxies, placeholders carrying fake values):
    ``(hidden_states, weight, target, bias, class_weight) -> loss``."""
    from compile_pass.graph.nodes import trace_into
    from compile_pass.op.loss import chunked_cross_entropy

    graph = torch.fx.Graph()
    placeholders = []
    for name, fake in zip(("hidden_states", "weight", "target", "bias", "class_weight"), fakes, strict=True):
        node = graph.placeholder(name)
        node.meta["example_value"] = fake
        placeholders.append(node)
    loss = trace_into(graph, chunked_cross_entropy, *placeholders, group_name=group_name, **kwargs)
    graph.output(loss)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def case_fx_traced(shard: Shard) -> dict[str, Any]:
    """Emitted into an FX graph with proxies, as the graph pass emits it, then run: exact."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_pass.op.kernels import HeadScale

    weight, bias, hidden, target, class_weight = problem(1001)
    start, size = shard.rows(*weight.shape)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(tensor) for tensor in (hidden, weight[:size], target, bias[:size], class_weight)]
    op_options = options(label_smoothing=0.1, transform=HeadScale(0.75))
    module = traced_loss(shard.group_name, fakes, reduction="sum", vocab_start=start, vocab_size=1001, **op_options)
    pairs = run_both(shard, weight, bias, hidden, target, class_weight, reduction="sum", loss_fn=module,
                     label_smoothing=0.1, transform=HeadScale(0.75))
    return {"pairs": pairs, "nodes": [str(node.target) for node in module.graph.nodes]}


def case_dtensor_entry(shard: Shard) -> dict[str, Any]:
    """``compile_pass.linear_cross_entropy`` on an ``nn.Linear`` parallelized by ``ColwiseParallel``
    (DTensor weight and bias ``Shard(0)``: the layout picks the vocabulary-parallel loss): with plain inputs (smoothing, class weights, a scale, ``mean``), with a replicated
    DTensor input (``sum``); and the layouts it refuses, with their messages."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from compile_pass import linear_cross_entropy
    from compile_pass.op.kernels import HeadScale

    weight, bias, hidden, target, class_weight = problem(1001, dtype=torch.float32)
    head = nn.Linear(8, 1001)
    with torch.no_grad():
        head.weight.copy_(weight), head.bias.copy_(bias)
    parallelize_module(head, shard.mesh, ColwiseParallel(output_layouts=Replicate()))
    assert isinstance(head.weight, DTensor)

    def entry(h, w, t, b, cw):  # run_both's local shards stand in for the module's: their gradients
        return linear_cross_entropy(h, head.weight, t, linear_bias=head.bias, weight=cw, label_smoothing=0.1,
                                    logit_scale=0.5, chunk_size=4, chunk_bytes=4 * 4 * 64)

    pairs = run_both(shard, weight, bias, hidden, target, class_weight, reduction="mean", loss_fn=entry,
                     label_smoothing=0.1, logits_dtype=torch.float32, transform=HeadScale(0.5))
    pairs["module grad_weight"] = (head.weight.grad.to_local().clone(), pairs.pop("grad_weight")[1])
    pairs["module grad_bias"] = (head.bias.grad.to_local().clone(), pairs.pop("grad_bias")[1])
    replicated = distribute_tensor(hidden, shard.mesh, [Replicate()]).requires_grad_()
    loss = linear_cross_entropy(replicated, head.weight, target, reduction="sum")
    loss.backward()
    reference = hidden.double().requires_grad_()  # fp64: the hidden-state gradient of a sum cancels to ~1e-2
    expected = torch.nn.functional.cross_entropy(torch.nn.functional.linear(reference, weight.double()).flatten(0, -2),
                                                 target.flatten(), reduction="sum")
    expected.backward()
    unfused = hidden.clone().requires_grad_()  # its fp32 error against fp64 bounds the op's
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(unfused, weight).flatten(0, -2), target.flatten(),
                                      reduction="sum").backward()
    pairs["replicated input loss"] = (loss.detach(), expected.detach().float())
    errors = {"op": (replicated.grad.to_local().double() - reference.grad).abs().max().item(),
              "unfused": (unfused.grad.double() - reference.grad).abs().max().item()}
    refusals = {}
    for name, kwargs in (("plain weight", {"linear_weight": weight}),
                         ("replicated weight", {"linear_weight": distribute_tensor(weight, shard.mesh, [Replicate()])}),
                         ("plain bias", {"linear_bias": bias})):
        arguments = {"linear_weight": head.weight, "linear_bias": head.bias, **kwargs}
        try:
            linear_cross_entropy(hidden, arguments.pop("linear_weight"), target, **arguments)
        except (TypeError, ValueError) as error:
            refusals[name] = f"{type(error).__name__}: {error}"
    return {"pairs": pairs, "replicated_grad_errors": errors, "refusals": refusals}


def case_inductor(shard: Shard) -> dict[str, Any]:
    """``torch.compile(backend="inductor", fullgraph=True)`` with the per-tile kernels compiled too (run
    alone, by its own test: ``CHUNKCE_EAGER_KERNELS=0``); two steps, the second from the cache."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from compile_pass.op.kernels import HeadScale
    from compile_pass.op.loss import chunked_cross_entropy

    os.environ["CHUNKCE_EAGER_KERNELS"] = "0"  # read at each call (compile_pass.op.tiling)
    weight, bias, hidden, target, class_weight = problem(1001, dtype=torch.float32)
    start, _ = shard.rows(*weight.shape)
    op_options = options(label_smoothing=0.1, logits_dtype=torch.float32, transform=HeadScale(0.5))

    @torch.compile(backend="inductor", fullgraph=True)
    def loss_fn(h, w, t, b, cw):
        return chunked_cross_entropy(h, w, t, b, cw, reduction="mean", vocab_start=start, vocab_size=1001,
                                            group_name=shard.group_name, **op_options)

    torch._dynamo.reset()
    counters.clear()
    graphs = []  # after each step: Dynamo's graphs (the loss's) and the op's kernels' (forward and backward)
    for _ in range(2):
        pairs = run_both(shard, weight, bias, hidden, target, class_weight, reduction="mean", loss_fn=loss_fn,
                         label_smoothing=0.1, logits_dtype=torch.float32, transform=HeadScale(0.5))
        graphs.append((counters["stats"]["unique_graphs"], counters["chunkce"]["kernel_graphs"]))
    return {"pairs": pairs, "graphs": graphs}


def case_checkpoint_and_hooks(shard: Shard) -> dict[str, Any]:
    """Inside non-reentrant activation checkpointing (its recompute repeats the collectives on every
    rank) and under saved-tensor hooks that pack every saved tensor into a copy."""
    from torch.utils.checkpoint import checkpoint

    from compile_pass.op.loss import chunked_cross_entropy

    weight, bias, hidden, target, class_weight = problem(1001)
    start, _ = shard.rows(*weight.shape)
    packed = [0]

    def pack(tensor):
        packed[0] += 1
        return tensor.clone()

    def loss_fn(h, w, t, b, cw):
        def inner(h, w, b):
            return chunked_cross_entropy(h, w, t, b, cw, reduction="mean", vocab_start=start, vocab_size=1001,
                                                group_name=shard.group_name, **options(label_smoothing=0.1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return checkpoint(inner, h, w, b, use_reentrant=False)

    pairs = run_both(shard, weight, bias, hidden, target, class_weight, reduction="mean", loss_fn=loss_fn,
                     label_smoothing=0.1)
    return {"pairs": pairs, "packed": packed[0]}


def case_memory(shard: Shard) -> dict[str, Any]:
    """Peak bytes of this rank's forward and backward above their inputs, against a tile and ``[N, V_local]``."""
    from compile_pass.memory import measure_peak_bytes
    from compile_pass.op.loss import chunked_cross_entropy

    tokens, hidden_size, vocab_size, chunk_size, block = 512, 16, 8192, 32, 256
    weight, _, hidden, target, _ = problem(vocab_size, hidden_size=hidden_size, shape=(tokens,), dtype=torch.float32)
    start, size = shard.rows(vocab_size, hidden_size)
    h, w = hidden.clone().requires_grad_(), shard.local(weight).clone().requires_grad_()
    loss, forward_peak = measure_peak_bytes(
        chunked_cross_entropy, h, w, target, None, None, reduction="mean", vocab_start=start,
        vocab_size=vocab_size, group_name=shard.group_name,
        **options(logits_dtype=torch.float32, chunk_size=chunk_size, chunk_bytes=chunk_size * block * 4))
    _, backward_peak = measure_peak_bytes(loss.backward)
    from compile_pass.op.tiling import walk_threads

    return {"forward_peak": forward_peak, "backward_peak": backward_peak, "tile_bytes": chunk_size * block * 4,
            "rows_bytes": tokens * size * 4, "vector_bytes": tokens * 4, "hidden_bytes": tokens * hidden_size * 4,
            "weight_bytes": size * hidden_size * 4, "walk_threads": walk_threads("cpu")}


def case_empty_shard(shard: Shard) -> dict[str, Any]:
    """V = 5: on 4 ranks DTensor gives the last rank no rows (2, 2, 1, 0)."""
    weight, bias, hidden, target, class_weight = problem(5)
    pairs = run_both(shard, weight, bias, hidden, target, class_weight, reduction="mean", label_smoothing=0.2)
    return {"pairs": pairs, "rows": shard.rows(5, 8)}


def case_bad_target(shard: Shard) -> dict[str, Any]:
    """A target of V (outside the vocabulary, not ignored) raises on every rank, naming the range."""
    from compile_pass.op.loss import chunked_cross_entropy

    weight, _, hidden, target, _ = problem(1001)
    target.view(-1)[0] = 1001
    start, _ = shard.rows(1001, 8)
    try:
        chunked_cross_entropy(hidden, shard.local(weight), target, None, None, reduction="mean",
                                     vocab_start=start, vocab_size=1001, group_name=shard.group_name, **options())
    except RuntimeError as error:
        return {"error_message": str(error)}
    return {"error_message": None}


# run by the tests of each world size; case_inductor is run alone, on 2 ranks, by its own test
CASES: dict[str, Callable[[Shard], dict[str, Any]]] = {
    "exact_fp64": case_exact_fp64,
    "exact_fp32": case_exact_fp32,
    "bf16": case_bf16,
    "compiled": case_compiled,
    "fx_traced": case_fx_traced,
    "dtensor_entry": case_dtensor_entry,
    "checkpoint_and_hooks": case_checkpoint_and_hooks,
    "memory": case_memory,
    "empty_shard": case_empty_shard,
    "bad_target": case_bad_target,
}


def run_rank(rank: int, world_size: int, out_dir: str, case_names: list[str]) -> None:
    """Entry of each spawned process: :func:`run_cases` of this module's cases."""
    run_cases(rank, world_size, out_dir, case_names, {**CASES, "inductor": case_inductor})


def run_cases(rank: int, world_size: int, out_dir: str, case_names: list[str],
              cases: dict[str, Callable[[Shard], dict[str, Any]]]) -> None:
    """Join the gloo group, run ``case_names`` of ``cases`` in order, and after each write every
    result so far to ``out_dir/rank<rank>.pt``; an exception is written there with its traceback
    (under its case's name), then raised (``statistics_parallel_cases`` runs its cases through it too)."""
    os.environ["CHUNKCE_EAGER_KERNELS"] = "1"  # the per-tile math eagerly: no Inductor compile per rank
    from torch.distributed.device_mesh import init_device_mesh

    import compile_pass  # noqa: F401 - registers the chunkce ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    shard = Shard(init_device_mesh("cpu", (world_size,)))
    results: dict[str, Any] = {}
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        for name in case_names:
            try:
                results[name] = cases[name](shard)
            except BaseException:
                results[name] = {"error": traceback.format_exc()}
                raise
            finally:
                torch.save(results, f"{path}.part")
                os.replace(f"{path}.part", path)
            dist.barrier()
    finally:
        dist.destroy_process_group()
