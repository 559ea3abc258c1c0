"""What the tests build and read, shared: a toy lm_head with a loss (:class:`Head`), its inputs,
a training step's outputs and gradients, and the rewritten graph's op node and arguments."""

import operator

import torch
import torch.nn.functional as F
from torch import nn

import compile_pass  # noqa: F401 - registers the chunkce ops

OP = torch.ops.chunkce.linear_cross_entropy.default  # what a rewritten site calls
B, T, H, V = 2, 5, 16, 23  # the builders' default shapes: batch, sequence, hidden size, an odd vocabulary


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


class ToyLM(nn.Module):
    """A body ``Linear(H, H)``, a ReLU, an lm_head ``[V, H]`` and ``F.cross_entropy`` of the
    flattened logits (``upcast``: ``.float()`` first, as Hugging Face's loss); seeded."""

    def __init__(self, hidden_size=H, vocab=V, upcast=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(hidden_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)
        self.upcast = upcast

    def forward(self, h, labels):
        logits = self.lm_head(torch.relu(self.body(h)))  # [B, T, V]
        logits = logits.float() if self.upcast else logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


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
