"""Reads of lazy logits that need only row statistics go through the op: stock's values and every
gradient, no fallback.

Each case runs the same user code on a ``LazyLogits`` built over a linear head (as the
returned-logits pass builds it: :mod:`lazy_reads`) and on stock's ``F.linear`` logits of
identical leaves, and compares the read and the gradients of hidden states, weight and bias
(``torch.testing.assert_close``; bf16: error against fp64 no worse than stock's). It also proves
the path: the op was called (walks over the vocabulary counted) and the recipe (the fallback that
computes ``[N, V]``) never ran. Spellings that must fall back are run too, and are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lazy_reads import assert_equal_reads, counting, flat, leaves, make_lazy, run_side
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from compile_pass import StaleLogitsError

V = 37


def ids_like(z, seed=7):
    """Token ids for the rows of ``z`` (the same on both sides), some ``< 5`` (ignored where a read ignores)."""
    return torch.randint(0, V, z.shape[:-1], generator=torch.Generator().manual_seed(seed))


def per_row(z, seed=3):
    """A per-row temperature for the rows of ``z``, in ``[0.5, 1.5)``."""
    return torch.rand(z.shape[:-1], generator=torch.Generator().manual_seed(seed)) + 0.5


def log_probs(z):
    return torch.log_softmax(z, -1)


READS = {
    "gather": lambda z: torch.gather(z, -1, ids_like(z)[..., None]).squeeze(-1),
    "tensor_gather": lambda z: z.gather(-1, ids_like(z).unsqueeze(-1)),
    "take_along_dim": lambda z: torch.take_along_dim(z, ids_like(z)[..., None], dim=-1),
    "logsumexp": lambda z: torch.logsumexp(z, -1),
    "logsumexp_keepdim": lambda z: z.logsumexp(dim=-1, keepdim=True),
    "log_softmax_gather": lambda z: F.log_softmax(z, dim=-1).gather(-1, ids_like(z)[..., None]),
    "softmax_gather": lambda z: z.softmax(-1).gather(-1, ids_like(z)[..., None]),
    "entropy_exp_lp": lambda z: -(torch.exp(log_probs(z)) * log_probs(z)).sum(-1),
    "entropy_p_lp": lambda z: -(z.softmax(-1) * log_probs(z)).sum(-1),
    "entropy_lse_pz": lambda z: torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1),
    "neg_cross_entropy": lambda z: -F.cross_entropy(z.reshape(-1, V), ids_like(z).masked_fill(ids_like(z) < 5, -100)
                                                     .reshape(-1), reduction="none", ignore_index=-100),
    "cross_entropy_mean": lambda z: F.cross_entropy(z.reshape(-1, V), ids_like(z).masked_fill(ids_like(z) < 5, -100)
                                                    .reshape(-1)),
    "cross_entropy_sum": lambda z: F.cross_entropy(z.reshape(-1, V), ids_like(z).reshape(-1), reduction="sum"),
    "argmax": lambda z: z.argmax(-1),
    "argmax_keepdim": lambda z: torch.argmax(z, dim=-1, keepdim=True),
    "max": lambda z: tuple(z.max(-1)),
    "max_keepdim": lambda z: tuple(torch.max(z, dim=-1, keepdim=True)),
    "trl_selective_log_softmax": lambda z: selective_log_softmax(z, ids_like(z)),
    "trl_entropy_from_logits": lambda z: entropy_from_logits(z, chunk_size=4),
    "gather_minus_row_loop": lambda z: z.gather(-1, ids_like(z)[..., None]).squeeze(-1)
    - torch.stack([torch.logsumexp(row, -1) for row in z]),
    "split_rows_entropy": lambda z: torch.cat([-(c.softmax(-1) * c.log_softmax(-1)).sum(-1)
                                               for c in z.reshape(-1, V).split(5)]),
    "chunk_unbind_lse": lambda z: torch.stack([torch.logsumexp(r, -1) for c in z.chunk(2) for r in c.unbind(0)]),
    "row_sum": lambda z: z.sum(-1),
    "row_mean_keepdim": lambda z: torch.mean(z, dim=-1, keepdim=True),
    "sum_of_every_value": lambda z: torch.sum(z),
    "mean_of_every_value": lambda z: z.mean(),
    "masked_mean": lambda z: z[ids_like(z) > 10].mean(),  # TRL DPO's metric: an index read of token rows
    "indexed_rows_lse_and_argmax": lambda z: (lambda rows: (rows.logsumexp(-1), rows.argmax(-1)))(
        z[ids_like(z) > 10]),
    "log_probs_row_mean": lambda z: z.log_softmax(-1).mean(-1),
    "entropy_row_mean": lambda z: (z.softmax(-1) * z.log_softmax(-1)).mean(-1),
}


def _div_(z, other):
    z.div_(other)
    return z


def _mul_(z, other):
    z.mul_(other)
    return z


VIEWS = {
    "plain": lambda z: z,
    "shift": lambda z: z[:, :-1],
    "last_k": lambda z: z[:, -3:],
    "select": lambda z: z[1],
    "flatten_view": lambda z: z.flatten(0, 1).view(z.shape),
    "transpose_tokens": lambda z: z.transpose(0, 1),
    "clone": lambda z: z.clone(),
    "contiguous_of_transpose": lambda z: z.transpose(0, 1).contiguous(),
    "reshape_that_copies": lambda z: z.transpose(0, 1).reshape(-1, V),
    "float": lambda z: z.float(),
    "double": lambda z: z.double(),
    "div_number": lambda z: z / 0.7,
    "mul_number": lambda z: 2.0 * z,
    "div_0d": lambda z: z / torch.tensor(0.7),
    "div_row": lambda z: z / per_row(z).clamp(min=1e-8).unsqueeze(-1),
    "mul_row": lambda z: z * per_row(z)[..., None],
    "div__number": lambda z: _div_(z[:, :-1], 0.7),
    "mul__number": lambda z: _mul_(z, 1.3),
    "div__row": lambda z: _div_(z[:, :-1], per_row(z[:, :-1])[..., None]),
    "float_then_div": lambda z: z.float() / 0.9,
    "div_then_float_then_shift": lambda z: (z / 0.9).float()[:, 1:],
}


def _check(read, view, dtype=torch.float32, grad=True, shape=(2, 6, 8, V)):
    """Run ``read(view(logits))`` both ways; returns the counts of the lazy run."""
    lazy_side, stock_side = leaves(shape, dtype=dtype)
    user = (lambda z: read(view(z))) if grad else torch.no_grad()(lambda z: read(view(z)))
    with counting() as calls:
        got, got_grads = run_side(user, lazy_side, lazy=True)
    expected, expected_grads = run_side(user, stock_side, lazy=False)
    if dtype == torch.float32:
        assert_equal_reads(got, expected)
        for name, g, e in zip(("hidden", "weight", "bias"), got_grads, expected_grads):
            torch.testing.assert_close(g, e, msg=lambda m, name=name: f"d {name}: {m}")
    else:
        assert_no_worse_than_stock(user, got, got_grads, expected, expected_grads, shape)
    return calls


def assert_no_worse_than_stock(user, got, got_grads, expected, expected_grads, shape):
    """Half precision: the same shapes and dtypes, and the error against fp64 (the same code on the same
    values in fp64) at most twice stock's, or one bf16 rounding (2**-7 relative)."""
    reference_side, _ = leaves(shape, dtype=torch.bfloat16)
    reference_side = type(reference_side)(*(t.detach().double().requires_grad_() for t in reference_side.tensors()))
    reference, reference_grads = run_side(user, reference_side, lazy=False)
    for g, e, r in zip(flat(got) + got_grads, flat(expected) + expected_grads, flat(reference) + reference_grads):
        if e is None:
            assert g is None
            continue
        assert (g.shape, g.dtype) == (e.shape, e.dtype)
        if not g.is_floating_point():
            assert torch.equal(g, e)
            continue
        def error(x):
            return ((x.double() - r.double()).norm() / r.double().norm()).item()
        assert error(g) <= max(2 * error(e), 2 ** -7), (error(g), error(e))


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("read", READS)
def test_every_read_of_every_view_is_fused_and_equals_stock(read, view):
    calls = _check(READS[read], VIEWS[view])
    assert calls.recipes == 0, "fell back: the logits were computed"
    assert calls.walks >= 1


@pytest.mark.parametrize("view", ["plain", "float", "div_number", "div_row", "div__number", "shift"])
@pytest.mark.parametrize("read", READS)
def test_bf16_reads_are_fused_and_no_less_precise_than_stock(read, view):
    calls = _check(READS[read], VIEWS[view], dtype=torch.bfloat16, shape=(2, 4, 8, V))
    assert calls.recipes == 0 and calls.walks >= 1


@pytest.mark.parametrize("read", READS)
def test_reads_under_no_grad_are_fused_and_detached(read):
    calls = _check(READS[read], VIEWS["div_row"], grad=False)
    assert calls.recipes == 0 and calls.backwards == 0


@pytest.mark.parametrize("read", ["gather", "entropy_exp_lp", "max", "trl_selective_log_softmax"])
def test_reads_of_a_detached_view_are_detached(read):
    calls = _check(lambda z: (READS[read](z.detach()), READS["logsumexp"](z)), VIEWS["div__number"])
    assert calls.recipes == 0 and calls.walks == 2  # statistics without grad serve no read with grad


FALLBACKS = {  # not fused: computed by the recipe, exact
    "second_temperature": lambda z: selective_log_softmax(z / 0.7, ids_like(z), temperature=0.9),
    "fp64_after_a_temperature": lambda z: torch.logsumexp((z / 0.7).double(), -1),
    "cross_entropy_label_smoothing": lambda z: F.cross_entropy(z.reshape(-1, V), ids_like(z).reshape(-1),
                                                               reduction="none", label_smoothing=0.1),
    "cross_entropy_weight": lambda z: F.cross_entropy(z.reshape(-1, V), ids_like(z).reshape(-1),
                                                      weight=torch.rand(V, generator=torch.Generator().manual_seed(3))),
    "logits_sum_of_squares": lambda z: (z * z).sum(-1),
    "masked_mean_of_a_vocabulary_slice": lambda z: z[..., torch.arange(V) % 3 == 0].mean(),
    "temperature_requiring_grad": lambda z: torch.logsumexp(z / per_row(z).requires_grad_()[..., None], -1),
    "vocabulary_slice": lambda z: torch.logsumexp(z[..., :20], -1),
    "log_softmax_over_tokens": lambda z: z.log_softmax(1).gather(-1, ids_like(z)[..., None]),
    "non_fused_read_after_div_": lambda z: (lambda y: (y * y).sum(-1))(_div_(z[:, :-1], 0.7)),
}


@pytest.mark.parametrize("read", FALLBACKS)
def test_reads_that_are_not_fused_compute_the_logits_and_equal_stock(read):
    calls = _check(FALLBACKS[read], VIEWS["plain"])
    assert calls.recipes >= 1


def test_a_copy_made_before_an_in_place_edit_keeps_its_values_and_views_see_the_edit():
    def user(z):
        copy, log_p, view = z.clone(), z.log_softmax(-1), z[:, 1:]
        z.div_(0.5)  # recorded on the rows: nothing computed
        return (torch.logsumexp(copy, -1), log_p.gather(-1, ids_like(z)[..., None]), torch.logsumexp(view, -1),
                torch.logsumexp(z, -1), (copy * copy).sum(-1))  # the last falls back: the copy's values before the edit
    calls = _check(user, VIEWS["plain"])
    assert calls.walks == 2  # before the edit (the copy; the log-probs share it), after it (the view, z)
    assert calls.recipes >= 1  # (copy * copy).sum(-1)


def test_rows_edited_and_not_are_read_together():
    def user(z):
        z[:, :-1].div_(0.7)
        return torch.logsumexp(z, -1), z.argmax(-1)
    calls = _check(user, VIEWS["plain"])
    assert (calls.walks, calls.recipes) == (2, 0)  # one walk per key: the edited rows and the last one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_walk_serves_trls_log_probs_and_entropy_and_one_backward_gets_their_gradients(dtype):
    """TRL's GRPO reads: a temperature, ``selective_log_softmax`` (fp32: a gather and a logsumexp
    per row; bf16: a log_softmax and a gather per row) then ``entropy_from_logits`` (128-row
    chunks; here 4). One walk over the vocabulary in forward, one backward through it; bf16's
    per-row gathers after the first are op calls without a walk."""
    def user(z):
        z = z[:, :-1] / 0.7
        return selective_log_softmax(z, ids_like(z)), entropy_from_logits(z, chunk_size=4)
    calls = _check(user, VIEWS["plain"], dtype=dtype, shape=(3, 7, 8, V))
    assert (calls.walks, calls.recipes) == (1, 0)
    assert calls.gathers == (0 if dtype == torch.float32 else 2)
    assert (calls.walk_backwards, calls.backwards) == (1, 1 + calls.gathers)


def test_a_read_after_optimizer_step_raises_and_values_read_before_are_served():
    lazy_side, _ = leaves()
    z = make_lazy(lazy_side)
    served = torch.logsumexp(z, -1)  # computed before the step: kept
    lazy_side.weight.grad = torch.ones_like(lazy_side.weight)
    torch.optim.SGD([lazy_side.weight], lr=0.1).step()
    torch.testing.assert_close(torch.logsumexp(z[:, 1:], -1), served[:, 1:])
    with pytest.raises(StaleLogitsError, match="before optimizer.step"):
        z.gather(-1, ids_like(z)[..., None])  # needs an op call: checked as any read
    with pytest.raises(StaleLogitsError):
        torch.logsumexp(z / 2, -1)


def test_reads_under_autocast_equal_stocks_reads_under_it():
    """Reads inside ``torch.autocast``: the op runs outside it (the head's own autocast is its
    ``projection_dtype``), and each read has the dtype stock's has under it (probed)."""
    def user(z):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (torch.logsumexp(z, -1), F.cross_entropy(z.reshape(-1, V), ids_like(z).reshape(-1),
                                                            reduction="none"),
                    z.log_softmax(-1).gather(-1, ids_like(z)[..., None]))
    calls = _check(user, VIEWS["div_number"])
    assert (calls.walks, calls.recipes) == (1, 0)


EMPTY_READS = {  # rows of none: stock's empty results and nan means, and their (zero) gradients
    "lse_of_no_rows": (lambda z: z[:, :0].logsumexp(-1), 0),
    "argmax_of_no_rows": (lambda z: z[:, :0].argmax(-1), 0),
    "mean_of_no_rows": (lambda z: z[:, :0].mean(), 0),
    "mean_of_an_empty_mask": (lambda z: z[torch.zeros(z.shape[:-1], dtype=torch.bool)].mean(), 1),
}


@pytest.mark.parametrize("read", EMPTY_READS)
def test_reads_of_no_rows_equal_stock(read):
    """A view of no rows reads through the op on none; a copy of no rows (an all-False mask) has no
    key left and computes the values (an edge: no rows to read)."""
    user, recipes = EMPTY_READS[read]
    lazy_side, stock_side = leaves()
    with counting() as calls:
        got, got_grads = run_side(user, lazy_side, lazy=True)
    expected, expected_grads = run_side(user, stock_side, lazy=False)
    assert (type(got), got.shape, got.dtype, got.requires_grad) == (torch.Tensor, expected.shape, expected.dtype,
                                                                       expected.requires_grad)
    torch.testing.assert_close(got, expected, equal_nan=True)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, equal_nan=True)
    assert calls.recipes >= recipes and (recipes or calls.recipes == 0)
