"""A `PackedSampler` state is untrusted input (a checkpoint file): every malformed, mistyped or hostile
state gives SamplerStateError before anything changes, or is a state a job can resume from, and either
way in bounded time; `state_dict(consumed=...)` refuses a position outside the epoch."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prepack.errors import PrepackError, SamplerStateError
from prepack.training.sampler import PackedSampler
MAX_PASSES = 64
from tests.train.test_balance import CuSeqlensOnly, random_packs

SIZE = 40
DATASET = CuSeqlensOnly(random_packs(SIZE, seed=1))


def samplers(world: int, balanced: bool) -> list[PackedSampler]:
    options = dict(batch_size=2, balance="attention", token_cost=3.0) if balanced else {}
    return [PackedSampler(DATASET, rank=r, world_size=world, seed=5, drop_last=True, **options) for r in range(world)]


def saved_state(world: int, balanced: bool, steps: int) -> dict:
    """What every rank of a job of `world` saves after `steps` indices each, through JSON as a checkpoint."""
    states = []
    for sampler in samplers(world, balanced):
        iterator = iter(sampler)
        for _ in range(min(steps, len(sampler))):
            next(iterator)
        states.append(json.loads(json.dumps(sampler.state_dict())))
    assert all(state == states[0] for state in states)
    return states[0]


HOSTILE = [
    ("epoch", "3"),  # a string: int() would have read it
    ("epoch", None),
    ("epoch", 2.7),  # a float: int() would have cut it to 2
    ("epoch", True),  # a bool: an int to Python
    ("epoch", -1),
    ("epoch", 2**64),
    ("used", "10"),
    ("used", 10.0),
    ("used", -4),
    ("used", SIZE + 1),
    ("seed", None),
    ("shuffle", 1),
    ("drop_last", "yes"),
    ("size", float(SIZE)),
]


@pytest.mark.parametrize(("key", "value"), HOSTILE)
def test_a_mistyped_or_out_of_range_field_is_named(key, value):
    state = saved_state(2, balanced=False, steps=3) | {key: value}
    sampler = samplers(2, balanced=False)[0]
    before = sampler.state_dict()
    with pytest.raises(SamplerStateError, match=key):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == before  # nothing changed


@pytest.mark.parametrize("key", ["epoch", "used", "size", "seed", "shuffle", "drop_last"])
def test_a_missing_field_is_named(key):
    state = saved_state(2, balanced=False, steps=3)
    del state[key]
    with pytest.raises(SamplerStateError, match=f"{key}: Field required"):
        samplers(2, balanced=False)[0].load_state_dict(state)


@pytest.mark.parametrize("state", [None, [], "used", {"used": 3, "epoch": 0, "surprise": 1}])
def test_not_a_state_is_refused(state):
    with pytest.raises(SamplerStateError):
        samplers(1, balanced=False)[0].load_state_dict(state)


@pytest.mark.parametrize(
    ("key", "value"),
    [("token_cost", float("nan")), ("token_cost", float("inf")), ("token_cost", "3.0"), ("balance", "tokens"),
     ("passes", [[0, 2, True]]), ("passes", [[0, 2, 2, 9]]), ("passes", [[0, 2**40, 2]])],
)
def test_a_hostile_balanced_field_is_named(key, value):
    state = saved_state(2, balanced=True, steps=3) | {key: value}
    with pytest.raises(SamplerStateError, match=key):
        samplers(2, balanced=True)[0].load_state_dict(state)


def test_a_huge_history_is_refused_at_once():
    state = saved_state(2, balanced=True, steps=3)
    sampler = samplers(2, balanced=True)[0]
    for passes in ([[0, 2, 2]] * 10**5, [[0, 2, 2]] + [[i, 2 + i % 2, 2] for i in range(1, MAX_PASSES + 1)]):
        start = time.monotonic()
        with pytest.raises(SamplerStateError, match="passes"):
            sampler.load_state_dict(state | {"passes": passes, "used": SIZE})
        assert time.monotonic() - start < 1


def test_a_resume_that_would_pass_the_bound_of_passes_says_how_to_go_on():
    history = [[i, 2 + i % 2, 2] for i in range(MAX_PASSES)]  # starts 0..63, world sizes 2, 3, 2, ...
    big = CuSeqlensOnly(random_packs(200, seed=2))
    state = {"epoch": 0, "used": 99, "size": 200, "seed": 5, "shuffle": True, "drop_last": True,
             "balance": "attention", "token_cost": 3.0, "passes": history}
    options = dict(rank=0, seed=5, drop_last=True, batch_size=2, balance="attention", token_cost=3)
    same = PackedSampler(big, world_size=3, **options)
    same.load_state_dict(state)  # the last pass's sizes: it continues that pass
    assert len(list(same)) == (200 - 63 - (200 - 63) % 3 - (99 - 63)) // 3
    other = PackedSampler(big, world_size=4, **options)
    with pytest.raises(SamplerStateError, match="resume on world size 3 and batch size 2"):
        other.load_state_dict(state)


@pytest.mark.parametrize("consumed", [-1, 21, 2.0, True, "3"])
def test_consumed_outside_the_epoch_is_refused(consumed):
    sampler = samplers(2, balanced=False)[0]
    with pytest.raises(SamplerStateError, match="consumed"):
        sampler.state_dict(consumed=consumed)


# --- the fuzz: every mutated state is refused by name or resumes, in bounded time ---------------------

values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 50), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=4), st.lists(st.integers(-2, 50), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
passes_lists = st.one_of(
    st.lists(st.lists(st.integers(-2, 50), min_size=0, max_size=4), max_size=6),
    st.lists(st.tuples(st.integers(0, 45), st.integers(1, 5), st.integers(1, 3)).map(list), min_size=1, max_size=6),
    st.integers(1, 4).map(lambda scale: [[0, 2, 2]] * 10**scale),  # a huge history
    st.integers(2, 200).map(lambda n: [[i, 1 + i % 2, 1] for i in range(n)]),
)
KEYS = ["epoch", "used", "size", "seed", "shuffle", "drop_last", "balance", "token_cost", "passes", "extra"]


@st.composite
def mutated_states(draw):
    balanced = draw(st.booleans())
    state = saved_state(draw(st.integers(1, 4)), balanced, draw(st.integers(0, 12)))
    for _ in range(draw(st.integers(0, 3))):  # 0: a genuine state
        key = draw(st.sampled_from(KEYS))
        action = draw(st.sampled_from(["delete", "set", "passes"]))
        if action == "delete":
            state.pop(key, None)
        elif action == "set":
            state[key] = draw(values)
        else:
            state["passes"] = draw(passes_lists)
    if draw(st.integers(0, 20)) == 0:
        return draw(values)  # not even a mapping
    return state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=mutated_states(), world=st.integers(1, 4), balanced=st.booleans())
@pytest.mark.slow
def test_every_mutated_state_is_refused_by_name_or_resumes_in_bounded_time(state, world, balanced):
    resumed = samplers(world, balanced)
    start = time.monotonic()
    outcomes = []
    for sampler in resumed:
        try:
            sampler.load_state_dict(state)
            outcomes.append(None)
        except SamplerStateError as error:
            assert isinstance(error, PrepackError) and str(error)
            outcomes.append(type(error))
    assert len(set(outcomes)) == 1  # every rank decides alike
    event("refused" if outcomes[0] else "resumed")
    if outcomes[0] is None:  # a valid resume: the ranks deal distinct packs of the dataset, in lockstep
        dealt = [list(sampler) for sampler in resumed]
        assert len({len(d) for d in dealt}) == 1
        flat = [index for d in dealt for index in d]
        assert len(set(flat)) == len(flat) and all(0 <= index < SIZE for index in flat)
        again = samplers(world, balanced)[0]
        again.load_state_dict(json.loads(json.dumps(resumed[0].state_dict())))  # its state resumes too
    assert time.monotonic() - start < 5
