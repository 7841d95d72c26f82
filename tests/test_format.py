"""The format's written description (schemas/) and the code agree; readers refuse what is wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack import build
from prepack.errors import FormatError
from prepack.format import (
    FORMAT_VERSION,
    Manifest,
    check_shard,
    open_shard,
    read_manifest,
    shard_file_problems,
    shard_schema,
    shard_sha256,
)
from tests.corpus import corpus_table, write_corpus

SCHEMAS = Path(__file__).parent.parent / "schemas"


def test_manifest_json_schema_matches_the_model():
    generated = json.dumps(Manifest.model_json_schema(), indent=2, sort_keys=True) + "\n"
    path = SCHEMAS / "manifest.schema.json"
    if os.environ.get("PREPACK_REGENERATE_SCHEMAS"):
        path.write_text(generated)
    assert path.read_text() == generated, (
        "schemas/manifest.schema.json is out of date: PREPACK_REGENERATE_SCHEMAS=1 pytest tests/test_format.py"
    )


def _type_name(dtype: pa.DataType) -> str:
    return f"list<{dtype.value_type}>" if pa.types.is_list(dtype) else str(dtype)


def test_shard_format_page_lists_the_columns_of_the_code():
    page = (SCHEMAS / "shard-format.md").read_text()
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", page, flags=re.MULTILINE))
    schema = shard_schema(has_labels=True, max_len=65_535)
    assert documented == {field.name: _type_name(field.type) for field in schema}
    # Above 65,535 tokens a pack may hold more documents than uint16 counts: the page says so.
    wide = shard_schema(has_labels=True, max_len=65_536).field("segment_ids").type
    assert re.search(rf"^\| `segment_ids` \|.*`{_type_name(wide)}` when `max_len` > 65,535", page, re.MULTILINE)
    assert f"version {FORMAT_VERSION}" in page.splitlines()[0]
    assert f'`prepack.format_version` = `"{FORMAT_VERSION}"`' in page
    assert schema.metadata == {b"prepack.format_version": str(FORMAT_VERSION).encode()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("format")
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 100, size=n).tolist() for n in rng.integers(1, 30, size=80)]
    build(write_corpus(tmp / "c.parquet", corpus_table(documents)), tmp / "packed", max_len=32)
    return tmp / "packed"


def test_unknown_format_version_is_refused(built, tmp_path):
    raw = json.loads((built / "manifest.json").read_text())
    raw["format_version"] = FORMAT_VERSION + 1
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(FormatError, match=f"format_version {FORMAT_VERSION + 1}"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, "does not exist"), ("{not json", "cannot be read as JSON"), (f'{{"format_version": {FORMAT_VERSION}}}', "not a valid")],
)
def test_bad_manifests_are_refused(tmp_path, text, message):
    if text is not None:
        (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(FormatError, match=message):
        read_manifest(tmp_path)


def _tampered(batch: pa.RecordBatch, column: str, edit) -> pa.RecordBatch:
    array = batch.column(column)
    if pa.types.is_list(array.type):
        values = array.values.to_numpy().copy()
        edit(values)
        array = pa.ListArray.from_arrays(array.offsets, pa.array(values))
    else:
        values = array.to_numpy().copy()
        edit(values)
        array = pa.array(values)
    columns = [array if name == column else batch.column(name) for name in batch.schema.names]
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


@pytest.mark.parametrize(
    ("column", "edit", "message"),
    [
        ("cu_seqlens", lambda v: v.__setitem__(1, v[1] + 1), "cu_seqlens"),
        ("cu_seqlens", lambda v: v.__setitem__(0, 1), "starts at 1"),
        ("cu_seqlens", lambda v: v.__setitem__(-1, 10**6), "ends at"),
        ("segment_ids", lambda v: v.__setitem__(0, 2), "segment_ids"),
        ("max_seqlen", lambda v: v.__setitem__(0, v[0] + 1), "max_seqlen"),
        ("input_ids", lambda v: v.__setitem__(3, -7), "negative token id"),
    ],
)
def test_check_shard_catches_tampered_columns(built, column, edit, message):
    batch = open_shard(built / "shard-00000.arrow", has_labels=False, max_len=32)
    check_shard(batch, 32, "shard-00000.arrow")
    with pytest.raises(FormatError, match=message):
        check_shard(_tampered(batch, column, edit), 32, "shard-00000.arrow")


def test_check_shard_refuses_a_null_inside_a_list(built):
    batch = open_shard(built / "shard-00000.arrow", has_labels=False, max_len=32)
    ids = batch.column("input_ids")
    values = pa.array(ids.values.to_pylist()[:2] + [None] + ids.values.to_pylist()[3:], pa.int32())
    columns = [pa.ListArray.from_arrays(ids.offsets, values) if n == "input_ids" else batch.column(n) for n in batch.schema.names]
    with pytest.raises(FormatError, match="shard-00000.arrow: column 'input_ids': has null values"):
        check_shard(pa.RecordBatch.from_arrays(columns, schema=batch.schema), 32, "shard-00000.arrow")


def test_open_shard_refuses_a_foreign_schema(tmp_path):
    path = tmp_path / "x.arrow"
    table = pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int64()))})
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(FormatError, match="schema"):
        open_shard(path, has_labels=False, max_len=32)
    path.write_bytes(b"garbage")
    with pytest.raises(FormatError, match="not a readable Arrow IPC stream"):
        open_shard(path, has_labels=False, max_len=32)


def test_shards_open_with_hugging_face_datasets(built):
    import datasets

    shard = str(built / "shard-00000.arrow")
    with pa.memory_map(shard) as source:
        expected = pa.ipc.open_stream(source).read_all().to_pylist()
    assert datasets.Dataset.from_file(shard).to_list() == expected
    loaded = datasets.load_dataset("arrow", data_files=[shard], split="train")
    assert loaded.to_list() == expected


def test_shard_files_are_checked_against_the_manifest(built, tmp_path):
    manifest = read_manifest(built)
    assert manifest.shards and list(shard_file_problems(built, manifest)) == []
    assert [shard_sha256(built / s.name) for s in manifest.shards] == [s.sha256 for s in manifest.shards]

    copy = shutil.copytree(built, tmp_path / "copy")
    (copy / manifest.shards[0].name).write_bytes(b"short")
    (copy / "shard-00002.arrow").unlink(missing_ok=True)
    entries = [
        manifest.shards[0],
        manifest.shards[0].model_copy(update={"name": "../shard-00000.arrow"}),
        manifest.shards[0].model_copy(update={"name": "shard-00002.arrow"}),
    ]
    found = list(shard_file_problems(copy, manifest.model_copy(update={"shards": entries})))
    assert [(p.index, p.kind, p.file) for p in found] == [
        (0, "size", "shard-00000.arrow"),
        (1, "name", "manifest.json"),
        (2, "missing", "shard-00002.arrow"),
    ]
    assert f"5 bytes, but the manifest says {manifest.shards[0].bytes}" in found[0].message
    assert "'../shard-00000.arrow', not 'shard-00001.arrow'" in found[1].message
