"""Shared fixtures and builders. The fixtures are not autouse (a test file opts in with
``pytestmark = pytest.mark.usefixtures("fresh_compile")``), but for the tiers' run-time
check (``tiers.py``: a test not marked slow may not compile with Inductor or start a process)."""

import contextlib
import operator
import os

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import compile_pass  # noqa: F401 - registers the chunkce ops
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache
from tiers import _tier_check  # noqa: F401 - the tiers' run-time check (tiers.py)


OP = torch.ops.chunkce.linear_cross_entropy.default  # what a rewritten site calls


def pytest_configure(config):
    """Under pytest-xdist (the README runs ``-n 2``) each worker takes its share of the cores:
    two workers each running the op's small per-tile kernels on every core would wait on each
    other's threads (the many-block precision case: 7 s alone, 15 s with both on 2 threads)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
B, T, H, V = 2, 5, 16, 23  # the builders' default shapes: batch, sequence, hidden size, an odd vocabulary


# --- builders ------------------------------------------------------------------------------------


def flat_loss(module, hidden, labels):
    """HF's loss without the shift: ``F.cross_entropy`` of the flattened ``[B*T, V]`` logits."""
    logits = module.lm_head(hidden)  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class Head(nn.Module):
    """An lm_head ``[V, H]`` and a loss written by ``loss(module, hidden, labels, *extra)``
    (default :func:`flat_loss`); seeded, so two builds hold the same weights."""

    def __init__(self, loss=flat_loss, *, hidden_size=H, vocab=V, bias=False, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=bias, dtype=dtype)
        self.loss = loss

    def forward(self, hidden, labels, *extra):
        return self.loss(self, hidden, labels, *extra)


def hidden_states(*shape, seed=0, dtype=torch.float32):
    """``[B, T, H]`` (or ``shape``) standard-normal hidden states that require grad."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (B, T, H)), generator=gen).to(dtype).requires_grad_()


def labels_of(*shape, vocab=V, seed=0):
    """``[B, T]`` (or ``shape``) int64 labels in ``[0, vocab)``."""
    return torch.randint(0, vocab, shape or (B, T), generator=torch.Generator().manual_seed(seed + 1))


def z_loss(logits):
    """PaLM's z-loss on the fp32 logits (``1e-2 * mean(logsumexp ** 2)``): a loss that reads every
    logit, as a training loop adds it outside the compiled region."""
    return 1e-2 * logits.float().logsumexp(-1).pow(2).mean()


def op_node(gm):
    """The one ``chunkce::linear_cross_entropy`` node of a rewritten graph (fails unless exactly one)."""
    (node,) = [n for n in gm.graph.nodes if n.target is OP]
    return node


def op_arguments(node):
    """The op node's arguments by schema name (``hidden_states``, ``logits_dtype``, ``chunk_size``, ...)."""
    return {argument.name: value for argument, value in zip(OP._schema.arguments, node.args)} | dict(node.kwargs)


def reduction_of(node):
    """The reduction the graph applies to the op's per-token loss, read from its nodes:
    ``"none"`` (viewed as the target), ``"mean"`` (its sum divided) or ``"sum"``."""
    (loss,) = [user for user in node.users if user.target is operator.getitem and user.args[1] == 0]
    if any(user.target == "view_as" for user in loss.users):
        return "none"
    (total,) = [user for user in loss.users if user.target == "sum"]
    return "mean" if any(user.target is operator.truediv for user in total.users) else "sum"


class RoundTo(torch.autograd.Function):
    """``x.to(dtype)`` computed in fp64: the value rounded to ``dtype``, and its
    gradient rounded to ``dtype`` too (what autograd of a cast produces). The ground
    truth of a graph that casts logits to half precision before the loss."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).double()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).double(), None


@pytest.fixture
def fresh_compile(request):
    """Isolation for compile tests: Dynamo reset, counters cleared, and for a slow test a
    fresh Inductor cache dir.

    A fast test keeps Inductor's cache, as every other fast test does: the only graphs
    Inductor compiles in it are the op's per-chunk kernels (``tiers.py`` fails any other),
    which the cache keys by their graph, so a hit serves what a fresh compile would. (A fresh
    dir per test compiled each kernel variant's C++ again in every test.)"""
    torch._dynamo.reset()
    counters.clear()
    with fresh_cache() if request.node.get_closest_marker("slow") else contextlib.nullcontext():
        yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def eager_kernels(monkeypatch):
    """Run the op's per-chunk math eagerly: tests of the pass need not pay for compiling it."""
    monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")


@pytest.fixture
def chunkce_logs(caplog):
    """Every record the pass logs (``compile_pass`` loggers at DEBUG)."""
    caplog.set_level("DEBUG", logger="compile_pass")
    return caplog


def train_step(model, inputs):
    """Forward, then backward of the sum of every floating output; returns (outputs, grads).

    grads: parameter gradients by name, then input gradients by position.
    """
    outputs = model(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable:
        sum(o.float().sum() for o in differentiable).backward()
    module = getattr(model, "_orig_mod", model)
    params = module.named_parameters() if isinstance(module, torch.nn.Module) else ()
    grads = {name: p.grad for name, p in params}
    grads.update({f"input{i}": x.grad for i, x in enumerate(inputs)
                  if isinstance(x, torch.Tensor) and x.requires_grad})
    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs), grads
