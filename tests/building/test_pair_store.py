"""Pair and group stores: `prepack tokenize CORPUS --pairs|--groups --out STORE` keeps every group's G documents
tokenized as a pair build tokenizes them (labels -100 on the prompt, so each group's prompt length), in shards cut
at group boundaries, with the pair options recorded; `prepack build STORE` then packs the build of the corpus byte
for byte, and `--index-only` the same packs and batches, reading the store's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import prepack
from prepack import PackedCollator, PackedDataset
from prepack.building.plan import first_trained_labels
from prepack.errors import FormatError, InputError
from prepack.exports import export_build
from prepack.formats.common import read_one_batch
from prepack.formats.shards import read_manifest
from prepack.formats.store import read_store_manifest
from prepack.sources.store import Store
from prepack.storage.files import write_record_batch
from tests.building.test_pairs import gpt2, write_jsonl  # noqa: F401 (fixture)
from tests.cli import WIDE, failure, run_prepack
from tests.corpus import files
from tests.demo_inputs import chitchat

GROUP = 3
BUILD = {"max_len": 96, "overflow": "truncate", "seed": 3, "shard_size": 3_000}


def text_groups(count: int) -> list[dict]:
    """Each chitchat exchange as a prompt and three completions: its answer and two others."""
    turns = [c for c in chitchat() if len(c) >= 2][:count]
    return [{"prompt": f"Q: {t[0][:40]} A:", "completions": [f" {t[1]}", " no idea", " perhaps so"]} for t in turns]


def short_pairs(count: int) -> list[dict]:
    """Each chitchat exchange as a pair (its answer chosen, a non-answer rejected), its prompt short enough for
    --max-len to cut the completions; every fourth with its prompt left implicit, inside chosen and rejected."""
    turns = [c for c in chitchat() if len(c) >= 2][:count]
    rows = []
    for i, t in enumerate(turns):
        prompt = f"Q: {t[0][:40]} A:"
        rows.append({"chosen": f"{prompt} {t[1]}", "rejected": f"{prompt} no idea"} if i % 4 == 3 else
                    {"prompt": prompt, "chosen": f" {t[1]}", "rejected": " no idea"})
    return rows


def _corpus(directory: Path, rows: list[dict]) -> Path:
    """`rows` in two JSONL files."""
    directory.mkdir()
    half = len(rows) // 2
    write_jsonl(directory / "a.jsonl", rows[:half])
    write_jsonl(directory / "b.jsonl", rows[half:])
    return directory


KINDS = {"pairs": ({"pairs": True}, 2, short_pairs), "groups": ({"groups": True}, GROUP, text_groups)}


@pytest.fixture(scope="module", params=sorted(KINDS))
def stored(request, tmp_path_factory, gpt2):  # noqa: F811
    """(root, corpus, store, reading options, G, the build of the corpus): a store made with small shards."""
    reading, size, rows = KINDS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    corpus = _corpus(root / "corpus", rows(70))
    reading = {"tokenizer": gpt2, **reading}
    prepack.build_store(corpus, root / "store", shard_size=1_500, num_proc=1, **reading)
    prepack.build(corpus, root / "from-corpus", num_proc=1, **reading, **BUILD)
    return root, corpus, root / "store", reading, size


def test_a_pair_store_records_its_options_and_cuts_shards_at_group_boundaries(stored):
    root, _, store, reading, size = stored
    m = read_store_manifest(store)
    assert m.pairs is not None and m.pairs.size == size
    assert m.documents == size * 70 and len(m.shards) > 2
    assert all(shard.documents % size == 0 for shard in m.shards)


def test_a_full_build_of_a_pair_store_is_the_corpus_builds_bytes(stored, tmp_path):
    root, _, store, reading, size = stored
    manifest = prepack.build(store, tmp_path / "out", **BUILD)
    assert manifest.pairs.pairs == 70 and manifest.pairs.truncated > 0 and len(manifest.shards) > 1
    assert files(tmp_path / "out") == files(root / "from-corpus")
    # The kind recorded in the store, given again alike, is taken.
    prepack.build(store, tmp_path / "again", **BUILD, **{k: v for k, v in reading.items() if k != "tokenizer"})
    assert files(tmp_path / "again") == files(root / "from-corpus")


def _batches(build: Path, size: int) -> list[dict]:
    dataset = PackedDataset(build)
    collate = PackedCollator(dataset.manifest.options.max_len)
    return [collate([dataset[i], dataset[i + 1]]) for i in range(0, len(dataset) - 1, 2)]


@pytest.mark.slow  # two index builds, four exports and two datasets opened
def test_an_index_build_of_a_pair_store_gives_the_full_builds_packs_and_batches(stored):
    root, _, store, _, size = stored
    index = root / f"index-{size}"
    if not index.exists():
        prepack.build(store, index, index_only=True, **BUILD)
    full, indexed = read_manifest(root / "from-corpus"), read_manifest(index)
    assert indexed.store is not None and indexed.pairs == full.pairs and indexed.totals == full.totals
    a, b = PackedDataset(root / "from-corpus"), PackedDataset(index)
    assert len(a) == len(b) > 2
    for i in range(len(a)):
        left, right = a[i], b[i]
        assert sorted(left) == sorted(right)
        for key in left:
            assert np.array_equal(np.asarray(left[key]), np.asarray(right[key])), (i, key)
    expected, found = _batches(root / "from-corpus", size), _batches(index, size)
    assert len(expected) == len(found) > 0
    for x, y in zip(expected, found):
        assert sorted(x) == sorted(y) and "pair_segments" in x
        for key in x:
            assert np.array_equal(np.asarray(x[key]), np.asarray(y[key])), key
    # Exported and opened as a `datasets.Dataset`, the index build's packs (pair_roles with them) are the full build's.
    for build, name in ((root / "from-corpus", "full"), (index, "index")):
        export_build(build, "parquet", root / f"{name}-{size}.parquet")
        export_build(build, "lance", root / f"{name}-{size}.lance")
    data = lambda export: {p.name: p.read_bytes() for p in (export / "data").iterdir()}  # noqa: E731
    assert data(root / f"full-{size}.parquet") == data(root / f"index-{size}.parquet")
    lanced = [lance.dataset(str(root / f"{name}-{size}.lance" / "packs.lance")).to_table() for name in ("full", "index")]
    assert lanced[0].equals(lanced[1]) and "pair_roles" in lanced[1].column_names
    full_rows = prepack.open_hf_dataset(root / "from-corpus", cache_dir=root / "hf")
    index_rows = prepack.open_hf_dataset(index, cache_dir=root / "hf")
    assert full_rows.column_names == index_rows.column_names and "pair_roles" in index_rows.column_names
    for i in range(len(full_rows)):
        left, right = full_rows[i], index_rows[i]
        for key in left:
            assert np.array_equal(left[key], right[key]), (i, key)


@pytest.mark.slow  # three verify runs and an inspect, each a process
def test_verify_and_inspect_read_builds_of_a_pair_store(stored, tmp_path):
    root, corpus, store, reading, size = stored
    index = root / f"index-{size}"
    if not index.exists():
        prepack.build(store, index, index_only=True, **BUILD)
    for build in (root / "from-corpus", index):
        result = run_prepack("verify", build, "--source", store, env=WIDE)
        assert result.returncode == 0, result.stdout + result.stderr
    result = run_prepack("verify", index, env=WIDE)
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_prepack("inspect", index, env=WIDE)
    assert result.returncode == 0 and ("pairs" if size == 2 else f"groups of {size}") in result.stdout
    # The index build's pairs, their prompts read from the store's labels, are those the full build's tokens hold.
    reports = [json.loads(run_prepack("inspect", build, "--json").stdout) for build in (root / "from-corpus", index)]
    assert reports[0]["pairs"] == reports[1]["pairs"] and reports[0]["pairs"]["prompt_tokens"] > 0


def test_options_other_than_the_stores_are_refused_by_name(stored, tmp_path):
    _, _, store, reading, size = stored
    other = {"groups": True} if size == 2 else {"pairs": True}
    with pytest.raises(InputError, match="--groups" if size == 2 else "--pairs"):
        prepack.build(store, tmp_path / "a", **BUILD, **other)
    with pytest.raises(InputError, match="--prompt-column"):
        prepack.build(store, tmp_path / "b", **BUILD, **{k: v for k, v in reading.items() if k != "tokenizer"}, prompt_column="q")
    with pytest.raises(InputError, match="never splits"):
        prepack.build(store, tmp_path / "c", **{**BUILD, "overflow": "split"})
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.slow  # an index build, and verify in a process
def test_a_changed_pair_store_shard_is_refused_by_build_and_found_by_verify(stored, tmp_path):
    root, _, store, _, size = stored
    copy = tmp_path / "store"
    copy.mkdir()
    for name, data in files(store).items():
        (copy / name).write_bytes(data)
    prepack.build(copy, tmp_path / "index", index_only=True, **BUILD)
    shard = copy / "documents-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[-200] ^= 1  # a token's bits, inside the record batch: same size, another sha256
    shard.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="documents-00001.arrow.*sha256"):
        prepack.build(copy, tmp_path / "full", **BUILD)
    result = run_prepack("verify", tmp_path / "index", env=WIDE)
    assert result.returncode == 1 and "documents-00001.arrow" in result.stdout + result.stderr


def test_a_pair_store_whose_labels_split_a_groups_prompt_is_refused(stored, tmp_path):
    """A group's documents share its prompt: labels that start training at other tokens in one group (a store
    written otherwise, its sha256 and store.json made to agree) are refused by shard and row."""
    _, _, store, _, size = stored
    copy = tmp_path / "store"
    copy.mkdir()
    for name, data in files(store).items():
        (copy / name).write_bytes(data)
    shard = copy / "documents-00000.arrow"
    batch = read_one_batch(shard.read_bytes(), "store shard", str(shard))
    schema = batch.schema
    labels = batch.column("labels")
    values = np.asarray(labels.values).copy()
    start = int(np.asarray(labels.offsets)[1])  # the second document of the first group
    first_trained = start + int(np.flatnonzero(values[start:] != -100)[0])
    values[first_trained] = -100
    changed = pa.ListArray.from_arrays(labels.offsets, pa.array(values, pa.int32()))
    batch = batch.set_column(batch.schema.get_field_index("labels"), schema.field("labels"), changed)
    shard.unlink()
    size_bytes, sha = write_record_batch(shard, batch, mode="xb")
    raw = json.loads((copy / "store.json").read_text())
    raw["shards"][0].update(bytes=size_bytes, sha256=sha)
    (copy / "store.json").write_text(json.dumps(raw))
    with pytest.raises(FormatError, match=r"documents-00000.arrow.*row 1"):
        prepack.build(copy, tmp_path / "out", index_only=True, **BUILD)
    # verify of the store on its own names the group too, beside the fingerprint its labels no longer give.
    assert prepack.verify_store(store) == []
    found = [(p.file, p.row, p.column) for p in prepack.verify_store(copy, all_problems=True)]
    assert found == [("store.json", None, "fingerprint"), ("documents-00000.arrow", 1, "labels")]
    with pytest.raises(FormatError, match=r"documents-00000.arrow.*row 1"):  # its batches' prompts, read in a full build
        prepack.build(copy, tmp_path / "full", **BUILD)


def test_a_small_pair_stores_prompts_are_read_without_starting_numba(stored, monkeypatch):
    """Its labels are read in numpy, faster than numba would start, when verified on its own or read for its prompts,
    as long as no kernel ran in the process before (`kernels.started`: pretended here, pytest's process having run some)."""
    _, _, store, _, size = stored
    monkeypatch.setattr("prepack.building.kernels.started", lambda: False)

    def kernel(offsets, labels):
        raise AssertionError("numba's kernel ran")

    monkeypatch.setattr("prepack.building.plan._first_trained", kernel)
    assert prepack.verify_store(store, all_problems=True) == []
    assert len(prepack.sources.store.open_store(store).prompt_lengths()) == read_store_manifest(store).documents // size


@pytest.mark.slow  # a store, and three commands in processes
def test_a_pair_store_refuses_another_kind_appended_and_works_from_the_command_line(tmp_path, gpt2):  # noqa: F811
    corpus = write_jsonl(tmp_path / "pairs.jsonl", short_pairs(6))
    prepack.build_store(corpus, tmp_path / "store", tokenizer=gpt2, pairs=True, num_proc=1)
    # A text corpus appended to a pair store reads otherwise: refused by the option that differs.
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello there"}])
    with pytest.raises(InputError, match="pairs"):
        prepack.build_store(text, tmp_path / "store", tokenizer=gpt2, append=True)
    # The command line: a group corpus read as pairs exits 2 by its row; pairs stored, then built, as the library does.
    message = failure(run_prepack("tokenize", corpus, "--tokenizer", gpt2, "--groups", "--out", tmp_path / "g", env=WIDE))
    assert "row 0, column 'completions'" in message and not (tmp_path / "g").exists()
    cli = run_prepack("tokenize", corpus, "--tokenizer", gpt2, "--pairs", "--num-proc", "1", "--out", tmp_path / "cli-store", env=WIDE)
    assert cli.returncode == 0, cli.stderr
    cli = run_prepack("build", tmp_path / "cli-store", "--max-len", "96", "--overflow", "truncate", "--out", tmp_path / "cli", env=WIDE)
    assert cli.returncode == 0, cli.stderr
    prepack.build(tmp_path / "store", tmp_path / "library", max_len=96, overflow="truncate")
    assert files(tmp_path / "cli") == files(tmp_path / "library")


def test_pairs_appended_to_a_pair_store_equal_a_store_of_the_whole_corpus(tmp_path, gpt2):  # noqa: F811
    rows = short_pairs(40)
    first, second = _corpus(tmp_path / "first", rows[:20]), tmp_path / "second"
    second.mkdir()
    write_jsonl(second / "c.jsonl", rows[20:])
    prepack.build_store(first, tmp_path / "store", tokenizer=gpt2, pairs=True, num_proc=1, shard_size=1_500)
    old = files(tmp_path / "store")
    grown = prepack.build_store(second, tmp_path / "store", tokenizer=gpt2, pairs=True, num_proc=1, shard_size=1_500, append=True)
    assert grown.pairs is not None and grown.generations is not None and grown.documents == 80
    assert all(files(tmp_path / "store")[name] == data for name, data in old.items() if name != "store.json")
    with pytest.raises(InputError, match="prompt_column"):
        prepack.build_store(second, tmp_path / "store", tokenizer=gpt2, pairs=True, prompt_column="q", num_proc=1, append=True)
    whole = tmp_path / "whole"
    whole.mkdir()
    write_jsonl(whole / "a.jsonl", rows[:10])
    write_jsonl(whole / "b.jsonl", rows[10:20])
    write_jsonl(whole / "c.jsonl", rows[20:])
    expected = prepack.build(whole, tmp_path / "expected", tokenizer=gpt2, pairs=True, num_proc=1, **BUILD)
    found = prepack.build(tmp_path / "store", tmp_path / "found", **BUILD)
    assert found.totals == expected.totals and found.pairs == expected.pairs
    for a, b in zip(PackedDataset(tmp_path / "expected"), PackedDataset(tmp_path / "found")):
        assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


@pytest.mark.slow  # a build each
@pytest.mark.parametrize("index_only", [False, True])
def test_a_build_of_a_pair_store_reads_each_shard_once(stored, monkeypatch, index_only):
    """Its groups' prompt lengths come from the offsets and labels the build reads anyway (a full build's
    `Store.shard_columns`, an index build's lengths and untrained flags): no shard is mapped a second time."""
    root, _, store, _, size = stored
    out = root / f"read-once-{index_only}-{size}"  # an index build lies beside its store
    opened = []
    batch = Store._batch

    def counted(self, shard, whole):
        opened.append(shard.name)
        return batch(self, shard, whole)

    monkeypatch.setattr(Store, "_batch", counted)
    prepack.build(store, out, index_only=index_only, **BUILD)
    shards = [shard.name for shard in read_store_manifest(store).shards]
    assert len(shards) > 1 and sorted(opened) == shards


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-100, -100, 5]), max_size=6), max_size=10))
def test_first_trained_labels_are_each_documents_untrained_tokens_with_numba_or_without(documents):
    """Each document's tokens before its first trained label (all of them when none is), alike from the kernel
    that stops there and from numpy."""
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    labels = np.array([label for d in documents for label in d], np.int32)
    expected = [next((i for i, label in enumerate(d) if label != -100), len(d)) for d in documents]
    for without_numba in (False, True):
        assert first_trained_labels(offsets, labels, without_numba).tolist() == expected


def test_a_pair_store_in_a_mixture_is_refused_by_its_source(stored, tmp_path):
    """A mixture selects documents, which would split the store's groups: its pair store is refused by name."""
    _, _, store, _, _ = stored
    mixture = tmp_path / "mix.yaml"
    mixture.write_text(f"tokens: 2000\nsources:\n  - {{name: prefs, path: {store}, weight: 1.0}}\n")
    with pytest.raises(InputError, match=r"source 'prefs'.*preference pairs or groups"):
        prepack.build(mixture, tmp_path / "out", max_len=64, overflow="truncate")
    assert not (tmp_path / "out").exists()


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 4).flatmap(lambda g: st.tuples(st.just(g), st.lists(st.lists(st.integers(0, 9), min_size=g, max_size=g), min_size=1, max_size=12))),
    st.integers(1, 30),
    st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
def test_store_shards_hold_whole_groups_however_the_groups_arrive(tmp_path_factory, groups, capacity, cuts):
    """`StoreShardWriter` (the local engine) and `store_shard_bounds` (Ray's plan) cut a pair store's documents at
    the same places, between groups only, whatever batches of whole groups they arrive in; a shard holds at most
    `capacity` tokens unless it is one group."""
    from prepack.building.write_store import StoreShardWriter, store_shard_bounds
    from prepack.sources.corpus import DocumentBatch

    size, lengths = groups[0], np.array([length for group in groups[1] for length in group], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    writer = StoreShardWriter(tmp_path_factory.mktemp("shards"), has_labels=False, shard_size=4 * capacity, group=size)
    start, count = 0, len(lengths) // size
    for cut in [*cuts, count]:  # batches of `cut` groups, then the rest
        end = min(count, start + cut)
        first, last = offsets[size * start], offsets[size * end]
        writer.add(DocumentBatch(Path("f"), size * start, offsets[size * start : size * end + 1] - first,
                                 np.zeros(last - first, np.int32), None))
        start = end
    writer.flush()
    written = [shard.documents for shard in writer.shards]
    bounds, _ = store_shard_bounds(lengths, capacity, size)
    assert written == np.diff(bounds).tolist() and sum(written) == len(lengths)
    for shard, (a, b) in zip(writer.shards, zip(bounds[:-1], bounds[1:])):
        assert shard.documents % size == 0 and (shard.tokens <= capacity or shard.documents == size)
        assert shard.tokens == int(lengths[a:b].sum())
