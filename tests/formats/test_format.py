"""The format's written description (schemas/) and the code agree; readers refuse what is wrong."""

from __future__ import annotations

import hashlib
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
from prepack.formats.common import FormatProblem
from prepack.formats.images import ImageSetManifest
from prepack.formats.reference import ReferenceManifest
from prepack.formats.shards import (
    FORMAT_VERSION,
    Manifest,
    check_shard,
    open_shard,
    read_manifest,
    shard_file_problems,
    shard_schema,
    shard_sha256,
)
from prepack.formats.store import StoreManifest
from tests.corpus import corpus_table, write_corpus

SCHEMAS = Path(__file__).parents[2] / "schemas"


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (Manifest, "manifest.schema.json"),
        (StoreManifest, "store.schema.json"),
        (ImageSetManifest, "image-set.schema.json"),
        (ReferenceManifest, "reference.schema.json"),
    ],
)
def test_json_schema_matches_the_model(model, name):
    generated = json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"
    path = SCHEMAS / name
    if os.environ.get("PREPACK_REGENERATE_SCHEMAS"):
        path.write_text(generated)
    assert path.read_text() == generated, (
        f"schemas/{name} is out of date: PREPACK_REGENERATE_SCHEMAS=1 pytest tests/formats/test_format.py"
    )


def _type_name(dtype: pa.DataType) -> str:
    return f"list<{dtype.value_type}>" if pa.types.is_list(dtype) else str(dtype)


def test_shard_format_page_lists_the_columns_of_the_code():
    page = (SCHEMAS / "shard-format.md").read_text()
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", page, flags=re.MULTILINE))
    schema = shard_schema(has_labels=True, max_len=65_535, sources=True, pairs=True, unpaired=True)  # every column, the optional ones too
    assert documented == {field.name: _type_name(field.type) for field in schema}
    # Above 65,535 tokens a pack may hold more documents than uint16 counts: the page says so.
    wide = shard_schema(has_labels=True, max_len=65_536).field("segment_ids").type
    assert re.search(rf"^\| `segment_ids` \|.*`{_type_name(wide)}` when `max_len` > 65,535", page, re.MULTILINE)
    assert f"version {FORMAT_VERSION}" in page.splitlines()[0]
    assert f'`prepack.format_version` = `"{FORMAT_VERSION}"`' in page
    assert schema.metadata == {b"prepack.format_version": str(FORMAT_VERSION).encode()}
    assert shard_schema(has_labels=True, max_len=65_535).names == [n for n in schema.names if n not in ("source_ids", "pair_roles", "desirable")]


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


def test_a_manifest_is_read_from_its_bytes_and_named_as_its_caller_says(built):
    """What a reader of object storage parses: the bytes it fetched, its problems naming the object."""
    data = (built / "manifest.json").read_bytes()
    assert read_manifest(data, "s3://bucket/packed/manifest.json") == read_manifest(built)
    broken = data.replace(b'"has_labels": false', b'"has_labels": 0')
    with pytest.raises(FormatError) as refused:
        read_manifest(broken, "s3://bucket/packed/manifest.json")
    assert refused.value.problem.file == "s3://bucket/packed/manifest.json"
    assert str(refused.value).startswith("s3://bucket/packed/manifest.json: is not a valid prepack manifest")


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


# The spec's machine-checkable parts -------------------------------------------------------------------


def test_shard_format_page_states_the_caps_of_the_code():
    from prepack.formats import common

    page = (SCHEMAS / "shard-format.md").read_text()
    assert f"`MANIFEST_MAX_BYTES` = {common.MANIFEST_MAX_BYTES} bytes" in page
    assert f"`_MAX_DIGITS` = {common._MAX_DIGITS}" in page


def _spec_rules(page: str) -> list[tuple[str, str]]:
    """The `= …` rows of the spec's arithmetic table, as (field, Python expression over t, o, m)."""
    rows = re.findall(r"^\| `(t\.\w+)` \| = (.+?) \|$", page, flags=re.MULTILINE)
    python = []
    for field, rule in rows:
        expression = rule.replace("`", "").replace("×", "*").replace("−", "-")
        expression = re.sub(r"Σ (\w+)\[\]\.(\w+)", r"sum(x.\2 for x in m.\1)", expression)
        expression = re.sub(r"⌈(.+) / (.+)⌉", r"-(-(\1) // (\2))", expression)
        python.append((field, expression))
    return python


def test_the_manifest_arithmetic_of_the_spec_holds_for_a_build(built):
    page = (SCHEMAS / "shard-format.md").read_text()
    rules = _spec_rules(page)
    assert {field for field, _ in rules} == {
        "t.documents", "t.packs", "t.tokens", "t.padding_tokens", "t.lower_bound", "t.segments", "t.input_tokens"
    }
    m = read_manifest(built)
    for field, expression in rules:
        value = eval(expression, {}, {"t": m.totals, "o": m.options, "m": m})  # noqa: S307 - our own page
        assert eval(field, {}, {"t": m.totals}) == value, (field, expression)


def test_the_fingerprint_is_the_specs(tmp_path):
    # The definition in schemas/shard-format.md, written again from the page.
    documents = [[5, 6, 7], [], [1] * 40, [9]]
    labels = [[-100, 6, 7], [], [1] * 40, [-100]]
    build(write_corpus(tmp_path / "c.parquet", corpus_table(documents, labels)), tmp_path / "out", max_len=16)

    def sha(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()

    lengths = b"".join(len(d).to_bytes(8, "little", signed=True) for d in documents)
    ids = b"".join(t.to_bytes(4, "little", signed=True) for d in documents for t in d)
    labs = b"".join(t.to_bytes(4, "little", signed=True) for d in labels for t in d)
    expected = hashlib.sha256(sha(lengths) + sha(ids) + sha(labs)).hexdigest()
    assert read_manifest(tmp_path / "out").fingerprint == expected


def test_the_tokenizer_hash_is_the_specs(tmp_path):
    from prepack.sources.tokenize import load_tokenizer
    from tests.demo_inputs import CHATML, gpt2_directory

    directory = gpt2_directory(tmp_path / "tok", CHATML)
    (directory / "model.safetensors").write_bytes(b"not a tokenizer file")
    names = ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    digest = hashlib.sha256()
    for name in sorted(n for n in names if (directory / n).is_file()):
        data = (directory / name).read_bytes()
        digest.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    assert load_tokenizer(directory).info.sha256 == digest.hexdigest()
    single = (directory / "tokenizer.json").read_bytes()
    expected = hashlib.sha256(b"tokenizer.json\0" + str(len(single)).encode() + b"\0" + single).hexdigest()
    assert load_tokenizer(directory / "tokenizer.json").info.sha256 == expected


def test_pack_layout_decodes_cu_seqlens():
    from prepack.formats.shards import pack_layout

    layout = pack_layout(np.array([0, 3, 5], np.int32), np.array([0, 2, 5, 0, 4], np.int32))
    assert [a.tolist() for a in layout] == [
        [5, 4],  # tokens
        [2, 1],  # documents
        [0, 0, 1],  # pack
        [1, 2, 1],  # number
        [0, 2, 0],  # starts
        [2, 3, 4],  # lengths
    ]
    assert layout._fields == ("tokens", "documents", "pack", "number", "starts", "lengths")


def test_check_shard_problems_are_fields(built):
    batch = open_shard(built / "shard-00000.arrow", has_labels=False, max_len=32)
    with pytest.raises(FormatError) as caught:
        check_shard(_tampered(batch, "max_seqlen", lambda v: v.__setitem__(2, v[2] + 1)), 32, "x.arrow")
    assert caught.value.problem == FormatProblem("x.arrow", caught.value.problem.message, 2, "max_seqlen")
    assert str(caught.value) == f"x.arrow: row 2, column 'max_seqlen': {caught.value.problem.message}"


def test_a_manifest_over_the_cap_is_never_written(tmp_path, monkeypatch):
    from prepack.formats import shards
    from prepack.errors import OutputError

    monkeypatch.setattr(shards, "MANIFEST_MAX_BYTES", 500)  # readers would refuse it: so does the writer
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]] * 4))
    with pytest.raises(OutputError, match="more than the 500 readers accept"):
        build(corpus, tmp_path / "out", max_len=8)
    assert [p.name for p in tmp_path.iterdir()] == ["c.parquet"]  # nothing left behind
