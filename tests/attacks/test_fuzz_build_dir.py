"""Seeded fuzzing of build directories: random corruptions of a valid build (shard bytes, list offsets and
values, manifest values, types and structure, files renamed, missing, added, replaced by symbolic links,
FIFOs or directories) fed to every reader. The only allowed outcomes are success (for verify: a list of
problems) or a `PrepackError`; a row the loader serves must satisfy the format.

A failure names the case's seed: `_corrupt(copy, random.Random(seed))` replays it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepack import build, inspect_build, open_hf_dataset, read_manifest, verify_build
from prepack.training.collate import PackedCollator
from prepack.errors import PrepackError
from prepack.training.dataset import PackedDataset
from tests.corpus import NOT_A_FILE, make_not_a_file, corpus_table, record_shard, write_corpus

MAX_LEN = 16
CASES = int(os.environ.get("FUZZ_CASES", 2000))
HF_EVERY = 25  # open_hf_dataset is slower: one case in HF_EVERY


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(5)
    documents = [rng.integers(0, 1000, size=n).tolist() for n in rng.integers(0, 40, size=40)]
    labels = [[-100 if i % 4 == 0 else t for i, t in enumerate(d)] for d in documents]
    out = tmp / "packed"
    build(write_corpus(tmp / "c.parquet", corpus_table(documents, labels)), out, max_len=MAX_LEN, shard_size=700)
    assert len(read_manifest(out).shards) >= 3
    return out


# Corruptions ---------------------------------------------------------------------------------------

_ODD_INTS = [-(2**63), -(2**31) - 1, -(2**31), -101, -100, -1, 0, 1, 2, 15, 16, 17, 2**15, 2**16, 2**31 - 1, 2**31,
             2**63 - 1, 2**63, 10**30]


def _odd_value(rng: random.Random):
    return rng.choice([
        rng.choice(_ODD_INTS), rng.random() * 1e6, 1.0, "102", "", "../x", "/etc/passwd", True, False, None,
        [], {}, [1, 2], {"a": 1}, "shard-00000.arrow", "f" * 64, "x" * 10_000,
    ])


def _shards(copy: Path) -> list[Path]:
    return sorted(copy.glob("shard-*.arrow"))


def _shard_bytes(copy: Path, rng: random.Random) -> str:
    shard = rng.choice(_shards(copy))
    data = bytearray(shard.read_bytes())
    kind = rng.choice(["flip", "truncate", "insert", "overwrite", "buffer"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "insert":
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.randbytes(rng.randint(1, 16))
    elif kind == "overwrite":
        at = rng.randrange(len(data))
        data[at : at + 8] = rng.randbytes(8)
    else:  # one value of an offsets or values buffer, found through the zero-copy read
        buffer = pa.py_buffer(bytes(data))
        batch = pa.ipc.open_stream(pa.BufferReader(buffer)).read_next_batch()
        column = batch.column(rng.randrange(batch.num_columns))
        arrays = [column, column.values] if isinstance(column, pa.ListArray) else [column]
        array = rng.choice(arrays)
        if array is column and isinstance(column, pa.ListArray):
            target, width = column.buffers()[1], 4  # offsets
        else:
            target, width = array.buffers()[1], array.type.byte_width
        count = target.size // width
        if count == 0:
            return "buffer: empty"
        at = target.address - buffer.address + width * rng.randrange(count)
        value = rng.choice(_ODD_INTS) % (1 << (8 * width))
        data[at : at + width] = value.to_bytes(width, "little")
        kind = f"buffer {array.type} = {value}"
    shard.write_bytes(bytes(data))
    if rng.random() < 0.7:
        record_shard(copy / "manifest.json", shard)
    return f"{shard.name}: {kind}"


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield path + (key,), item
            yield from _leaves(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield path + (index,), item
            yield from _leaves(item, path + (index,))


def _manifest_value(copy: Path, rng: random.Random) -> str:
    raw = json.loads((copy / "manifest.json").read_text())
    path, old = rng.choice(list(_leaves(raw)))
    parent = raw
    for step in path[:-1]:
        parent = parent[step]
    kind = rng.choice(["odd", "odd", "nudge", "delete", "add", "duplicate-entry", "drop-entry"])
    if kind == "nudge" and isinstance(old, int) and not isinstance(old, bool):
        parent[path[-1]] = old + rng.choice([-1, 1, 1000])
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "add" and isinstance(parent, dict):
        parent["extra"] = _odd_value(rng)
    elif kind in ("duplicate-entry", "drop-entry") and raw["shards"]:
        entry = rng.randrange(len(raw["shards"]))
        if kind == "drop-entry":
            del raw["shards"][entry]
        else:
            raw["shards"].insert(entry, dict(raw["shards"][entry]))
    else:
        parent[path[-1]] = _odd_value(rng)
    (copy / "manifest.json").write_text(json.dumps(raw))
    return f"manifest {kind} {path}"


def _manifest_text(copy: Path, rng: random.Random) -> str:
    text = (copy / "manifest.json").read_bytes()
    kind = rng.choice(["truncate", "flip", "nest", "big-int", "not-utf8"])
    if kind == "truncate":
        text = text[: rng.randrange(len(text))]
    elif kind == "flip":
        at = rng.randrange(len(text))
        text = text[:at] + bytes([text[at] ^ (1 << rng.randrange(8))]) + text[at + 1 :]
    elif kind == "nest":
        depth = rng.choice([100, 5_000, 100_000])
        text = text.rstrip()[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "big-int":
        text = text.replace(b'"rows": ', b'"rows": ' + b"9" * rng.choice([20, 5000]), 1)
    else:
        text = text.replace(b'"prepack_version": "', b'"prepack_version": "\xff', 1)
    (copy / "manifest.json").write_bytes(text)
    return f"manifest text {kind}"


def _files(copy: Path, rng: random.Random) -> str:
    shards = _shards(copy)
    shard = rng.choice(shards)
    kind = rng.choice(["delete", "swap", "extra", "symlink", "fifo", "directory", "dev-zero", "manifest-gone",
                       "manifest-symlink", "empty"])
    if kind == "delete":
        shard.unlink()
    elif kind == "swap":
        other = rng.choice(shards)
        shard.rename(copy / "tmp")
        other.rename(shard)
        (copy / "tmp").rename(other)
    elif kind == "extra":
        shutil.copy(shard, copy / f"shard-{len(shards) + rng.randrange(3):05d}.arrow")
    elif kind in NOT_A_FILE:
        make_not_a_file(shard, kind)
    elif kind == "manifest-gone":
        (copy / "manifest.json").unlink()
    elif kind == "manifest-symlink":
        moved = copy.parent / "moved-manifest.json"
        (copy / "manifest.json").rename(moved)
        (copy / "manifest.json").symlink_to(moved)
    else:
        shard.write_bytes(b"")
        record_shard(copy / "manifest.json", shard)
    return f"{shard.name}: {kind}"


def _corrupt(copy: Path, rng: random.Random) -> list[str]:
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        mutate = rng.choices([_shard_bytes, _manifest_value, _manifest_text, _files], weights=[5, 3, 1, 2])[0]
        try:
            done.append(mutate(copy, rng))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, json.JSONDecodeError, UnicodeDecodeError,
                pa.ArrowException, IndexError, KeyError, TypeError, ValueError, OSError, RecursionError):
            done.append(f"{mutate.__name__}: not applicable after the previous corruption")
    return done


# Readers ------------------------------------------------------------------------------------------------


def _served_rows(path: Path) -> int:
    """Every row through PackedCollator; each must satisfy the format."""
    dataset = PackedDataset(path)
    max_len = dataset.manifest.options.max_len
    collate = PackedCollator(max_len)
    for index in range(len(dataset)):
        row = dataset[index]
        ids, cu, seg = row["input_ids"], row["cu_seqlens"], row["segment_ids"]
        assert 1 <= len(ids) <= max_len and len(seg) == len(ids), index
        assert cu[0] == 0 and cu[-1] == len(ids) and (np.diff(cu) > 0).all(), index
        assert (ids >= 0).all() and (seg == np.repeat(np.arange(1, len(cu)), np.diff(cu))).all(), index
        if "labels" in row:
            assert len(row["labels"]) == len(ids) and ((row["labels"] >= 0) | (row["labels"] == -100)).all()
        collate([row])
    return len(dataset)


def _hf_rows(path: Path) -> int:
    dataset = open_hf_dataset(path)
    for row in dataset:
        assert row["cu_seqlens"][-1] == len(row["input_ids"])
    return len(dataset)


READERS = {
    "read_manifest": read_manifest,
    "PackedDataset": _served_rows,
    "inspect_build": inspect_build,
    "verify_build": lambda path: verify_build(path, all_problems=True),
}


@pytest.mark.slow
def test_corrupted_build_directories_end_in_success_or_a_prepack_error(valid, tmp_path):
    faulthandler.dump_traceback_later(600, exit=True)  # a reader that hangs fails the run, not CI's clock
    failures, outcomes = [], {"ok": 0, "refused": 0}
    try:
        for seed in range(CASES):
            copy = Path(shutil.copytree(valid, tmp_path / f"case-{seed}", symlinks=True))
            corruption = _corrupt(copy, random.Random(seed))
            readers = dict(READERS, **({"open_hf_dataset": _hf_rows} if seed % HF_EVERY == 0 else {}))
            for name, reader in readers.items():
                try:
                    reader(copy)
                    outcomes["ok"] += 1
                except PrepackError:
                    outcomes["refused"] += 1
                except BaseException as exc:  # noqa: BLE001 - every other outcome is the finding
                    failures.append(f"seed {seed}, {name}, {corruption}: {type(exc).__name__}: {str(exc)[:300]}")
            shutil.rmtree(copy)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not failures, f"{len(failures)} failures, first 20:\n" + "\n".join(failures[:20])
    assert outcomes["refused"] > CASES and outcomes["ok"] > CASES // 10  # the corruptions reach both ends


# Index builds and their stores: hypothesis mutates one field of either manifest ----------------------

_PATHS = ["", ".", "..", "../", "../.", "../store", "../store/", "../../store", "/abs/store", "../st\0re", "a\0b",
          "../" + "x" * 300, "../" + "/".join(["x"] * 3000), "../a//b", "store", "documents-00000.arrow",
          "../other/store", "x" * 10_000]


@pytest.fixture(scope="module")
def valid_index(tmp_path_factory) -> Path:
    """A directory holding a store (`store/`), its corpus, an index build of it (`index/`) and a store of
    the same lengths and other tokens (`other/`)."""
    from prepack import build_store

    tmp = tmp_path_factory.mktemp("fuzz-index")
    rng = np.random.default_rng(9)
    documents = [rng.integers(0, 1000, size=n).tolist() for n in rng.integers(0, 40, size=40)]
    labels = [[-100 if i % 4 == 0 else t for i, t in enumerate(d)] for d in documents]
    write_corpus(tmp / "c.parquet", corpus_table(documents, labels))
    build_store(tmp / "c.parquet", tmp / "store", shard_size=300)
    others = [rng.integers(0, 1000, size=len(d)).tolist() for d in documents]
    write_corpus(tmp / "o.parquet", corpus_table(others, labels))
    build_store(tmp / "o.parquet", tmp / "other", shard_size=300)
    build(tmp / "store", tmp / "index", max_len=MAX_LEN, shard_size=300, index_only=True)
    return tmp


def _index_readers(index: Path, rows: list) -> None:
    """Every reader of an index build, each to succeed or raise a PrepackError; rows served must be
    `rows`, the valid build's (never another store's tokens)."""
    for reader in (read_manifest, _served_rows, inspect_build, lambda path: verify_build(path, all_problems=True)):
        try:
            reader(index)
        except PrepackError:
            pass
    try:
        dataset = PackedDataset(index)
        served = [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]
    except PrepackError:
        return
    assert served == rows


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("FUZZ_INDEX_CASES", 150)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_index_and_store_manifests_end_in_a_prepack_error_or_success(valid_index, data):
    import tempfile

    dataset = PackedDataset(valid_index / "index")
    rows = [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]
    which = data.draw(st.sampled_from(["index/manifest.json", "store/store.json"]), label="file")
    raw = json.loads((valid_index / which).read_text())
    if which == "index/manifest.json" and data.draw(st.booleans(), label="retarget at the other store"):
        fingerprint = json.loads((valid_index / "other" / "store.json").read_text())["fingerprint"]
        raw["store"] = {"path": "../other", "fingerprint": fingerprint}
        if data.draw(st.booleans(), label="and the build's fingerprint"):
            raw["fingerprint"] = fingerprint
    leaves = [path for path, _ in _leaves(raw)]
    path = data.draw(st.sampled_from(leaves), label="field")
    old = raw
    for step in path:
        old = old[step]
    value = data.draw(
        st.sampled_from(_PATHS)
        | st.sampled_from(_ODD_INTS)
        | st.sampled_from([None, True, False, 1.5, [], {}, "f" * 64, "0" * 64])
        | st.text(max_size=20)
        | (st.integers(-3, 3).map(lambda d: old + d) if isinstance(old, int) and not isinstance(old, bool) else st.nothing()),
        label="value",
    )
    parent = raw
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    faulthandler.dump_traceback_later(120, exit=True)  # a reader that hangs fails the run
    try:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(shutil.copytree(valid_index, Path(tmp) / "case", symlinks=True))
            (copy / which).write_text(json.dumps(raw))
            _index_readers(copy / "index", rows)
    finally:
        faulthandler.cancel_dump_traceback_later()
