"""Index-only builds: a build of a document store that writes which documents each pack holds, and no
token. Its rows, gathered from the store, are those of the full build of the same store."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack import build, build_store
from prepack.errors import FormatError, InputError
from prepack.formats.shards import IndexOf, read_manifest, shard_schema
from prepack.training.dataset import PackedDataset
from prepack.check.report import inspect_build
from prepack.check.verify import verify_build
from tests.cli import failure, invoke_prepack, run_prepack
from tests.corpus import corpus_table, record_shard, write_corpus


@pytest.fixture(scope="module")
def module_store(tmp_path_factory) -> Path:
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


@pytest.fixture
def store(module_store, tmp_path) -> Path:
    """A copy of the store (and its corpus) in the test's directory: an index build lies beside its store."""
    shutil.copytree(module_store.parent / "corpus", tmp_path / "corpus")
    return Path(shutil.copytree(module_store, tmp_path / "shared-store"))


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
    assert index.store.path == "../shared-store"
    assert index.store.fingerprint == index.fingerprint == full.fingerprint
    assert index.totals == full.totals
    full_rows, index_rows = _rows(PackedDataset(tmp_path / "full")), _rows(PackedDataset(tmp_path / "index"))
    assert index_rows == full_rows and len(index_rows) == full.totals.packs
    assert set(index_rows[0]) == {"input_ids", "labels", "cu_seqlens", "segment_ids"}
    for name in ("input_ids", "labels", "cu_seqlens", "segment_ids"):
        assert PackedDataset(tmp_path / "index")[0][name].dtype == PackedDataset(tmp_path / "full")[0][name].dtype


def test_index_shards_hold_the_pack_columns_only(store, tmp_path):
    manifest = build(store, tmp_path / "index", max_len=32, index_only=True)
    of = IndexOf(120, manifest.fingerprint)
    with pa.ipc.open_stream(tmp_path / "index" / "shard-00000.arrow") as reader:
        assert reader.schema.equals(shard_schema(True, 32, of), check_metadata=True)
    assert reader.schema.metadata[b"prepack.store_fingerprint"] == manifest.store.fingerprint.encode()
    assert reader.schema.names == ["cu_seqlens", "max_seqlen", "source_rows", "source_pieces"]
    assert reader.schema.field("source_rows").type == pa.list_(pa.uint32())
    assert shard_schema(True, 32, of._replace(documents=2**32)).field("source_rows").type == pa.list_(pa.uint32())
    assert shard_schema(True, 32, of._replace(documents=2**32 + 1)).field("source_rows").type == pa.list_(pa.int64())
    assert not shard_schema(True, 32, of).equals(shard_schema(True, 32), check_metadata=True)
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


def test_an_index_build_reads_no_token_and_the_loader_checks_them(store, tmp_path):
    """An index build reads the store's offsets (and labels up to each document's first trained one),
    not its token ids: changed ids give the same build, and the loader and verify refuse the shard
    whose sha256 no longer matches when its tokens are used."""
    copy = shutil.copytree(store, tmp_path / "store")
    build(copy, tmp_path / "before", max_len=32, index_only=True)
    manifest = (copy / "store.json").read_bytes()
    _rewrite_store_tokens(copy, "documents-00000.arrow", lambda ids: ids + 1)  # same size, other sha256
    (copy / "store.json").write_bytes(manifest)
    build(copy, tmp_path / "after", max_len=32, index_only=True)
    for name in sorted(p.name for p in (tmp_path / "before").iterdir()):
        assert (tmp_path / "after" / name).read_bytes() == (tmp_path / "before" / name).read_bytes(), name
    dataset = PackedDataset(tmp_path / "after")
    with pytest.raises(FormatError, match=r"documents-00000.arrow: its sha256 is not the store manifest's"):
        [dataset[i] for i in range(len(dataset))]
    assert verify_build(tmp_path / "after")[0].file == "../store/documents-00000.arrow"


def test_an_index_build_checks_the_offsets_it_reads(store, tmp_path):
    """The offsets an index build reads are checked before use (from 0 to the tokens, never
    decreasing, labels' the same), each refusal naming the store shard, row and column; nothing is
    written."""
    path = store / "documents-00000.arrow"
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    offsets = batch.column("input_ids").offsets.to_numpy()

    def with_offsets(ids_offsets: np.ndarray, labels_offsets: np.ndarray) -> pa.RecordBatch:
        columns = [
            pa.Array.from_buffers(
                batch.schema.field(n).type,
                batch.num_rows,
                [None, pa.py_buffer(o.astype(np.int32))],
                children=[batch.column(n).values],
            )
            for n, o in (("input_ids", ids_offsets), ("labels", labels_offsets))
        ]
        return pa.RecordBatch.from_arrays(columns, schema=batch.schema)

    shrinking = offsets.copy()
    shrinking[1] = shrinking[2] + 1  # document 0 runs past document 1's end: document 1 is negative
    moved = offsets.copy()
    moved[1] += 1  # labels cut where input_ids do not
    assert len(offsets) >= 3
    cases = [(with_offsets(shrinking, shrinking), 1, "input_ids"), (with_offsets(offsets, moved), 0, "labels")]
    for edited, row, column in cases:
        copy = tmp_path / "store"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(store, copy)
        with pa.ipc.new_stream(copy / path.name, batch.schema) as writer:
            writer.write_batch(edited)
        manifest = json.loads((copy / "store.json").read_text())
        data = (copy / path.name).read_bytes()
        manifest["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        (copy / "store.json").write_text(json.dumps(manifest))
        with pytest.raises(FormatError) as caught:
            build(copy, tmp_path / "index", max_len=32, index_only=True)
        assert (caught.value.problem.row, caught.value.problem.column) == (row, column), str(caught.value)
        assert str(caught.value).startswith(f"{copy / path.name}: row {row}, column {column!r}")
        assert not (tmp_path / "index").exists()


def test_index_only_refuses_a_corpus(module_store, tmp_path):
    with pytest.raises(InputError, match="--index-only packs a document store"):
        build(module_store.parent / "corpus", tmp_path / "index", max_len=32, index_only=True)
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


def _rewrite_index_column(build_dir: Path, name: str, column: str, edit) -> None:
    """Replace one list column's values of an index shard by `edit(values)` and record the file's new
    size and sha256 in the manifest, so that only the checks of what the rows say can notice."""
    path = build_dir / name
    with pa.ipc.open_stream(path.read_bytes()) as reader:  # in memory: the file is rewritten below
        batch = reader.read_next_batch()
    array = batch.column(column)
    values = edit(array.values.to_numpy().copy())
    edited = pa.ListArray.from_arrays(array.offsets, pa.array(values))
    columns = [edited if n == column else batch.column(n) for n in batch.schema.names]
    with pa.ipc.new_stream(path, batch.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=batch.schema))
    record_shard(build_dir / "manifest.json", path)


def _at_first(values: np.ndarray, value: int) -> np.ndarray:
    """`values` with its first element replaced by `value`."""
    return np.concatenate([np.array([value], dtype=values.dtype), values[1:]])


def _rewrite_store_tokens(store: Path, name: str, edit) -> None:
    """Replace a store shard's token ids by `edit(ids)`, recording its new size and sha256 in store.json:
    a store changed consistently, which only its fingerprint (or the source) can tell."""
    path = store / name
    with pa.ipc.open_stream(path.read_bytes()) as reader:
        batch = reader.read_next_batch()
    ids = batch.column("input_ids")
    changed = pa.ListArray.from_arrays(ids.offsets, pa.array(edit(ids.values.to_numpy().copy())))
    with pa.ipc.new_stream(path, batch.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays([changed, *batch.columns[1:]], schema=batch.schema))
    record_shard(store / "store.json", path)


def test_a_piece_past_its_document_is_refused(store, tmp_path):
    """A (row, piece) whose tokens are not all in the store's document: refused by name as the pack is
    gathered, never served short, and named by verify, with a source or without."""
    build(store, tmp_path / "index", max_len=32, index_only=True, overflow="split")
    # The first document's piece 5: 5 * 32 tokens into a document of at most 40.
    _rewrite_index_column(tmp_path / "index", "shard-00000.arrow", "source_pieces", lambda v: _at_first(v, v[0] + 5))
    dataset = PackedDataset(tmp_path / "index")
    with pytest.raises(FormatError, match=r"shard-00000.arrow: row 0, column 'source_pieces': document 1 .* runs past"):
        dataset[0]
    for source in (None, store.parent / "corpus"):
        problems = verify_build(tmp_path / "index", source, all_problems=True)
        past = [p for p in problems if "runs past" in p.message]
        assert [(p.file, p.row, p.column) for p in past] == [("shard-00000.arrow", 0, "source_pieces")]
        assert any(p.column == "source_pieces" and "without gaps" in p.message for p in problems)


def test_verify_an_index_build_against_its_source(store, tmp_path):
    """A sound index build passes verify with its corpus or its store as the source, every token
    compared, whatever the overflow; so does a full build with the store as its source."""
    for overflow, drop_untrained in (("split", False), ("truncate", False), ("drop", True)):
        out = tmp_path / overflow
        build(store, out, max_len=16, overflow=overflow, drop_untrained=drop_untrained, index_only=True, shard_size=256)
        for source in (None, store.parent / "corpus", store):
            assert verify_build(out, source, all_problems=True) == [], (overflow, source)
    build(store, tmp_path / "full", max_len=16)
    assert verify_build(tmp_path / "full", store, all_problems=True) == []
    with pytest.raises(InputError, match="tokenized already"):
        verify_build(tmp_path / "full", store, tokenizer=tmp_path)


def test_verify_reads_an_index_builds_store_in_full(store, tmp_path):
    """A changed store shard is named at its path from the build, whether its bytes changed under its
    sha256 or it was rewritten with a new one (then the fingerprint tells, and the source the token)."""
    copy = shutil.copytree(store, tmp_path / "store")
    build(copy, tmp_path / "index", max_len=32, index_only=True)
    shard = copy / "documents-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[-40] ^= 1
    shard.write_bytes(bytes(data))
    problems = verify_build(tmp_path / "index", all_problems=True)
    assert (problems[0].file, problems[0].row) == ("../store/documents-00001.arrow", None)
    assert "sha256" in problems[0].message and "not checked against the store's documents" in problems[1].message

    shutil.rmtree(copy)
    shutil.copytree(store, copy)
    _rewrite_store_tokens(copy, "documents-00001.arrow", lambda ids: np.where(np.arange(len(ids)) == 3, ids + 1, ids))
    [problem] = verify_build(tmp_path / "index", all_problems=True)
    assert (problem.file, problem.column) == ("../store/store.json", "fingerprint") and "changed" in problem.message
    with_source = verify_build(tmp_path / "index", store.parent / "corpus", all_problems=True)
    token = [p for p in with_source if p.column == "input_ids"]
    assert len(token) == 1 and token[0].file.startswith("shard-") and "the source has" in token[0].message


def test_verify_holds_an_index_build_to_its_store_documents(store, tmp_path):
    """Without a source, an index build's packs are checked against the store's documents: a pack's
    first document swapped for a longer one (inside the store, so the gather would not notice) is
    named at its row, and so are the document left unpacked and the one now packed twice."""
    build(store, tmp_path / "index", max_len=64, index_only=True)
    paths = sorted(store.glob("documents-*.arrow"))
    shards = [pa.ipc.open_stream(path.read_bytes()).read_next_batch() for path in paths]
    lengths = [n for shard in shards for n in np.diff(shard.column("input_ids").offsets.to_numpy()).tolist()]
    first = pa.ipc.open_stream((tmp_path / "index" / "shard-00000.arrow").read_bytes()).read_all().to_pylist()[0]
    original = first["source_rows"][0]
    longer = next(d for d in range(120) if lengths[d] > lengths[original] and d not in first["source_rows"])
    _rewrite_index_column(tmp_path / "index", "shard-00000.arrow", "source_rows", lambda v: _at_first(v, longer))
    problems = verify_build(tmp_path / "index", all_problems=True)
    assert any(
        (p.file, p.row, p.column) == ("shard-00000.arrow", 0, "cu_seqlens")
        and f"the source gives {lengths[longer]}" in p.message
        for p in problems
    ), problems
    file, row = ("a.parquet", original) if original < 70 else ("b.parquet", original - 70)
    assert any((p.source_file, p.source_row) == (file, row) and "in no pack" in p.message for p in problems)
    assert any(p.column == "source_rows" and f"corpus row {longer}, piece 0 is also in" in p.message for p in problems)


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
    result = run_prepack("build", store, "--max-len", "32", "--out", tmp_path / "index", "--index-only", "--quiet")
    assert result.returncode == 0, result.stderr
    assert read_manifest(tmp_path / "index").store is not None
    result = run_prepack("build", store.parent / "corpus", "--max-len", "32", "--out", tmp_path / "x", "--index-only")
    assert "--index-only packs a document store" in failure(result)


@pytest.mark.slow
def test_the_cli_verifies_and_inspects_an_index_build(store, tmp_path):
    """`prepack verify` exits 0 on a sound index build (with or without --source), 1 with the problem
    of a changed store shard, 2 for a source it cannot take; `prepack inspect` reports on it."""
    copy = shutil.copytree(store, tmp_path / "store")
    index = tmp_path / "index"
    build(copy, index, max_len=32, index_only=True)

    for extra in ([], ["--source", str(store.parent / "corpus")], ["--source", str(copy)]):
        result = invoke_prepack("verify", str(index), *extra)
        assert result.returncode == 0 and "no problems" in result.stdout, result.stdout + result.stderr
    result = invoke_prepack("inspect", str(index), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["packs"] == read_manifest(index).totals.packs
    result = invoke_prepack("verify", str(index), "--source", str(copy), "--tokenizer", str(tmp_path))
    assert result.returncode == 2 and "tokenized already" in result.stderr and "Traceback" not in result.stderr
    data = bytearray((copy / "documents-00000.arrow").read_bytes())
    data[-40] ^= 1
    (copy / "documents-00000.arrow").write_bytes(bytes(data))
    result = invoke_prepack("verify", str(index))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"problem: {verify_build(index)[0]}"]
    assert result.stdout.startswith("problem: ../store/documents-00000.arrow: its sha256")


def test_an_index_dataset_pickles_for_workers(store, tmp_path):
    """DataLoader workers get a pickled dataset: paths, no memory map; they reopen the store themselves."""
    import pickle

    build(store, tmp_path / "index", max_len=32, index_only=True)
    dataset = PackedDataset(tmp_path / "index")
    first = dataset[0]  # maps an index shard and a store shard
    again = pickle.loads(pickle.dumps(dataset))
    assert again._open == {} and again._gather.tokens is None
    assert all(np.array_equal(again[0][name], first[name]) for name in first)
