"""`prepack verify STORE`: a document store checked on its own, without a build of it. A sound store (fresh or
grown by appends) passes; each kind of damage to its shards or to what store.json claims of them is named by
file (relative to the store) and column; a build's options are refused with a store."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack import build_store, verify_store
from prepack.errors import FormatError
from prepack.formats.store import read_store_manifest
from tests.cli import failure, invoke_prepack
from tests.corpus import corpus_table, edit_json, record_shard, write_corpus


def _batch(root: Path, name: str, seed: int, count: int) -> Path:
    """A corpus of `count` documents of 1-59 tokens, one Parquet file `name`.parquet in a directory of its own."""
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 500, size=int(rng.integers(1, 60))).tolist() for _ in range(count)]
    (root / f"batch-{name}").mkdir()
    write_corpus(root / f"batch-{name}" / f"{name}.parquet", corpus_table(documents, [[-100, *d[1:]] for d in documents]))
    return root / f"batch-{name}"


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """A store as tokenized ("fresh") and one grown by two appends ("grown"), each of several shards."""
    root = tmp_path_factory.mktemp("stores")
    build_store(_batch(root, "a", 0, 40), root / "fresh", shard_size=1_000)
    build_store(_batch(root, "b", 0, 40), root / "grown", shard_size=1_000)
    for name, seed in (("c", 1), ("d", 2)):
        build_store(_batch(root, name, seed, 12), root / "grown", shard_size=1_000, append=True)
    return {"fresh": root / "fresh", "grown": root / "grown"}


@pytest.fixture
def grown(stores, tmp_path) -> Path:
    """A copy of the grown store, to damage."""
    return shutil.copytree(stores["grown"], tmp_path / "store")


def test_a_fresh_store_verifies_and_the_command_says_what_it_checked(stores):
    store = stores["fresh"]
    m = read_store_manifest(store)
    assert m.generations is None and len(m.shards) > 1
    assert verify_store(store) == []
    result = invoke_prepack("verify", store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"{store}: no problems (store.json and {len(m.shards)} shards checked: {m.documents:,} documents, "
        f"{m.tokens:,} tokens, 1 generation)."
    ]


def test_the_command_summarises_the_store_json_it_checked_not_one_appended_meanwhile(grown, monkeypatch, tmp_path):
    """store.json is read once: a store appended to while it is checked (here, once its shards are) is described as
    it was checked, not as the append left it."""
    import prepack.check.verify as verify

    checked = read_store_manifest(grown)
    check = verify._standalone_store_problems

    def appended_meanwhile(store):
        yield from check(store)
        build_store(_batch(tmp_path, "e", 3, 12), grown, shard_size=1_000, append=True)

    monkeypatch.setattr(verify, "_standalone_store_problems", appended_meanwhile)
    result = invoke_prepack("verify", grown)
    assert read_store_manifest(grown).documents > checked.documents
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"{grown}: no problems (store.json and {len(checked.shards)} shards checked: {checked.documents:,} documents, "
        f"{checked.tokens:,} tokens, 3 generations)."
    ]


def test_a_store_grown_by_two_appends_verifies(stores):
    m = read_store_manifest(stores["grown"])
    assert len(m.generations) == 3 and m.length_counts is not None
    assert verify_store(stores["grown"], all_problems=True) == []


def test_a_flipped_byte_in_a_shard_is_named_by_its_sha256(grown):
    shard = grown / "documents-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[-40] ^= 1
    shard.write_bytes(bytes(data))
    problems = verify_store(grown, all_problems=True)
    assert [(p.file, p.column) for p in problems] == [("documents-00001.arrow", None), (None, None)]
    assert "sha256" in problems[0].message and "not checked" in problems[1].message
    result = invoke_prepack("verify", grown, "--all")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"problem: {problem}" for problem in problems]


def test_a_changed_token_with_its_sha256_recorded_again_is_named_by_the_fingerprint(grown):
    shard = grown / "documents-00000.arrow"
    with pa.ipc.open_stream(shard.read_bytes()) as reader:
        batch = reader.read_next_batch()
    ids = batch.column("input_ids")
    values = ids.values.to_numpy().copy()
    values[3] += 1
    changed = pa.ListArray.from_arrays(ids.offsets, pa.array(values, pa.int32()))
    with pa.ipc.new_stream(shard, batch.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays([changed, *batch.columns[1:]], schema=batch.schema))
    record_shard(grown / "store.json", shard)
    [problem] = verify_store(grown, all_problems=True)
    assert (problem.file, problem.column) == ("store.json", "fingerprint") and "changed" in problem.message


def test_forged_length_counts_with_consistent_totals_are_named(grown):
    m = read_store_manifest(grown)
    # Every document of 1 token but one: they add up to the store's documents and tokens, which its model checks.
    edit_json(grown / "store.json", lambda raw: raw.update(length_counts=[[1, m.documents - 1], [m.tokens - m.documents + 1, 1]]))
    read_store_manifest(grown)
    assert [(p.file, p.column) for p in verify_store(grown, all_problems=True)] == [("store.json", "length_counts")]


def test_a_forged_generation_fingerprint_is_named(grown):
    edit_json(grown / "store.json", lambda raw: raw["generations"][0].update(fingerprint="ab" * 32))
    [problem] = verify_store(grown, all_problems=True)
    assert (problem.file, problem.column) == ("store.json", "generations[0].fingerprint")
    assert "ab" * 32 in problem.message


def test_an_unlisted_arrow_file_is_named(grown):
    shutil.copy(grown / "documents-00000.arrow", grown / f"documents-{len(read_store_manifest(grown).shards):05d}.arrow")
    shutil.copy(grown / "documents-00000.arrow", grown / "stray.arrow")
    problems = verify_store(grown, all_problems=True)
    assert sorted(p.file for p in problems) == [f"documents-{len(read_store_manifest(grown).shards):05d}.arrow", "stray.arrow"]
    assert all("does not list" in p.message for p in problems)


def test_a_missing_shard_is_named(grown):
    (grown / "documents-00002.arrow").unlink()
    problems = verify_store(grown, all_problems=True)
    assert [(p.file, p.column) for p in problems] == [("documents-00002.arrow", None), (None, None)]
    assert "missing" in problems[0].message
    assert verify_store(grown) == problems[:1]


def test_an_invalid_store_json_is_a_problem_naming_its_field(grown):
    edit_json(grown / "store.json", lambda raw: raw["shards"][1].update(sha256="not a digest"))
    [problem] = verify_store(grown, all_problems=True)
    assert (problem.file, problem.column) == ("store.json", "shards[1].sha256")
    assert "not a valid prepack store manifest" in problem.message


@pytest.mark.parametrize("option", [["--source", "corpus"], ["--images", "images"], ["--reference", "ref"],
                                    ["--export", "out"], ["--store", "other"], ["--tokenizer", "tok"], ["--decode"],
                                    ["--chat-template", "t"], ["--cache-dir", "c"]])
def test_a_build_only_option_with_a_store_is_refused_by_name(stores, option):
    result = invoke_prepack("verify", stores["fresh"], *option)
    assert result.returncode == 2
    assert option[0] in failure(result) and "document store" in failure(result)


@pytest.mark.slow  # the S3 server, a store uploaded and downloaded twice
def test_a_store_in_object_storage_verifies_and_its_problems_name_its_objects(tmp_path, s3_bucket):
    """A store at a URI (the moto server of tests/conftest.py) is checked as a local one, its objects copied
    locally; its problems carry its URI: a shard changed in place, an object a killed append left unlisted."""
    s3fs = pytest.importorskip("s3fs")
    uri = f"{s3_bucket}/store"
    build_store(_batch(tmp_path, "a", 0, 30), uri, shard_size=1_000)
    result = invoke_prepack("verify", uri)
    assert result.returncode == 0 and result.stdout.startswith(f"{uri}: no problems (store.json and "), result.stdout + result.stderr
    fs = s3fs.S3FileSystem()
    key = f"{uri.removeprefix('s3://')}/documents-00001.arrow"
    data = bytearray(fs.cat_file(key))
    data[-40] ^= 1
    fs.pipe_file(key, bytes(data))
    fs.pipe_file(f"{uri.removeprefix('s3://')}/documents-00099.arrow", bytes(data))
    problems = verify_store(uri, all_problems=True)
    assert [(p.file, p.location) for p in problems[:2]] == [("documents-00099.arrow", uri), ("documents-00001.arrow", uri)]
    assert str(problems[1]).startswith(f"{uri}/documents-00001.arrow: its sha256")


def test_a_prefix_in_object_storage_is_refused_as_no_store_before_any_object_is_copied(s3_bucket, monkeypatch):
    """Its store.json is read first: a prefix without one, empty or not, is no store (FormatError), and an invalid one
    is its one problem, named by the store's URI, with nothing downloaded (`local_input` copies a store's objects)."""
    s3fs = pytest.importorskip("s3fs")

    def copies(spec):
        raise AssertionError(f"{spec} was copied")

    monkeypatch.setattr("prepack.check.verify.local_input", copies)
    fs, bucket = s3fs.S3FileSystem(), s3_bucket.removeprefix("s3://")
    with pytest.raises(FormatError, match=f"{s3_bucket}/empty/store.json does not exist: .* not a finished prepack document store"):
        verify_store(f"{s3_bucket}/empty")
    fs.pipe_file(f"{bucket}/half/documents-00000.arrow", b"a shard a killed store left")  # no store.json
    with pytest.raises(FormatError, match=f"{s3_bucket}/half/store.json does not exist: .* not a finished prepack document store"):
        verify_store(f"{s3_bucket}/half")
    fs.pipe_file(f"{bucket}/half/store.json", b"{}")
    [problem] = verify_store(f"{s3_bucket}/half", all_problems=True)
    assert (problem.file, problem.column, problem.location) == ("store.json", "store_version", f"{s3_bucket}/half")
