"""Groups of completions in the shared-prompt layout (`prepack.training.shared_prompt.shared_prompt_layout`,
`prepack.training.preference.group_logps`): for G in 2..8, with hypothesis drawing the prompts' and completions'
lengths, every completion's log-probabilities in float64 on a tiny random Llama equal those of its prompt +
that completion run alone, on sdpa, eager and flex_attention (torch's flex uncompiled, `tests.flash_reference`:
forward only on a CPU), each against the same backend run alone: to 1e-10, and on eager to its float64 bound
(`prepack.model.isolation.default_tolerances`: transformers' eager softmax computes in float32). A mask that
lets a completion see the sibling before it fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepack.errors import IsolationError, UsageError
from prepack.model.isolation import default_tolerances
from prepack.model.packing import enable_packing
from prepack.model.shared_prompt import shared_prompt_mask
from prepack.training.collate import PackedCollator
from prepack.training.preference import group_logps, model_inputs, pair_logps
from prepack.training.shared_prompt import Group, shared_prompt_layout
from tests import flash_reference
from tests.train.test_preference import VOCAB, tiny_llama

use_flex_reference = flash_reference.use_flex_reference  # the fixture, which pytest finds by this name
TOLERANCE = 1e-10

_models: dict[str, torch.nn.Module] = {}


def model_on(attn: str):
    """One tiny float64 Llama (seed 0) per attention backend, passed to `enable_packing`."""
    if attn not in _models:
        model = tiny_llama(0)
        model.set_attn_implementation(attn)
        _models[attn] = enable_packing(model)
    return _models[attn]


@st.composite
def group_rows(draw):
    """One or two rows of one to three groups, each of G completions, G drawn in 2..8."""
    size = draw(st.integers(2, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(draw(st.integers(1, 2))):
        row = []
        for _ in range(draw(st.integers(1, 3))):
            prompt = rng.integers(0, VOCAB, draw(st.integers(1, 12))).tolist()
            completions = [rng.integers(0, VOCAB, draw(st.integers(1, 9))).tolist() for _ in range(size)]
            row.append(Group(prompt, completions))
        rows.append(row)
    return rows


def alone(model, group: Group) -> list[tuple[float, int]]:
    """Each completion's summed log-probability and token count, prompt + that completion run alone."""
    result = []
    for completion in group.completions:
        ids = torch.tensor([*group.prompt, *completion])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1]
        logp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0][len(group.prompt) - 1 :]
        result.append((logp.sum(), len(completion)))
    return result


def check_rows(rows, attn: str, padding_free: bool) -> None:
    batch = shared_prompt_layout(rows, padding_free=padding_free)
    model = model_on(attn)
    with torch.no_grad():
        got = group_logps(model(**batch).logits, batch)
    expected = [pair for row in rows for group in row for pair in alone(model, group)]
    size = len(rows[0][0].completions)
    assert got.logps.shape == (sum(map(len, rows)), size)
    tolerance = default_tolerances(torch.float64, "eager")[0] if attn == "eager" else TOLERANCE
    torch.testing.assert_close(got.logps.flatten(), torch.stack([e for e, _ in expected]), rtol=0, atol=tolerance)
    assert got.tokens.flatten().tolist() == [n for _, n in expected]


_SETTINGS = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.slow  # hypothesis examples of float64 forwards: ~5 s
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@_SETTINGS
@given(rows=group_rows(), padding_free=st.booleans())
def test_each_completion_equals_its_prompt_and_it_alone(attn, rows, padding_free):
    check_rows(rows, attn, padding_free)


@pytest.mark.slow  # flex's unfused reference: ~5 s
@pytest.mark.usefixtures("use_flex_reference")
@_SETTINGS
@given(rows=group_rows(), padding_free=st.booleans())
def test_each_completion_equals_its_prompt_and_it_alone_on_flex(rows, padding_free):
    check_rows(rows, "flex_attention", padding_free)


@pytest.mark.slow  # ~1 s each
@pytest.mark.parametrize("size", range(2, 9))
def test_every_group_size_from_two_to_eight(size):
    """Each G of 2..8 at least once (hypothesis draws G; this pins every one), on sdpa: two rows of two groups."""
    rng = np.random.default_rng(size)
    rows = [[Group(rng.integers(0, VOCAB, rng.integers(1, 12)).tolist(),
                   [rng.integers(0, VOCAB, rng.integers(1, 9)).tolist() for _ in range(size)]) for _ in range(2)]
            for _ in range(2)]
    check_rows(rows, "sdpa", padding_free=False)


def test_a_completion_that_sees_its_sibling_fails_the_comparison():
    """The leak control: the same batch with a mask whose completions all share one part (each sees the siblings
    before it) moves the later completions' log-probabilities."""
    rng = np.random.default_rng(0)
    rows = [[Group(rng.integers(0, VOCAB, 6).tolist(), [rng.integers(0, VOCAB, 5).tolist() for _ in range(4)])]]
    batch = shared_prompt_layout(rows)
    ids, parts = batch["shared_prompt_ids"], batch["shared_prompt_parts"]
    one_part = torch.where(ids % parts > 0, ids - ids % parts + 1, ids)
    model = model_on("sdpa")
    with torch.no_grad():
        exact = group_logps(model(**batch).logits, batch).logps
        leaked_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                              attention_mask=shared_prompt_mask(one_part, torch.float64, parts)).logits
    leaked = group_logps(leaked_logits, batch).logps
    torch.testing.assert_close(leaked[:, 0], exact[:, 0], rtol=0, atol=TOLERANCE)  # the first sees no sibling
    assert (leaked[:, 1:] - exact[:, 1:]).abs().min() > 1e-6


def test_groups_without_a_prompt_or_a_completion_are_refused():
    with pytest.raises(UsageError, match="needs a prompt and completions"):
        shared_prompt_layout([[Group([], [[1], [2]])]])
    with pytest.raises(UsageError, match="needs a prompt and completions"):
        shared_prompt_layout([[Group([1], [[1], []])]])
    with pytest.raises(UsageError, match="one list a completion"):
        shared_prompt_layout([[Group([1], [[1], [2]], [[1]])]])


def group_pack(groups: list[Group]) -> dict:
    """A pack of whole groups as a group build's shards hold it: each completion one document, prompt +
    completion, labels -100 on the prompt, `pair_roles` 0 … G - 1 a group."""
    documents = [np.array([*g.prompt, *c]) for g in groups for c in g.completions]
    labels = [np.array([-100] * len(g.prompt) + list(c)) for g in groups for c in g.completions]
    size = len(groups[0].completions)
    return {"input_ids": np.concatenate(documents), "labels": np.concatenate(labels),
            "cu_seqlens": np.cumsum([0, *map(len, documents)]).astype(np.int32),
            "pair_roles": np.tile(np.arange(size, dtype=np.uint8), len(groups))}


@pytest.mark.slow  # ~2 s
@pytest.mark.parametrize("options", [{"layout": "padded"}, {"layout": "padding_free"}, {"shared_prompt": True},
                                     {"shared_prompt": True, "layout": "padding_free"}], ids=str)
def test_packs_of_groups_collate_into_each_layout_exactly(options):
    """PackedCollator on packs of groups of 4: `pair_segments` [P, 4] (one document a completion) or the shared
    layout, and `group_logps` equal to each prompt + completion alone (the first document's label is masked by
    the collator as every document's first, a prompt token, is)."""
    rng = np.random.default_rng(4)
    packs = [[Group(rng.integers(0, VOCAB, rng.integers(2, 9)).tolist(),
                    [rng.integers(0, VOCAB, rng.integers(1, 7)).tolist() for _ in range(4)]) for _ in range(n)]
             for n in (2, 3)]
    batch = PackedCollator(128, **options)([group_pack(groups) for groups in packs])
    model = model_on("sdpa")
    with torch.no_grad():
        got = group_logps(model(**model_inputs(batch)).logits, batch)
    expected = [pair for groups in packs for group in groups for pair in alone(model, group)]
    assert got.logps.shape == (5, 4) and ("pair_segments" in batch) != ("shared_prompt_ids" in batch)
    torch.testing.assert_close(got.logps.flatten(), torch.stack([e for e, _ in expected]), rtol=0, atol=TOLERANCE)
    assert got.tokens.flatten().tolist() == [n for _, n in expected]
    with pytest.raises(UsageError, match="not of groups of 4"):
        pair_logps(model(**model_inputs(batch)).logits, batch)


def test_packs_of_broken_groups_are_refused():
    rng = np.random.default_rng(0)
    pack = group_pack([Group([1, 2], [rng.integers(0, VOCAB, 3).tolist() for _ in range(3)]) for _ in range(2)])
    with pytest.raises(IsolationError, match="do not make whole groups of 3"):
        PackedCollator(64)([dict(pack, pair_roles=np.array([0, 1, 2, 0, 2, 1], np.uint8))])
    other = group_pack([Group([1, 2], [[3], [4]])])
    with pytest.raises(IsolationError, match="do not make whole"):
        PackedCollator(64)([pack, other])  # groups of 3 and pairs in one batch


def test_a_batch_without_its_parts_is_refused():
    """A G = 4 batch whose `shared_prompt_parts` went missing (a collator that drops unknown keys): read with
    parts = 3 its completions 2 and 3 would see completion 1 and not the prompt, so the model and
    `group_logps` refuse it by the key's name."""
    rng = np.random.default_rng(1)
    rows = [[Group(rng.integers(0, VOCAB, 6).tolist(), [rng.integers(0, VOCAB, 5).tolist() for _ in range(4)])]]
    batch = shared_prompt_layout(rows)
    del batch["shared_prompt_parts"]
    with pytest.raises(UsageError, match="shared_prompt_parts"), torch.no_grad():
        model_on("sdpa")(**batch)
    with pytest.raises(UsageError, match="shared_prompt_parts"):
        group_logps(torch.zeros(*batch["input_ids"].shape, VOCAB, dtype=torch.float64), batch)
