"""Reads of returned logits after ``optimizer.step()``: what was read before is served, the rest raises.

Once an optimizer steps the head's weight, the logits can no longer be computed as the step
would have. Values kept before (``logits + 0``, ``logits.compute()``) serve every later read as torch
runs it on them; a statistic a read produced before (a logsumexp, an argmax, gathered log-probs of
the same rows and indices) is served again, equal to what it read before; anything else raises
:class:`StaleLogitsError`. Each case reads a ``LazyLogits`` over a toy linear head (:mod:`lazy_reads`)
and compares against torch's reads of stock ``F.linear`` logits of the same leaves before the step.
The table below is one case per row (each read today, before: StaleLogitsError but the last two); then
one case per kind of statistic read twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lazy_reads import leaves, make_lazy, stock_logits

from compile_pass import StaleLogitsError

V = 37


def step(side):
    """An SGD step of the lazy side's weight and bias: the logits' inputs change."""
    for t in (side.weight, side.bias):
        t.grad = torch.ones_like(t)
    torch.optim.SGD([side.weight, side.bias], lr=0.1).step()


def ids_like(z, seed=7):
    return torch.randint(0, V, z.shape[:-1], generator=torch.Generator().manual_seed(seed))


def argmax(z):
    return z.argmax(-1)


def logsumexp(z):
    return torch.logsumexp(z, -1)


def plus_zero(z):
    return z + 0


def computed(z):
    return z.compute()


# (read before the step, read after it); every row is served
TABLE = {
    "kept_values_then_argmax": (plus_zero, argmax),
    "kept_values_then_logsumexp": (plus_zero, logsumexp),
    "compute_then_argmax": (computed, argmax),
    "argmax_then_argmax": (argmax, argmax),
    "logsumexp_then_logsumexp": (logsumexp, logsumexp),
    "kept_values_then_kept_values": (plus_zero, plus_zero),
}


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("row", TABLE)
def test_each_row_of_the_issue_table_is_served_after_the_step_as_read_before(row, grad):
    before_read, after_read = TABLE[row]
    lazy_side, stock_side = leaves()
    expected = after_read(stock_logits(stock_side)).detach()  # (float32: the two sides share their leaves)
    z = make_lazy(lazy_side)
    with torch.set_grad_enabled(grad):
        before = before_read(z)
        step(lazy_side)
        after = after_read(z)
    torch.testing.assert_close(after.detach(), expected)
    if before_read is after_read:
        assert torch.equal(after.detach(), before.detach())


# one kind of statistic a read produces, read before the step and again after it
def entropy(z):
    p, lp = z.softmax(-1), z.log_softmax(-1)
    return -(p * lp).sum(-1)


STATISTICS = {
    "logsumexp": logsumexp,
    "entropy": entropy,
    "max": lambda z: tuple(z.max(-1)),
    "argmax": argmax,
    "row_sum": lambda z: z.sum(-1),
    "row_mean": lambda z: z.mean(-1),
    "sum": lambda z: z.sum(),
    "gathered_logits": lambda z: z.gather(-1, ids_like(z)[..., None]),
    "gathered_log_probs": lambda z: z.log_softmax(-1).gather(-1, ids_like(z)[..., None]),
    "cross_entropy": lambda z: F.cross_entropy(z.reshape(-1, V), ids_like(z).reshape(-1), reduction="none"),
    "logsumexp_of_some_rows": lambda z: torch.logsumexp(z[:, 2:4] / 0.7, -1),
}


def _values(out):
    return [t.detach() for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kind", STATISTICS)
def test_a_statistic_read_before_the_step_is_served_again_after_it_equal(kind, grad):
    read = STATISTICS[kind]
    lazy_side, stock_side = leaves()
    expected = _values(read(stock_logits(stock_side)))
    z = make_lazy(lazy_side)
    with torch.set_grad_enabled(grad):
        before = read(z)
        step(lazy_side)
        after = read(z)
    assert not z.is_computed  # served from the statistics, not from values
    for got, was, expected in zip(_values(after), _values(before), expected):
        assert torch.equal(got, was)
        torch.testing.assert_close(got, expected)


def test_a_statistic_read_without_grad_is_served_to_a_read_with_grad_whose_backward_raises():
    lazy_side, stock_side = leaves()
    expected = torch.logsumexp(stock_logits(stock_side), -1).detach()
    z = make_lazy(lazy_side)
    with torch.no_grad():
        before = torch.logsumexp(z, -1)
    step(lazy_side)
    after = torch.logsumexp(z, -1)
    assert after.requires_grad  # as stock's read of logits that require grad
    assert torch.equal(after.detach(), before)
    torch.testing.assert_close(before, expected)
    with pytest.raises(StaleLogitsError, match="backpropagate through"):
        after.sum().backward()


# reads with nothing computed before the step: they still raise
NOT_READ_BEFORE = {
    "argmax": (None, argmax),
    "logsumexp": (None, logsumexp),
    "kept_values": (None, plus_zero),
    "gather": (None, lambda z: z.gather(-1, ids_like(z)[..., None])),
    "another_statistic": (logsumexp, lambda z: z.gather(-1, ids_like(z)[..., None])),
    # a copy's statistics are computed for the rows it was made of (the logits' own: for every row)
    "other_rows": (lambda z: torch.logsumexp(z[0] / 2, -1), lambda z: torch.logsumexp(z[1] / 2, -1)),
    "other_indices": (lambda z: z.gather(-1, ids_like(z)[..., None]), lambda z: z.gather(-1, ids_like(z, 8)[..., None])),
    "argmax_then_max": (argmax, lambda z: z.max(-1)),
    "another_temperature": (logsumexp, lambda z: torch.logsumexp(z / 2, -1)),
}


@pytest.mark.parametrize("case", NOT_READ_BEFORE)
def test_a_read_with_nothing_computed_before_the_step_raises(case):
    before_read, after_read = NOT_READ_BEFORE[case]
    lazy_side, _ = leaves()
    z = make_lazy(lazy_side)
    if before_read is not None:
        before_read(z)
    step(lazy_side)
    with pytest.raises(StaleLogitsError, match="before optimizer.step"):
        after_read(z)
