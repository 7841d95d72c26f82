"""Appends in object storage, against the moto server of `tests/conftest.py` (nothing of prepack's mocked):
a store and a build grown in S3 equal their local twins byte for byte, their old objects untouched; a
killed append leaves the previous generation published and readable, and the next append succeeds; of
two appends at once, one publishes and the other is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prepack import PackedDataset, build, build_store
from prepack.check.verify import verify_build
from prepack.errors import OutputError
from prepack.storage.remote import read_output_manifest
from tests.corpus import corpus_table, write_corpus

s3fs = pytest.importorskip("s3fs")

MAX_LEN = 64


@pytest.fixture
def fs(s3_server):
    return s3fs.S3FileSystem()


def _batch(root: Path, name: str, seed: int, count: int) -> Path:
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 500, size=int(rng.integers(1, 90))).tolist() for _ in range(count)]
    (root / f"batch-{name}").mkdir()
    write_corpus(root / f"batch-{name}" / f"{name}.parquet", corpus_table(documents))
    return root / f"batch-{name}"


def _objects(fs, uri: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    prefix = uri.removeprefix("s3://").rstrip("/")
    return {os.path.relpath(key, prefix): fs.cat_file(key) for key in fs.find(prefix)}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("index_only", [False, True])
def test_a_store_and_a_build_grown_in_s3_equal_their_local_twins(tmp_path, fs, s3_bucket, index_only):
    a, b = _batch(tmp_path, "a", 0, 80), _batch(tmp_path, "b", 1, 20)
    options = dict(max_len=MAX_LEN, index_only=index_only, shard_size=3000)
    for store, out in ((tmp_path / "store", tmp_path / "packed"), (f"{s3_bucket}/store", f"{s3_bucket}/packed")):
        build_store(a, store, shard_size=800)
        build(store, out, **options)
    old_store, old_build = _objects(fs, f"{s3_bucket}/store"), _objects(fs, f"{s3_bucket}/packed")
    for where, (store, out) in enumerate(((tmp_path / "store", tmp_path / "packed"), (f"{s3_bucket}/store", f"{s3_bucket}/packed"))):
        build_store(b, store, shard_size=800, append=True)
        # The build of the store's first generation still reads and verifies (in S3, its store through the cache).
        assert verify_build(out) == [] and len(PackedDataset(out, cache_dir=tmp_path / f"cache-{where}"))
        build(store, out, **options, append=True)
    grown_store, grown_build = _objects(fs, f"{s3_bucket}/store"), _objects(fs, f"{s3_bucket}/packed")
    assert grown_store == _files(tmp_path / "store") and grown_build == _files(tmp_path / "packed")
    for old, grown, manifest in ((old_store, grown_store, "store.json"), (old_build, grown_build, "manifest.json")):
        assert {name: grown[name] for name in old if name != manifest} == {n: d for n, d in old.items() if n != manifest}
        assert len(grown) > len(old)
    assert verify_build(f"{s3_bucket}/packed") == []


# An append paused at a phase, to be killed there or let go on: argv = phase, go-file, then "store"
# CORPUS STORE or "build" STORE OUT.
PAUSED_APPEND = """
import os, sys, time
from pathlib import Path
import prepack.building.build as build_module
import prepack.storage.remote as remote

phase, go, kind, *args = sys.argv[1:]

def pause():
    print("paused", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)

if phase == "planning":
    plan = build_module.plan_packs
    build_module.plan_packs = lambda *a, **k: (pause(), plan(*a, **k))[1]
elif phase == "published":  # the manifest is up, the staging marker not deleted yet
    import s3fs
    remove = s3fs.S3FileSystem.rm_file
    def rm_file(self, path, *a, **k):
        if str(path).endswith(".prepack-staging"):
            pause()
        return remove(self, path, *a, **k)
    s3fs.S3FileSystem.rm_file = rm_file
else:  # "uploaded": the new shards are up, the manifest not yet
    check = remote.Publication.check_claim
    def check_claim(self, thorough=False):
        if thorough:
            pause()
        return check(self, thorough)
    remote.Publication.check_claim = check_claim
if kind == "store":
    build_module.build_store(args[0], args[1], shard_size=800, append=True)
else:
    build_module.build(args[0], args[1], max_len=64, append=True)
print("appended", flush=True)
"""


def _paused(tmp_path: Path, phase: str, *args) -> tuple[subprocess.Popen, Path]:
    go = tmp_path / f"go-{phase}"
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSED_APPEND, phase, str(go), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert process.stdout.readline() == "paused\n", process.stderr.read()
    return process, go


@pytest.mark.slow
# A store append plans nothing: its shards go up at its end, before its manifest ("uploaded").
@pytest.mark.parametrize(
    ("kind", "phase"),
    [("store", "uploaded"), ("store", "published"), ("build", "planning"), ("build", "uploaded"), ("build", "published")],
)
def test_a_killed_append_in_s3_leaves_the_previous_generation_and_the_next_append_succeeds(tmp_path, fs, s3_bucket, kind, phase):
    store, out = f"{s3_bucket}/store", f"{s3_bucket}/packed"
    build_store(_batch(tmp_path, "a", 0, 60), store, shard_size=800)
    build(store, out, max_len=MAX_LEN)
    build_store(_batch(tmp_path, "b", 1, 20), store, shard_size=800, append=True)
    target = store if kind == "store" else out
    before = _objects(fs, target)
    args = ("store", _batch(tmp_path, "c", 2, 10), store) if kind == "store" else ("build", store, out)
    process, _ = _paused(tmp_path, phase, *args)
    process.kill()
    process.wait()
    process.stdout.close()
    process.stderr.close()
    # Killed before its manifest went up, the previous generation is still the one published, and reads;
    # killed after, the append is published (its marker left for the next append to delete).
    published = phase == "published"
    now = _objects(fs, target)
    manifest = "store.json" if kind == "store" else "manifest.json"
    assert {name: now[name] for name in before if name != manifest} == {n: d for n, d in before.items() if n != manifest}
    assert (now[manifest] == before[manifest]) != published
    assert len(PackedDataset(out, cache_dir=tmp_path / "cache")) == read_output_manifest(out).totals.packs
    # Object storage has no staging directory: a shard the killed append uploaded lies under the prefix,
    # unlisted (and listed in its staging marker), until the next append deletes it; verify names it.
    leftovers = {p.file for p in verify_build(out, all_problems=True)}
    assert all(p.message == "a shard file the manifest does not list." for p in verify_build(out, all_problems=True))
    assert leftovers == ({"shard-00001.arrow"} if (kind, phase) == ("build", "uploaded") else set())
    # The next append clears what the killed one left and publishes.
    if kind == "store":
        assert build_store(_batch(tmp_path, "d", 3, 10), store, shard_size=800, append=True).documents == (100 if published else 90)
    else:
        assert build(store, out, max_len=MAX_LEN, append=True).totals.documents == 80
    assert verify_build(out) == []
    fs.invalidate_cache()
    assert [p for p in fs.ls(s3_bucket.removeprefix("s3://")) if "prepack-staging" in p] == []


@pytest.mark.slow
def test_of_two_appends_in_s3_at_once_one_publishes_and_the_other_is_refused(tmp_path, fs, s3_bucket):
    store, out = f"{s3_bucket}/store", f"{s3_bucket}/packed"
    build_store(_batch(tmp_path, "a", 0, 60), store, shard_size=800)
    build(store, out, max_len=MAX_LEN)
    build_store(_batch(tmp_path, "b", 1, 20), store, shard_size=800, append=True)
    first, go = _paused(tmp_path, "uploaded", "build", store, out)
    try:
        # The second append takes the prefix over from the first (object storage cannot tell a paused
        # writer from a killed one) and publishes.
        assert build(store, out, max_len=MAX_LEN, append=True).totals.documents == 80
        published = _objects(fs, out)
        go.touch()
        said, errors = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode != 0 and "took the prefix over" in errors and "appended" not in said
    assert _objects(fs, out) == published and verify_build(out) == []
    with pytest.raises(OutputError, match="holds no prepack build to append to"):
        build(store, f"{s3_bucket}/nothing", max_len=MAX_LEN, append=True)


@pytest.mark.slow
def test_an_append_whose_prefix_is_taken_over_and_published_after_its_last_check_does_not_replace_that_manifest(tmp_path, fs, s3_bucket, monkeypatch):
    """Another append takes the prefix over (deleting this one's shards) and publishes between this one's
    last check of its marker and its manifest's PUT: the PUT, conditional on the manifest it replaces, fails."""
    from prepack.storage import remote

    store = f"{s3_bucket}/store"
    build_store(_batch(tmp_path, "a", 0, 60), store, shard_size=800)
    second = _batch(tmp_path, "c", 2, 10)
    check, taken_over = remote.Publication.check_claim, []

    def check_then_be_taken_over(publication, thorough=False):
        check(publication, thorough)
        if thorough and not taken_over:
            taken_over.append(None)  # the taker's own checks pass through
            taken_over[0] = build_store(second, store, shard_size=800, append=True)

    monkeypatch.setattr(remote.Publication, "check_claim", check_then_be_taken_over)
    with pytest.raises(OutputError, match="another prepack build published"):
        build_store(_batch(tmp_path, "b", 1, 20), store, shard_size=800, append=True)
    assert read_output_manifest(store, "store.json") == taken_over[0]
    assert taken_over[0].documents == 70
    published = _objects(fs, store)
    assert sorted(published) == sorted(["store.json", *(s.name for s in taken_over[0].shards)])
