"""`prepack.building.pair_plan` for groups of G completions (`size`): a group longer than max_len follows
`overflow` like a pair, never split. Under "truncate" the completions share the room left by water-filling,
which for G = 2 is the pair rule as schemas/shard-format.md states it (the shorter kept whole when it takes at
most half of the room, else half each, the chosen one the odd token), and for every G keeps as many tokens as
fit, cuts every cut completion to one level (the first ones a spare token more), and keeps whole every
completion no longer than that level (or one more, finished by a spare token).
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prepack.building.pair_plan import kept_lengths, overlong_prompts, plan_pairs


def pair_rule(chosen: int, rejected: int, prompt: int, max_len: int) -> tuple[int, int]:
    """The pair rule as the format states it, for one overlong pair whose room holds a token each."""
    room = max_len - 2 * prompt
    c, r = chosen - prompt, rejected - prompt
    if 2 * min(c, r) <= room:
        return (prompt + c, prompt + room - c) if c <= r else (prompt + room - r, prompt + r)
    return prompt + room - room // 2, prompt + room // 2


@st.composite
def groups(draw, size=None):
    size = size or draw(st.integers(2, 8))
    max_len = draw(st.integers(size + 1, 200))
    count = draw(st.integers(1, 20))
    prompts = draw(st.lists(st.integers(1, max_len), min_size=count, max_size=count))
    completions = draw(st.lists(st.integers(1, 120), min_size=count * size, max_size=count * size))
    lengths = np.repeat(np.array(prompts), size) + np.array(completions)
    return size, max_len, np.array(prompts), lengths


@settings(max_examples=100, deadline=None)
@given(data=groups(size=2))
def test_pairs_keep_what_the_pair_rule_keeps(data):
    size, max_len, prompts, lengths = data
    chosen, rejected = kept_lengths(lengths, prompts, max_len)
    refused = set(overlong_prompts(lengths, prompts, max_len).tolist())
    for pair, prompt in enumerate(prompts):
        c, r = int(lengths[2 * pair]), int(lengths[2 * pair + 1])
        expected = (c, r) if c + r <= max_len or pair in refused else pair_rule(c, r, int(prompt), max_len)
        assert (int(chosen[pair]), int(rejected[pair])) == expected


@settings(max_examples=100, deadline=None)
@given(data=groups())
def test_groups_are_cut_by_water_filling(data):
    size, max_len, prompts, lengths = data
    kept = np.stack(kept_lengths(lengths, prompts, max_len, size), 1)
    full = lengths.reshape(-1, size)
    refused = set(overlong_prompts(lengths, prompts, max_len, size).tolist())
    for group, prompt in enumerate(prompts):
        if full[group].sum() <= max_len or group in refused:
            assert (kept[group] == full[group]).all()
            continue
        assert kept[group].sum() == max_len and (kept[group] > prompt).all() and (kept[group] <= full[group]).all()
        cut = kept[group] < full[group]
        level = kept[group][cut] - prompt
        assert level.max() - level.min() <= 1 and (np.diff(level) <= 0).all()  # one level, the extra first
        # Every whole one no longer than the level, or one more (a spare token may finish one).
        assert (full[group][~cut] - prompt <= level.min() + 1).all()


@settings(max_examples=50, deadline=None)
@given(data=groups(), overflow=st.sampled_from(["truncate", "drop"]))
def test_a_group_is_never_split_across_packs(data, overflow):
    size, max_len, prompts, lengths = data
    refused = overlong_prompts(lengths, prompts, max_len, size)
    if overflow == "truncate" and len(refused):
        prompts, lengths = np.delete(prompts, refused), np.delete(lengths.reshape(-1, size), refused, 0).reshape(-1)
    assume(len(prompts) > 0)
    plan = plan_pairs(lengths, prompts, max_len, overflow=overflow, size=size)
    packs = plan.slice(0, plan.packs)
    rows = packs.rows
    assert (packs.pair_roles == np.tile(np.arange(size), len(rows) // size)).all()
    assert (rows.reshape(-1, size) == rows.reshape(-1, size)[:, :1] + np.arange(size)).all()
    assert (rows.reshape(-1, size)[:, 0] % size == 0).all()
    for first, end in zip(packs.pack_offsets[:-1], packs.pack_offsets[1:]):
        assert (end - first) % size == 0 and packs.lengths[first:end].sum() <= max_len
    assert plan.pair_counts["pairs"] == len(prompts)
    assert len(rows) // size == len(prompts) - plan.pair_counts["dropped"]
