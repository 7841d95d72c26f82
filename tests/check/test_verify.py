"""`prepack verify`: a clean build passes; each kind of damage is caught, in its own test, and reported
at the exact shard, row and column (or corpus row)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack import build
from prepack.errors import FormatError, InputError
from prepack.check.verify import Problem, verify_build
from tests.cli import invoke_prepack, run_prepack
from tests.corpus import corpus_table, edit_json, record_shard, write_corpus

MAX_LEN = 32
FIRST_TOKEN = 10_000  # every token of the corpus is distinct: FIRST_TOKEN + its position in the corpus


def make_documents() -> list[list[int]]:
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 30, size=120)
    lengths[[3, 40, 77]] = [70, 33, 100]  # longer than MAX_LEN
    lengths[[10, 90]] = 0  # empty
    ends = np.cumsum(lengths)
    return [
        list(range(FIRST_TOKEN + e - n, FIRST_TOKEN + e)) for n, e in zip(lengths.tolist(), ends.tolist())
    ]


def labels_of(documents: list[list[int]]) -> list[list[int]]:
    return [[-100] + doc[1:] if doc else [] for doc in documents]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("verify")
    documents = make_documents()
    (tmp / "src").mkdir()
    corpus = write_corpus(tmp / "src" / "c.parquet", corpus_table(documents, labels_of(documents)))
    builds = {}
    for overflow in ("split", "truncate", "drop"):
        builds[overflow] = tmp / overflow
        build(corpus, builds[overflow], max_len=MAX_LEN, overflow=overflow, shard_size=2500)
    return {"corpus": corpus, "builds": builds, "documents": documents}


@pytest.fixture
def packed(clean, tmp_path) -> Path:
    """A copy of the split build to damage."""
    return shutil.copytree(clean["builds"]["split"], tmp_path / "packed")


def rewrite_shard(out: Path, name: str, edit) -> None:
    """Replace a shard's record batch by `edit(batch)` and record the new file's size and hash in the
    manifest, so that only the row checks can notice."""
    path = out / name
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    batch = edit(batch)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    record_shard(out / "manifest.json", path)


def with_column(batch: pa.RecordBatch, name: str, rows: list) -> pa.RecordBatch:
    array = pa.array(rows, batch.schema.field(name).type)
    return pa.RecordBatch.from_arrays(
        [array if n == name else batch.column(n) for n in batch.schema.names], schema=batch.schema
    )


def shard_rows(out: Path, name: str) -> list[dict]:
    with pa.memory_map(str(out / name)) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def row_with_documents(rows: list[dict], at_least: int = 2) -> int:
    return next(r for r, row in enumerate(rows) if len(row["source_rows"]) >= at_least)


# --- clean builds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_clean_build_passes_with_and_without_source(clean, overflow):
    out = clean["builds"][overflow]
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) > 3
    assert verify_build(out) == []
    assert verify_build(out, clean["corpus"], all_problems=True) == []


# --- damage, one kind per test ----------------------------------------------------------------------


def test_a_flipped_byte_is_caught_and_located_with_source(clean, packed):
    rows = shard_rows(packed, "shard-00000.arrow")
    r = row_with_documents(rows)
    d = 1  # the pack's second document; its first token has label -100, so its bytes occur once
    token = rows[r]["input_ids"][rows[r]["cu_seqlens"][d]]
    data = bytearray((packed / "shard-00000.arrow").read_bytes())
    pattern = struct.pack("<i", token)
    assert data.count(pattern) == 1
    data[data.index(pattern)] ^= 1
    (packed / "shard-00000.arrow").write_bytes(bytes(data))

    [problem] = verify_build(packed)
    assert (problem.file, problem.row, problem.column) == ("shard-00000.arrow", None, None)
    assert "sha256" in problem.message
    assert json.loads((packed / "manifest.json").read_text())["shards"][0]["sha256"] in problem.message

    problems = verify_build(packed, clean["corpus"], all_problems=True)
    assert problems[0] == problem
    [located] = problems[1:]
    assert (located.file, located.row, located.column) == ("shard-00000.arrow", r, "input_ids")
    assert f"token {rows[r]['cu_seqlens'][d]} of the pack" in located.message
    assert f"is {token ^ 1}; the source has {token}" in located.message


def test_a_truncated_shard_is_caught(packed):
    path = packed / "shard-00001.arrow"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    [problem] = verify_build(packed)
    assert problem.file == "shard-00001.arrow"
    assert f"{size // 2} bytes, but the manifest says {size}" in problem.message
    problems = verify_build(packed, all_problems=True)
    assert [p.file for p in problems[:2]] == ["shard-00001.arrow"] * 2
    assert "not a readable Arrow IPC stream" in problems[1].message
    assert "skipped" in problems[-1].message


def test_a_missing_shard_is_caught(packed):
    (packed / "shard-00002.arrow").unlink()
    [problem] = verify_build(packed)
    assert problem.file == "shard-00002.arrow"
    assert "missing" in problem.message


def test_the_directory_is_checked_before_any_shard_is_read(packed):
    edit_json(packed / "manifest.json", lambda m: m["shards"][0].update(name="../shard-00000.arrow"))
    (packed / "shard-00002.arrow").unlink()
    shutil.copy(packed / "shard-00001.arrow", packed / "shard-99999.arrow")
    path = packed / "shard-00003.arrow"
    path.write_bytes(path.read_bytes()[:100])
    problems = verify_build(packed, all_problems=True)
    assert [(p.file, p.column) for p in problems[:5]] == [
        ("manifest.json", "shards[0].name"),
        ("shard-00002.arrow", None),
        ("shard-00003.arrow", None),
        ("shard-00000.arrow", None),  # no longer listed under that name
        ("shard-99999.arrow", None),
    ]
    assert "'../shard-00000.arrow', not 'shard-00000.arrow'" in problems[0].message
    assert "missing" in problems[1].message and "100 bytes" in problems[2].message
    assert "does not list" in problems[3].message
    assert problems[5].file == "shard-00003.arrow"  # read despite its size
    assert "not a readable Arrow IPC stream" in problems[5].message
    assert "3 shard(s) could not be read" in problems[-1].message


def test_a_tampered_cu_seqlens_is_caught_at_its_row(packed):
    rows = shard_rows(packed, "shard-00001.arrow")
    r = row_with_documents(rows)
    tampered = [row["cu_seqlens"] for row in rows]
    tampered[r] = tampered[r][:-1] + [tampered[r][-1] + 1]  # an off-by-one end
    rewrite_shard(packed, "shard-00001.arrow", lambda b: with_column(b, "cu_seqlens", tampered))
    [problem] = verify_build(packed)
    assert (problem.file, problem.row, problem.column) == ("shard-00001.arrow", r, "cu_seqlens")
    n = len(rows[r]["input_ids"])
    assert f"ends at {n + 1}, but the pack has {n} tokens" in problem.message
    assert str(problem).startswith(f"shard-00001.arrow, row {r}, column 'cu_seqlens': ")


def test_a_tampered_segment_ids_is_caught_at_its_row(packed):
    rows = shard_rows(packed, "shard-00003.arrow")
    r = row_with_documents(rows)
    tampered = [row["segment_ids"] for row in rows]
    start = rows[r]["cu_seqlens"][1]  # the first token of document 2 ...
    tampered[r][start] = 1  # ... claims to belong to document 1
    rewrite_shard(packed, "shard-00003.arrow", lambda b: with_column(b, "segment_ids", tampered))
    [problem] = verify_build(packed)
    assert (problem.file, problem.row, problem.column) == ("shard-00003.arrow", r, "segment_ids")
    assert f"token {start} has 1, cu_seqlens says 2" in problem.message


def test_every_tampered_row_is_reported_with_all(packed):
    names = ["shard-00000.arrow", "shard-00002.arrow"]
    expected = []
    for name in names:
        rows = shard_rows(packed, name)
        tampered = [row["max_seqlen"] for row in rows]
        for r in (0, len(rows) - 1):
            tampered[r] += 1
            expected.append((name, r, "max_seqlen"))
        rewrite_shard(packed, name, lambda b, t=tampered: with_column(b, "max_seqlen", t))
    problems = verify_build(packed, all_problems=True)
    assert [(p.file, p.row, p.column) for p in problems[:-1]] == expected
    assert "skipped" in problems[-1].message
    assert verify_build(packed) == problems[:1]


@pytest.mark.parametrize(
    ("lie", "file", "column", "message"),
    [
        (
            lambda m: m["totals"].update(packs=m["totals"]["packs"] + 1),
            "manifest.json",
            "totals.packs",
            "sum of shards[].rows",
        ),
        (
            lambda m: m["totals"].update(split=m["totals"]["split"] + 1),
            "manifest.json",
            "totals.segments",
            "documents - empty",
        ),
        (
            lambda m: (
                m["shards"][1].update(rows=m["shards"][1]["rows"] + 1),
                m["totals"].update(
                    packs=m["totals"]["packs"] + 1, padding_tokens=m["totals"]["padding_tokens"] + MAX_LEN
                ),
            ),
            "shard-00001.arrow",
            None,
            "packs, but the manifest says",
        ),
        (
            lambda m: (
                m["shards"][2].update(tokens=m["shards"][2]["tokens"] - 1),
                m["shards"][3].update(tokens=m["shards"][3]["tokens"] + 1),
            ),
            "shard-00002.arrow",
            "input_ids",
            "tokens, but the manifest says",
        ),
    ],
    ids=["totals.packs", "totals.split", "shard rows", "shard tokens"],
)
def test_a_manifest_that_lies_about_counts_is_caught(packed, lie, file, column, message):
    edit_json(packed / "manifest.json", lie)
    [problem] = verify_build(packed)
    assert (problem.file, problem.column) == (file, column)
    assert message in problem.message


def test_a_consistent_lie_about_documents_needs_the_source(clean, packed):
    def lie(m):  # one more empty document, everywhere it is counted
        m["totals"].update(documents=m["totals"]["documents"] + 1, empty=m["totals"]["empty"] + 1)
        m["inputs"][0]["rows"] += 1

    edit_json(packed / "manifest.json", lie)
    assert verify_build(packed) == []
    problems = verify_build(packed, clean["corpus"], all_problems=True)
    assert [(p.file, p.column) for p in problems] == [
        ("manifest.json", "inputs"),
        ("manifest.json", "totals.documents"),
        ("manifest.json", "totals.empty"),
    ]


def test_a_source_document_missing_from_the_packs_is_named(clean, tmp_path):
    documents = make_documents()
    assert documents[10] == []  # empty when built, so no pack holds row 10
    documents[10] = [7, 8, 9]
    source = tmp_path / "src"
    source.mkdir()
    corpus = write_corpus(source / "c.parquet", corpus_table(documents, labels_of(documents)))
    problems = verify_build(clean["builds"]["split"], corpus, all_problems=True)
    assert problems[0] == Problem(
        source_file="c.parquet",
        source_row=10,
        column="input_ids",
        message="the document (3 tokens) is in no pack (corpus row 10).",
    )
    assert [p.column for p in problems[1:]] == ["totals.input_tokens", "totals.empty"]


def test_documents_of_a_lost_pack_are_each_named(clean, packed):
    rows = shard_rows(packed, "shard-00001.arrow")
    r = row_with_documents(rows)
    lost = rows[r]
    kept = pa.array([i != r for i in range(len(rows))])
    rewrite_shard(packed, "shard-00001.arrow", lambda b: b.filter(kept))

    def recount(m):
        m["shards"][1].update(rows=len(rows) - 1, tokens=m["shards"][1]["tokens"] - len(lost["input_ids"]))

    edit_json(packed / "manifest.json", recount)
    problems = verify_build(packed, clean["corpus"], all_problems=True)
    missing = [(p.source_row, p.message) for p in problems if p.source_row is not None]
    assert [row for row, _ in missing] == lost["source_rows"]
    assert all("is in no pack" in message for _, message in missing)
    assert problems[0].file == "manifest.json"  # the totals no longer add up, and say so first


def test_a_document_in_two_packs_is_caught(packed):
    def duplicate_last_row(batch: pa.RecordBatch) -> pa.RecordBatch:
        return (
            pa.Table.from_batches([batch, batch.slice(batch.num_rows - 1)]).combine_chunks().to_batches()[0]
        )

    rows = shard_rows(packed, "shard-00000.arrow")
    rewrite_shard(packed, "shard-00000.arrow", duplicate_last_row)
    edit_json(packed / "manifest.json", lambda m: m["shards"][0].update(rows=len(rows) + 1))
    problems = verify_build(packed, all_problems=True)
    duplicates = [p for p in problems if "is also in" in p.message]
    assert (
        duplicates
        and duplicates[0].file == "shard-00000.arrow"
        and duplicates[0].row in (len(rows) - 1, len(rows))
    )


# --- inputs that are not findings ------------------------------------------------------------------


def test_not_a_build_or_an_unreadable_source_raises(clean, tmp_path):
    with pytest.raises(FormatError, match="not a finished prepack build"):
        verify_build(tmp_path)
    with pytest.raises(InputError):
        verify_build(clean["builds"]["split"], tmp_path / "no-such-corpus")


def test_an_invalid_manifest_is_a_finding(packed):
    (packed / "manifest.json").write_text("{not json")
    [problem] = verify_build(packed)
    assert problem.file == "manifest.json" and "cannot be read as JSON" in problem.message


@pytest.mark.slow
def test_cli_exit_codes(clean, packed, tmp_path):
    result = run_prepack("verify", str(clean["builds"]["split"]), "--source", str(clean["corpus"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no problems" in result.stdout

    (packed / "shard-00002.arrow").unlink()
    (packed / "shard-00001.arrow").write_bytes(b"garbage")
    result = invoke_prepack("verify", str(packed))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"problem: {verify_build(packed)[0]}"]
    result = invoke_prepack("verify", str(packed), "--all")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"problem: {p}" for p in verify_build(packed, all_problems=True)]
    assert len(result.stdout.splitlines()) >= 3

    result = invoke_prepack("verify", str(clean["builds"]["split"]), "--source", str(tmp_path / "nothing"))
    assert result.returncode == 2 and result.stdout == ""
    assert "no such file or directory" in " ".join(result.stderr.split())
