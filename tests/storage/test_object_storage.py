"""Object storage, against a real S3-compatible server: moto's server mode on loopback, started by the
session fixture `s3_server` (tests/conftest.py), reached over HTTP by s3fs and boto3 through
`AWS_ENDPOINT_URL` and credentials in the environment. Nothing of prepack's is mocked.

A build, a store and an index build from and to s3:// equal their local twins byte for byte; bad input
fails with the local message naming the object and leaves nothing behind; the loader reads a build
through a checked cache that several processes share."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepack
from prepack import PackedDataset, build, build_store
from prepack.errors import FormatError, InputError, OutputError
from prepack.check.report import inspect_build
from prepack.check.verify import verify_build
from tests.cli import failure, invoke_prepack, run_prepack
from tests.corpus import corpus_table, write_corpus
from tests.demo_inputs import chitchat, gpt2_directory

s3fs = pytest.importorskip("s3fs")


def _documents(seed: int, count: int, longest: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 96, size=rng.integers(1, longest)).tolist() for _ in range(count)]


def _token_corpus(directory: Path) -> Path:
    """Three files in two formats and a subdirectory, with labels."""
    directory.mkdir()
    (directory / "more").mkdir()
    for seed, name in enumerate(["part-0.parquet", "part-1.jsonl", "more/part-2.parquet"]):
        ids = _documents(seed, 150)
        write_corpus(directory / name, corpus_table(ids, [[-100, *d[1:]] for d in ids]))
    return directory


def _files(fs, uri: str) -> dict[str, bytes]:
    """Every object under `uri`, by name relative to it."""
    fs.invalidate_cache()
    prefix = uri.removeprefix("s3://").rstrip("/")
    return {os.path.relpath(key, prefix): fs.cat_file(key) for key in fs.find(prefix)}


def _local_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def fs(s3_server):
    return s3fs.S3FileSystem()


def _upload(fs, local: Path, uri: str) -> str:
    for path, data in _local_files(local).items():
        fs.pipe_file(f"{uri.removeprefix('s3://')}/{path}", data)
    return uri


@pytest.mark.slow
def test_a_build_from_and_to_s3_is_byte_identical_to_a_local_build(tmp_path, fs, s3_bucket):
    corpus = _token_corpus(tmp_path / "corpus")
    remote = _upload(fs, corpus, f"{s3_bucket}/corpus")
    options = dict(max_len=512, shard_size=20_000, seed=3)
    local = build(corpus, tmp_path / "packed", **options)
    published = build(f"{remote}/", f"{s3_bucket}/packed", **options)
    assert published == local
    assert len(local.shards) > 3 and [f.path for f in local.inputs] == ["more/part-2.parquet", "part-0.parquet", "part-1.jsonl"]
    assert _files(fs, f"{s3_bucket}/packed") == _local_files(tmp_path / "packed")
    # Either side alone in object storage gives the same bytes too.
    build(remote, tmp_path / "from-s3", **options)
    build(corpus, f"{s3_bucket}/to-s3", **options)
    assert _local_files(tmp_path / "from-s3") == _local_files(tmp_path / "packed")
    assert _files(fs, f"{s3_bucket}/to-s3") == _local_files(tmp_path / "packed")


def test_a_single_object_and_a_glob_name_their_inputs_as_locally(tmp_path, fs, s3_bucket):
    corpus = _upload(fs, _token_corpus(tmp_path / "corpus"), f"{s3_bucket}/corpus")
    one = build(f"{corpus}/part-0.parquet", f"{s3_bucket}/one", max_len=512)
    assert [f.path for f in one.inputs] == ["part-0.parquet"]
    some = build(f"{corpus}/*.parquet", f"{s3_bucket}/some", max_len=512)
    assert some == build(tmp_path / "corpus" / "*.parquet", tmp_path / "some", max_len=512)
    with pytest.raises(InputError, match="no such object or prefix"):
        build(f"{s3_bucket}/nothing/", f"{s3_bucket}/x", max_len=512)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return gpt2_directory(tmp_path_factory.mktemp("tok") / "gpt2")


def test_a_text_corpus_tokenized_from_s3_is_byte_identical(tmp_path, fs, s3_bucket, gpt2):
    conversations = chitchat()[:300]
    (tmp_path / "text").mkdir()
    for part, rows in enumerate((conversations[:200], conversations[200:])):
        pq.write_table(pa.table({"text": ["\n".join(t) for t in rows]}), tmp_path / "text" / f"{part}.parquet")
    remote = _upload(fs, tmp_path / "text", f"{s3_bucket}/text")
    options = dict(tokenizer=gpt2, max_len=1024, num_proc=1)
    build(tmp_path / "text", tmp_path / "packed", **options)
    build(remote, f"{s3_bucket}/packed", **options)
    assert _files(fs, f"{s3_bucket}/packed") == _local_files(tmp_path / "packed")


def test_a_store_and_an_index_build_in_s3_equal_local_ones(tmp_path, fs, s3_bucket):
    corpus = _token_corpus(tmp_path / "corpus")
    remote = _upload(fs, corpus, f"{s3_bucket}/corpus")
    build_store(corpus, tmp_path / "store", shard_size=30_000)
    build_store(remote, f"{s3_bucket}/store", shard_size=30_000)
    assert _files(fs, f"{s3_bucket}/store") == _local_files(tmp_path / "store")
    for out, extra in (("packed", {}), ("index", {"index_only": True})):
        build(tmp_path / "store", tmp_path / out, max_len=512, **extra)
        build(f"{s3_bucket}/store", f"{s3_bucket}/{out}", max_len=512, **extra)
        assert _files(fs, f"{s3_bucket}/{out}") == _local_files(tmp_path / out), out
    assert prepack.read_manifest(tmp_path / "index").store.path == "../store"
    # The store's build names the corpus files, as a build of the corpus does.
    assert _files(fs, f"{s3_bucket}/packed")["manifest.json"] == _local_files(build_to(tmp_path, corpus))["manifest.json"]
    with pytest.raises(InputError, match="both be local or both in object storage"):
        build(f"{s3_bucket}/store", tmp_path / "index-2", max_len=512, index_only=True)


def test_the_loader_reads_an_index_build_in_s3_and_its_store_through_the_cache(tmp_path, fs, s3_bucket, s3_server):
    corpus = _token_corpus(tmp_path / "corpus")
    build(corpus, tmp_path / "packed", max_len=512)
    build_store(corpus, f"{s3_bucket}/data/store", shard_size=30_000)
    build(f"{s3_bucket}/data/store", f"{s3_bucket}/index", max_len=512, index_only=True)
    store_gets = f"/{s3_bucket.removeprefix('s3://')}/data/store/documents-"
    before = len(s3_server.requests("GET", store_gets))  # the index build read every store shard once
    dataset = PackedDataset(f"{s3_bucket}/index", cache_dir=tmp_path / "cache")
    assert dataset.manifest.store.path == "../data/store"
    _same_rows(PackedDataset(tmp_path / "packed"), dataset)
    store_shards = dataset.store.manifest.shards
    assert len(store_shards) > 1
    cached = {p.name for p in (tmp_path / "cache").glob("*.arrow")}
    assert {f"{s.sha256}.arrow" for s in store_shards} <= cached
    assert before == len(store_shards)
    assert len(s3_server.requests("GET", store_gets)) == 2 * len(store_shards)  # each once, though many packs gather from each
    # A store that changed since the index was planned is refused.
    build_store(corpus / "part-0.parquet", f"{s3_bucket}/data/store", overwrite=True)
    with pytest.raises(FormatError, match="the store changed; build the index again"):
        PackedDataset(f"{s3_bucket}/index", cache_dir=tmp_path / "cache")


def build_to(tmp_path: Path, corpus: Path) -> Path:
    build(corpus, tmp_path / "direct", max_len=512)
    return tmp_path / "direct"


def test_bad_input_names_the_object_row_and_column_and_leaves_nothing(tmp_path, fs, s3_bucket):
    corpus = _token_corpus(tmp_path / "corpus")
    rows = [{"input_ids": [5, 6], "labels": [-100, 6]}] * 7 + [{"input_ids": [5, -3], "labels": [-100, 6]}]
    write_corpus(corpus / "part-1.jsonl", pa.Table.from_pylist(rows))
    remote = _upload(fs, corpus, f"{s3_bucket}/corpus")
    with pytest.raises(InputError) as locally:
        build(corpus, tmp_path / "packed", max_len=512)
    with pytest.raises(InputError) as remotely:
        build(remote, f"{s3_bucket}/packed", max_len=512)
    assert str(remotely.value) == f"{remote}/part-1.jsonl, row 7, column 'input_ids': token id -3 is out of range; ids must lie in [0, 2147483647]."
    assert str(locally.value) == str(remotely.value).replace(remote, str(corpus))
    assert _files(fs, f"{s3_bucket}/packed") == {}
    assert not (tmp_path / "packed").exists()


@pytest.mark.slow
def test_an_existing_build_is_replaced_only_with_overwrite_and_only_if_it_is_one(tmp_path, fs, s3_bucket):
    corpus = _upload(fs, _token_corpus(tmp_path / "corpus"), f"{s3_bucket}/corpus")
    out = f"{s3_bucket}/packed"
    first = build(corpus, out, max_len=512, shard_size=20_000)
    before = _files(fs, out)
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        build(corpus, out, max_len=256)
    assert _files(fs, out) == before
    second = build(corpus, out, max_len=2048, overwrite=True)  # fewer shards: the rest of the old are deleted
    assert len(second.shards) < len(first.shards)
    assert sorted(_files(fs, out)) == sorted(["manifest.json", *(s.name for s in second.shards)])
    assert PackedDataset(out, cache_dir=tmp_path / "cache").manifest == second
    # A prefix holding anything else is not prepack's to replace, with or without --overwrite.
    fs.pipe_file(f"{out.removeprefix('s3://')}/notes.txt", b"mine")
    with pytest.raises(OutputError, match="notes.txt, which prepack did not write"):
        build(corpus, out, max_len=512, overwrite=True)
    fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/other/data.bin", b"mine")
    with pytest.raises(OutputError, match="holds 1 objects and no manifest.json"):
        build(corpus, f"{s3_bucket}/other", max_len=512, overwrite=True)
    assert _files(fs, f"{s3_bucket}/other") == {"data.bin": b"mine"}
    assert _files(fs, out)["notes.txt"] == b"mine"


def test_a_build_that_cannot_be_uploaded_fails_cleanly(tmp_path, s3_server):
    corpus = _token_corpus(tmp_path / "corpus")
    with pytest.raises(OutputError, match="^cannot write s3://prepack-no-such-bucket/.packed.prepack-staging: .*bucket does not exist"):
        build(corpus, "s3://prepack-no-such-bucket/packed", max_len=512)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_a_prefix_without_a_manifest_is_no_build(tmp_path, fs, s3_bucket):
    corpus = _upload(fs, _token_corpus(tmp_path / "corpus"), f"{s3_bucket}/corpus")
    build(corpus, f"{s3_bucket}/packed", max_len=512)
    fs.rm_file(f"{s3_bucket.removeprefix('s3://')}/packed/manifest.json")
    with pytest.raises(FormatError, match="is not a finished prepack build"):
        PackedDataset(f"{s3_bucket}/packed", cache_dir=tmp_path / "cache")
    fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/packed/manifest.json", b'{"format_version": 2}')
    with pytest.raises(FormatError, match=f"^{s3_bucket}/packed/manifest.json: is not a valid prepack manifest"):
        PackedDataset(f"{s3_bucket}/packed", cache_dir=tmp_path / "cache")
    with pytest.raises(InputError, match="pass cache_dir="):
        PackedDataset(f"{s3_bucket}/packed")


@pytest.fixture
def remote_build(tmp_path, fs, s3_bucket) -> tuple[Path, str]:
    """A local build and its twin in the bucket."""
    corpus = _token_corpus(tmp_path / "corpus")
    build(corpus, tmp_path / "packed", max_len=512, shard_size=20_000)
    build(corpus, f"{s3_bucket}/packed", max_len=512, shard_size=20_000)
    return tmp_path / "packed", f"{s3_bucket}/packed"


@pytest.mark.parametrize("cache_dir", ["", " \t"])
def test_an_empty_cache_dir_is_refused_not_taken_for_the_current_directory(remote_build, tmp_path, monkeypatch, cache_dir):
    """Path("") is the current directory: an empty `--cache-dir ""` (a variable left unset) would fill it."""
    from prepack import open_hf_dataset

    _, uri = remote_build
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for read in (PackedDataset, open_hf_dataset, verify_build, inspect_build):
        with pytest.raises(InputError, match=f"^cache_dir {re.escape(repr(cache_dir))} is empty"):
            read(uri, cache_dir=cache_dir)
    for command in ("verify", "inspect"):
        assert f"cache_dir {cache_dir!r} is empty" in failure(invoke_prepack(command, uri, "--cache-dir", cache_dir, cwd=work))
    assert list(work.iterdir()) == []


def _same_rows(a: PackedDataset, b: PackedDataset) -> None:
    assert len(a) == len(b) > 0
    for index in range(len(a)):
        x, y = a[index], b[index]
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), index


def test_the_loader_reads_a_build_in_s3_through_its_cache(remote_build, tmp_path, s3_server):
    local, uri = remote_build
    cache = tmp_path / "cache"
    dataset = PackedDataset(uri, cache_dir=cache)
    _same_rows(PackedDataset(local), dataset)
    shards = dataset.manifest.shards
    assert sorted(p.name for p in cache.glob("*.arrow")) == sorted(f"{s.sha256}.arrow" for s in shards)
    gets = s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/shard-")
    assert sorted(gets) == sorted(f"/{uri.removeprefix('s3://')}/{s.name}" for s in shards)
    # A warm cache downloads nothing.
    PackedDataset(uri, cache_dir=cache).check_all()
    assert len(s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/shard-")) == len(gets)


def test_a_corrupt_cached_copy_is_downloaded_again(remote_build, tmp_path, s3_server):
    local, uri = remote_build
    cache = tmp_path / "cache"
    PackedDataset(uri, cache_dir=cache).check_all()
    first = PackedDataset(local).manifest.shards[0]
    cached = cache / f"{first.sha256}.arrow"
    data = bytearray(cached.read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes
    cached.write_bytes(bytes(data))
    _same_rows(PackedDataset(local), PackedDataset(uri, cache_dir=cache))
    assert cached.read_bytes() == (local / first.name).read_bytes()
    assert len(s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/{first.name}")) == 2


def test_a_corrupt_shard_in_s3_is_refused_by_its_sha256(remote_build, tmp_path, fs):
    local, uri = remote_build
    name = PackedDataset(local).manifest.shards[1].name
    data = bytearray((local / name).read_bytes())
    data[-100] ^= 0xFF
    fs.pipe_file(f"{uri.removeprefix('s3://')}/{name}", bytes(data))
    dataset = PackedDataset(uri, cache_dir=tmp_path / "cache")
    with pytest.raises(FormatError, match=f"^{uri}/{name}: sha256 [0-9a-f]{{64}} does not match the manifest's"):
        dataset.check_all()
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.arrow")) == [
        f"{PackedDataset(local).manifest.shards[0].sha256}.arrow"  # the bad copy was not kept
    ]


_READ_ALL = """
import sys
from prepack import PackedDataset
dataset = PackedDataset(sys.argv[1], cache_dir=sys.argv[2])
print(sum(int(dataset[i]["input_ids"].sum()) for i in range(len(dataset))))
"""


@pytest.mark.slow
def test_processes_sharing_a_cache_download_each_shard_once(remote_build, tmp_path, s3_server):
    local, uri = remote_build
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    readers = [
        subprocess.Popen([sys.executable, "-c", _READ_ALL, uri, str(cache)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    totals = [int(reader.communicate(timeout=300)[0]) for reader in readers]
    assert all(reader.returncode == 0 for reader in readers)
    expected = sum(int(row["input_ids"].sum()) for row in PackedDataset(local))
    assert totals == [expected] * 2
    shards = PackedDataset(local).manifest.shards
    gets = s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/shard-")
    assert sorted(gets) == sorted(f"/{uri.removeprefix('s3://')}/{s.name}" for s in shards)


@pytest.mark.slow
def test_a_training_step_from_s3_equals_one_from_the_local_build(remote_build, tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from prepack import PackedCollator, enable_packing
    from tests.tiny_models import tiny_model

    local, uri = remote_build
    losses = []
    for source in (PackedDataset(local), PackedDataset(uri, cache_dir=tmp_path / "cache")):
        torch.manual_seed(0)
        model = enable_packing(tiny_model("llama", "sdpa", torch.float32))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = next(iter(DataLoader(source, batch_size=4, collate_fn=PackedCollator.for_dataset(source))))
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append((loss.item(), next(model.parameters()).detach().clone()))
    assert np.isfinite(losses[0][0]) and losses[0][0] == losses[1][0]
    assert torch.equal(losses[0][1], losses[1][1])


@pytest.mark.slow
def test_the_cli_builds_from_and_to_s3(tmp_path, fs, s3_bucket):
    corpus = _upload(fs, _token_corpus(tmp_path / "corpus"), f"{s3_bucket}/corpus")
    result = run_prepack("build", f"{corpus}/", "--max-len", "512", "--out", f"{s3_bucket}/packed", "--quiet")
    assert result.returncode == 0, result.stderr
    assert _files(fs, f"{s3_bucket}/packed") == _local_files(build_to(tmp_path, tmp_path / "corpus"))
    fs.pipe_file(f"{corpus.removeprefix('s3://')}/part-3.jsonl", b'{"input_ids": [1, 2], "labels": [1, 2]}\n{"input_ids": "x", "labels": [1]}\n')
    result = run_prepack("build", corpus, "--max-len", "512", "--out", f"{s3_bucket}/bad")
    assert result.returncode == 2
    assert f"{corpus}/part-3.jsonl, row 1, column 'input_ids'" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert _files(fs, f"{s3_bucket}/bad") == {}


@pytest.mark.slow
def test_the_cli_tokenizes_a_text_corpus_from_s3_into_s3(tmp_path, fs, s3_bucket, gpt2):
    (tmp_path / "text").mkdir()
    pq.write_table(pa.table({"text": ["\n".join(t) for t in chitchat()[:200]]}), tmp_path / "text" / "0.parquet")
    corpus = _upload(fs, tmp_path / "text", f"{s3_bucket}/corpus")
    arguments = ["--tokenizer", str(gpt2), "--max-len", "8192", "--num-proc", "1"]
    result = invoke_prepack("build", f"{corpus}/", *arguments, "--out", f"{s3_bucket}/packed")
    assert result.returncode == 0, result.stderr
    assert f"packed into {s3_bucket}/packed" in result.stdout
    assert invoke_prepack("build", str(tmp_path / "text"), *arguments, "--out", str(tmp_path / "packed"), "-q").returncode == 0
    assert _files(fs, f"{s3_bucket}/packed") == _local_files(tmp_path / "packed")


@pytest.mark.slow
def test_a_missing_client_asks_for_the_extra(tmp_path):
    program = (
        "import sys; sys.modules['s3fs'] = None\n"  # as if prepack-llm[s3] were not installed
        "from prepack import build\n"
        "from prepack.errors import MissingExtraError\n"
        "try:\n    build('s3://bucket/corpus/', 'out', max_len=8)\n"
        "except MissingExtraError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.stdout.startswith("s3://bucket/corpus/ needs s3fs, which is not installed: pip install 'prepack-llm[s3]'")


# --- verify, inspect and open_hf_dataset of a build in object storage --------------------------------
# They read its shards through a ShardCache (--cache-dir, or a temporary one), check them as a local
# build's, and name every problem by the object's URI, never by its cached copy.


def _inspect_json(build: str) -> dict:
    result = invoke_prepack("inspect", build, "--json", "--world-size", "2")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_verify_and_inspect_a_build_in_s3_as_the_local_build(remote_build, tmp_path, fs, s3_bucket, s3_server):
    local, uri = remote_build
    corpus = _upload(fs, tmp_path / "corpus", f"{s3_bucket}/corpus")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for source, checked in (([], "shards and manifest"), (["--source", corpus], "shards, manifest and every token of the source")):
        result = run_prepack("verify", uri, *source, env={"TMPDIR": str(scratch)})  # to see what it leaves there
        assert (result.returncode, result.stdout) == (0, f"{uri}: no problems ({checked} checked).\n"), result.stderr
    assert list(scratch.iterdir()) == []  # the temporary cache and the copy of the source are gone
    remote, here = _inspect_json(uri), _inspect_json(str(local))
    assert (remote.pop("path"), here.pop("path")) == (uri, str(local))
    assert remote == here and remote["shards"] > 3
    # With --cache-dir the shards stay, checked, for the next command (or a PackedDataset).
    cache = tmp_path / "cache"
    assert invoke_prepack("verify", uri, "--cache-dir", str(cache)).returncode == 0
    shards = prepack.read_manifest(local).shards
    assert sorted(p.name for p in cache.glob("*.arrow")) == sorted(f"{s.sha256}.arrow" for s in shards)
    gets = len(s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/shard-"))
    assert inspect_build(uri, cache_dir=cache).model_dump() == {**inspect_build(local).model_dump(), "path": uri}
    assert len(s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/shard-")) == gets  # all from the cache
    # verify checks what is in object storage now: every shard is read again, whatever the cache holds.
    assert verify_build(uri, corpus, cache_dir=cache, all_problems=True) == []
    assert len(s3_server.requests("GET", f"/{uri.removeprefix('s3://')}/shard-")) == gets + len(shards)


@pytest.mark.slow
def test_verify_and_inspect_an_index_build_in_s3_with_its_store(tmp_path, fs, s3_bucket):
    corpus = _token_corpus(tmp_path / "corpus")
    build_store(corpus, tmp_path / "data" / "store", shard_size=30_000)
    build(tmp_path / "data" / "store", tmp_path / "index", max_len=512, index_only=True)
    build_store(corpus, f"{s3_bucket}/data/store", shard_size=30_000)
    uri = f"{s3_bucket}/index"
    build(f"{s3_bucket}/data/store", uri, max_len=512, index_only=True)
    result = invoke_prepack("verify", uri, "--all")
    checked = "index shards, manifest and the store's shards and documents checked"
    assert (result.returncode, result.stdout) == (0, f"{uri}: no problems ({checked}).\n"), result.stderr
    assert verify_build(uri, f"{s3_bucket}/data/store", all_problems=True) == []  # a source store at a URI
    build_store(corpus / "part-0.parquet", f"{s3_bucket}/other-store")
    wrong = verify_build(uri, f"{s3_bucket}/other-store", all_problems=True)
    inputs = next(p for p in wrong if p.column == "inputs")
    assert str(inputs) == f"{uri}/manifest.json, inputs: {inputs.message}" and "the source has [('part-0.parquet', 150)]" in inputs.message
    remote, here = _inspect_json(uri), _inspect_json(str(tmp_path / "index"))
    assert remote.pop("path") == uri and here.pop("path") == str(tmp_path / "index")
    assert remote == here
    # A store shard changed in the bucket (same size, other bytes): named by its URI, exit 1.
    store = prepack.read_store_manifest(tmp_path / "data" / "store")
    name = store.shards[1].name
    data = bytearray((tmp_path / "data" / "store" / name).read_bytes())
    data[-100] ^= 0xFF
    fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/data/store/{name}", bytes(data))
    result = invoke_prepack("verify", uri, "--all")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"problem: {s3_bucket}/data/store/{name}: sha256 "), result.stdout
    [problem, *_] = verify_build(uri)
    assert (problem.location, problem.file) == (uri, f"../data/store/{name}")


@pytest.mark.slow
def test_verify_names_a_damaged_shard_in_s3_by_its_uri(remote_build, tmp_path, fs, s3_server):
    local, uri = remote_build
    name = prepack.read_manifest(local).shards[1].name
    data = bytearray((local / name).read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes
    fs.pipe_file(f"{uri.removeprefix('s3://')}/{name}", bytes(data))
    result = invoke_prepack("verify", uri, "--all")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"problem: {uri}/{name}: sha256 ") and "does not match the manifest's" in lines[0]
    assert lines[1].startswith("problem: 1 shard(s) could not be read") and len(lines) == 2, result.stdout
    with pytest.raises(FormatError, match=f"^{uri}/{name}: sha256 "):
        inspect_build(uri)
    fs.pipe_file(f"{uri.removeprefix('s3://')}/shard-09999.arrow", b"stray")
    fs.pipe_file(f"{uri.removeprefix('s3://')}/more/shard-09998.arrow", b"not at the top")
    problems = verify_build(uri, all_problems=True)
    assert [str(p) for p in problems if "shard-0999" in (p.file or "")] == [
        f"{uri}/shard-09999.arrow: a shard file the manifest does not list."  # as locally: the top level only
    ]


@pytest.mark.slow
def test_a_bad_row_in_s3_is_named_by_the_uri_in_verify_inspect_and_the_loader(remote_build, tmp_path, fs):
    """A shard rewritten with a wrong `cu_seqlens` and recorded in the manifest (so that only the row
    checks notice): every reader names the object's URI, row and column, not the cached copy."""
    from tests.check.test_verify import rewrite_shard, row_with_documents, shard_rows, with_column

    local, uri = remote_build
    name = "shard-00001.arrow"
    rows = shard_rows(local, name)
    r = row_with_documents(rows)
    tampered = [row["cu_seqlens"] for row in rows]
    tampered[r] = tampered[r][:-1] + [tampered[r][-1] + 1]
    rewrite_shard(local, name, lambda b: with_column(b, "cu_seqlens", tampered))
    for file in (name, "manifest.json"):
        fs.pipe_file(f"{uri.removeprefix('s3://')}/{file}", (local / file).read_bytes())
    [here] = verify_build(local)
    [there] = verify_build(uri)
    assert (there.file, there.row, there.column, there.message) == (here.file, here.row, here.column, here.message)
    assert str(there) == f"{uri}/{here}" and str(there).startswith(f"{uri}/{name}, row {r}, column 'cu_seqlens': ")
    result = invoke_prepack("verify", uri)
    assert (result.returncode, result.stdout) == (1, f"problem: {there}\n")
    cache = tmp_path / "cache"
    with pytest.raises(FormatError, match=f"^{uri}/{name}: row {r}, column 'cu_seqlens': ") as loading:
        PackedDataset(uri, cache_dir=cache).check_all()
    assert str(cache) not in str(loading.value)
    with pytest.raises(FormatError, match=f"^{uri}/{name}: row {r}, column 'cu_seqlens': "):
        inspect_build(uri, cache_dir=cache)


def test_open_hf_dataset_reads_a_build_in_s3_through_its_cache(remote_build, tmp_path):
    from prepack import open_hf_dataset

    local, uri = remote_build
    here = open_hf_dataset(local)
    there = open_hf_dataset(uri, cache_dir=tmp_path / "cache")
    assert there.column_names == here.column_names and len(there) == len(here) > 0
    for a, b in zip(here, there):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert {p.name for p in (tmp_path / "cache").glob("*.arrow")} == {f"{s.sha256}.arrow" for s in prepack.read_manifest(local).shards}
    with pytest.raises(InputError, match="pass cache_dir="):
        open_hf_dataset(uri)


@pytest.mark.slow
def test_an_invalid_manifest_in_s3_is_a_finding_of_verify(remote_build, fs):
    local, uri = remote_build
    fs.pipe_file(f"{uri.removeprefix('s3://')}/manifest.json", b"{not json")
    (local / "manifest.json").write_bytes(b"{not json")
    [here] = verify_build(local)
    [there] = verify_build(uri)
    assert there == here.model_copy(update={"location": uri}) and "cannot be read as JSON" in there.message
    result = invoke_prepack("verify", uri)
    assert (result.returncode, result.stdout) == (1, f"problem: {uri}/manifest.json: {here.message}\n"), result.stderr


@pytest.mark.slow
def test_verify_and_inspect_of_a_prefix_without_a_manifest_exit_2(tmp_path, fs, s3_bucket):
    fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/packed/shard-00000.arrow", b"not a build")
    for command in ("verify", "inspect"):
        result = run_prepack(command, f"{s3_bucket}/packed", env={"TMPDIR": str(tmp_path)})
        assert f"{s3_bucket}/packed/manifest.json does not exist: {s3_bucket}/packed is not a finished prepack build" in failure(result)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_store_shard_in_s3_is_named_by_its_uri_when_built_from(tmp_path, fs, s3_bucket):
    """A store read from a URI (copied locally first) names its shards by their URIs (`Store.shard_where`)."""
    corpus = _token_corpus(tmp_path / "corpus")
    build_store(corpus, tmp_path / "store", shard_size=30_000)
    name = prepack.read_store_manifest(tmp_path / "store").shards[1].name
    data = bytearray((tmp_path / "store" / name).read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "store" / name).write_bytes(bytes(data))
    store = _upload(fs, tmp_path / "store", f"{s3_bucket}/store")
    with pytest.raises(FormatError) as locally:
        build(tmp_path / "store", tmp_path / "packed", max_len=512)
    with pytest.raises(FormatError) as remotely:
        build(store, f"{s3_bucket}/packed", max_len=512)
    assert str(remotely.value) == f"{store}/{name}: its sha256 is not the store manifest's: the shard changed."
    assert str(locally.value) == str(remotely.value).replace(store, str(tmp_path / "store"))


def test_a_store_in_s3_is_named_by_its_uri_in_refusals_of_its_manifest_and_of_reading_options(tmp_path, fs, s3_bucket):
    """A store read from a URI is named by its URI, once, not by the local copy it is read from: when
    options that would read it otherwise are refused, and when its manifest is."""
    corpus = _token_corpus(tmp_path / "corpus")
    build_store(corpus, tmp_path / "store", shard_size=30_000)
    store = _upload(fs, tmp_path / "store", f"{s3_bucket}/store")
    with pytest.raises(InputError, match=f"^{store} is a document store, tokenized already: leave out --tokenizer"):
        build(store, tmp_path / "packed", max_len=512, tokenizer=tmp_path)
    build(store, tmp_path / "packed", max_len=512)
    with pytest.raises(InputError, match=f"^{store} is a document store, tokenized already: leave out --tokenizer"):
        verify_build(tmp_path / "packed", store, tokenizer=tmp_path)
    raw = json.loads((tmp_path / "store" / "store.json").read_text())
    fs.pipe_file(f"{store.removeprefix('s3://')}/store.json", json.dumps({**raw, "store_version": 4}).encode())
    with pytest.raises(FormatError) as refused:
        prepack.storage.remote.read_output_manifest(store, "store.json")
    assert str(refused.value).startswith(f"{store}/store.json: column 'store_version': has store_version 4; this prepack reads versions 1 to 3.")


def test_missing_credentials_are_a_named_error_not_a_traceback(tmp_path, s3_server):
    # botocore raises NoCredentialsError, which s3fs lets through rather than map to an OSError.
    no_credentials = {
        "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": None, "AWS_CONTAINER_CREDENTIALS_FULL_URI": None,
    }
    result = run_prepack("build", "s3://bucket/corpus.parquet", "--max-len", "8", "--out", tmp_path / "out", env=no_credentials)
    assert "s3://bucket/corpus.parquet: cannot be listed (Unable to locate credentials)" in failure(result)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a pair store tokenized twice, four builds, two inspect processes
def test_a_pair_store_and_its_builds_in_s3_equal_local_ones(tmp_path, fs, s3_bucket, gpt2):
    """Pairs tokenized into a store in a bucket, and its full and index builds there, are the local ones; `inspect`
    of the index build reads its pairs' prompts from the store through the cache, as locally."""
    turns = [t for t in chitchat() if len(t) >= 2 and len(t[0]) < 50][:40]
    (tmp_path / "prefs.jsonl").write_text("".join(
        json.dumps({"prompt": f"Q: {t[0]} A:", "chosen": f" {t[1]}", "rejected": " no idea"}) + "\n" for t in turns
    ))
    reading = {"tokenizer": gpt2, "pairs": True, "num_proc": 1, "shard_size": 2_000}
    build_store(tmp_path / "prefs.jsonl", tmp_path / "data" / "store", **reading)
    build_store(tmp_path / "prefs.jsonl", f"{s3_bucket}/data/store", **reading)
    assert _files(fs, f"{s3_bucket}/data/store") == _local_files(tmp_path / "data" / "store")
    for out, extra in (("packed", {}), ("index", {"index_only": True})):
        build(tmp_path / "data" / "store", tmp_path / "data" / out, max_len=40, overflow="truncate", **extra)
        build(f"{s3_bucket}/data/store", f"{s3_bucket}/data/{out}", max_len=40, overflow="truncate", **extra)
        assert _files(fs, f"{s3_bucket}/data/{out}") == _local_files(tmp_path / "data" / out), out
    remote, here = _inspect_json(f"{s3_bucket}/data/index"), _inspect_json(str(tmp_path / "data" / "index"))
    assert remote.pop("path") == f"{s3_bucket}/data/index" and here.pop("path") == str(tmp_path / "data" / "index")
    assert remote == here and here["pairs"]["prompt_tokens"] > 0
