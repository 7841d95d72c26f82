"""`prepack.build`: every token lands in exactly one pack in order (or is counted), the columns agree,
placement is exact FFD/BFD, output is byte-identical across runs and corpus formats."""

from __future__ import annotations

import hashlib
import json
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepack import build
from prepack.storage import files as output_files
from prepack.formats.shards import check_shard, open_shard
from tests.corpus import corpus_table, read_build, reference_placement, write_corpus


def expected_segments(documents: list[list[int]], max_len: int, overflow: str) -> dict:
    """(row, piece) -> tokens, as the overflow policy says."""
    segments = {}
    for row, doc in enumerate(documents):
        if len(doc) > max_len and overflow == "drop":
            continue
        if overflow == "truncate":
            doc = doc[:max_len]
        for piece in range(-(-len(doc) // max_len)):
            segments[(row, piece)] = doc[piece * max_len : (piece + 1) * max_len]
    return segments


def packs_by_segment(packs: list[dict]) -> tuple[dict, dict]:
    """Tokens and labels of every (row, piece), cut out of the packs by cu_seqlens."""
    tokens, labels = {}, {}
    for pack in packs:
        cu = pack["cu_seqlens"]
        for d, key in enumerate(zip(pack["source_rows"], pack["source_pieces"])):
            assert key not in tokens, f"segment {key} is in two packs"
            tokens[key] = pack["input_ids"][cu[d] : cu[d + 1]]
            if "labels" in pack:
                labels[key] = pack["labels"][cu[d] : cu[d + 1]]
    return tokens, labels


documents_strategy = st.lists(
    st.lists(st.integers(0, 50_000), max_size=40), min_size=1, max_size=60
).filter(lambda docs: any(docs))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    documents=documents_strategy,
    max_len=st.integers(1, 24),
    overflow=st.sampled_from(["split", "truncate", "drop"]),
    algorithm=st.sampled_from(["ffd", "bfd"]),
    seed=st.integers(0, 2**32),
    shard_size=st.sampled_from([1, 500, 2**20]),
    with_labels=st.booleans(),
)
def test_every_token_is_packed_once_in_order_or_counted(
    tmp_path, documents, max_len, overflow, algorithm, seed, shard_size, with_labels
):
    labels = [[t if t % 3 else -100 for t in doc] for doc in documents] if with_labels else None
    corpus = write_corpus(tmp_path / f"{uuid.uuid4().hex}.parquet", corpus_table(documents, labels))
    expected = expected_segments(documents, max_len, overflow)
    if not expected:
        return  # everything dropped: covered by test_bad_input
    out = tmp_path / uuid.uuid4().hex
    build(corpus, out, max_len=max_len, overflow=overflow, algorithm=algorithm, seed=seed,
          shard_size=shard_size)
    manifest, packs = read_build(out)

    tokens, pack_labels = packs_by_segment(packs)
    assert tokens == expected
    if with_labels:
        assert pack_labels == {
            (row, piece): labels[row][piece * max_len : piece * max_len + len(seg)]
            for (row, piece), seg in expected.items()
        }
    else:
        assert "labels" not in packs[0]

    lengths = [len(doc) for doc in documents]
    long = [n for n in lengths if n > max_len]
    totals = manifest["totals"]
    assert totals["documents"] == len(documents)
    assert totals["input_tokens"] == sum(lengths)
    assert totals["tokens"] == sum(map(len, expected.values()))
    assert totals["segments"] == len(expected)
    assert totals["packs"] == len(packs) == sum(s["rows"] for s in manifest["shards"])
    assert totals["padding_tokens"] == len(packs) * max_len - totals["tokens"]
    assert totals["lower_bound"] == -(-totals["tokens"] // max_len)
    assert totals["empty"] == lengths.count(0)
    assert totals["split"] == (len(long) if overflow == "split" else 0)
    assert totals["split_pieces"] == (sum(-(-n // max_len) for n in long) if overflow == "split" else 0)
    assert totals["truncated"] == (len(long) if overflow == "truncate" else 0)
    assert totals["truncated_tokens"] == (sum(n - max_len for n in long) if overflow == "truncate" else 0)
    assert totals["dropped"] == (len(long) if overflow == "drop" else 0)
    assert totals["dropped_tokens"] == (sum(long) if overflow == "drop" else 0)

    for pack in packs:
        docs = list(zip(pack["source_rows"], pack["source_pieces"]))
        seg_lengths = np.diff(pack["cu_seqlens"])
        assert docs == sorted(docs)
        assert len(pack["input_ids"]) == pack["cu_seqlens"][-1] <= max_len
        assert pack["segment_ids"] == [d + 1 for d, n in enumerate(seg_lengths) for _ in range(n)]
        assert pack["max_seqlen"] == max(seg_lengths)
    for shard in manifest["shards"]:
        check_shard(open_shard(out / shard["name"], with_labels, max_len), max_len, shard["name"])

    # Placement is exact: the same groups of segments as the reference planner forms.
    keys = sorted(expected)
    reference = reference_placement([len(expected[k]) for k in keys], max_len, algorithm)
    groups = {}
    for key, p in zip(keys, reference):
        groups.setdefault(p, set()).add(key)
    built = {frozenset(zip(p["source_rows"], p["source_pieces"])) for p in packs}
    assert built == {frozenset(g) for g in groups.values()}


def test_pack_order_is_shuffled_by_seed(tmp_path):
    rng = np.random.default_rng(1)
    documents = [list(range(n)) for n in rng.integers(1, 64, size=400)]
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table(documents))
    orders = {}
    for seed in (0, 1):
        build(corpus, tmp_path / f"s{seed}", max_len=64, seed=seed)
        orders[seed] = [tuple(p["source_rows"]) for p in read_build(tmp_path / f"s{seed}")[1]]
    assert orders[0] != orders[1]
    assert sorted(orders[0]) == sorted(orders[1])
    fill = [sum(len(documents[r]) for r in rows) for rows in orders[0]]
    assert fill != sorted(fill, reverse=True)  # not the planner's decreasing order


def test_shards_synced_in_pieces_keep_their_bytes_and_hashes(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    documents = [rng.integers(0, 1000, size=n).tolist() for n in rng.integers(1, 300, size=200)]
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table(documents))
    build(corpus, tmp_path / "whole", max_len=128, shard_size=16_384)
    syncs, real_sync = [], output_files.SyncedFile.sync

    def counted_sync(file):
        syncs.append(file.size - file.synced)
        real_sync(file)

    monkeypatch.setattr(output_files, "_SYNC_EVERY", 1000)  # a sync inside every token column
    monkeypatch.setattr(output_files.SyncedFile, "sync", counted_sync)
    build(corpus, tmp_path / "pieces", max_len=128, shard_size=16_384)
    manifest = json.loads((tmp_path / "pieces" / "manifest.json").read_text())
    assert len(syncs) > 3 * len(manifest["shards"])
    assert max(syncs) < 1000 + 1000  # never more than one piece past the sync point
    for shard in manifest["shards"]:
        data = (tmp_path / "pieces" / shard["name"]).read_bytes()
        assert data == (tmp_path / "whole" / shard["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]


def test_same_input_gives_byte_identical_output(tmp_path):
    rng = np.random.default_rng(2)
    documents = [rng.integers(0, 1000, size=n).tolist() for n in rng.integers(0, 300, size=300)]
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table(documents))
    for name in ("a", "b"):
        build(corpus, tmp_path / name, max_len=128, shard_size=4096)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(files) > 3
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize(("max_len", "stored"), [(65_535, "uint16"), (65_536, "int32")])
def test_segment_ids_are_16_bit_while_every_document_number_fits(tmp_path, max_len, stored):
    # One-token documents fill a pack with max_len of them: the most document numbers a pack can need.
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[7]] * 65_536))
    build(corpus, tmp_path / "out", max_len=max_len)
    manifest, packs = read_build(tmp_path / "out")
    shard = open_shard(tmp_path / "out" / manifest["shards"][0]["name"], False, max_len)
    assert str(shard.schema.field("segment_ids").type.value_type) == stored
    assert max(max(pack["segment_ids"]) for pack in packs) == max_len  # no wrap-around at 2**16
    for pack in packs:
        assert pack["segment_ids"] == list(range(1, len(pack["input_ids"]) + 1))


@pytest.mark.parametrize(
    "layout", ["parquet", "arrow", "ipc", "jsonl", "jsonl.gz", "jsonl.zst", "directory", "glob", "save_to_disk"]
)
def test_every_corpus_format_gives_the_same_shards(tmp_path, layout):
    rng = np.random.default_rng(3)
    documents = [rng.integers(0, 50_000, size=n).tolist() for n in rng.integers(1, 200, size=250)]
    labels = [[-100] + doc[1:] for doc in documents]
    table = corpus_table(documents, labels)
    build(write_corpus(tmp_path / "ref.parquet", table), tmp_path / "ref", max_len=256)

    src = tmp_path / "src"
    src.mkdir()
    halves = [table.slice(0, 100), table.slice(100)]
    if layout in ("directory", "glob"):
        for i, part in enumerate(halves):
            # Formats may mix within one corpus when the columns agree.
            write_corpus(src / (f"part-{i}.jsonl" if i else f"part-{i}.parquet"), part)
        corpus = src if layout == "directory" else src / "part-*"
    elif layout == "save_to_disk":
        import datasets

        datasets.Dataset(table).save_to_disk(src / "hf", num_shards=2)
        corpus = src / "hf"
    else:
        corpus = write_corpus(src / f"corpus.{layout}", table)
    manifest = build(corpus, tmp_path / "out", max_len=256)

    reference, ref_packs = read_build(tmp_path / "ref")
    assert manifest.fingerprint == reference["fingerprint"]
    assert manifest.has_labels
    assert sum(f.rows for f in manifest.inputs) == len(documents)
    assert read_build(tmp_path / "out")[1] == ref_packs
