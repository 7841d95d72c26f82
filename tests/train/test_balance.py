"""Attention-balanced steps: the cost model, the regrouping within windows, and `PackedSampler(balance=...)`
dealing every pack once, resuming exactly and on another world size, and evening out SFT-like steps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack import build
from prepack.errors import InputError, PrepackError
from prepack.building.balance import WINDOW_STEPS, balanced_order, epoch_order, imbalance, pack_costs, step_costs
from prepack.training.dataset import PackedDataset
from prepack.check.report import inspect_build
from prepack.building.plan import assign_packs
from prepack.training.sampler import PackedSampler
from tests.cli import invoke_prepack, run_prepack
from tests.corpus import corpus_table, write_corpus


class CuSeqlensOnly:
    """A `PackedDataset` reduced to what the balanced sampler reads: its length and the cu_seqlens column
    of each shard, decoded by `PackedDataset.document_lengths` itself."""

    document_lengths = PackedDataset.document_lengths

    def __init__(self, pack_lengths: list[list[int]], shards: int = 1):
        self.pack_lengths = pack_lengths
        self.columns = []
        for part in np.array_split(np.arange(len(pack_lengths)), shards):
            rows = [np.concatenate([[0], np.cumsum(pack_lengths[p])]) for p in part]
            offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
            values = np.concatenate([np.empty(0, np.int32), *rows]).astype(np.int32)
            self.columns.append({"cu_seqlens": (offsets, values)})
        self.manifest = SimpleNamespace(shards=self.columns)

    def __len__(self) -> int:
        return len(self.pack_lengths)

    def _columns(self, shard: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return self.columns[shard]


def random_packs(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 300, size=rng.integers(1, 6)).tolist() for _ in range(count)]


def sft_like_costs(documents: int, max_len: int, seed: int, token_cost: float = 0.0) -> np.ndarray:
    """Pack costs of lognormal document lengths (median 350, p99 ~4k, as benchmarks/bench_plan.py) packed FFD."""
    sigma = math.log(4000 / 350) / 2.3263
    lengths = np.random.default_rng(seed).lognormal(math.log(350), sigma, documents)
    lengths = np.clip(lengths, 1, max_len).astype(np.int64)
    pack = assign_packs(lengths, max_len)
    return np.bincount(pack, weights=lengths.astype(np.float64) ** 2 + token_cost * lengths)


# --- the cost model ---------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(packs=st.lists(st.lists(st.integers(1, 8192), min_size=1, max_size=8), max_size=30),
       shards=st.integers(1, 3), token_cost=st.sampled_from([0.0, 1.0, 49152.0]))
def test_pack_cost_is_the_sum_of_squared_document_lengths_plus_token_cost_per_token(packs, shards, token_cost):
    parts = list(CuSeqlensOnly(packs, shards).document_lengths())
    assert len(parts) == shards
    documents, lengths = (np.concatenate(arrays) for arrays in zip(*parts))
    assert documents.tolist() == [len(p) for p in packs] and lengths.tolist() == [l for p in packs for l in p]
    costs = pack_costs(documents, lengths, token_cost)
    assert costs.tolist() == [sum(l * l for l in p) + token_cost * sum(p) for p in packs]


def test_pack_costs_refuse_a_pack_without_documents():
    with pytest.raises(ValueError, match="at least one document"):
        pack_costs(np.array([1, 0, 1]), np.array([5, 6]), 0.0)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A build of a few hundred packs of 256 tokens over several shards, lengths from 1 to 256."""
    root = tmp_path_factory.mktemp("balance")
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1000, size=min(256, int(rng.pareto(1.2) * 30) + 1)).tolist() for _ in range(2000)]
    build(write_corpus(root / "c.parquet", corpus_table(documents)), root / "b", max_len=256, shard_size=20000)
    return root / "b"


def test_pack_costs_of_a_build_are_read_from_its_cu_seqlens(packed):
    dataset = PackedDataset(packed)
    assert len(dataset.manifest.shards) > 1
    costs = np.concatenate([pack_costs(d, l, 3.0) for d, l in dataset.document_lengths()])
    expected = [float(sum(np.diff(dataset[i]["cu_seqlens"]).astype(np.int64) ** 2) + 3 * len(dataset[i]["input_ids"]))
                for i in range(len(dataset))]
    assert costs.tolist() == expected
    sampler = PackedSampler(dataset, rank=0, world_size=2, batch_size=2, balance="attention", drop_last=True)
    assert sorted(sampler) == sorted(set(sampler))


@pytest.mark.slow
def test_inspect_reports_the_steps_the_sampler_deals(packed):
    dataset = PackedDataset(packed)
    costs = np.array([float(sum(np.diff(dataset[i]["cu_seqlens"]).astype(np.int64) ** 2)) for i in range(len(dataset))])
    report = inspect_build(packed, batch_size=2, seed=4, world_size=3, token_cost=0)
    for balance, max_over_mean, waiting in (
        (None, report.steps.unbalanced_max_over_mean, report.steps.unbalanced_waiting_share),
        ("attention", report.steps.balanced_max_over_mean, report.steps.balanced_waiting_share),
    ):
        ranks = [list(PackedSampler(dataset, rank=r, world_size=3, seed=4, drop_last=True, batch_size=2,
                                    balance=balance, token_cost=0)) for r in range(3)]
        steps = len(ranks[0]) // 2
        per_step = costs[np.array(ranks)[:, : steps * 2]].reshape(3, steps, 2).sum(axis=2).T
        slowest, mean = per_step.max(axis=1), per_step.mean(axis=1)
        assert max_over_mean == pytest.approx((slowest / mean).mean())
        assert waiting == pytest.approx(1 - mean.sum() / slowest.sum())
    assert report.steps.balanced_max_over_mean < report.steps.unbalanced_max_over_mean
    assert inspect_build(packed).steps is None

    args = ["inspect", packed, "--world-size", "3", "--batch-size", "2", "--seed", "4", "--token-cost", "0"]
    result = run_prepack(*args, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == report.steps.model_dump(mode="json")
    text = invoke_prepack(*args).stdout
    assert 'balance="attention"' in text and f"{report.steps.balanced_max_over_mean:.3f}" in text
    result = invoke_prepack(*args[:2], "--world-size", "0")
    assert result.returncode == 2



NOT_A_COST = [float("nan"), float("inf"), -float("inf"), -1.0, 1e300, True, "3"]


@pytest.mark.parametrize("token_cost", NOT_A_COST)
def test_a_token_cost_that_is_not_a_finite_number_is_refused_where_it_enters(packed, token_cost):
    with pytest.raises(ValueError, match="token_cost"):
        pack_costs(np.array([1]), np.array([5]), token_cost)
    dataset = CuSeqlensOnly(random_packs(20, seed=0))
    for balance in ("attention", None):  # unused without balance, and still no NaN kept in its state
        with pytest.raises(ValueError, match="token_cost"):
            PackedSampler(dataset, rank=0, world_size=2, batch_size=2, drop_last=True, balance=balance, token_cost=token_cost)
    with pytest.raises(InputError, match="token_cost"):
        inspect_build(packed, world_size=2, token_cost=token_cost)


@pytest.mark.slow
def test_inspect_json_is_strict_json(packed):
    for cost in ("nan", "inf", "1e300"):
        result = invoke_prepack("inspect", packed, "--world-size", "2", "--token-cost", cost, "--json")
        assert result.returncode == 2 and "token" in result.stderr and result.stdout == "", (cost, result)
        assert "Traceback" not in result.stderr

    def no_constant(name: str):
        raise AssertionError(f"{name} is not JSON")

    report = inspect_build(packed, world_size=2)
    assert json.loads(report.to_json(), parse_constant=no_constant) == report.model_dump(mode="json")
    broken = report.model_copy(update={"fill": float("nan")})  # a figure no input can produce now
    with pytest.raises(PrepackError, match="JSON"):
        broken.to_json()

# --- regrouping ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(steps=st.integers(0, 3 * WINDOW_STEPS), world=st.integers(1, 9), batch=st.integers(1, 4), tail=st.integers(0, 3))
def test_packs_move_only_within_their_window_and_each_rank_gets_as_many_per_step(steps, world, batch, tail):
    tail = min(tail, batch - 1) * world  # a last step with fewer packs per rank
    size = steps * world * batch + tail
    order = np.random.default_rng(steps).permutation(size)
    costs = np.random.default_rng(world).pareto(1.0, size)
    balanced = balanced_order(order, costs, world, batch, [0])
    window = WINDOW_STEPS * world * batch
    for start in range(0, size, window):
        assert sorted(balanced[start : start + window]) == sorted(order[start : start + window])
    assert np.array_equal(balanced, balanced_order(order, costs, world, batch, [0]))  # deterministic


def test_sft_like_steps_are_balanced_to_within_two_percent():
    costs = sft_like_costs(200_000, 8192, seed=0)
    order = epoch_order(len(costs), seed=0, epoch=0)
    order = order[: len(order) - len(order) % 8]
    unbalanced = imbalance(step_costs(order, costs, 8, 2))
    balanced = imbalance(step_costs(balanced_order(order, costs, 8, 2, [0]), costs, 8, 2))
    assert unbalanced.max_over_mean > 1.8  # random steps: the issue measured about 2.2
    assert balanced.max_over_mean <= 1.02
    assert balanced.waiting_share < 0.02 < unbalanced.waiting_share


def test_windows_keep_the_epoch_shuffled():
    """Regrouping within 64 steps leaves no trend of cost over the epoch."""
    costs = sft_like_costs(200_000, 8192, seed=1)
    order = epoch_order(len(costs), seed=0, epoch=0)
    order = order[: len(order) - len(order) % 8]
    per_step = step_costs(balanced_order(order, costs, 8, 2, [0]), costs, 8, 2).sum(axis=1)
    halves = np.array_split(per_step, 2)
    assert abs(halves[0].mean() / halves[1].mean() - 1) < 0.1
    # Within a window the heaviest group is not always first.
    first_steps = per_step[: len(per_step) // WINDOW_STEPS * WINDOW_STEPS].reshape(-1, WINDOW_STEPS).argmax(axis=1)
    assert len(set(first_steps.tolist())) > 3


# --- the sampler -----------------------------------------------------------------------------------


def balanced_samplers(dataset, world: int, batch: int, **options) -> list[PackedSampler]:
    return [
        PackedSampler(dataset, rank=r, world_size=world, batch_size=batch, balance="attention", drop_last=True,
                      seed=5, token_cost=0, **options)
        for r in range(world)
    ]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 400), world=st.integers(1, 8), batch=st.integers(1, 3), epoch=st.integers(0, 3))
def test_ranks_get_disjoint_equal_slices_of_the_epoch_in_balanced_steps(size, world, batch, epoch):
    dataset = CuSeqlensOnly(random_packs(size, seed=size), shards=2)
    slices = []
    for sampler in balanced_samplers(dataset, world, batch):
        sampler.set_epoch(epoch)
        slices.append(list(sampler))
    assert {len(s) for s in slices} == {size // world}
    trained = [index for s in slices for index in s]
    assert len(set(trained)) == len(trained) == size - size % world
    # The same packs as the unbalanced sampler's, each within the window of steps it was in there.
    plain = []
    for rank in range(world):
        sampler = PackedSampler(size, rank=rank, world_size=world, drop_last=True, seed=5)
        sampler.set_epoch(epoch)
        plain.append(list(sampler))
    window = WINDOW_STEPS * batch
    for start in range(0, size // world, window):
        assert sorted(i for s in slices for i in s[start : start + window]) == sorted(
            i for s in plain for i in s[start : start + window])


def test_set_epoch_reshuffles_and_balance_none_is_unchanged():
    dataset = CuSeqlensOnly(random_packs(300, seed=0))
    sampler = balanced_samplers(dataset, 3, 2)[1]
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert len({tuple(o) for o in orders}) == 3
    assert orders[0] == list(balanced_samplers(dataset, 3, 2)[1])
    plain = PackedSampler(dataset, rank=1, world_size=3, drop_last=True, seed=5, batch_size=2)
    assert list(plain) == list(PackedSampler(300, rank=1, world_size=3, drop_last=True, seed=5))
    assert sorted(plain.state_dict()) == ["drop_last", "epoch", "seed", "shuffle", "size", "used"]


def run_job(samplers: list[PackedSampler], steps: int) -> tuple[list[int], dict]:
    used, states = [], []
    for sampler in samplers:
        iterator = iter(sampler)
        used.extend(next(iterator) for _ in range(steps))
        states.append(json.loads(json.dumps(sampler.state_dict())))
    assert all(state == states[0] for state in states)
    return used, states[0]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.integers(0, 400), world=st.integers(1, 6), batch=st.integers(1, 3))
def test_resume_on_the_same_world_size_continues_exactly(data, size, world, batch):
    dataset = CuSeqlensOnly(random_packs(size, seed=size))
    expected = [list(s) for s in balanced_samplers(dataset, world, batch)]
    steps = data.draw(st.integers(0, size // world))
    used, state = run_job(balanced_samplers(dataset, world, batch), steps)
    for rank, resumed in enumerate(balanced_samplers(dataset, world, batch)):
        resumed.load_state_dict(state)
        resumed.set_epoch(0)
        assert expected[rank][:steps] + list(resumed) == expected[rank]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.integers(0, 400), worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4),
       batch=st.integers(1, 3))
def test_resumes_on_other_world_sizes_train_the_rest_of_the_epoch_once(data, size, worlds, batch):
    dataset = CuSeqlensOnly(random_packs(size, seed=size))
    trained, state, left = [], None, size
    for world in worlds:
        samplers = balanced_samplers(dataset, world, batch)
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
        steps = data.draw(st.integers(0, left // world))
        used, state = run_job(samplers, steps)
        trained += used
        left = size - state["used"]
        assert state["used"] == len(trained)
    for sampler in balanced_samplers(dataset, worlds[-1], batch):
        sampler.load_state_dict(state)
        trained += list(sampler)
    assert len(set(trained)) == len(trained) == size - left % worlds[-1]  # only the last pass drops a tail


def test_a_resume_on_another_world_size_rebalances_the_rest():
    costs_dataset = CuSeqlensOnly([[int(x)] for x in np.random.default_rng(0).integers(1, 4000, 4096)])
    _, state = run_job(balanced_samplers(costs_dataset, 8, 2), 40)
    samplers = balanced_samplers(costs_dataset, 4, 2)
    for sampler in samplers:
        sampler.load_state_dict(state)
    assert samplers[0].state_dict()["passes"] == [[0, 8, 2], [320, 4, 2]]
    per_rank = np.array([list(s) for s in samplers])
    costs = np.concatenate([pack_costs(d, l, 0) for d, l in costs_dataset.document_lengths()])
    steps = costs[per_rank].reshape(4, -1, 2).sum(axis=2).T  # [steps, ranks]
    assert imbalance(steps).max_over_mean < 1.02
    # The same packs dealt in the epoch's order, unbalanced:
    left = set(per_rank.ravel().tolist())
    unbalanced = np.array([i for i in epoch_order(4096, seed=5, epoch=0) if i in left])
    assert imbalance(step_costs(unbalanced, costs, 4, 2)).max_over_mean > 1.2


def test_refusals():
    dataset = CuSeqlensOnly(random_packs(20, seed=0))
    with pytest.raises(ValueError, match="batch_size"):
        PackedSampler(dataset, rank=0, world_size=2, balance="attention", drop_last=True)
    with pytest.raises(ValueError, match="drop_last=True"):
        PackedSampler(dataset, rank=0, world_size=2, balance="attention", batch_size=2)
    with pytest.raises(TypeError, match="PackedDataset"):
        PackedSampler(20, rank=0, world_size=2, balance="attention", batch_size=2, drop_last=True)
    with pytest.raises(ValueError, match="balance must be"):
        PackedSampler(dataset, rank=0, world_size=2, balance="tokens", batch_size=2, drop_last=True)
    state = balanced_samplers(dataset, 2, 2)[0].state_dict()
    with pytest.raises(ValueError, match="balance 'attention' \\(now None\\)"):
        PackedSampler(dataset, rank=0, world_size=2, drop_last=True, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="token_cost"):
        balanced_samplers(dataset, 2, 2)[0].load_state_dict(state | {"token_cost": 1.0})
    for passes in (None, [], [[1, 2, 2]], [[0, 0, 2]], [[0, 2, 2], [30, 2, 2]], [[0, 2.5, 2]]):
        with pytest.raises(ValueError, match="passes"):
            balanced_samplers(dataset, 2, 2)[0].load_state_dict(state | {"passes": passes})


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_a_balanced_epoch_at_the_next_untrained_batch(packed, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = PackedDataset(packed)

    def loader():
        sampler = PackedSampler(dataset, rank=1, world_size=2, seed=4, batch_size=3, drop_last=True, balance="attention")
        return StatefulDataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=list, num_workers=workers)

    def packs(batches):
        return [row["input_ids"].tolist() for batch in batches for row in batch]

    expected = packs(loader())
    interrupted = loader()
    iterator = iter(interrupted)
    trained = packs(next(iterator) for _ in range(4))  # the workers have drawn batches beyond these
    state = interrupted.state_dict()
    del iterator
    resumed = loader()
    resumed.load_state_dict(state)
    assert trained + packs(resumed) == expected
