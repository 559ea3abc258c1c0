"""A chunkce-compiled module whose first call (the compile) runs inside
``torch.utils.checkpoint(..., use_reentrant=False)``.

Non-reentrant checkpoint counts the tensors its region saves in forward and again in the
recompute, and raises ``CheckpointError`` when they differ. The compile runs only in the
first forward: whatever it runs with grad enabled (the pass computes the fake
``example_value`` of each node it adds, the custom op's autograd included) must save
nothing through the region's hooks, as Dynamo's own tracing saves nothing. Reference:
stock ``aot_eager`` compiled and called the same way (its first call inside the same
checkpoint); loss and every gradient compared, the rewrite proved on the graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import ToyLM
from rewrite_proof import Recorder
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.usefixtures("fresh_compile")

H, V = 16, 23  # builders' defaults, named here
GIF_OP = torch.ops.chunkce.linear_cross_entropy_grads_in_forward.default




def _first_call_under_checkpoint(module, h, labels):
    h = h.detach().clone().requires_grad_()
    loss = checkpoint(module, h, labels, use_reentrant=False)
    loss.backward()
    grads = {name: p.grad for name, p in getattr(module, "_orig_mod", module).named_parameters()}
    return loss.detach(), {**grads, "h": h.grad}


@pytest.mark.parametrize("kernels", ["compiled", "eager"])
@pytest.mark.parametrize("grads_in_forward", [False, True], ids=["recompute", "grads_in_forward"])
def test_first_call_inside_non_reentrant_checkpoint(kernels, grads_in_forward, monkeypatch):
    if kernels == "eager":
        monkeypatch.setenv("CHUNKCE_EAGER_KERNELS", "1")
    model = ToyLM(H, V, upcast=True)
    reference = copy.deepcopy(model)
    recorder = Recorder("aot_eager")
    compiled = torch.compile(model, backend="chunkce",
                             options={"inner_backend": recorder, "grads_in_forward": grads_in_forward})
    gen = torch.Generator().manual_seed(1)
    h, labels = torch.randn(2, 5, H, generator=gen), torch.randint(0, V, (2, 5), generator=gen)
    loss, grads = _first_call_under_checkpoint(compiled, h, labels)
    if grads_in_forward:
        assert sum(fact.target is GIF_OP for graph in recorder.graphs for fact in graph) == 1
        assert recorder.logits_like(2 * 5, V) == []
    else:
        recorder.assert_rewritten(2 * 5, V)
    ref_loss, ref_grads = _first_call_under_checkpoint(torch.compile(reference, backend="aot_eager"), h, labels)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")
