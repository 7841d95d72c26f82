"""`plackett_luce_loss`: DPO under the Plackett-Luce model of a ranking (the DPO paper's Appendix A.3), on the
[P, G] log-probabilities `group_logps` gives and a group build's `group_ranks`, checked against the paper's
product written out per group, against `dpo_loss` at G = 2, and by its own law: the probabilities it assigns to
the G! orders of a group sum to one.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack.errors import UsageError
from prepack.training.preference import GroupLogps, PairLogps, dpo_loss, plackett_luce_loss

finite = st.floats(-50, 50, allow_nan=False)


def groups(values: list[list[float]]) -> GroupLogps:
    logps = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    return GroupLogps(logps, torch.ones(logps.shape, dtype=torch.int64))


def written_out(policy: list[float], reference: list[float], ranks: list[int], beta: float) -> torch.Tensor:
    """-log Π_k exp(h_τ(k)) / Σ_{j ≥ k} exp(h_τ(j)) of one group, term by term, as the paper writes it."""
    order = sorted(range(len(ranks)), key=lambda k: ranks[k])
    h = [beta * (policy[k] - reference[k]) for k in order]
    return -sum(torch.log(torch.exp(h[k]) / sum(torch.exp(h[j]) for j in range(k, len(h)))) for k in range(len(h)))


@pytest.mark.slow  # 15 examples with autograd on both sides: ~1.5 s
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_equals_the_papers_product_with_its_gradients(data):
    size = data.draw(st.integers(2, 8), label="G")
    count = data.draw(st.integers(1, 4), label="groups")
    policy = [data.draw(st.lists(finite, min_size=size, max_size=size)) for _ in range(count)]
    reference = [data.draw(st.lists(finite, min_size=size, max_size=size)) for _ in range(count)]
    ranks = [[r + 1 for r in data.draw(st.permutations(range(size)))] for _ in range(count)]
    beta = data.draw(st.sampled_from([0.1, 0.5, 2.0]))
    packed, frozen = groups(policy), groups(reference)
    got = plackett_luce_loss(packed, frozen, torch.tensor(ranks), beta)
    alone = groups(policy)
    expected = torch.stack([written_out(list(alone.logps[g]), list(reference[g]), ranks[g], beta) for g in range(count)])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    got.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(packed.logps.grad, alone.logps.grad, rtol=1e-10, atol=1e-10)


def test_is_dpo_at_two_and_a_distribution_over_orders():
    """G = 2: `dpo_loss` of the completion ranked 1 against the other. G = 4: exp(-loss) over all 24 orders sums
    to 1 (a loss summing the wrong tail, or leaving a term out, breaks that); the one given equal rewards is 1/24."""
    policy, reference = groups([[-3.0, -5.5], [-2.0, -1.0]]), groups([[-4.0, -4.0], [-1.5, -2.5]])
    got = plackett_luce_loss(policy, reference, torch.tensor([[1, 2], [2, 1]]), beta=0.3)
    chosen = [0, 1]
    pairs = [PairLogps(v.logps[torch.arange(2), chosen], v.logps[torch.arange(2), [1, 0]], v.tokens[:, 0], v.tokens[:, 1])
             for v in (policy, reference)]
    torch.testing.assert_close(got, dpo_loss(*pairs, beta=0.3), rtol=1e-12, atol=1e-12)
    policy, reference = groups([[-3.0, -1.0, -7.5, -2.0]]), groups([[-2.0, -2.0, -2.0, -2.5]])
    orders = torch.tensor([[p + 1 for p in permutation] for permutation in itertools.permutations(range(4))])
    total = sum(torch.exp(-plackett_luce_loss(policy, reference, ranks[None], beta=0.7)) for ranks in orders)
    torch.testing.assert_close(total, torch.ones(1, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    same = plackett_luce_loss(policy, policy, torch.tensor([[2, 1, 4, 3]]), beta=0.7)
    assert same.item() == pytest.approx(math.log(24), abs=1e-12)


def test_ties_and_misshapen_ranks_are_refused_by_name():
    policy = groups([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    with pytest.raises(UsageError, match=r"group 1 has ranks \[1, 2, 2\]: the Plackett-Luce model takes a strict ranking"):
        plackett_luce_loss(policy, policy, torch.tensor([[3, 1, 2], [1, 2, 2]]))
    with pytest.raises(UsageError, match=r"ranks of shape \(2, 2\) for log-probabilities of shape \(2, 3\)"):
        plackett_luce_loss(policy, policy, torch.tensor([[1, 2], [2, 1]]))
