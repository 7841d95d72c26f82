"""Hypothesis fuzzing of reference directories (`prepack.formats.reference`, schemas/reference-logps.md): random
corruptions of a valid one (reference.json's fields changed, deleted, added or its text broken; counts off;
files truncated, flipped, swapped, missing, extra, replaced by links, FIFOs or directories; values rewritten
with their manifest entry updated) fed to every reader: `read_reference_manifest`, `verify_reference`,
`PackedDataset(build, reference=)` (with and without checksums), `open_hf_dataset(build, reference=)` and the
writer given the directory as its output.

The only allowed outcomes are a `PrepackError` or success, and a reader that succeeds serves the valid
values, unless `verify_reference` reports a problem (the loader without checksums does not hash files) or the
corruption rewrote a file and recorded its new size and sha256 (then the values are another valid directory's,
and every value served must still be one the format allows: one per document, finite, at most 0).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from prepack import PackedDataset, open_hf_dataset, read_manifest
from prepack.check.reference import verify_reference
from prepack.errors import PrepackError
from prepack.formats.common import list_array, list_column
from prepack.formats.reference import REFERENCE_MANIFEST, REFERENCE_SCHEMA, read_reference_manifest
from prepack.model.packing import enable_packing
from prepack.storage.files import write_record_batch
from prepack.training.reference import write_reference_logps
from tests.corpus import NOT_A_FILE, make_not_a_file
from tests.train.test_preference import MAX_LEN, pair_build

CASES = int(os.environ.get("FUZZ_REFERENCE_CASES", 150))
VOCAB = 50_259  # the demo tokenizer's ids, whole


def _model() -> torch.nn.Module:
    """A one-layer float32 Llama over the demo tokenizer's ids: cheap, and its values differ per document."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_LEN)
    torch.manual_seed(3)
    return enable_packing(LlamaForCausalLM(config)).eval()


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, Path, list[np.ndarray]]:
    """A pair build of four shards, its reference directory, and every pack's values as the loader serves them."""
    root = tmp_path_factory.mktemp("fuzz-reference")
    build = pair_build(root, shard_size=3000)
    reference = root / "reference"
    write_reference_logps(build, _model(), reference, batch_size=2)
    assert len(read_manifest(build).shards) == 4
    return build, reference, _served(build, reference)


def _served(build: Path, reference: Path, **options) -> list[np.ndarray]:
    dataset = PackedDataset(build, reference=reference, **options)
    return [np.array(dataset[i]["reference_logps"]) for i in range(len(dataset))]


def _hf_served(build: Path, reference: Path) -> list[np.ndarray]:
    return [np.asarray(row["reference_logps"], np.float64) for row in open_hf_dataset(build, reference=reference)]


# Corruptions: each a tuple drawn by hypothesis (so that a failure shrinks to a few plain values) ----------

_ODD_INTS = [-(2**63), -(2**31), -1, 0, 1, 2, 3, 4, 5, 2**31 - 1, 2**63, 10**30]
_ODD_VALUES = [None, True, False, 1.5, "", "../x", "/etc/passwd", [], {}, [1], {"a": 1}, "reference-00000.arrow",
               "f" * 64, "0" * 64, "x" * 10_000, *_ODD_INTS]
_ODD_FLOATS = [float("nan"), float("inf"), -float("inf"), 0.5, 1e308, -0.0, -1e-300, 5e-324]
_FILE_KINDS = ["delete", "swap", "rename", "extra", "symlink", "fifo", "directory", "dev-zero", "empty", "copy-other"]

corruption = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 10_000), st.sampled_from(["odd", "nudge", "delete", "add"]),
              st.sampled_from(_ODD_VALUES), st.sampled_from([-1000, -1, 1, 1000])),
    st.tuples(st.just("text"), st.sampled_from(["truncate", "flip", "not-utf8", "big-int", "nest"]), st.integers(0, 10_000)),
    st.tuples(st.just("count"), st.sampled_from(["shards", "rows", "bytes", "drop-entry", "duplicate-entry", "reorder"]),
              st.integers(0, 3), st.sampled_from([-1, 1, 2])),
    st.tuples(st.just("bytes"), st.integers(0, 3), st.sampled_from(["truncate", "flip", "insert", "overwrite", "value-bit"]),
              st.integers(0, 10_000), st.booleans()),
    st.tuples(st.just("values"), st.integers(0, 3), st.sampled_from(["value"] * 4 + ["move", "drop-row", "add-row", "empty-row"]),
              st.integers(0, 10_000), st.sampled_from(_ODD_FLOATS), st.booleans()),
    st.tuples(st.just("file"), st.integers(0, 3), st.sampled_from([*_FILE_KINDS, "manifest-gone", "manifest-symlink"]),
              st.integers(0, 3)),
)


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield path + (key,), item
            yield from _leaves(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield path + (index,), item
            yield from _leaves(item, path + (index,))


def _read(path: Path) -> bytes:
    """The bytes of a regular file. One that an earlier corruption made a link, a FIFO or a directory is an
    OSError, "not applicable" to `_corrupt`: read, a FIFO would block and /dev/zero fill the memory."""
    if not stat.S_ISREG(path.lstat().st_mode):
        raise OSError(f"{path.name} is no longer a regular file")
    return path.read_bytes()


def _write(path: Path, data: bytes) -> None:
    """Write a regular file, or a new one: into a FIFO an earlier corruption made, the write would block."""
    if os.path.lexists(path):
        _read(path)
    path.write_bytes(data)


def _manifest(copy: Path) -> dict:
    return json.loads(_read(copy / REFERENCE_MANIFEST))


def _write_manifest(copy: Path, raw) -> None:
    _write(copy / REFERENCE_MANIFEST, json.dumps(raw).encode())


def _record(copy: Path, name: str) -> None:
    """Update `name`'s entry (bytes, sha256) to the file as it now is: a consistent rewrite."""
    raw = _manifest(copy)
    data = _read(copy / name)
    for entry in raw["files"]:
        if entry["name"] == name:
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    _write_manifest(copy, raw)


def _file(copy: Path, index: int) -> Path:
    return copy / f"reference-{index:05d}.arrow"


def _field(copy, at, kind, odd, nudge) -> bool:
    raw = _manifest(copy)
    path, old = list(_leaves(raw))[at % len(list(_leaves(raw)))]
    parent = raw
    for step in path[:-1]:
        parent = parent[step]
    if kind == "nudge" and type(old) is int:
        parent[path[-1]] = old + nudge
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "add" and isinstance(parent, dict):
        parent["extra"] = odd
    else:
        parent[path[-1]] = odd
    _write_manifest(copy, raw)
    return False


def _text(copy, kind, at) -> bool:
    text = _read(copy / REFERENCE_MANIFEST)
    if kind == "truncate":
        text = text[: at % len(text)]
    elif kind == "flip":
        text = text[: at % len(text)] + bytes([text[at % len(text)] ^ 0x20]) + text[at % len(text) + 1 :]
    elif kind == "not-utf8":
        text = text.replace(b'"name": "', b'"name": "\xff', 1)
    elif kind == "big-int":
        text = text.replace(b'"rows": ', b'"rows": ' + b"9" * 5000, 1)
    else:
        text = text.rstrip()[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _write(copy / REFERENCE_MANIFEST, text)
    return False


def _count(copy, kind, index, delta) -> bool:
    raw = _manifest(copy)
    files = raw["files"]
    if kind == "shards":
        raw["shards"] += delta
    elif kind in ("rows", "bytes"):
        files[index % len(files)][kind] += delta
    elif kind == "drop-entry":
        del files[index % len(files)]
    elif kind == "duplicate-entry":
        files.insert(index % len(files), dict(files[index % len(files)]))
    else:  # two entries swapped, their names kept in order
        a, b = index % len(files), (index + 1) % len(files)
        names = [entry["name"] for entry in files]
        files[a], files[b] = files[b], files[a]
        for entry, name in zip(files, names):
            entry["name"] = name
    _write_manifest(copy, raw)
    return False


def _bytes(copy, index, kind, at, record) -> bool:
    path = _file(copy, index)
    data = bytearray(_read(path))
    if kind == "truncate":
        data = data[: at % len(data)]
    elif kind == "flip":
        data[at % len(data)] ^= 1 << (at % 8)
    elif kind == "insert":
        data[at % (len(data) + 1) : at % (len(data) + 1)] = b"\x01\x02\x03"
    elif kind == "value-bit":  # a value's lowest bit, found through the zero-copy read: still a log-probability
        buffer = pa.py_buffer(bytes(data))
        values = pa.ipc.open_stream(pa.BufferReader(buffer)).read_next_batch().column(0).values.buffers()[1]
        data[values.address - buffer.address + 8 * (at % (values.size // 8))] ^= 1
    else:
        data[at % len(data) : at % len(data) + 8] = b"\xff" * 8
    _write(path, bytes(data))
    if record:
        _record(copy, path.name)
    return record


def _values(copy, index, kind, at, odd, record) -> bool:
    """Rewrite a file's values as a valid Arrow stream of the schema, changed: then maybe record it."""
    path = _file(copy, index)
    batch = pa.ipc.open_stream(_read(path)).read_next_batch()
    offsets, values = (array.copy() for array in list_column(batch, "logps"))
    if kind == "value" and len(values):
        values[at % len(values)] = odd
    elif kind == "move" and len(offsets) > 2:
        offsets[1] -= 1
    elif kind == "drop-row":
        offsets, values = offsets[:-1], values[: offsets[-2]]
    elif kind == "add-row":
        offsets, values = np.append(offsets, offsets[-1] + 2), np.append(values, [-1.0, -2.0])
    else:  # row 0 emptied: its values go to row 1
        offsets[1] = 0
    write_record_batch(path, pa.RecordBatch.from_arrays([list_array(offsets, values)], schema=REFERENCE_SCHEMA))
    if record:
        _record(copy, path.name)
    return record


def _files(copy, index, kind, other) -> bool:
    path, other_path = _file(copy, index), _file(copy, other)
    if kind == "delete":
        path.unlink()
    elif kind == "swap" and path != other_path:
        path.rename(copy / "tmp")
        other_path.rename(path)
        (copy / "tmp").rename(other_path)
    elif kind == "rename":
        path.rename(_file(copy, 4 + other))
    elif kind == "extra":
        _write(_file(copy, 4 + other), _read(path))
    elif kind in NOT_A_FILE:
        make_not_a_file(path, kind)
    elif kind == "empty":
        _write(path, b"")
    elif kind == "copy-other":
        _write(path, _read(other_path))
    elif kind == "manifest-gone":
        (copy / REFERENCE_MANIFEST).unlink()
    elif kind == "manifest-symlink":
        moved = copy.parent / "moved-reference.json"
        (copy / REFERENCE_MANIFEST).rename(moved)
        (copy / REFERENCE_MANIFEST).symlink_to(moved)
    return False


_APPLY = {"field": _field, "text": _text, "count": _count, "bytes": _bytes, "values": _values, "file": _files}


def _corrupt(copy: Path, corruptions) -> tuple[bool, list[str]]:
    """Apply each corruption (one that no longer applies after the ones before is skipped); whether a file
    was rewritten and recorded, and what was done."""
    recorded, done = False, []
    for kind, *arguments in corruptions:
        try:
            recorded |= _APPLY[kind](copy, *arguments)
            done.append(f"{kind} {arguments}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, json.JSONDecodeError, UnicodeDecodeError,
                pa.ArrowException, AttributeError, IndexError, KeyError, TypeError, ValueError, OSError, RecursionError,
                ZeroDivisionError):
            done.append(f"{kind} {arguments}: not applicable after the ones before")
    return recorded, done


# The property ---------------------------------------------------------------------------------------------------


def _allowed(served: list[np.ndarray], valid: list[np.ndarray], recorded: bool, found: bool) -> bool:
    """Served values are the valid ones; or verify found a problem; or, after a recorded rewrite, values
    the format allows (one per document, finite, at most 0)."""
    if len(served) == len(valid) and all(np.array_equal(a, b) for a, b in zip(served, valid)):
        return True
    if found:
        return True
    return recorded and len(served) == len(valid) and all(
        len(a) == len(b) and np.isfinite(a).all() and (a <= 0).all() for a, b in zip(served, valid))


@pytest.mark.slow
@example(corruptions=[("values", 1, "value", 0, float("nan"), True)], hf=0)  # each check of the loader, met once
@example(corruptions=[("values", 2, "value", 1, 0.5, True)], hf=1)
@example(corruptions=[("values", 3, "move", 0, 0.5, True)], hf=1)
@example(corruptions=[("values", 0, "drop-row", 0, 0.5, True)], hf=1)
@example(corruptions=[("count", "rows", 1, 1)], hf=1)
@example(corruptions=[("file", 1, "copy-other", 2)], hf=1)
@example(corruptions=[("bytes", 2, "overwrite", 300, False)], hf=0)
@example(corruptions=[("bytes", 1, "value-bit", 3, False)], hf=0)
@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruptions=st.lists(corruption, min_size=1, max_size=3), hf=st.integers(0, 9))
def test_a_corrupted_reference_directory_is_a_named_error_a_verify_finding_or_the_valid_values(valid, corruptions, hf):
    build, reference, values = valid
    faulthandler.dump_traceback_later(120, exit=True)  # a reader that hangs (a FIFO, /dev/zero) fails the run
    try:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(shutil.copytree(reference, Path(tmp) / "reference", symlinks=True))
            recorded, done = _corrupt(copy, corruptions)
            before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file() and not p.is_symlink()}
            try:
                read_reference_manifest(copy)
            except PrepackError:
                pass
            try:
                found = bool(verify_reference(build, copy))
            except PrepackError:
                found = True
            readers = {
                "PackedDataset": lambda: _served(build, copy),
                "PackedDataset(verify_checksums=True)": lambda: _served(build, copy, verify_checksums=True),
            }
            if hf == 0:  # open_hf_dataset writes the joined dataset: one case in ten
                readers["open_hf_dataset"] = lambda: _hf_served(build, copy)
            for name, reader in readers.items():
                try:
                    served = reader()
                except PrepackError:
                    continue
                checked = name.endswith("True)")  # hashes every file: a verify finding does not excuse it
                assert _allowed(served, values, recorded, found and not checked), (name, done)
            try:  # the writer takes the directory only when every file checks, and changes nothing in it
                write_reference_logps(build, _model(), copy)
                assert not found, done
            except PrepackError:
                pass
            after = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file() and not p.is_symlink()}
            assert after == before, done
    finally:
        faulthandler.cancel_dump_traceback_later()
