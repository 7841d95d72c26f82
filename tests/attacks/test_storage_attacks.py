"""Object storage that changes under prepack, or is named wrongly, against moto's real S3 server
(tests/s3server.py; nothing of prepack's mocked): a warm cache never hides a changed object, URIs
without a bucket or prefix are refused by name, a killed build's objects are cleared by the next build
and nothing else is, two builds to one prefix never both succeed, an oversized manifest is refused by
its size, and an index build is not written inside its own store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from prepack import PackedDataset, build, build_store
from prepack.errors import FormatError, InputError, OutputError
from prepack.formats.common import MANIFEST_MAX_BYTES
from prepack.check.verify import verify_build
from tests.cli import PREPACK, invoke_prepack
from tests.corpus import corpus_table, files, write_corpus

s3fs = pytest.importorskip("s3fs")


@pytest.fixture
def fs(s3_server):
    return s3fs.S3FileSystem()


def _corpus(path: Path, first: int = 1, count: int = 60) -> Path:
    return write_corpus(path, corpus_table([[first + i % 7] * (20 + i % 30) for i in range(count)]))


def _objects(fs, uri: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    bucket = uri.removeprefix("s3://")
    return {key.removeprefix(f"{bucket}/"): fs.cat_file(key) for key in fs.find(bucket)}


def _key(uri: str) -> str:
    return uri.removeprefix("s3://")


# 1. A warm cache never hides what changed in object storage.


@pytest.mark.slow
def test_verify_and_the_loader_with_a_warm_cache_see_a_deleted_or_rewritten_shard(tmp_path, fs, s3_bucket):
    uri, cache = f"{s3_bucket}/rp", tmp_path / "cache"
    build(_corpus(tmp_path / "c.parquet"), uri, max_len=64, shard_size=1_000)
    assert invoke_prepack("verify", uri, "--cache-dir", str(cache)).returncode == 0  # the cache is warm
    PackedDataset(uri, cache_dir=cache).check_all()
    first, second = (s.name for s in PackedDataset(uri, cache_dir=cache).manifest.shards[:2])
    data = bytearray(fs.cat_file(f"{_key(uri)}/{second}"))
    data[-100] ^= 0xFF  # same size, other bytes
    fs.pipe_file(f"{_key(uri)}/{second}", bytes(data))
    fs.rm_file(f"{_key(uri)}/{first}")

    result = invoke_prepack("verify", uri, "--cache-dir", str(cache), "--all")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{uri}/{first}" in result.stdout and "missing" in result.stdout
    assert f"{uri}/{second}" in result.stdout and "sha256" in result.stdout
    with pytest.raises(FormatError, match=f"^{uri}/{first}: missing"):
        PackedDataset(uri, cache_dir=cache).check_all()
    fs.pipe_file(f"{_key(uri)}/{first}", (cache / f"{PackedDataset(uri, cache_dir=cache).manifest.shards[0].sha256}.arrow").read_bytes())
    with pytest.raises(FormatError, match=f"^{uri}/{second}: sha256 [0-9a-f]{{64}} does not match the manifest's"):
        PackedDataset(uri, cache_dir=cache).check_all()


# 2. URIs without a bucket or a prefix.


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "CORPUS", "--max-len", "8", "--out", "s3://"], "s3://: names no bucket"),
        (["build", "CORPUS", "--max-len", "8", "--out", "s3:///x"], "s3:///x: names no bucket"),
        (["build", "CORPUS", "--max-len", "8", "--out", "s3://BUCKET"], "names a bucket but no prefix"),
        (["build", "CORPUS", "--max-len", "8", "--out", "s3://BUCKET/a/../b"], "a prefix with an empty, '.' or '..' part"),
        (["build", "s3://", "--max-len", "8", "--out", "OUT"], "s3://: names no bucket"),
        (["verify", "s3://"], "s3://: names no bucket"),
        (["inspect", "s3:///x"], "s3:///x: names no bucket"),
    ],
)
@pytest.mark.slow
def test_uris_without_a_bucket_or_prefix_are_refused_by_name(args, message, tmp_path, fs, s3_bucket):
    corpus = _corpus(tmp_path / "c.parquet")
    bucket = s3_bucket.removeprefix("s3://")
    args = [a.replace("CORPUS", str(corpus)).replace("BUCKET", bucket).replace("OUT", str(tmp_path / "out")) for a in args]
    result = invoke_prepack(*args)
    stderr = " ".join(result.stderr.split())  # as rich wraps it
    assert result.returncode == 2 and message in stderr and "Traceback" not in stderr, result.stderr
    assert _objects(fs, s3_bucket) == {} and not (tmp_path / "out").exists()


# 4. A killed build's leftovers.


@pytest.mark.slow
def test_a_killed_builds_objects_are_cleared_by_the_next_build_and_nothing_else(tmp_path, fs, s3_bucket):
    from prepack.storage.remote import Publication, scratch_prefix

    uri = f"{s3_bucket}/rp"
    build(_corpus(tmp_path / "old.parquet", 1, 200), uri, max_len=64, shard_size=1_000)  # to be replaced
    old_shards = [s.name for s in PackedDataset(uri, cache_dir=tmp_path / "c0").manifest.shards]
    beside = {"rp-2/keep": b"k", ".rp.prepack-scratch-notours/x": b"s"}
    for name, data in beside.items():
        fs.pipe_file(f"{_key(s3_bucket)}/{name}", data)
    # A build killed while uploading: it unpublished the old build, uploaded a shard and scratch objects,
    # and never ran its clean-up (as when its process is killed).
    killed = Publication(uri, True, "manifest.json")
    killed.uploading(["shard-00000.arrow"])
    fs.pipe_file(f"{_key(uri)}/shard-00000.arrow", b"half a shard")
    scratch = scratch_prefix(killed)
    scratch_uri = scratch.__enter__()
    fs.pipe_file(f"{_key(scratch_uri)}/tokens-0.bin", b"tokens")
    assert "rp/manifest.json" not in _objects(fs, s3_bucket)

    new = _corpus(tmp_path / "new.parquet", 3)
    build(new, uri, max_len=64)  # without --overwrite: what was there is the killed build's, not a build
    assert verify_build(uri, new) == []
    new_shards = {s.name for s in PackedDataset(uri, cache_dir=tmp_path / "c1").manifest.shards}
    assert len(new_shards) < len(old_shards)  # the old build's other shards went too
    after = _objects(fs, s3_bucket)
    assert set(after) == {*beside, "rp/manifest.json", *(f"rp/{n}" for n in new_shards)}
    assert all(after[name] == data for name, data in beside.items())


def test_objects_a_marker_does_not_list_stay_and_a_foreign_marker_is_refused(tmp_path, fs, s3_bucket):
    from prepack.storage.remote import Publication

    uri = f"{s3_bucket}/rp"
    killed = Publication(uri, False, "manifest.json")
    killed.uploading(["shard-00000.arrow"])
    fs.pipe_file(f"{_key(uri)}/shard-00000.arrow", b"ours")
    fs.pipe_file(f"{_key(uri)}/notes.txt", b"the user's")  # not listed by the marker
    with pytest.raises(OutputError, match=f"^{uri} is not a prepack build.*1 objects and no manifest.json"):
        build(_corpus(tmp_path / "c.parquet"), uri, max_len=64)
    assert _objects(fs, s3_bucket) == {"rp/notes.txt": b"the user's"}

    marker = f"{_key(s3_bucket)}/.rp.prepack-staging"
    for text in (b"not json", json.dumps({"build": "x", "objects": ["../other/x"], "scratch": []}).encode()):
        fs.pipe_file(marker, text)
        with pytest.raises(OutputError, match=r"\.rp\.prepack-staging is not a staging marker prepack writes"):
            build(_corpus(tmp_path / "c.parquet"), f"{s3_bucket}/rp", max_len=64, overwrite=True)
    assert _objects(fs, s3_bucket) == {"rp/notes.txt": b"the user's", ".rp.prepack-staging": text}


# 5. Two builds to one prefix at once.


def test_a_manifest_published_meanwhile_wins_and_the_loser_deletes_only_its_own(tmp_path, fs, s3_bucket):
    """A writer that ignored the marker published first: the loser uploads nothing more, deletes what
    it uploaded that the winner's manifest does not name, and leaves the winner's objects as they are."""
    from prepack.storage.remote import Publication

    uri = f"{s3_bucket}/rp"
    built, won = tmp_path / "built", tmp_path / "won"
    build(_corpus(tmp_path / "c.parquet"), built, max_len=64, shard_size=1_000)
    build(_corpus(tmp_path / "w.parquet", 5, 3), won, max_len=64)
    shards = sorted(p.name for p in built.iterdir() if p.name != "manifest.json")
    assert sorted(p.name for p in won.iterdir()) == ["manifest.json", shards[0]] and len(shards) > 2
    loser = Publication(uri, False, "manifest.json")
    loser.uploading(shards[:2])
    for name in shards[:2]:
        fs.pipe_file(f"{_key(uri)}/{name}", (built / name).read_bytes())
    winner = files(won)
    for name, data in winner.items():
        fs.pipe_file(f"{_key(uri)}/{name}", data)
    with pytest.raises(OutputError, match=f"^another prepack build published {uri} while this one ran"):
        loser.publish(built)
    assert _objects(fs, s3_bucket) == {f"rp/{name}": data for name, data in winner.items()}


def test_a_build_taken_over_by_a_later_one_stops_and_leaves_the_later_ones_objects(tmp_path, fs, s3_bucket):
    """The later of two builds to one prefix takes it over (it cannot tell a running build from a
    killed one); the earlier one finds its marker gone before it uploads more, and stops."""
    from prepack.storage.remote import Publication

    uri = f"{s3_bucket}/rp"
    built = tmp_path / "built"
    build(_corpus(tmp_path / "c.parquet"), built, max_len=64, shard_size=1_000)
    shards = sorted(p.name for p in built.iterdir() if p.name != "manifest.json")
    earlier = Publication(uri, False, "manifest.json")
    earlier.uploading(shards[:1])
    fs.pipe_file(f"{_key(uri)}/{shards[0]}", b"the earlier build's")
    later = Publication(uri, False, "manifest.json")  # clears what the earlier one listed
    later.uploading(shards[:1])
    fs.pipe_file(f"{_key(uri)}/{shards[0]}", (built / shards[0]).read_bytes())
    with pytest.raises(OutputError, match=f"^another prepack build to {uri} started while this one ran and took the prefix over"):
        earlier.publish(built)
    assert set(_objects(fs, s3_bucket)) == {f"rp/{shards[0]}", ".rp.prepack-staging"}
    later.publish(built)
    assert _objects(fs, s3_bucket) == {f"rp/{p.name}": p.read_bytes() for p in built.iterdir()}


@pytest.mark.slow
def test_of_two_builds_to_one_prefix_at_once_one_fails_and_the_other_is_intact(tmp_path, fs, s3_bucket):
    uri = f"{s3_bucket}/rp"
    corpora = [_corpus(tmp_path / f"c{i}.parquet", 1 + 10 * i, 3_000) for i in range(2)]
    builds = [
        subprocess.Popen([PREPACK, "build", str(c), "--max-len", "64", "--shard-size", "20000", "--out", uri],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in corpora
    ]
    results = [(b.wait(timeout=300), b.stderr.read()) for b in builds]
    assert sorted(code for code, _ in results) == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "another prepack build" in loser or "already exists" in loser, loser
    assert invoke_prepack("verify", uri, "--source", str(corpora[[code for code, _ in results].index(0)])).returncode == 0
    assert not any(name.startswith(".rp.") for name in _objects(fs, s3_bucket))


# 6. Manifests by size, an index build inside its store, messages by URI.


@pytest.mark.slow
def test_an_oversized_manifest_is_refused_by_its_size_without_being_downloaded(fs, s3_bucket, s3_server):
    uri = f"{s3_bucket}/rp"
    fs.pipe_file(f"{_key(uri)}/manifest.json", b" " * (MANIFEST_MAX_BYTES + 1))
    with pytest.raises(FormatError, match=f"^{uri}/manifest.json: is larger than {MANIFEST_MAX_BYTES} bytes"):
        PackedDataset(uri, cache_dir="unused")
    result = invoke_prepack("verify", uri)
    assert result.returncode == 1 and f"{uri}/manifest.json" in result.stdout and "is larger than" in result.stdout
    assert s3_server.requests("GET", f"/{_key(uri)}/manifest.json") == []


def test_an_index_build_inside_its_own_store_in_s3_is_refused_as_locally(tmp_path, fs, s3_bucket):
    store = f"{s3_bucket}/store"
    build_store(_corpus(tmp_path / "c.parquet"), store)
    before = _objects(fs, s3_bucket)
    for out in (f"{store}/index", f"{store}/"):
        with pytest.raises(InputError, match=f"^{store}: the document store and --out {out} must not lie inside each other"):
            build(store, out, max_len=64, index_only=True)
    assert _objects(fs, s3_bucket) == before
