"""The installed `prepack` console script, end to end, as a user runs it."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_prepack
from tests.corpus import corpus_table, read_build, write_corpus


def test_build_writes_shards_and_prints_a_summary(tmp_path):
    documents = [list(range(n)) for n in (5, 9, 3, 12, 7, 1, 20)]
    corpus = write_corpus(tmp_path / "c.jsonl.gz", corpus_table(documents))
    result = run_prepack("build", str(corpus), "--max-len", "16", "--out", str(tmp_path / "packed"), "--seed", "3")
    assert result.returncode == 0, result.stderr
    manifest, packs = read_build(tmp_path / "packed")
    assert manifest["options"]["seed"] == 3
    assert manifest["totals"]["tokens"] == sum(map(len, documents))
    assert sorted(r for p in packs for r in p["source_rows"]) == [0, 1, 2, 3, 4, 5, 6, 6]
    assert "packs" in result.stdout and f"{manifest['totals']['packs']:,}" in result.stdout


def test_quiet_prints_nothing(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    result = run_prepack("build", str(corpus), "--out", str(tmp_path / "p"), "--quiet", "--shard-size", "1MB")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["options"]["shard_size"] == 10**6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--column", "tokens"], "no column 'tokens'"),
        (["--max-len", "0"], "max_len"),
        (["--shard-size", "lots"], "not a size"),
        (["--overflow", "explode"], "explode"),
    ],
)
def test_errors_exit_2_with_a_message_and_no_output(tmp_path, args, message):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    result = run_prepack("build", str(corpus), "--out", str(tmp_path / "p"), *args)
    assert result.returncode == 2
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "p").exists()
