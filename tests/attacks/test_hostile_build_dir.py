"""Build directories made to hurt a reader: every reader (the loader, the Hugging Face loader, inspect,
verify) refuses them with a FormatError (verify: a problem), promptly, before serving a wrong row or
reading a file outside the build."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack import build, inspect_build, open_hf_dataset, read_manifest, verify_build
from prepack.errors import FormatError
from prepack.training.dataset import PackedDataset
from tests.corpus import corpus_table, edit_json, record_shard, write_corpus


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile")
    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 100, size=n).tolist() for n in rng.integers(1, 30, size=60)]
    out = tmp / "packed"
    build(write_corpus(tmp / "c.parquet", corpus_table(documents)), out, max_len=32, shard_size=800)
    assert len(read_manifest(out).shards) >= 2
    return out


@pytest.fixture
def copy(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "packed"))


def _all_rows(path: Path) -> list:
    dataset = PackedDataset(path)
    rows = [dataset[i] for i in range(len(dataset))]
    for row in rows:  # what a served row must satisfy
        assert row["cu_seqlens"][-1] == len(row["input_ids"]) == len(row["segment_ids"])
    return rows


def _verify(path: Path) -> None:
    problems = verify_build(path)
    if problems:
        raise FormatError(str(problems[0]))


READERS = {
    "PackedDataset": _all_rows,
    "open_hf_dataset": lambda path: open_hf_dataset(path)[:],
    "inspect_build": inspect_build,
    "verify_build": _verify,
}


def _refusal(reader: str, path: Path, seconds: float = 30) -> str:
    """The FormatError message `reader` ends with on `path`; fails if it succeeds, raises anything
    else, or has not finished after `seconds` (a reader blocked on a FIFO or reading /dev/zero)."""
    outcome: list = []

    def run() -> None:
        try:
            READERS[reader](path)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{reader} still runs after {seconds} s"
    [error] = outcome
    assert isinstance(error, FormatError), f"{reader}: {error!r}"
    return str(error)


def _overwrite_offsets(path: Path, column: str, edit) -> None:
    """Overwrite `column`'s offsets buffer in the shard's bytes with `edit(offsets)`: the stream is read
    zero-copy, so the buffer's address in memory gives its place in the file."""
    data = pa.py_buffer(path.read_bytes())
    array = pa.ipc.open_stream(pa.BufferReader(data)).read_next_batch().column(column)
    at = array.buffers()[1].address - data.address
    offsets = np.frombuffer(data, dtype="<i4", count=len(array) + 1, offset=at)
    edited = bytearray(data.to_pybytes())
    edited[at : at + offsets.nbytes] = np.asarray(edit(offsets.copy()), dtype="<i4").tobytes()
    path.write_bytes(bytes(edited))


# 1. List offsets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
def test_offsets_shifted_past_the_values_are_refused(copy, reader):
    # Every row of input_ids points past its values: lengths, and so cu_seqlens, still agree, but a
    # reader that trusts the offsets serves rows of 0 tokens whose cu_seqlens says otherwise.
    _overwrite_offsets(copy / "shard-00000.arrow", "input_ids", lambda off: off + off[-1])
    record_shard(copy / "manifest.json", copy / "shard-00000.arrow")
    message = _refusal(reader, copy)
    assert "shard-00000.arrow" in message and "offset" in message


@pytest.mark.parametrize("reader", READERS)
def test_offsets_that_go_back_are_refused_at_their_row(copy, reader):
    # Inside the values, but rows 1 and 2 swap their boundary: row 2 would have a negative length.
    def swap(off):
        off = off.copy()
        off[2], off[3] = off[3], off[2]
        return off

    for column in ("input_ids", "segment_ids"):
        _overwrite_offsets(copy / "shard-00000.arrow", column, swap)
    record_shard(copy / "manifest.json", copy / "shard-00000.arrow")
    message = _refusal(reader, copy)
    assert "shard-00000.arrow" in message and "offset" in message


def test_a_shifted_offsets_problem_names_row_and_column(copy):
    from prepack.formats.shards import check_shard, open_shard

    batch = open_shard(copy / "shard-00000.arrow", has_labels=False, max_len=32)
    ids = batch.column("input_ids")
    off = ids.offsets.to_numpy().copy()
    off[2], off[3] = off[3], off[2]
    bad = pa.ListArray.from_arrays(pa.array(off), ids.values)
    columns = [bad if name == "input_ids" else batch.column(name) for name in batch.schema.names]
    with pytest.raises(FormatError) as caught:
        check_shard(pa.RecordBatch.from_arrays(columns, schema=batch.schema), 32, "shard-00000.arrow")
    problem = caught.value.problem
    assert (problem.file, problem.row, problem.column) == ("shard-00000.arrow", 2, "input_ids")
    assert "go back" in problem.message


# 2. Names outside the build, and files that are not regular files -----------------------------------


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", ["../secret.arrow", "ABSOLUTE"])
def test_shard_names_outside_the_build_are_refused_without_reading_them(copy, reader, name):
    secret = copy.parent / "secret.arrow"
    secret.write_bytes(b"TOPSECRET" * 100)
    name = str(secret) if name == "ABSOLUTE" else name
    edit_json(copy / "manifest.json", lambda m: m["shards"][0].update(name=name))
    message = _refusal(reader, copy)
    assert f"is named {name!r}, not 'shard-00000.arrow'" in message
    # The secret's first bytes, read as Arrow's metadata length, were in inspect's error on main.
    assert str(int.from_bytes(b"TOPS", "little")) not in message


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero symlink", "symlink to a shard", "directory"])
def test_a_shard_that_is_not_a_regular_file_is_refused_promptly(copy, reader, kind):
    shard = copy / "shard-00001.arrow"
    real = copy.parent / "elsewhere.arrow"
    shutil.move(shard, real)
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "dev-zero symlink":
        os.symlink("/dev/zero", shard)
    elif kind == "symlink to a shard":  # same bytes, so only the type check can refuse it
        os.symlink(real, shard)
    else:
        shard.mkdir()
    try:
        message = _refusal(reader, copy)
    finally:
        if kind == "fifo":  # let a reader still blocked on it (main's) finish
            try:
                os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert "shard-00001.arrow" in message and "regular file" in message


@pytest.mark.parametrize("reader", READERS)
def test_a_manifest_that_is_a_fifo_is_refused_promptly(copy, reader):
    (copy / "manifest.json").unlink()
    os.mkfifo(copy / "manifest.json")
    try:
        assert "regular file" in _refusal(reader, copy)  # verify raises it too: not a build at all
    finally:
        try:
            os.close(os.open(copy / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


# 3. Compressed bodies, coerced manifest values, schema metadata -------------------------------------


def _rewrite(path: Path, name: str, options=None, metadata=None) -> None:
    reader = pa.ipc.open_stream((path / name).read_bytes())
    batch = reader.read_next_batch()
    schema = reader.schema if metadata is None else reader.schema.with_metadata(metadata)
    with pa.ipc.new_stream(str(path / name), schema, options=options) as writer:
        writer.write_batch(batch.replace_schema_metadata(schema.metadata))
    record_shard(path / "manifest.json", path / name)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_compressed_shard_is_refused(copy, reader, codec):
    _rewrite(copy, "shard-00001.arrow", options=pa.ipc.IpcWriteOptions(compression=codec))
    message = _refusal(reader, copy)
    assert "shard-00001.arrow" in message and "compressed" in message


@pytest.mark.parametrize("reader", READERS)
def test_extra_schema_metadata_is_refused(copy, reader):
    _rewrite(copy, "shard-00000.arrow", metadata={"prepack.format_version": "2", "note": "hi"})
    assert "schema" in _refusal(reader, copy)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["shards"][0].update(rows=str(m["shards"][0]["rows"])), "shards.0.rows"),
        (lambda m: m.update(has_labels=0), "has_labels"),
        (lambda m: m["totals"].update(packs=float(m["totals"]["packs"])), "totals.packs"),
        (lambda m: m["options"].update(max_len="32"), "options.max_len"),
        (lambda m: m.update(format_version=2.0), "format_version 2.0"),
        (lambda m: m.update(format_version=True), "format_version True"),
        (lambda m: m["shards"][0].update(rows=2**63), "shards.0.rows"),
    ],
)
def test_manifest_values_must_have_their_json_type(copy, edit, message):
    edit_json(copy / "manifest.json", edit)
    with pytest.raises(FormatError, match=message):
        read_manifest(copy)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format_version": 2, "format_version": 2}', "'format_version' appears twice"),
        ('{"format_version": NaN}', "NaN is not a JSON number"),
        ('{"format_version": 2, "seed": ' + "9" * 5000 + "}", "5000 digits"),
        # One digit over the bound, alone and in a manifest with non-ASCII text (each integer then parsed by a hook).
        ('{"format_version": 2, "seed": -' + "9" * 101 + "}", "101 digits"),
        ('{"format_version": 2, "x": "\u00e9", "seed": ' + "9" * 101 + "}", "101 digits"),
        ('{"format_version": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
        ('{"format_version": 2, "x": "\udcff"}'.encode("utf-8", "surrogateescape"), "cannot be read as JSON"),
    ],
)
def test_manifests_that_break_json_parsers_are_format_errors(tmp_path, text, message):
    path = tmp_path / "manifest.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(FormatError, match=message):
        read_manifest(tmp_path)


@pytest.mark.parametrize("text", ['[1, -22, ' + "9" * 100 + "]", '["\u00e9", 1, -22, ' + "9" * 100 + "]"])
def test_integers_up_to_the_bound_parse_whatever_the_text_around_them(text):
    from prepack.formats.common import load_manifest_json

    assert load_manifest_json(text.encode(), "manifest.json", "m.json")[1][-3:] == [1, -22, int("9" * 100)]


def test_a_manifest_over_the_size_cap_is_refused_unread(copy, monkeypatch):
    from prepack.formats import common

    size = (copy / "manifest.json").stat().st_size
    monkeypatch.setattr(common, "MANIFEST_MAX_BYTES", size - 1)
    with pytest.raises(FormatError, match=f"larger than {size - 1} bytes"):
        read_manifest(copy)
    monkeypatch.setattr(common, "MANIFEST_MAX_BYTES", size)
    assert read_manifest(copy).shards
