"""Growing without repacking: `prepack tokenize NEW --out STORE --append` adds documents to a store, and
`prepack build STORE --out DIR --append` packs only the documents its build does not hold yet. Every
shard written before stays byte for byte as it was; index builds of an earlier generation keep reading
the grown store; an append is as atomic and exclusive as a build; the sampler sees one dataset."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prepack import build, build_store
from prepack.check.report import REBUILD_GAIN_PP, inspect_build
from prepack.check.verify import verify_build
from prepack.building.plan import histogram_pairs, pairs_histogram
from prepack.errors import FormatError, InputError, OutputError
from prepack.formats.shards import SHARD_STORE_KEY, read_manifest
from prepack.formats.store import read_store_manifest
from prepack.sources.store import open_store
from prepack.training.dataset import PackedDataset
from prepack.training.sampler import PackedSampler
from tests.cli import WIDE, run_prepack
from prepack.storage.files import write_record_batch
from tests.corpus import corpus_table, record_shard, write_corpus

MAX_LEN = 64


def _documents(seed: int, count: int, longest: int = 90) -> list[list[int]]:
    """Documents of 1..longest tokens, some longer than MAX_LEN (split)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, size=int(rng.integers(1, longest))).tolist() for _ in range(count)]


def _batch(root: Path, name: str, documents: list[list[int]], labels: bool = False) -> Path:
    """A corpus of one file, `name`.parquet, in its own directory (an append's batch of documents)."""
    directory = root / f"batch-{name}"
    directory.mkdir()
    table = corpus_table(documents, [[-100, *d[1:]] for d in documents] if labels else None)
    write_corpus(directory / f"{name}.parquet", table)
    return directory


def _sha256s(directory: Path, manifest_name: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir() if p.name != manifest_name}


def _store_documents(store: Path) -> list[tuple[list[int], list[int] | None]]:
    """Every document of a store, in order, as (ids, labels)."""
    opened = open_store(store)
    out = []
    for batch in opened.documents():
        for d in range(len(batch.offsets) - 1):
            ids = batch.ids[batch.offsets[d] : batch.offsets[d + 1]].tolist()
            labels = None if batch.labels is None else batch.labels[batch.offsets[d] : batch.offsets[d + 1]].tolist()
            out.append((ids, labels))
    return out


def _packs(build_dir: Path) -> list[list[tuple[int, int]]]:
    """The (store document, piece) pairs of every pack of a build, in pack order (shard by shard)."""
    packs = []
    for shard in read_manifest(build_dir).shards:
        with pa.ipc.open_stream(build_dir / shard.name) as reader:
            table = reader.read_all()
        packs += [list(zip(rows, pieces)) for rows, pieces in zip(table["source_rows"].to_pylist(), table["source_pieces"].to_pylist())]
    return packs


# A store grows -------------------------------------------------------------------------------------


def test_an_append_leaves_every_shard_of_the_store_byte_for_byte_and_records_a_generation(tmp_path):
    store = tmp_path / "store"
    first = build_store(_batch(tmp_path, "a", _documents(0, 120)), store, shard_size=600)
    before = _sha256s(store, "store.json")
    grown = build_store(_batch(tmp_path, "b", _documents(1, 30)), store, shard_size=600, append=True)
    after = _sha256s(store, "store.json")
    assert {name: after[name] for name in before} == before
    assert {s.name: s.sha256 for s in grown.shards[: len(first.shards)]} == before
    assert len(after) > len(before)
    assert grown.store_version == 2 and [g.documents for g in grown.generations] == [120, 150]
    assert grown.generations[0].fingerprint == first.fingerprint
    assert grown.fingerprint == grown.generations[1].fingerprint != first.fingerprint
    assert [f.path for f in grown.inputs] == ["a.parquet", "b.parquet"]
    assert read_store_manifest(store) == grown


@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 25), min_size=2, max_size=4),
    shard_size=st.sampled_from([64, 300, 5000]),
    labels=st.booleans(),
)
def test_a_store_grown_in_k_appends_holds_the_documents_of_the_store_of_the_whole_corpus(sizes, shard_size, labels):
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        documents = _documents(sum(sizes), sum(sizes), longest=40)
        parts, start = [], 0
        for number, size in enumerate(sizes):
            parts.append(_batch(root, f"part{number}", documents[start : start + size], labels))
            start += size
        build_store(parts[0], root / "grown", shard_size=shard_size)
        for part in parts[1:]:
            build_store(part, root / "grown", shard_size=shard_size, append=True)
        whole = root / "whole"
        whole.mkdir()
        table = corpus_table(documents, [[-100, *d[1:]] for d in documents] if labels else None)
        write_corpus(whole / "all.parquet", table)
        build_store(whole, root / "at-once", shard_size=shard_size)
        assert _store_documents(root / "grown") == _store_documents(root / "at-once")
        grown = read_store_manifest(root / "grown")
        assert len(grown.generations) == len(sizes) and grown.documents == sum(sizes)
        assert grown.tokens == read_store_manifest(root / "at-once").tokens
        assert grown.lengths == read_store_manifest(root / "at-once").lengths


def test_an_append_is_read_as_the_store_was_and_refused_otherwise_by_name(tmp_path):
    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 20), labels=True), store)
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    with pytest.raises(InputError, match=r"store was read with labels_column 'labels', and this corpus is read with None"):
        build_store(_batch(tmp_path, "b", _documents(1, 5)), store, append=True)
    (tmp_path / "again").mkdir()
    with pytest.raises(InputError, match=r"holds a corpus file named 'a.parquet' already"):
        build_store(_batch(tmp_path / "again", "a", _documents(2, 5), labels=True), store, append=True)
    with pytest.raises(InputError, match="--append grows the output at --out and --overwrite replaces it"):
        build_store(tmp_path / "batch-b", store, append=True, overwrite=True)
    with pytest.raises(OutputError, match="holds no prepack document store to append to"):
        build_store(tmp_path / "batch-b", tmp_path / "nothing", append=True)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "batch-a", "batch-b", "store"]


@pytest.mark.slow
def test_a_text_append_with_another_tokenizing_option_is_refused_by_its_name(tmp_path):
    from tests.demo_inputs import gpt2_directory

    tokenizer = gpt2_directory(tmp_path / "gpt2")
    for name, rows in (("a", ["one line", "two lines here"]), ("b", ["three"])):
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"text": rows}), tmp_path / name / f"{name}.parquet")
    build_store(tmp_path / "a", tmp_path / "store", tokenizer=tokenizer)
    with pytest.raises(InputError, match=r"was read with tokenize.eos True, and this corpus is read with False"):
        build_store(tmp_path / "b", tmp_path / "store", tokenizer=tokenizer, eos=False, append=True)
    # The same tokenizer files under another name read alike: the name is informative.
    renamed = tmp_path / "same-files"
    renamed.mkdir()
    for file in tokenizer.iterdir():
        (renamed / file.name).write_bytes(file.read_bytes())
    grown = build_store(tmp_path / "b", tmp_path / "store", tokenizer=renamed, append=True)
    assert grown.documents == 3 and grown.tokenize.tokenizer.name == tokenizer.name


# An index build of an earlier generation ------------------------------------------------------------


def test_an_index_build_of_an_earlier_generation_still_loads_and_verifies(tmp_path):
    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 80)), store, shard_size=500)
    build(store, tmp_path / "old-index", max_len=MAX_LEN, index_only=True)
    before = PackedDataset(tmp_path / "old-index")
    packs = [before[i]["input_ids"].tolist() for i in range(len(before))]
    for name, seed in (("b", 1), ("c", 2)):
        build_store(_batch(tmp_path, name, _documents(seed, 20)), store, shard_size=500, append=True)
    assert verify_build(tmp_path / "old-index") == []
    after = PackedDataset(tmp_path / "old-index")
    assert [after[i]["input_ids"].tolist() for i in range(len(after))] == packs
    # A store whose earlier shard changed no longer serves it: its fingerprint of that generation is checked.
    shard = store / "documents-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 1
    shard.write_bytes(bytes(data))
    assert any("sha256" in p.message for p in verify_build(tmp_path / "old-index"))


# A build grows -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("index_only", [False, True])
def test_a_build_appended_k_times_holds_every_document_once_and_keeps_its_shards(tmp_path, index_only):
    store, out = tmp_path / "store", tmp_path / "packed"
    batches = [_documents(0, 150), _documents(1, 15), _documents(2, 20), _documents(3, 10)]
    build_store(_batch(tmp_path, "b0", batches[0]), store, shard_size=2000)
    build(store, out, max_len=MAX_LEN, index_only=index_only, shard_size=3000, seed=5)
    for number, documents in enumerate(batches[1:], start=1):
        before = _sha256s(out, "manifest.json")
        build_store(_batch(tmp_path, f"b{number}", documents), store, shard_size=2000, append=True)
        grown = build(store, out, max_len=MAX_LEN, index_only=index_only, shard_size=3000, seed=5, append=True)
        after = _sha256s(out, "manifest.json")
        assert {name: after[name] for name in before} == before and len(after) > len(before)
    assert verify_build(out) == [] and verify_build(out, store) == []
    assert len(grown.generations) == 4
    # Every piece of every document exactly once, the old packs first.
    packs = _packs(out)
    pieces = [piece for pack in packs for piece in pack]
    total = sum(map(len, batches))
    expected = [(row, piece) for row, doc in enumerate(d for b in batches for d in b) for piece in range(-(-len(doc) // MAX_LEN))]
    assert sorted(pieces) == expected and len(set(pieces)) == len(pieces)
    first = grown.generations[0]
    assert {row for pack in packs[: first.packs] for row, _ in pack} == set(range(first.documents))
    assert grown.totals.documents == total
    # The fill is reported against a build of the same documents at once, which packs them no worse.
    rebuilt = build(store, tmp_path / "rebuilt", max_len=MAX_LEN, index_only=index_only, shard_size=3000, seed=5)
    assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs <= grown.totals.packs
    report = inspect_build(out)
    assert report.appends.appends == 3 and report.appends.rebuild_packs == rebuilt.totals.packs
    assert report.appends.gap_pp == pytest.approx(100 * grown.totals.tokens / MAX_LEN * (1 / rebuilt.totals.packs - 1 / grown.totals.packs))
    assert report.appends.rebuild_advised == (report.appends.gap_pp > REBUILD_GAIN_PP)


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=2, max_size=4),
    max_len=st.sampled_from([16, 50]),
    overflow=st.sampled_from(["split", "truncate", "drop"]),
    algorithm=st.sampled_from(["ffd", "bfd"]),
    index_only=st.booleans(),
    drop_untrained=st.booleans(),
)
def test_any_build_grown_in_k_appends_packs_each_document_as_a_build_of_it_at_once(sizes, max_len, overflow, algorithm, index_only, drop_untrained):
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        documents = _documents(len(sizes), sum(sizes), longest=70)
        # Every third document untrained (all its labels -100), so that --drop-untrained leaves some out.
        labels = [[-100] * len(d) if row % 3 == 0 else [-100, *d[1:]] for row, d in enumerate(documents)]
        options = dict(max_len=max_len, overflow=overflow, algorithm=algorithm, index_only=index_only, drop_untrained=drop_untrained)
        start = 0
        for number, size in enumerate(sizes):
            (root / f"part{number}").mkdir()
            table = corpus_table(documents[start : start + size], labels[start : start + size])
            write_corpus(root / f"part{number}" / f"part{number}.parquet", table)
            build_store(root / f"part{number}", root / "store", append=number > 0)
            start += size
            if number == 0:
                try:
                    build(root / "store", root / "grown", **options)
                except InputError as exc:  # a first build of nothing to pack is refused; an append of it is not
                    assume("no document is left to pack" not in str(exc))
                    raise
            else:
                grown = build(root / "store", root / "grown", **options, append=True)
        once = build(root / "store", root / "at-once", **options)
        grown_pieces = sorted(piece for pack in _packs(root / "grown") for piece in pack)
        assert grown_pieces == sorted(piece for pack in _packs(root / "at-once") for piece in pack)
        assert len(set(grown_pieces)) == len(grown_pieces)
        counts = ("documents", "tokens", "segments", "split", "truncated", "dropped", "empty", "input_tokens", "untrained")
        assert {c: getattr(grown.totals, c) for c in counts} == {c: getattr(once.totals, c) for c in counts}
        assert grown.generations[-1].rebuild_packs == once.totals.packs
        assert verify_build(root / "grown") == []


def test_verify_names_an_index_shard_that_claims_another_generation_of_the_store(tmp_path):
    store, out = tmp_path / "store", tmp_path / "index"
    build_store(_batch(tmp_path, "a", _documents(0, 40)), store)
    build(store, out, max_len=MAX_LEN, index_only=True)
    build_store(_batch(tmp_path, "b", _documents(1, 10)), store, append=True)
    grown = build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    assert verify_build(out) == []
    # Shard 0 (generation 0) rewritten to claim generation 1's store, its size and sha256 recorded.
    shard = out / "shard-00000.arrow"
    with pa.ipc.open_stream(pa.BufferReader(shard.read_bytes())) as reader:  # a copy: the file is rewritten
        batch = reader.read_next_batch()
    metadata = {**batch.schema.metadata, SHARD_STORE_KEY.encode(): grown.generations[1].fingerprint.encode()}
    write_record_batch(shard, batch.replace_schema_metadata(metadata))
    record_shard(out / "manifest.json", shard)
    problems = verify_build(out, all_problems=True)
    assert [(p.file, p.message) for p in problems] == [
        ("shard-00000.arrow", f"was planned from the store of fingerprint {grown.generations[1].fingerprint}, but it is "
         f"a shard of generation 0, planned from {grown.generations[0].fingerprint}.")
    ]


def test_verify_names_a_generation_fingerprint_of_store_json_or_the_build_that_its_documents_do_not_give(tmp_path):
    import json

    store, out = tmp_path / "store", tmp_path / "index"
    build_store(_batch(tmp_path, "a", _documents(0, 40)), store)
    build(store, out, max_len=MAX_LEN, index_only=True)
    build_store(_batch(tmp_path, "b", _documents(1, 10)), store, append=True)
    build_store(_batch(tmp_path, "c", _documents(2, 10)), store, append=True)
    build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    assert verify_build(out) == []
    forged = "ab" * 32
    # Generation 1 of store.json (not the last, so the chained fingerprint still matches) and of the build.
    recorded = json.loads((store / "store.json").read_text())
    true_fingerprint = recorded["generations"][1]["fingerprint"]
    recorded["generations"][1]["fingerprint"] = forged
    (store / "store.json").write_text(json.dumps(recorded))
    problems = verify_build(out, all_problems=True)
    assert [(p.file, p.column) for p in problems] == [("../store/store.json", "generations[1].fingerprint")]
    assert true_fingerprint in problems[0].message and forged in problems[0].message
    recorded["generations"][1]["fingerprint"] = true_fingerprint
    (store / "store.json").write_text(json.dumps(recorded))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["generations"][0]["fingerprint"] = recorded["generations"][1]["fingerprint"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_build(out, all_problems=True)
    assert ("manifest.json", "generations[0].fingerprint") in [(p.file, p.column) for p in problems]


@pytest.mark.slow
def test_the_loaders_serve_a_grown_index_build_as_the_grown_full_build(tmp_path):
    from prepack import open_hf_dataset

    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 60), labels=True), store, shard_size=700)
    for index_only in (False, True):
        build(store, tmp_path / f"packed-{index_only}", max_len=MAX_LEN, index_only=index_only, shard_size=1500)
    for name, seed in (("b", 1), ("c", 2)):
        build_store(_batch(tmp_path, name, _documents(seed, 15), labels=True), store, shard_size=700, append=True)
        for index_only in (False, True):
            build(store, tmp_path / f"packed-{index_only}", max_len=MAX_LEN, index_only=index_only, shard_size=1500, append=True)
    full, index = PackedDataset(tmp_path / "packed-False"), PackedDataset(tmp_path / "packed-True")
    assert len(full) == len(index) == read_manifest(tmp_path / "packed-True").totals.packs
    assert len(read_manifest(tmp_path / "packed-True").shards) >= 3
    for i in range(len(full)):
        assert {k: v.tolist() for k, v in full[i].items()} == {k: v.tolist() for k, v in index[i].items()}
    gathered = open_hf_dataset(tmp_path / "packed-True", cache_dir=tmp_path / "hf-cache")
    assert [[int(t) for t in row] for row in gathered["input_ids"]] == [full[i]["input_ids"].tolist() for i in range(len(full))]


def test_an_append_of_documents_that_give_no_pack_records_them_in_a_generation_without_shards(tmp_path):
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 30), labels=True), store)
    first = build(store, out, max_len=MAX_LEN, drop_untrained=True)
    (tmp_path / "untrained").mkdir()
    write_corpus(tmp_path / "untrained" / "u.parquet", corpus_table([[1, 2, 3], [4]], [[-100] * 3, [-100]]))
    build_store(tmp_path / "untrained", store, append=True)
    grown = build(store, out, max_len=MAX_LEN, drop_untrained=True, append=True)
    assert grown.shards == first.shards and grown.totals.packs == first.totals.packs
    assert grown.totals.documents == 32 and grown.totals.untrained == first.totals.untrained + 2
    assert [(g.documents, g.shards, g.packs) for g in grown.generations] == [(30, 1, first.totals.packs), (32, 1, first.totals.packs)]
    assert verify_build(out) == [] and verify_build(out, store) == []


def test_an_append_with_nothing_new_leaves_the_build_as_it_is(tmp_path):
    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 30)), store)
    manifest = build(store, tmp_path / "packed", max_len=MAX_LEN)
    before = {p.name: p.read_bytes() for p in (tmp_path / "packed").iterdir()}
    assert build(store, tmp_path / "packed", max_len=MAX_LEN, append=True) == manifest
    assert {p.name: p.read_bytes() for p in (tmp_path / "packed").iterdir()} == before


def test_an_append_packs_as_the_build_did_and_only_a_build_of_its_store(tmp_path):
    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 30)), store)
    build(store, tmp_path / "packed", max_len=MAX_LEN)
    build_store(_batch(tmp_path, "b", _documents(1, 5)), store, append=True)
    before = {p.name: p.read_bytes() for p in (tmp_path / "packed").iterdir()}
    with pytest.raises(InputError, match=r"--max-len 128, but .* was built with 64: an append packs as the build did"):
        build(store, tmp_path / "packed", max_len=128, append=True)
    with pytest.raises(InputError, match=r"--seed 1, but .* was built with 0"):
        build(store, tmp_path / "packed", max_len=MAX_LEN, seed=1, append=True)
    with pytest.raises(InputError, match="is a full build: append to it without --index-only"):
        build(store, tmp_path / "packed", max_len=MAX_LEN, index_only=True, append=True)
    build_store(_batch(tmp_path, "c", _documents(2, 30)), tmp_path / "other")
    with pytest.raises(InputError, match="was not built from this store"):
        build(tmp_path / "other", tmp_path / "packed", max_len=MAX_LEN, append=True)
    with pytest.raises(InputError, match="this is a corpus"):
        build(tmp_path / "batch-b", tmp_path / "packed", max_len=MAX_LEN, append=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "packed").iterdir()} == before


# The sampler ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_run_resumed_after_an_append_trains_every_old_pack_once_then_the_new_ones(tmp_path, drop_last):
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 120)), store)
    build(store, out, max_len=MAX_LEN, index_only=True)
    old = PackedDataset(out)
    samplers = [PackedSampler(old, rank=rank, world_size=2, seed=7, drop_last=drop_last) for rank in range(2)]
    iterators = [iter(s) for s in samplers]
    trained = [next(it) for _ in range(9) for it in iterators]
    state = samplers[0].state_dict()
    build_store(_batch(tmp_path, "b", _documents(1, 40)), store, append=True)
    build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    grown = PackedDataset(out)
    assert len(grown) > len(old)
    resumed = [PackedSampler(grown, rank=rank, world_size=2, seed=7, drop_last=drop_last) for rank in range(2)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    rest = [list(sampler) for sampler in resumed]
    dealt = [index for step in zip(*rest) for index in step]  # in the order the ranks' steps take them
    # Every old pack once over both runs, then every new pack once (with drop_last, but the last one
    # dealt when the rest is odd; else padding after: the epoch's first packs again).
    left = len(grown) - len(trained)
    packs = trained + dealt[: left - left % 2 if drop_last else left]
    assert len(set(packs)) == len(packs) and set(range(len(old))) <= set(packs) <= set(range(len(grown)))
    assert len(packs) == (len(grown) - left % 2 if drop_last else len(grown))
    assert max(dealt[: len(old) - len(trained)]) < len(old) <= min(dealt[len(old) - len(trained) : len(packs) - len(trained)])
    # Saved again on the grown build, the run resumes there too.
    again = PackedSampler(grown, rank=0, world_size=2, seed=7, drop_last=drop_last)
    again.load_state_dict(resumed[0].state_dict(consumed=3))
    assert list(again) == rest[0][3:]
    # Iterated again without set_epoch: the epoch from its beginning, shuffled over every pack as a sampler
    # that began on the grown build shuffles it; a state saved at its start resumes to that order.
    iterators = [iter(sampler) for sampler in resumed]
    at_start = resumed[0].state_dict()
    whole = [list(it) for it in iterators]
    assert whole == [list(PackedSampler(grown, rank=rank, world_size=2, seed=7, drop_last=drop_last)) for rank in range(2)]
    again.load_state_dict(at_start)
    assert list(again) == whole[0]


def test_a_state_of_another_size_that_is_no_generation_is_still_refused(tmp_path):
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 120)), store)
    build(store, out, max_len=MAX_LEN, index_only=True)
    build_store(_batch(tmp_path, "b", _documents(1, 40)), store, append=True)
    build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    grown = PackedDataset(out)
    sampler = PackedSampler(grown, rank=0, world_size=1)
    state = {**PackedSampler(len(grown) - 1, rank=0, world_size=1).state_dict()}
    with pytest.raises(ValueError, match="another setup: size"):
        sampler.load_state_dict(state)
    # A state that says its epoch began on a generation this dataset does not have is refused too.
    with pytest.raises(ValueError, match="which no generation of this dataset ends at"):
        sampler.load_state_dict({**sampler.state_dict(), "grown": [len(grown) - 3]})
    balanced = PackedSampler(grown, rank=0, world_size=1, batch_size=2, drop_last=True, balance="attention")
    with pytest.raises(ValueError, match="which no generation of this dataset ends at"):
        balanced.load_state_dict({**balanced.state_dict(), "grown": [3]})


@pytest.mark.parametrize("world", [2, 3])
def test_a_balanced_run_resumed_after_an_append_finishes_its_epoch_then_trains_the_new_packs(tmp_path, world):
    """A balanced state saved mid-epoch on two ranks, loaded into samplers of the grown build (on two ranks, or
    on three, which rebalances the rest as a resume on other sizes does): the rest of the epoch is dealt over the
    old packs alone, as the run would have dealt it without the append (on two ranks, step for step), no old pack
    twice and none left out but the drop_last remainder; iterated again without `set_epoch`, they deal the epoch
    from its beginning on every pack, as a sampler that began on the grown build does. Saved again in the resumed
    epoch and resumed after a second append (an epoch begun two generations back), it resumes over the old packs
    still. The next epoch deals every pack of the grown build once, the new ones among them, as a sampler that
    began on the grown build deals it (and as a state saved at that epoch's start resumes it)."""
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 120)), store)
    build(store, out, max_len=MAX_LEN, index_only=True)
    old = PackedDataset(out)
    options = dict(seed=5, batch_size=2, drop_last=True, balance="attention", token_cost=100.0)
    samplers = [PackedSampler(old, rank=rank, world_size=2, **options) for rank in range(2)]
    iterators = [iter(s) for s in samplers]
    trained = [next(it) for _ in range(4) for it in iterators]
    state = samplers[0].state_dict()
    uninterrupted = [list(it) for it in iterators]  # the rest of the epoch, had the build not grown
    build_store(_batch(tmp_path, "b", _documents(1, 41)), store, append=True)
    build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    grown = PackedDataset(out)
    assert len(grown) > len(old) and len(grown) % 6 == 0  # every pack dealt in an epoch, on 2 or 3 ranks
    resumed = [PackedSampler(grown, rank=rank, world_size=world, **options) for rank in range(world)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    rest = [list(sampler) for sampler in resumed]
    if world == 2:
        assert rest == uninterrupted
    packs = trained + [index for part in rest for index in part]
    assert len(set(packs)) == len(packs) and set(packs) <= set(range(len(old)))
    assert len(old) - len(packs) < world  # the epoch's last packs short of a step of every rank (drop_last)
    mid_epoch = resumed[0].state_dict(consumed=2)
    # Iterated again in the same epoch: from its beginning, on every pack (a state saved there resumes it).
    iterators = [iter(sampler) for sampler in resumed]
    at_start = resumed[0].state_dict()
    whole = [list(it) for it in iterators]
    assert whole == [list(PackedSampler(grown, rank=rank, world_size=world, **options)) for rank in range(world)]
    assert sorted(index for part in whole for index in part) == list(range(len(grown)))
    restarted = [PackedSampler(grown, rank=rank, world_size=world, **options) for rank in range(world)]
    for sampler in restarted:
        sampler.load_state_dict(at_start)
    assert [list(sampler) for sampler in restarted] == whole
    # Saved mid-way through the resumed epoch, resumed after a second append: over the old packs still.
    build_store(_batch(tmp_path, "c", _documents(2, 10)), store, append=True)
    build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    twice = PackedDataset(out)
    assert len(twice) > len(grown) and len(twice) % 6 == 0
    again = [PackedSampler(twice, rank=rank, world_size=world, **options) for rank in range(world)]
    for sampler in again:
        sampler.load_state_dict(mid_epoch)
    assert [list(sampler) for sampler in again] == [part[2:] for part in rest]
    fresh = [PackedSampler(twice, rank=rank, world_size=world, **options) for rank in range(world)]
    for sampler in [*again, *fresh]:
        sampler.set_epoch(1)
    following = [list(sampler) for sampler in again]
    assert following == [list(sampler) for sampler in fresh]
    assert sorted(index for part in following for index in part) == list(range(len(twice)))
    # A state saved on the old build before its next epoch dealt a pack begins that epoch on every pack.
    samplers[0].set_epoch(1)
    for sampler in again:
        sampler.load_state_dict(samplers[0].state_dict())
    assert [list(sampler) for sampler in again] == following


# The command line ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_appends_to_a_store_and_a_build(tmp_path):
    store, out = tmp_path / "store", tmp_path / "packed"
    assert run_prepack("tokenize", _batch(tmp_path, "a", _documents(0, 60)), "--out", store, "-q").returncode == 0
    assert run_prepack("build", store, "--out", out, "--max-len", MAX_LEN, "-q").returncode == 0
    appended = run_prepack("tokenize", _batch(tmp_path, "b", _documents(1, 10)), "--out", store, "--append", env=WIDE)
    assert appended.returncode == 0 and "stored 70 documents" in appended.stdout, appended.stderr
    grown = run_prepack("build", store, "--out", out, "--max-len", MAX_LEN, "--append", env=WIDE)
    assert grown.returncode == 0 and "documents" in grown.stdout, grown.stderr
    assert read_manifest(out).totals.documents == 70
    inspected = run_prepack("inspect", out, env=WIDE)
    assert inspected.returncode == 0 and "a rebuild would take" in inspected.stdout
    refused = run_prepack("build", store, "--out", out, "--max-len", "32", "--append", env=WIDE)
    assert refused.returncode == 2 and "--max-len 32, but" in refused.stderr and "Traceback" not in refused.stderr


# Killed and concurrent appends ---------------------------------------------------------------------

# Runs an append with one function replaced by a pause (the phase it is killed in), so that the test can
# SIGKILL it there: argv = module, function, then "store" CORPUS STORE or "build" STORE OUT INDEX_ONLY.
PAUSED_APPEND = """
import importlib, sys, time

module, function, kind, *args = sys.argv[1:]
original = getattr(importlib.import_module(module), function)

def pause(*a, **k):
    result = original(*a, **k) if function == "_remove_staging" else None  # after publishing: pause after it
    print("paused", flush=True)
    time.sleep(600)

setattr(importlib.import_module(module), function, pause)
from prepack import build, build_store
if kind == "store":
    build_store(args[0], args[1], shard_size=500, append=True)
else:
    build(args[0], args[1], max_len=64, index_only=args[2] == "1", append=True)
"""

_STORE_PHASES = [
    ("prepack.building.write_store", "write_store_shard"),  # writing the new shards
    ("prepack.building.write_store", "write_store_manifest"),  # the shards written, not the manifest
    ("prepack.storage.output", "_remove_staging"),  # published, its staging not yet deleted
]
_BUILD_PHASES = [
    ("prepack.building.build", "plan_packs"),  # planning
    ("prepack.building.build", "write_manifest"),  # the shards written, not the manifest
    ("prepack.storage.output", "_remove_staging"),
]


def _paused(phase: tuple[str, str], *args) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", PAUSED_APPEND, *phase, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "paused\n"
    return process


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize("phase", range(3))
def test_a_killed_store_append_leaves_the_store_readable_and_the_next_append_succeeds(tmp_path, phase):
    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 60)), store, shard_size=500)
    build(store, tmp_path / "index", max_len=MAX_LEN, index_only=True)
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    paused = _paused(_STORE_PHASES[phase], "store", _batch(tmp_path, "b", _documents(1, 20)), store)
    try:
        refused = run_prepack("tokenize", _batch(tmp_path, "c", _documents(2, 5)), "--out", store, "--append", env=WIDE)
        assert refused.returncode == 2 and "another prepack build is writing" in refused.stderr
    finally:
        _kill(paused)
    published = phase == 2  # killed after publishing: the append is there
    assert read_store_manifest(store).documents == (80 if published else 60)
    if not published:
        assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    assert verify_build(tmp_path / "index") == []
    grown = build_store(tmp_path / "batch-c", store, shard_size=500, append=True)
    assert grown.documents == (85 if published else 65)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch-a", "batch-b", "batch-c", "index", "store"]


@pytest.mark.slow
@pytest.mark.parametrize("index_only", [False, True])
@pytest.mark.parametrize("phase", range(3))
def test_a_killed_build_append_leaves_the_build_readable_and_the_next_append_succeeds(tmp_path, phase, index_only):
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 60)), store, shard_size=500)
    first = build(store, out, max_len=MAX_LEN, index_only=index_only)
    build_store(_batch(tmp_path, "b", _documents(1, 20)), store, shard_size=500, append=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    paused = _paused(_BUILD_PHASES[phase], "build", store, out, int(index_only))
    try:
        with pytest.raises(OutputError, match="another prepack build is writing"):
            build(store, out, max_len=MAX_LEN, index_only=index_only, append=True)
    finally:
        _kill(paused)
    if phase < 2:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert verify_build(out) == [] and len(PackedDataset(out)) >= first.totals.packs
    grown = build(store, out, max_len=MAX_LEN, index_only=index_only, append=True)
    assert grown.totals.documents == 80 and verify_build(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch-a", "batch-b", "packed", "store"]


class _Killed(BaseException):
    """Stands for a SIGKILL: raised where the process dies, with the cleanup a kill skips patched out."""


def test_an_append_killed_between_the_renames_of_an_exchange_without_renameat2_keeps_the_store(tmp_path, monkeypatch):
    """Where the file system has no atomic exchange (NFS), publishing takes three renames, and between the
    second and third `out` does not exist: the next run puts the old store back rather than deleting it."""
    from prepack.storage import output

    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 60)), store, shard_size=500)
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    exchange_or_not = output._renameat2_flags
    monkeypatch.setattr(output, "_renameat2_flags", lambda s, t, flags: flags != output._RENAME_EXCHANGE and exchange_or_not(s, t, flags))

    def killed(*args):
        raise _Killed

    with monkeypatch.context() as dying:
        dying.setattr(output, "_rename_no_replace", killed)  # the third rename
        dying.setattr(output, "_remove_staging", lambda staging: None)  # a kill runs no cleanup
        with pytest.raises(_Killed):
            build_store(_batch(tmp_path, "b", _documents(1, 20)), store, shard_size=500, append=True)
    assert not store.exists()
    grown = build_store(_batch(tmp_path, "c", _documents(2, 5)), store, shard_size=500, append=True)
    assert grown.documents == 65
    assert {name: (store / name).read_bytes() for name in before if name != "store.json"} == {
        name: data for name, data in before.items() if name != "store.json"
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch-a", "batch-b", "batch-c", "store"]


def test_a_new_shard_never_writes_through_a_staged_hard_link_to_a_published_one(tmp_path):
    """Staged shards of an append are hard links to the published ones: a new shard that took such a name
    would truncate the published file through the link, so new shard files are created exclusively."""
    from prepack.building.write_store import write_store_shard

    published = tmp_path / "published.arrow"
    published.write_bytes(b"a published shard")
    os.link(published, tmp_path / "documents-00000.arrow")
    with pytest.raises(OutputError, match="documents-00000.arrow"):
        write_store_shard(tmp_path, 0, np.array([2]), np.array([1, 2]), None)
    assert published.read_bytes() == b"a published shard"


@pytest.mark.parametrize("out", [".", ".."])
def test_an_append_to_dot_or_dot_dot_is_refused_as_a_build_to_it_is_and_writes_nothing(tmp_path, monkeypatch, out):
    store = tmp_path / "inner" / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 10)), store)
    monkeypatch.chdir(store)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(OutputError, match=f"--out {re.escape(out)} does not name a directory"):
        build_store(tmp_path / "batch-a", out, append=True)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def _tamper_store_json(store: Path, change) -> None:
    """Rewrite store.json after `change(recorded)` edits its parsed fields (what a hand or a bug could do)."""
    import json

    recorded = json.loads((store / "store.json").read_text())
    change(recorded)
    (store / "store.json").write_text(json.dumps(recorded))


@pytest.mark.parametrize("index_only", [False, True])
def test_an_append_counts_a_rebuild_from_the_old_shards_offsets_not_the_unchecked_length_counts(tmp_path, index_only):
    """store.json's length_counts sum to its documents and tokens, but nothing ties them to the shards:
    lengths that do (documents of 1 token and one long one) give another rebuild count. The append reads
    the old shards' offsets (checked against their entries) and counts what a rebuild takes; verify names
    the length_counts its store's shards do not give."""
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 60)), store, shard_size=600)
    build(store, out, max_len=MAX_LEN, index_only=index_only)
    build_store(_batch(tmp_path, "b", _documents(1, 15)), store, shard_size=600, append=True)
    m = read_store_manifest(store)

    def one_long(recorded):
        recorded["length_counts"] = [[1, m.documents - 1], [m.tokens - m.documents + 1, 1]]

    _tamper_store_json(store, one_long)
    grown = build(store, out, max_len=MAX_LEN, index_only=index_only, append=True)
    assert grown.generations[-1].rebuild_packs == build(store, tmp_path / "rebuilt", max_len=MAX_LEN, index_only=index_only).totals.packs
    if index_only:  # a full build's verify reads no store (without --source)
        problems = verify_build(out)
        assert [(p.file, p.column) for p in problems] == [("../store/store.json", "length_counts")], problems


@pytest.mark.parametrize("recorded", [False, True])
@pytest.mark.parametrize("index_only", [False, True])
def test_an_append_refuses_a_shard_whose_tokens_store_json_inflated_before_it_allocates(tmp_path, index_only, recorded):
    """A shard entry and the store's totals grown by 1e9 tokens, with length_counts to match: a build that
    records no segment lengths (a full build before its first append) has the old shard's offsets read against
    its entry and refused (FormatError), no rebuild of 1e9 tokens counted; one that records them reads no old
    shard, and counts a rebuild of the documents the store holds."""
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 60)), store, shard_size=600)
    build(store, out, max_len=MAX_LEN, index_only=index_only)
    if recorded and not index_only:  # recorded from the first append on
        build_store(_batch(tmp_path, "first", _documents(2, 5)), store, shard_size=600, append=True)
        build(store, out, max_len=MAX_LEN, append=True)
    if index_only and not recorded:
        _without_record(out)
    assert (read_manifest(out).segment_lengths is not None) == recorded
    build_store(_batch(tmp_path, "b", _documents(1, 15)), store, shard_size=600, append=True)
    rebuilt = build(store, tmp_path / "rebuilt", max_len=MAX_LEN, index_only=index_only)
    extra = 10**9

    def inflate(recorded):
        recorded["shards"][0]["tokens"] += extra
        recorded["tokens"] += extra
        length, count = recorded["length_counts"][-1]
        recorded["length_counts"][-1:] = [[length, count - 1], [length + extra, 1]] if count > 1 else [[length + extra, 1]]

    _tamper_store_json(store, inflate)
    read_store_manifest(store)  # store.json itself still parses
    if recorded:
        grown = build(store, out, max_len=MAX_LEN, index_only=index_only, append=True)
        assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs
        return
    with pytest.raises(FormatError, match=r"documents-00000\.arrow: .* tokens, but the store manifest says"):
        build(store, out, max_len=MAX_LEN, index_only=index_only, append=True)


def test_an_append_counts_a_rebuild_from_one_shards_lengths_at_a_time(tmp_path, monkeypatch):
    """Of a build that records no segment lengths, the rebuild count adds up the segment histograms of the old
    store shards, each read alone: it never holds every store document's length at once."""
    from prepack.building import build as build_module

    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 30)), store, shard_size=300)
    build(store, out, max_len=MAX_LEN, index_only=True)
    _without_record(out)
    build_store(_batch(tmp_path, "b", _documents(1, 10)), store, shard_size=300, append=True)
    m = read_store_manifest(store)
    counted, histogram = [], build_module.segment_histogram
    monkeypatch.setattr(build_module, "segment_histogram", lambda lengths, *a, **k: counted.append(len(lengths)) or histogram(lengths, *a, **k))
    build(store, out, max_len=MAX_LEN, index_only=True, append=True)
    old = m.shards[: m.generations[0].shards]
    assert len(old) > 1 and counted == [s.documents for s in old]


@pytest.mark.parametrize("recorded", [False, True])
def test_an_append_counts_a_rebuild_in_memory_that_follows_the_documents_not_max_len(tmp_path, monkeypatch, recorded):
    """A max-len of 2**24 tokens over documents of at most 90: the rebuild count's histogram (from the record or
    from the old shards) is as long as the longest segment (a histogram of max_len + 1 counts would be 128 MiB,
    and its copy as much again)."""
    import tracemalloc

    from prepack.building import build as build_module

    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 30)), store)
    build(store, out, max_len=2**24, index_only=True)
    if not recorded:
        _without_record(out)
    build_store(_batch(tmp_path, "b", _documents(1, 10)), store, append=True)
    peaks = []

    def measured(name):
        count = getattr(build_module, name)

        def call(*args):
            tracemalloc.reset_peak()
            result = count(*args)
            peaks.append(tracemalloc.get_traced_memory()[1])
            return result

        monkeypatch.setattr(build_module, name, call)

    measured("_rebuild_histogram")  # the histogram of every segment a rebuild plans
    measured("_grown_manifest")  # its pack count
    tracemalloc.start()
    try:
        grown = build(store, out, max_len=2**24, index_only=True, append=True)
    finally:
        tracemalloc.stop()
    assert len(peaks) == 2 and max(peaks) < 2**20 and grown.generations[-1].rebuild_packs == 1


def test_an_append_refuses_a_record_longer_than_the_stores_longest_document_before_it_allocates(tmp_path, monkeypatch):
    """A record of one segment of all but S - 1 of the build's T tokens and S - 1 of one token keeps totals.segments
    (S) and totals.tokens (T) and lies within a max-len of 2**24: the model takes it. No segment is longer than the
    store's longest document (store.json's length_counts): the append refuses it by name before its histogram (as
    long as the store's tokens, three times over) is allocated, and publishes nothing. Of a store that records no
    length_counts, it counts from the old shards instead."""
    import tracemalloc

    from prepack.building import build as build_module

    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 2000)), store)
    manifest = build(store, out, max_len=2**24, index_only=True)
    segments, tokens = manifest.totals.segments, manifest.totals.tokens
    assert tokens - segments + 1 > 50_000
    _edit_manifest(out, lambda recorded: recorded.update(segment_lengths=[[1, segments - 1], [tokens - segments + 1, 1]]))
    read_manifest(out)  # the model takes it: its sums are its totals'
    build_store(_batch(tmp_path, "b", _documents(1, 10)), store, append=True)
    assert read_store_manifest(store).length_counts[-1][0] <= 90
    before, listed = (out / "manifest.json").read_bytes(), sorted(os.listdir(tmp_path))
    peaks, count = [], build_module._rebuild_histogram

    def measured(*args):
        tracemalloc.reset_peak()
        try:
            return count(*args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])

    monkeypatch.setattr(build_module, "_rebuild_histogram", measured)
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=rf"manifest\.json: segment_lengths record a segment of {tokens - segments + 1} tokens, longer than the longest document"):
            build(store, out, max_len=2**24, index_only=True, append=True)
    finally:
        tracemalloc.stop()
    assert len(peaks) == 1 and peaks[0] < 2**17, peaks
    assert (out / "manifest.json").read_bytes() == before and sorted(os.listdir(tmp_path)) == listed
    # A store grown before stores recorded length_counts gives no longest document: the old shards' offsets are read.
    _tamper_store_json(store, lambda recorded: recorded.pop("length_counts"))
    assert build(store, out, max_len=2**24, index_only=True, append=True).segment_lengths[-1][0] <= 90


@pytest.mark.parametrize("drop_untrained", [False, True])
def test_an_index_append_of_a_small_store_loads_no_kernel_as_its_rebuild_loads_none(tmp_path, drop_untrained):
    """numba's start-up (0.5-0.7 CPU s) is what an index build of a small store saves by planning in
    numpy; an append, planning less, must not pay it (its count of a rebuild's packs included)."""
    store, out = tmp_path / "store", tmp_path / "index"
    build_store(_batch(tmp_path, "a", _documents(0, 60), labels=True), store)
    build(store, out, max_len=MAX_LEN, index_only=True, drop_untrained=drop_untrained)
    build_store(_batch(tmp_path, "b", _documents(1, 9), labels=True), store, append=True)
    code = f"""
import sys
import prepack
prepack.build({str(store)!r}, {str(out)!r}, max_len={MAX_LEN}, index_only=True, drop_untrained={drop_untrained}, append=True)
print("numba" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]
    grown = read_manifest(out)
    rebuilt = build(store, tmp_path / "rebuilt", max_len=MAX_LEN, index_only=True, drop_untrained=drop_untrained)
    assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs and grown.totals.documents == 69
    assert verify_build(out) == []


def test_a_full_build_of_a_grown_store_refuses_a_fingerprint_its_documents_do_not_give(tmp_path):
    import json

    store = tmp_path / "store"
    build_store(_batch(tmp_path, "a", _documents(0, 30)), store)
    grown = build_store(_batch(tmp_path, "b", _documents(1, 10)), store, append=True)
    recorded = json.loads((store / "store.json").read_text())
    forged, generation = "cd" * 32, 1
    recorded["generations"][generation]["fingerprint"] = recorded["fingerprint"] = forged  # the last's is the store's
    (store / "store.json").write_text(json.dumps(recorded))
    with pytest.raises(InputError, match=rf"store\.json: generations\[{generation}\]\.fingerprint is {forged}, but the "
                       rf"store's documents give {grown.generations[generation].fingerprint}"):
        build(store, tmp_path / "packed", max_len=MAX_LEN)
    assert not (tmp_path / "packed").exists()


@pytest.mark.parametrize("append", [False, True])
def test_a_full_build_refuses_an_earlier_generation_swapped_under_a_chain_that_still_ends_right(tmp_path, append):
    """The shard of the first generation a full build reads (generation 0; an append to a build of generation
    0: generation 1) swapped for one of other tokens of the same lengths, store.json's shard entry and last
    fingerprint brought in line with the swap, the swapped generation's recorded fingerprint left as it was.
    The chain then ends where the documents' does, so only a check of every link it hashed finds the swap."""
    import json

    from prepack.formats.store import StoreFingerprint, chained_fingerprint

    store, out = tmp_path / "store", tmp_path / "packed"
    parts = {"a": _documents(0, 30), "b": _documents(1, 10), "c": _documents(2, 10)}
    swapped = 1 if append else 0
    for number, (name, documents) in enumerate(parts.items()):
        build_store(_batch(tmp_path, name, documents), store, append=number > 0)
        if append and number == 0:
            build(store, out, max_len=MAX_LEN)

    def alone(name: str, documents: list[list[int]]):
        """The store of one part alone (its shard's bytes are the part's shard in the grown store)."""
        (tmp_path / f"alone-{name}").mkdir(exist_ok=True)
        return build_store(_batch(tmp_path / f"alone-{name}", name, documents), tmp_path / f"alone-{name}" / "store")

    name = list(parts)[swapped]
    shard = store / f"documents-{swapped:05d}.arrow"
    alone(name, parts[name])
    assert shard.read_bytes() == (tmp_path / f"alone-{name}" / "store" / "documents-00000.arrow").read_bytes()
    (tmp_path / "alone-swap").mkdir()
    swap = build_store(_batch(tmp_path / "alone-swap", name, [[(t + 1) % 500 for t in d] for d in parts[name]]), tmp_path / "alone-swap" / "store")
    shard.write_bytes((tmp_path / "alone-swap" / "store" / "documents-00000.arrow").read_bytes())
    record_shard(store / "store.json", shard)
    chain = []
    for number, (part, documents) in enumerate(parts.items()):
        added = swap.fingerprint if number == swapped else alone(part, documents).fingerprint
        chain.append(chained_fingerprint(chain[-1], added) if chain else added)
    recorded = json.loads((store / "store.json").read_text())
    recorded["generations"][-1]["fingerprint"] = recorded["fingerprint"] = chain[-1]
    (store / "store.json").write_text(json.dumps(recorded))
    # The chain ends right: the documents give the last link recorded, and the swapped link another.
    grown = open_store(store)
    hashed = StoreFingerprint(grown.manifest)
    for batch in grown.documents():
        hashed.update(np.diff(batch.offsets), batch.ids, batch.labels)
    assert hashed.hexdigest() == recorded["fingerprint"] and hashed.found[swapped] != (was := recorded["generations"][swapped]["fingerprint"])
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(InputError, match=rf"store\.json: generations\[{swapped}\]\.fingerprint is {was}, but the store's "
                       rf"documents give {chain[swapped]}: its documents or store\.json changed"):
        build(store, out if append else tmp_path / "rebuilt", max_len=MAX_LEN, append=append)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_an_append_to_a_grown_store_summarises_its_lengths_without_reading_its_shards(tmp_path, monkeypatch):
    from prepack.sources.store import Store

    store = tmp_path / "store"
    documents = _documents(5, 70, longest=120)
    build_store(_batch(tmp_path, "a", documents[:40]), store, shard_size=500)
    build_store(_batch(tmp_path, "b", documents[40:55]), store, shard_size=500, append=True)  # reads them once

    def unread(*args, **kwargs):
        raise AssertionError("an old shard was read")

    monkeypatch.setattr(Store, "shard_document_lengths", unread)
    monkeypatch.setattr(Store, "shard_columns", unread)
    grown = build_store(_batch(tmp_path, "c", documents[55:]), store, shard_size=500, append=True)
    monkeypatch.undo()
    (tmp_path / "whole").mkdir()
    write_corpus(tmp_path / "whole" / "all.parquet", corpus_table(documents))
    at_once = build_store(tmp_path / "whole", tmp_path / "at-once", shard_size=500)
    assert grown.lengths == at_once.lengths and grown.documents == 70
    assert sum(count for _, count in grown.length_counts) == 70


@pytest.mark.parametrize("drop_untrained", [False, True])
def test_an_index_append_reads_labels_as_it_plans_by_its_new_documents_tokens(tmp_path, monkeypatch, drop_untrained):
    """An index append's first pass (its new documents' labels) decides numpy or kernels as its planning
    does, on the new documents' tokens: numpy both here, the old documents over the numpy bound and the new
    under it. Of a build that records no segment lengths, its count of a rebuild's packs reads the old shards'
    labels only with --drop-untrained, and decides on theirs: the kernels here."""
    from prepack.building import build as build_module, kernels, plan_vectorized
    from prepack.building.engines import local
    from prepack.sources.store import Store

    store, out = tmp_path / "store", tmp_path / "index"
    build_store(_batch(tmp_path, "a", _documents(0, 60), labels=True), store)
    old = build(store, out, max_len=MAX_LEN, index_only=True, drop_untrained=drop_untrained)
    _without_record(out)
    grown = build_store(_batch(tmp_path, "b", _documents(1, 9), labels=True), store, append=True)
    monkeypatch.setattr(plan_vectorized, "_LABELS", old.totals.input_tokens - 1)
    assert grown.tokens - old.totals.input_tokens <= plan_vectorized._LABELS
    monkeypatch.setattr(kernels, "started", lambda: False)  # as in a process of its own
    read, planned, old_read = [], [], []
    untrained, plan_packs, shard_lengths = local.untrained_documents, build_module.plan_packs, Store.shard_lengths
    monkeypatch.setattr(local, "untrained_documents", lambda offsets, labels, without_numba: read.append(without_numba) or untrained(offsets, labels, without_numba))
    monkeypatch.setattr(build_module, "plan_packs", lambda *a, **k: planned.append(k["without_numba"]) or plan_packs(*a, **k))
    monkeypatch.setattr(Store, "shard_lengths", lambda self, shard, without_numba: old_read.append(without_numba) or shard_lengths(self, shard, without_numba))
    build(store, out, max_len=MAX_LEN, index_only=True, append=True, drop_untrained=drop_untrained)
    assert planned == [True] and set(read) == {True}
    assert old_read == ([False] * grown.generations[0].shards if drop_untrained else [])


# The segment lengths a build records, which an append counts a rebuild's packs from ---------------


def _segment_lengths(build_dir: Path) -> list[list[int]]:
    """[length, count] by rising length of every segment the build's shards hold (their cu_seqlens)."""
    lengths = []
    for shard in read_manifest(build_dir).shards:
        with pa.ipc.open_stream(build_dir / shard.name) as reader:
            table = reader.read_all()
        lengths += [b - a for bounds in table["cu_seqlens"].to_pylist() for a, b in zip(bounds, bounds[1:])]
    found, counts = np.unique(np.array(lengths, np.int64), return_counts=True)
    return [[int(length), int(count)] for length, count in zip(found, counts)]


def _edit_manifest(out: Path, change) -> None:
    """Rewrite a build's manifest.json after `change(recorded)` edits its parsed fields."""
    import json

    recorded = json.loads((out / "manifest.json").read_text())
    change(recorded)
    (out / "manifest.json").write_text(json.dumps(recorded))


def _without_record(out: Path) -> None:
    """The build as prepack wrote it before builds recorded their segment lengths."""
    _edit_manifest(out, lambda recorded: recorded.pop("segment_lengths"))


@settings(max_examples=6, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 25), min_size=1, max_size=2),
    overflow=st.sampled_from(["split", "truncate", "drop"]),
    drop_untrained=st.booleans(),
    max_documents=st.sampled_from([None, 2]),
    index_only=st.booleans(),
)
def test_a_build_of_a_store_records_the_lengths_of_the_segments_its_packs_hold(sizes, overflow, drop_untrained, max_documents, index_only):
    """Every overflow mode, untrained documents left out or not, a cap on documents a pack, an index build first
    built and any build appended to: `segment_lengths` are the lengths of the segments in the packs, and sum to
    the totals. A full build records none until appended to."""
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        documents = _documents(len(sizes) + 7, sum(sizes), longest=40)
        labels = [[-100] * len(d) if row % 3 == 0 else [-100, *d[1:]] for row, d in enumerate(documents)]
        options = dict(max_len=16, overflow=overflow, drop_untrained=drop_untrained, max_docs_per_pack=max_documents, index_only=index_only)
        start = 0
        for number, size in enumerate(sizes):
            (root / f"p{number}").mkdir()
            write_corpus(root / f"p{number}" / f"p{number}.parquet", corpus_table(documents[start : start + size], labels[start : start + size]))
            build_store(root / f"p{number}", root / "store", append=number > 0)
            start += size
            try:
                manifest = build(root / "store", root / "packed", **options, append=number > 0)
            except InputError as exc:  # a first build of nothing to pack is refused
                assume("no document is left to pack" not in str(exc))
                raise
            if number == 0 and not index_only:  # a full build is the build of its store's corpus until appended to
                assert manifest.segment_lengths is None
                continue
            assert manifest.segment_lengths == _segment_lengths(root / "packed")
            assert sum(c for _, c in manifest.segment_lengths) == manifest.totals.segments
            assert sum(length * c for length, c in manifest.segment_lengths) == manifest.totals.tokens
            assert read_manifest(root / "packed") == manifest


def test_a_full_build_of_a_store_records_no_segment_lengths_and_stays_the_build_of_its_corpus(tmp_path):
    corpus = _batch(tmp_path, "a", _documents(0, 20))
    build_store(corpus, tmp_path / "store")
    assert build(corpus, tmp_path / "of-corpus", max_len=MAX_LEN).segment_lengths is None
    assert build(tmp_path / "store", tmp_path / "of-store", max_len=MAX_LEN).segment_lengths is None
    assert (tmp_path / "of-store" / "manifest.json").read_bytes() == (tmp_path / "of-corpus" / "manifest.json").read_bytes()


@pytest.mark.parametrize("index_only", [False, True])
def test_an_append_counts_a_rebuild_from_the_record_reading_no_old_store_shard(tmp_path, index_only):
    """The old store shards' bytes overwritten before an append: an append of a build that records its segment
    lengths still succeeds (it reads none of them), its rebuild count and record those of a build from scratch,
    append after append; the same append of the build without the record reads them, and is refused. A full
    build records them from its first append on (that append reads the old shards' offsets)."""
    store, out, options = tmp_path / "store", tmp_path / "packed", dict(max_len=MAX_LEN, index_only=index_only)
    build_store(_batch(tmp_path, "a", _documents(0, 80)), store, shard_size=600)
    assert (build(store, out, **options).segment_lengths is None) == (not index_only)
    for number in (1, 2, 3):
        old_shards = [store / s.name for s in read_store_manifest(store).shards]
        assert len(old_shards) > 1
        build_store(_batch(tmp_path, f"b{number}", _documents(number, 12)), store, shard_size=600, append=True)
        rebuilt = build(store, tmp_path / f"rebuilt{number}", **options)
        if read_manifest(out).segment_lengths is None:
            grown = build(store, out, **options, append=True)
        else:
            without = tmp_path / f"without{number}"
            shutil.copytree(out, without)
            _without_record(without)
            kept = {path: path.read_bytes() for path in old_shards}
            for path in old_shards:
                path.write_bytes(bytes(len(kept[path])))
            try:
                grown = build(store, out, **options, append=True)
                with pytest.raises(FormatError, match=r"documents-00000\.arrow"):
                    build(store, without, **options, append=True)
            finally:
                for path, data in kept.items():
                    path.write_bytes(data)
        assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs
        assert grown.segment_lengths == _segment_lengths(tmp_path / f"rebuilt{number}")
    assert len(grown.generations) == 4 and verify_build(out) == []


@pytest.mark.parametrize("index_only", [False, True])
def test_a_build_without_the_record_still_appends_counting_from_the_old_shards(tmp_path, index_only):
    store, out, options = tmp_path / "store", tmp_path / "packed", dict(max_len=MAX_LEN, index_only=index_only)
    build_store(_batch(tmp_path, "a", _documents(0, 60)), store, shard_size=600)
    build(store, out, **options)
    if index_only:
        _without_record(out)
    assert read_manifest(out).segment_lengths is None
    build_store(_batch(tmp_path, "b", _documents(1, 15)), store, shard_size=600, append=True)
    grown = build(store, out, **options, append=True)
    rebuilt = build(store, tmp_path / "rebuilt", **options)
    assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs
    assert grown.segment_lengths == _segment_lengths(tmp_path / "rebuilt")  # recorded from the append on
    assert verify_build(out) == []


@pytest.mark.parametrize(
    "forge, why",
    [
        (lambda pairs: pairs[::-1], "by rising length"),
        (lambda pairs: [[0, 1], *pairs], "by rising length"),
        (lambda pairs: [*pairs[:-1], [MAX_LEN + 1, pairs[-1][1]]], "by rising length"),
        (lambda pairs: [[pairs[0][0], 0], *pairs[1:]], "each count at least 1"),
        (lambda pairs: [[pairs[0][0], pairs[0][1], 1], *pairs[1:]], "are not \\[length, count\\] pairs"),
        (lambda pairs: [[pairs[0][0], pairs[0][1] + 10**30], *pairs[1:]], "not totals.segments"),
        (lambda pairs: [[pairs[0][0], 2**40], *pairs[1:]], "not totals.segments"),
    ],
)
def test_a_forged_segment_lengths_record_is_refused_by_name_before_it_is_counted(tmp_path, forge, why):
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 30)), store)
    build(store, out, max_len=MAX_LEN, index_only=True)
    _edit_manifest(out, lambda recorded: recorded.update(segment_lengths=forge(recorded["segment_lengths"])))
    with pytest.raises(FormatError, match=f"(?s)segment_lengths.*{why}"):
        read_manifest(out)
    build_store(_batch(tmp_path, "b", _documents(1, 5)), store, append=True)
    with pytest.raises(OutputError, match=f"(?s)is not a prepack build.*segment_lengths.*{why}"):  # as for any broken manifest
        build(store, out, max_len=MAX_LEN, index_only=True, append=True)


def test_verify_names_a_consistent_but_wrong_record_and_an_append_refuses_one_of_more_tokens_than_its_store(tmp_path):
    """One segment moved to a length one shorter and another to one longer keeps both sums: the model takes it,
    verify finds it against the packs. Segments of more tokens than the store's documents hold are refused by
    the append before they are counted."""
    store, out = tmp_path / "store", tmp_path / "packed"
    build_store(_batch(tmp_path, "a", _documents(0, 40)), store)
    manifest = build(store, out, max_len=MAX_LEN, index_only=True)
    histogram = pairs_histogram(manifest.segment_lengths)
    short, long = manifest.segment_lengths[0][0], manifest.segment_lengths[-1][0]
    assert long - short >= 2
    histogram[[short, long]] -= 1
    histogram[[short + 1, long - 1]] += 1
    _edit_manifest(out, lambda recorded: recorded.update(segment_lengths=histogram_pairs(histogram)))
    problems = verify_build(out, all_problems=True)
    assert [(p.file, p.column) for p in problems] == [("manifest.json", "segment_lengths")], problems
    build_store(_batch(tmp_path, "b", _documents(1, 5)), store, append=True)
    # Segments of max_len tokens, more than the store's documents give, with totals to match.
    extra = read_store_manifest(store).at_generation(0).tokens // MAX_LEN + 1

    def inflate(recorded):
        inflated = np.zeros(MAX_LEN + 1, np.int64)
        inflated[: len(histogram)] = pairs_histogram(manifest.segment_lengths)
        inflated[MAX_LEN] += extra
        recorded["segment_lengths"] = histogram_pairs(inflated)
        recorded["totals"]["tokens"] += extra * MAX_LEN
        recorded["totals"]["segments"] += extra

    _edit_manifest(out, inflate)
    read_manifest(out)  # the model takes it: its sums are its totals'
    with pytest.raises(InputError, match=r"manifest.json: segment_lengths \(and totals.tokens\) hold \d+ tokens, more than the \d+ of the store's documents"):
        build(store, out, max_len=MAX_LEN, index_only=True, append=True)
