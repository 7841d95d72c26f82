"""`prepack.training.dataset`: rows equal the shards read independently, are zero-copy views of the map, survive
DataLoader workers; the sampler shards, shuffles per epoch and resumes exactly; bad builds raise
FormatError before any value is served."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from prepack import FormatError, build
from prepack.training.dataset import PackedDataset, open_hf_dataset
from prepack.training.sampler import PackedSampler
from tests.corpus import corpus_table, edit_json, read_build, write_corpus

MAX_LEN = 256


def random_documents(count: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 1000, size=rng.integers(1, 200)).tolist() for _ in range(count)]
    labels = [[-100, *doc[1:]] for doc in documents]
    return documents, labels


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """One build with labels and one without, each a few dozen packs over many small shards."""
    root = tmp_path_factory.mktemp("load")
    documents, labels = random_documents(300, seed=1)
    corpora = {"labels": corpus_table(documents, labels), "plain": corpus_table(documents)}
    for name, table in corpora.items():
        build(write_corpus(root / f"{name}.parquet", table), root / name, max_len=MAX_LEN, shard_size=8000)
    return {name: root / name for name in corpora}


@pytest.fixture
def labelled(builds) -> Path:
    return builds["labels"]


@pytest.fixture
def copy_of_build(builds, tmp_path) -> Path:
    """A build this test may damage."""
    return Path(shutil.copytree(builds["labels"], tmp_path / "packed"))


def as_lists(rows: list[dict]) -> list[dict]:
    """A DataLoader collate_fn that keeps rows apart (module level, so that spawned workers find it)."""
    return [{name: values.tolist() for name, values in row.items()} for row in rows]


# --- rows -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["labels", "plain"])
def test_rows_equal_the_shards_read_with_pyarrow(builds, name):
    manifest, packs = read_build(builds[name])
    dataset = PackedDataset(builds[name])
    assert len(dataset) == len(packs) == manifest["totals"]["packs"]
    assert len(manifest["shards"]) > 3
    columns = ["input_ids", "cu_seqlens", "segment_ids", *(["labels"] if name == "labels" else [])]
    for index, pack in enumerate(packs):
        row = dataset[index]
        assert sorted(row) == sorted(columns)
        for column in columns:
            assert row[column].dtype == np.int32
            assert row[column].tolist() == pack[column], (index, column)
    assert dataset[-1]["input_ids"].tolist() == packs[-1]["input_ids"]
    with pytest.raises(IndexError):
        dataset[len(packs)]


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process has `path` memory-mapped (Linux /proc)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_rows_are_read_only_views_into_the_memory_mapped_shard(labelled):
    dataset = PackedDataset(labelled)
    index = len(dataset) - 1
    row = dataset[index]
    shard = labelled / dataset.manifest.shards[-1].name
    ranges = mapped_ranges(shard)
    assert ranges, "the shard is not memory-mapped"
    # segment_ids is stored as uint16 and served widened: a copy, equal to what cu_seqlens says.
    segment_ids = row.pop("segment_ids")
    assert segment_ids.dtype == np.int32
    lengths = np.diff(row["cu_seqlens"])
    assert segment_ids.tolist() == np.repeat(np.arange(1, len(lengths) + 1), lengths).tolist()
    for column, values in row.items():
        assert values.dtype == np.int32, column
        address = values.__array_interface__["data"][0]
        assert any(start <= address and address + values.nbytes <= end for start, end in ranges), column
        assert not values.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            values[0] = 1


def test_pickling_carries_paths_not_maps(labelled):
    dataset = PackedDataset(labelled)
    before = pickle.dumps(dataset)
    expected = [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]  # opens every shard
    assert len(pickle.dumps(dataset)) == len(before)
    copy = pickle.loads(pickle.dumps(dataset))
    assert [copy[i]["input_ids"].tolist() for i in range(len(copy))] == expected


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.slow
def test_two_workers_yield_the_same_batches_as_none(labelled, context):
    dataset = PackedDataset(labelled)
    dataset[0]  # a shard already open in the parent must not leak into the workers
    sampler = PackedSampler(dataset, seed=5)

    def batches(**workers):
        loader = DataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=as_lists, **workers)
        return list(loader)

    assert batches(num_workers=2, multiprocessing_context=context) == batches(num_workers=0)


def test_works_with_torch_distributed_sampler(labelled):
    dataset = PackedDataset(labelled)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=as_lists)
        rows = [row for batch in loader for row in batch]
        assert rows == as_lists([dataset[i] for i in sampler])
        seen.extend(row["input_ids"] for row in rows)
    everything = {tuple(dataset[i]["input_ids"]) for i in range(len(dataset))}
    assert {tuple(ids) for ids in seen} == everything


# --- HF datasets ------------------------------------------------------------------------------------


def test_hf_datasets_rows_collate_to_the_same_batch(labelled):
    from datasets import Dataset

    from prepack.training.collate import PackedCollator

    collate = PackedCollator(max_len=MAX_LEN)
    dataset = PackedDataset(labelled)
    hf_rows = [row for shard in dataset.shard_paths for row in Dataset.from_file(str(shard))]
    helper = open_hf_dataset(labelled)
    assert len(hf_rows) == len(helper) == len(dataset)
    for start in range(0, len(dataset), 4):
        indices = range(start, min(start + 4, len(dataset)))
        expected = collate([dataset[i] for i in indices])
        for batch in (collate([hf_rows[i] for i in indices]), collate([helper[i] for i in indices])):
            assert batch.keys() == expected.keys()
            for key, value in expected.items():
                if isinstance(value, torch.Tensor):
                    assert batch[key].dtype == value.dtype, key
                    assert torch.equal(batch[key], value), key
                else:
                    assert batch[key] == value, key


# --- sampler ----------------------------------------------------------------------------------------


def test_each_epoch_is_a_new_reproducible_permutation():
    def order(seed: int, epoch: int) -> list[int]:
        sampler = PackedSampler(100, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert sorted(order(0, 0)) == list(range(100))
    assert order(0, 0) == order(0, 0)
    assert order(0, 1) == order(0, 1)
    assert len({tuple(order(0, 0)), tuple(order(0, 1)), tuple(order(1, 0)), tuple(order(0, 2))}) == 4
    assert list(PackedSampler(10, shuffle=False)) == list(range(10))


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 300), world=st.integers(1, 8), drop_last=st.booleans(), epoch=st.integers(0, 5))
def test_ranks_get_equal_disjoint_slices_that_cover_the_epoch(size, world, drop_last, epoch):
    samplers = [PackedSampler(size, rank=r, world_size=world, drop_last=drop_last, seed=7) for r in range(world)]
    slices = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        slices.append(list(sampler))
    assert {len(s) for s in slices} == {len(samplers[0])}
    # Dealt round-robin from one epoch order: rank r holds its positions r, r + world, ...
    dealt = [slices[p % world][p // world] for p in range(world * len(samplers[0]))]
    if drop_last:
        assert len(set(dealt)) == len(dealt) == size // world * world
    else:
        assert sorted(dealt[:size]) == list(range(size))
        assert dealt[size:] == dealt[: len(dealt) - size]  # the padding repeats the start


@settings(max_examples=200, deadline=None)
@given(data=st.data(), size=st.integers(0, 200), world=st.integers(1, 6), drop_last=st.booleans())
def test_resume_mid_epoch_yields_exactly_the_remaining_indices(data, size, world, drop_last):
    rank = data.draw(st.integers(0, world - 1))
    epoch = data.draw(st.integers(0, 3))

    def sampler() -> PackedSampler:
        return PackedSampler(size, seed=11, rank=rank, world_size=world, drop_last=drop_last)

    full = sampler()
    full.set_epoch(epoch)
    expected = list(full)
    stop = data.draw(st.integers(0, len(expected)))

    interrupted = sampler()
    interrupted.set_epoch(epoch)
    iterator = iter(interrupted)
    consumed = [next(iterator) for _ in range(stop)]
    state = json.loads(json.dumps(interrupted.state_dict()))  # what a checkpoint would store

    resumed = sampler()
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # a training loop calls this again on restart; it keeps the position
    assert consumed + list(resumed) == expected
    resumed.set_epoch(epoch + 1)
    assert len(list(resumed)) == len(expected)


def test_consumed_overrides_what_a_prefetching_loader_drew():
    sampler = PackedSampler(50, seed=3)
    expected = list(sampler)
    loader = iter(DataLoader(range(50), batch_size=5, sampler=sampler))
    next(loader)
    next(loader)
    state = sampler.state_dict(consumed=10)
    resumed = PackedSampler(50, seed=3)
    resumed.load_state_dict(state)
    assert list(resumed) == expected[10:]


def test_a_state_from_another_setup_is_refused():
    state = PackedSampler(50, world_size=2, rank=0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed 1 \\(now 2\\)"):
        PackedSampler(50, world_size=4, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="size 50 \\(now 51\\)"):
        PackedSampler(51, world_size=2, rank=0, seed=1).load_state_dict(state)


def job_states(size: int, world: int, steps: int, epoch: int, **options) -> tuple[list[int], dict]:
    """`world` ranks in lockstep draw `steps` indices each: the packs used, and each rank's saved state."""
    samplers = [PackedSampler(size, rank=r, world_size=world, **options) for r in range(world)]
    used, states = [], []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        iterator = iter(sampler)
        used.extend(next(iterator) for _ in range(steps))
        states.append(json.loads(json.dumps(sampler.state_dict())))  # what a checkpoint would store
    assert all(state == states[0] for state in states)  # any rank's state resumes the job
    return used, states[0]


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    size=st.integers(0, 200),
    before=st.integers(1, 6),
    after=st.integers(1, 6),
    drop_last=st.booleans(),
)
def test_resume_on_another_world_size_trains_the_rest_of_the_epoch_once(data, size, before, after, drop_last):
    epoch = data.draw(st.integers(0, 3))
    per_rank = size // before if drop_last else -(-size // before)
    steps = data.draw(st.integers(0, per_rank))
    used, state = job_states(size, before, steps, epoch, seed=3, drop_last=drop_last)
    rest = []
    for rank in range(after):
        resumed = PackedSampler(size, rank=rank, world_size=after, seed=3, drop_last=drop_last)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)  # a training loop calls this again on restart; it keeps the position
        rest.append(list(resumed))
    assert len({len(indices) for indices in rest}) == 1  # the ranks stay in lockstep
    trained = used + [index for indices in rest for index in indices]
    left = size - min(steps * before, size)
    if drop_last:
        assert len(set(trained)) == len(trained) == size - left % after  # the resumed ranks drop what does not deal evenly
    else:
        assert set(trained) == set(range(size))
        assert len(trained) - size < before + after  # repeated only as DistributedSampler pads


def test_built_before_init_process_group_in_a_launched_job_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="not initialised"):
        PackedSampler(50)
    assert len(PackedSampler(50, rank=1, world_size=2)) == 25  # explicit ranks need no process group


def test_built_before_init_process_group_in_this_process_is_refused_when_iterated(monkeypatch):
    sampler = PackedSampler(50)  # nothing says this process will join a job of several
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="built before torch.distributed was initialised"):
        iter(sampler)


def test_a_loader_that_accelerate_shards_again_is_refused_before_the_first_batch():
    """In one process, Accelerate's two ways of sharding a prepared loader for two processes (the real
    two-process run is in test_clients.py)."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher
    from torch.utils.data import BatchSampler

    sampler = PackedSampler(10, rank=0, world_size=2)
    split = BatchSamplerShard(BatchSampler(sampler, 2, drop_last=False), num_processes=2, process_index=0)
    with pytest.raises(RuntimeError, match="BatchSamplerShard shards the loader again"):
        next(iter(split))
    dispatched = DataLoaderDispatcher(list(range(10)), batch_size=2, sampler=sampler)
    dispatched.state = SimpleNamespace(num_processes=2, process_index=0, device="cpu")  # rank 0 of two
    with pytest.raises(RuntimeError, match="DataLoaderDispatcher shards the loader again"):
        next(iter(dispatched))
    # An unsharded sampler is Accelerate's to shard: process 1 of 2 gets every other batch.
    batches = list(BatchSampler(PackedSampler(10, world_size=1), 2, drop_last=False))
    alone = BatchSamplerShard(BatchSampler(PackedSampler(10, world_size=1), 2, False), num_processes=2, process_index=1)
    assert list(alone)[:2] == batches[1::2]


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_at_the_next_untrained_batch(labelled, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = PackedDataset(labelled)

    def loader(sampler):
        return StatefulDataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=as_lists, num_workers=workers)

    def packs(batches):
        return [row["input_ids"] for batch in batches for row in batch]

    expected = packs(loader(PackedSampler(dataset, seed=4)))
    interrupted = loader(PackedSampler(dataset, seed=4))
    iterator = iter(interrupted)
    trained = packs(next(iterator) for _ in range(4))  # the workers have drawn batches beyond these
    state = interrupted.state_dict()
    del iterator
    resumed = loader(PackedSampler(dataset, seed=4))
    resumed.load_state_dict(state)
    assert trained + packs(resumed) == expected


# --- damaged builds ---------------------------------------------------------------------------------


def rewrite_shard(path: Path, column: str, row: int, edit) -> None:
    """Rewrite one shard with one row's `column` changed by `edit`, keeping schema and byte size."""
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_stream(source).read_all()
    rows = table.to_pylist()
    rows[row][column] = edit(rows[row][column])
    edited = pa.Table.from_pylist(rows, schema=table.schema)
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        writer.write_table(edited)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "manifest.json").write_text("{not json"), "cannot be read as JSON"),
        (lambda d: edit_json(d / "manifest.json", lambda m: m.update(format_version=1)), "format_version 1"),
        (lambda d: edit_json(d / "manifest.json", lambda m: m["shards"][1].update(name="../shard-00001.arrow")), "is named"),
        (lambda d: edit_json(d / "manifest.json", lambda m: m["shards"][0].update(rows=m["shards"][0]["rows"] + 1)), "packs"),
        (lambda d: edit_json(d / "manifest.json", lambda m: m["shards"][2].update(bytes=m["shards"][2]["bytes"] - 1)), "bytes"),
        (lambda d: (d / "shard-00003.arrow").unlink(), "missing"),
        (lambda d: (d / "manifest.json").unlink(), "not a finished prepack build"),
    ],
)
def test_a_damaged_manifest_is_refused_on_open(copy_of_build, damage, message):
    damage(copy_of_build)
    with pytest.raises(FormatError, match=message):
        PackedDataset(copy_of_build)


def test_a_shard_with_other_rows_than_the_manifest_says_is_refused_on_first_use(copy_of_build):
    def move_a_row(manifest):
        manifest["shards"][0]["rows"] -= 1
        manifest["shards"][1]["rows"] += 1

    edit_json(copy_of_build / "manifest.json", move_a_row)
    dataset = PackedDataset(copy_of_build)
    with pytest.raises(FormatError, match="rows, but the manifest says"):
        dataset[0]


def test_edited_cu_seqlens_are_refused_before_any_row_of_the_shard_is_served(copy_of_build):
    shard = copy_of_build / "shard-00001.arrow"
    with pa.memory_map(str(shard)) as source:
        cu_seqlens = pa.ipc.open_stream(source).read_all().column("cu_seqlens").to_pylist()
    row = next(r for r, cu in enumerate(cu_seqlens) if len(cu) > 2)  # a pack of two documents or more
    rewrite_shard(shard, "cu_seqlens", row, lambda cu: [cu[0], cu[1] + 1, *cu[2:]])
    dataset = PackedDataset(copy_of_build)  # the file's size and the manifest still agree
    first = dataset.manifest.shards[0].rows
    assert dataset[0]["input_ids"].size  # other shards are still served
    for index in (first, first + row):
        with pytest.raises(FormatError, match=f"row {row}, column"):
            dataset[index]
    assert PackedDataset(copy_of_build, validate=False)[first + row]["cu_seqlens"].tolist() != cu_seqlens[row]


def test_checksums_catch_an_edit_that_keeps_the_format(copy_of_build):
    shard = copy_of_build / "shard-00002.arrow"
    rewrite_shard(shard, "input_ids", 0, lambda ids: [ids[0] + 1, *ids[1:]])
    index = sum(info.rows for info in PackedDataset(copy_of_build).manifest.shards[:2])
    assert PackedDataset(copy_of_build)[index]["input_ids"].size  # a valid shard, just not the one built
    with pytest.raises(FormatError, match="sha256"):
        PackedDataset(copy_of_build, verify_checksums=True)[index]
    with pytest.raises(FormatError, match="sha256"):
        open_hf_dataset(copy_of_build, verify_checksums=True)


def test_open_hf_dataset_checks_every_shard(copy_of_build):
    rewrite_shard(copy_of_build / "shard-00004.arrow", "segment_ids", 0, lambda seg: [0, *seg[1:]])
    with pytest.raises(FormatError, match="segment_ids"):
        open_hf_dataset(copy_of_build)


def test_iterating_again_restarts_the_epoch_as_distributed_sampler_does():
    sampler = PackedSampler(20, seed=2)
    first = list(sampler)
    iterator = iter(sampler)
    next(iterator)
    assert list(sampler) == first
    assert sampler.state_dict()["used"] == 20
