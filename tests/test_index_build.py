"""Index-only builds: a build of a document store that writes which documents each pack holds, and no
token. Its rows, gathered from the store, are those of the full build of the same store."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack import build, build_store
from prepack.errors import FormatError, InputError
from prepack.format import read_manifest, shard_schema
from prepack.load import PackedDataset
from prepack.report import inspect_build
from prepack.verify import verify_build
from tests.corpus import corpus_table, write_corpus

PREPACK = shutil.which("prepack", path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """Documents of 0 to 40 tokens (some longer than the max-lens below, one empty), with labels."""
    root = tmp_path_factory.mktemp("index")
    (root / "corpus").mkdir()
    rng = np.random.default_rng(7)
    ids = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(0, 41, 120)]
    labels = [[-100 if rng.random() < 0.3 else t for t in doc] for doc in ids]
    write_corpus(root / "corpus" / "a.parquet", corpus_table(ids[:70], labels[:70]))
    write_corpus(root / "corpus" / "b.parquet", corpus_table(ids[70:], labels[70:]))
    build_store(root / "corpus", root / "store", shard_size=512)  # several store shards
    return root / "store"


def _rows(dataset: PackedDataset) -> list[dict[str, list[int]]]:
    return [{name: values.tolist() for name, values in dataset[i].items()} for i in range(len(dataset))]


@pytest.mark.parametrize(
    "options",
    [
        {"max_len": 32, "algorithm": "ffd", "overflow": "split"},
        {"max_len": 32, "algorithm": "bfd", "overflow": "split", "seed": 3},
        {"max_len": 16, "algorithm": "ffd", "overflow": "truncate"},
        {"max_len": 64, "algorithm": "bfd", "overflow": "drop", "drop_untrained": True},
    ],
)
def test_index_rows_are_the_full_builds(store, tmp_path, options):
    full = build(store, tmp_path / "full", shard_size=2048, **options)
    index = build(store, tmp_path / "index", shard_size=256, index_only=True, **options)
    assert len(index.shards) > 1 and len(full.shards) > 1
    assert index.store.path == "../../store" or Path(tmp_path / "index" / index.store.path).resolve() == store.resolve()
    assert index.store.fingerprint == index.fingerprint == full.fingerprint
    assert index.totals == full.totals
    full_rows, index_rows = _rows(PackedDataset(tmp_path / "full")), _rows(PackedDataset(tmp_path / "index"))
    assert index_rows == full_rows and len(index_rows) == full.totals.packs
    assert set(index_rows[0]) == {"input_ids", "labels", "cu_seqlens", "segment_ids"}
    for name in ("input_ids", "labels", "cu_seqlens", "segment_ids"):
        assert PackedDataset(tmp_path / "index")[0][name].dtype == PackedDataset(tmp_path / "full")[0][name].dtype


def test_index_shards_hold_the_pack_columns_only(store, tmp_path):
    build(store, tmp_path / "index", max_len=32, index_only=True)
    with pa.ipc.open_stream(tmp_path / "index" / "shard-00000.arrow") as reader:
        assert reader.schema.equals(shard_schema(True, 32, store_documents=120), check_metadata=True)
    assert reader.schema.names == ["cu_seqlens", "max_seqlen", "source_rows", "source_pieces"]
    assert reader.schema.field("source_rows").type == pa.list_(pa.uint32())
    assert shard_schema(True, 32, store_documents=2**32).field("source_rows").type == pa.list_(pa.uint32())
    assert shard_schema(True, 32, store_documents=2**32 + 1).field("source_rows").type == pa.list_(pa.int64())
    assert not shard_schema(True, 32, store_documents=120).equals(shard_schema(True, 32), check_metadata=True)
    raw = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert set(raw["store"]) == {"path", "fingerprint"}
    # The same store and options, twice: the same bytes.
    build(store, tmp_path / "again", max_len=32, index_only=True)
    for name in sorted(p.name for p in (tmp_path / "index").iterdir()):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "index" / name).read_bytes(), name


def test_a_full_build_manifest_has_no_store_key(store, tmp_path):
    build(store, tmp_path / "full", max_len=32)
    assert "store" not in json.loads((tmp_path / "full" / "manifest.json").read_text())
    assert read_manifest(tmp_path / "full").store is None


def test_index_only_refuses_a_corpus(store, tmp_path):
    with pytest.raises(InputError, match="--index-only packs a document store"):
        build(store.parent / "corpus", tmp_path / "index", max_len=32, index_only=True)
    assert not (tmp_path / "index").exists()


def test_a_changed_store_is_refused(store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    build(copy, tmp_path / "index", max_len=32, index_only=True)
    manifest = json.loads((copy / "store.json").read_text())
    manifest["fingerprint"] = "0" * 64
    (copy / "store.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="the store changed"):
        PackedDataset(tmp_path / "index")
    problems = verify_build(tmp_path / "index")
    assert problems and "store changed" in problems[0].message
    shutil.rmtree(copy)
    with pytest.raises(FormatError, match="is not there"):
        PackedDataset(tmp_path / "index")


def test_a_piece_past_its_document_is_refused(store, tmp_path):
    """A (row, piece) whose tokens are not all in the store's document: refused by name as the pack is
    gathered, never served short."""
    build(store, tmp_path / "index", max_len=32, index_only=True, overflow="split")
    path = tmp_path / "index" / "shard-00000.arrow"
    with pa.ipc.open_stream(path.read_bytes()) as reader:  # in memory: the file is rewritten below
        batch = reader.read_next_batch()
    pieces = batch.column("source_pieces")
    values = pieces.values.to_numpy().copy()
    values[0] += 5  # 5 * 32 tokens into a document of at most 40
    columns = [*batch.columns[:3], pa.ListArray.from_arrays(pieces.offsets, pa.array(values))]
    with pa.ipc.new_stream(path, batch.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=batch.schema))
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    manifest["shards"][0]["bytes"] = path.stat().st_size
    (tmp_path / "index" / "manifest.json").write_text(json.dumps(manifest))
    dataset = PackedDataset(tmp_path / "index")
    with pytest.raises(FormatError, match=r"shard-00000.arrow: row 0, column 'source_pieces': document 1 .* runs past"):
        dataset[0]


def test_inspect_and_verify_an_index_build(store, tmp_path):
    build(store, tmp_path / "full", max_len=32)
    build(store, tmp_path / "index", max_len=32, index_only=True)
    assert verify_build(tmp_path / "index", all_problems=True) == []
    full, index = inspect_build(tmp_path / "full"), inspect_build(tmp_path / "index")
    assert index.model_dump(exclude={"per_shard", "path"}) == full.model_dump(exclude={"per_shard", "path"})
    # One shard each (64 MiB): the same packs, documents and tokens; the index shard's bytes fewer.
    assert [s.model_dump(exclude={"bytes"}) for s in index.per_shard] == [s.model_dump(exclude={"bytes"}) for s in full.per_shard]
    assert index.per_shard[0].bytes < full.per_shard[0].bytes / 4


def test_verify_finds_a_changed_index_shard(store, tmp_path):
    build(store, tmp_path / "index", max_len=32, index_only=True)
    path = tmp_path / "index" / "shard-00000.arrow"
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    problems = verify_build(tmp_path / "index")
    assert problems and problems[0].file == "shard-00000.arrow" and "sha256" in problems[0].message


def test_the_cli_builds_an_index(store, tmp_path):
    result = subprocess.run(
        [PREPACK, "build", str(store), "--max-len", "32", "--out", str(tmp_path / "index"), "--index-only", "--quiet"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert read_manifest(tmp_path / "index").store is not None
    result = subprocess.run(
        [PREPACK, "build", str(store.parent / "corpus"), "--max-len", "32", "--out", str(tmp_path / "x"), "--index-only"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2 and "--index-only packs a document store" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_an_index_dataset_pickles_for_workers(store, tmp_path):
    """DataLoader workers get a pickled dataset: paths, no memory map; they reopen the store themselves."""
    import pickle

    build(store, tmp_path / "index", max_len=32, index_only=True)
    dataset = PackedDataset(tmp_path / "index")
    first = dataset[0]  # maps an index shard and a store shard
    again = pickle.loads(pickle.dumps(dataset))
    assert again._open == {} and again._store_tokens is None
    assert all(np.array_equal(again[0][name], first[name]) for name in first)
