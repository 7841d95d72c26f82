"""Bad input: a message naming the file, the row and the column, and nothing written."""

from __future__ import annotations

import importlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prepack import build
from prepack.errors import InputError, OutputError
from tests.corpus import corpus_table, files, write_corpus


def assert_nothing_written(tmp_path, out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def parquet(tmp_path, name, **columns):
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def raw(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def truncated(tmp_path, name, cut):
    full = write_corpus(tmp_path / f"full-{name}", corpus_table([[1, 2, 3]] * 50))
    return raw(tmp_path, name, full.read_bytes()[:-cut])


def jsonl(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


CASES = {
    "missing column": (
        lambda t: parquet(t, "a.parquet", tokens=pa.array([[1, 2]])),
        ["a.parquet", "no column 'input_ids'", "--column"],
    ),
    "float ids": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[1.0, 2.5]])),
        ["a.parquet", "'input_ids'", "integers"],
    ),
    "negative id": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[1], [2], [3, -4]])),
        ["a.parquet", "row 2", "'input_ids'", "-4"],
    ),
    "id beyond int32": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[1], [2**31]])),
        ["a.parquet", "row 1", "'input_ids'", str(2**31)],
    ),
    "nested lists": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[[1, 2]], [[3]]])),
        ["a.parquet", "'input_ids'", "nested"],
    ),
    "null row": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[1], None])),
        ["a.parquet", "row 1", "'input_ids'", "null"],
    ),
    "jsonl non-integer id": (
        lambda t: jsonl(t, "a.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [1, 2.5]}]),
        ["a.jsonl", "row 1", "'input_ids'", "2.5"],
    ),
    "jsonl string id": (
        lambda t: jsonl(t, "a.jsonl", [{"input_ids": [1]}, {"input_ids": [1]}, {"input_ids": ["x"]}]),
        ["a.jsonl", "row 2", "'input_ids'", "'x'"],
    ),
    "jsonl nested lists": (
        lambda t: jsonl(t, "a.jsonl", [{"input_ids": [[1, 2]]}]),
        ["a.jsonl", "row 0", "'input_ids'", "nested"],
    ),
    "jsonl missing column in a row": (
        lambda t: jsonl(t, "a.jsonl", [{"input_ids": [1]}, {"ids": [1]}]),
        ["a.jsonl", "row 1", "'input_ids'"],
    ),
    "jsonl broken line": (
        lambda t: raw(t, "a.jsonl", b'{"input_ids": [1]}\n{"input_ids": [1,\n'),
        ["a.jsonl", "row 1"],
    ),
    "labels of another length": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[1, 2], [3, 4]]), labels=pa.array([[1, 2], [3]])),
        ["a.parquet", "row 1", "'labels'", "different lengths"],
    ),
    "bad label value": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[1, 2]]), labels=pa.array([[-100, -5]])),
        ["a.parquet", "row 0", "'labels'", "-5"],
    ),
    "mixed token types": (
        lambda t: [
            parquet(t, "a.parquet", input_ids=pa.array([[1]], pa.list_(pa.int32()))),
            parquet(t, "b.parquet", input_ids=pa.array([[1]], pa.list_(pa.int64()))),
        ][0].parent,
        ["mixed schemas", "a.parquet", "b.parquet", "'input_ids'"],
    ),
    "labels in some files only": (
        lambda t: [
            parquet(t, "a.parquet", input_ids=pa.array([[1]]), labels=pa.array([[1]])),
            parquet(t, "b.parquet", input_ids=pa.array([[1]])),
        ][0].parent,
        ["mixed schemas", "a.parquet", "b.parquet", "'labels'"],
    ),
    "no rows": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([], pa.list_(pa.int64()))),
        ["a.parquet", "no documents"],
    ),
    "only empty documents": (
        lambda t: parquet(t, "a.parquet", input_ids=pa.array([[], []], pa.list_(pa.int64()))),
        ["a.parquet", "all 2 documents are empty"],
    ),
    "truncated parquet": (
        lambda t: truncated(t, "a.parquet", 40),
        ["a.parquet", "cannot be read"],
    ),
    "truncated arrow stream": (
        lambda t: truncated(t, "a.ipc", 100),
        ["a.ipc", "cannot be read"],
    ),
    "unsupported file": (
        lambda t: raw(t, "a.csv", b"input_ids\n1\n"),
        ["a.csv", "unsupported"],
    ),
    "nothing matches": (lambda t: t / "nothing-*.parquet", ["nothing-*.parquet", "no such file"]),
    "overlong with --overflow error": (
        lambda t: [
            parquet(t, "a.parquet", input_ids=pa.array([[1]] * 3)),
            parquet(t, "b.parquet", input_ids=pa.array([[1], [1] * 9])),
        ][0].parent,
        ["b.parquet", "row 1", "'input_ids'", "9 tokens", "--max-len 8"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_names_file_row_column_and_writes_nothing(tmp_path, case):
    make, fragments = CASES[case]
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    corpus = make(corpus_dir)
    out = tmp_path / "packed"
    with pytest.raises(InputError) as info:
        build(corpus, out, max_len=8, overflow="error" if "overflow" in case else "split")
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_nothing_written(tmp_path, out)


@pytest.mark.parametrize("max_len", [0, -3])
def test_max_len_below_one_is_refused(tmp_path, max_len):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2]]))
    with pytest.raises(InputError, match="max_len"):
        build(corpus, tmp_path / "out", max_len=max_len)
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.slow
def test_existing_output_is_refused_unless_overwrite(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2], [3]]))
    out = tmp_path / "out"
    first = build(corpus, out, max_len=4)
    with pytest.raises(OutputError, match="--overwrite"):
        build(corpus, out, max_len=4, seed=5)
    assert build(corpus, out, max_len=4, overwrite=True, seed=5).options.seed == 5
    assert first.options.seed == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_refuses_a_directory_that_is_not_a_build(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2]]))
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputError, match="not a prepack build"):
        build(corpus, precious, max_len=4, overwrite=True)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_a_failure_while_writing_leaves_the_old_build_intact(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2], [3]]))
    out = tmp_path / "out"
    build(corpus, out, max_len=4)
    before = files(out)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("prepack.building.build"), "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        build(corpus, out, max_len=4, overwrite=True, seed=1)
    assert files(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_output_inside_the_corpus_directory_is_refused(tmp_path):
    corpus = tmp_path / "data"
    corpus.mkdir()
    write_corpus(corpus / "c.parquet", corpus_table([[1, 2], [3]]))
    build(corpus, corpus / "packed", max_len=4)  # the first time, nothing of the output is in the corpus
    # Now the earlier output is inside the corpus: found as a build before --out is compared.
    with pytest.raises(InputError, match=r"a shard of the prepack build .*data/packed"):
        build(corpus, corpus / "packed", max_len=4, overwrite=True)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_corpus_file_whose_name_is_not_utf8_is_refused_for_that_reason(tmp_path, kind):
    # pyarrow cannot open such a path; the refusal used to blame the file's contents ("is it truncated?").
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = write_corpus(corpus / f"good.{kind}", corpus_table([[1, 2, 3]] * 4))
    bad = os.path.join(os.fsencode(corpus), f"docs-\xff.{kind}".encode("latin-1"))
    os.rename(os.fsencode(good), bad)
    out = tmp_path / "out"
    with pytest.raises(InputError, match="not valid UTF-8") as raised:
        build(corpus, max_len=16, out=out)
    assert "truncated" not in str(raised.value)
    assert_nothing_written(tmp_path, out)
