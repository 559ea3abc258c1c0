"""Shared fixtures. Not autouse: a test file opts in with
``pytestmark = pytest.mark.usefixtures("fresh_compile")``."""

import operator

import pytest
import torch
import torch._dynamo

import compile_pass  # noqa: F401 - registers the chunkce ops
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache


OP = torch.ops.chunkce.linear_cross_entropy.default  # what a rewritten site calls


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
def fresh_compile():
    """Isolation for compile tests: Dynamo reset, counters cleared, a fresh Inductor cache dir."""
    torch._dynamo.reset()
    counters.clear()
    with fresh_cache():
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


def _clone_inputs(inputs):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs]


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


@pytest.fixture
def compare_with_inductor():
    """``check(model, *inputs, options=None, backend="inductor", **tolerances) -> generated code``.

    Compiles ``model`` with ``backend="chunkce"`` (inner backend ``backend``) and a
    deep copy with stock ``backend``, runs a training step on each (cloned
    inputs), and asserts every output and every parameter / input gradient equal.
    Returns Inductor's generated code as one string ("" for other backends).
    """
    import copy

    from torch._inductor.utils import run_and_get_code

    def check(model, *inputs, options=None, backend="inductor", **tolerances):
        reference = copy.deepcopy(model)
        reference_inputs = _clone_inputs(inputs)
        options = {**(options or {}), "inner_backend": backend}
        compiled = torch.compile(model, backend="chunkce", options=options)
        (outputs, grads), code = run_and_get_code(train_step, compiled, list(inputs))
        ref_outputs, ref_grads = train_step(torch.compile(reference, backend=backend), reference_inputs)
        torch.testing.assert_close(outputs, ref_outputs, **tolerances)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **tolerances,
                                       msg=lambda m, name=name: f"{name}: {m}")
        return "\n".join(code)

    return check
