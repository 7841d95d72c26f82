"""What a newcomer reads from the console script: errors that name the likely fix when the corpus is
text or chat and the options say otherwise, and summary lines that say what was done."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli import failure, invoke_prepack, run_prepack
from tests.corpus import corpus_table, write_corpus
from tests.demo_inputs import as_chat, gpt2_directory


def write_records(path: Path, records: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


CONVERSATIONS = [as_chat(["hello", "hi there"]), as_chat(["how are you?", "fine, thanks", "good"])]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_text_corpus_without_a_tokenizer_is_told_to_use_one(tmp_path, suffix):
    corpus = write_records(tmp_path / f"c{suffix}", [{"text": "one document"}, {"text": "another"}])
    message = failure(run_prepack("build", str(corpus), "--out", str(tmp_path / "p")))
    assert "no column 'input_ids' (columns: text)" in message
    assert "it holds text: tokenize it with --tokenizer DIR (a local tokenizer), or choose the token column with --column." in message
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(("column", "fix"), [("messages", "--chat"), ("conversations", "--chat --messages-column conversations")])
def test_a_chat_corpus_without_a_tokenizer_is_told_to_tokenize_it_as_chat(tmp_path, column, fix):
    corpus = write_records(tmp_path / "c.jsonl", [{column: c} for c in CONVERSATIONS])
    message = failure(invoke_prepack("build", str(corpus), "--out", str(tmp_path / "p")))
    assert f"it holds conversations: tokenize them with --tokenizer DIR {fix} " in message


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize(("column", "fix"), [("messages", "--chat,"), ("conversations", "--chat --messages-column conversations,")])
def test_a_chat_corpus_tokenized_as_text_is_told_to_add_chat(tmp_path, suffix, column, fix):
    corpus = write_records(tmp_path / f"c{suffix}", [{column: c} for c in CONVERSATIONS])
    tokenizer = gpt2_directory(tmp_path / "gpt2")
    message = failure(invoke_prepack("build", str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "p")))
    assert "'text'" in message and f"it holds conversations: add {fix}" in message
    assert not (tmp_path / "p").exists()


def test_a_text_corpus_tokenized_as_chat_is_told_to_leave_chat_out(tmp_path):
    corpus = write_records(tmp_path / "c.parquet", [{"text": "one document"}])
    tokenizer = gpt2_directory(tmp_path / "gpt2", "{{ messages }}")
    message = failure(invoke_prepack("build", str(corpus), "--tokenizer", str(tokenizer), "--chat", "--out", str(tmp_path / "p")))
    assert "no column 'messages' (columns: text); it holds text: leave out --chat, or choose it with --messages-column." in message


def test_a_missing_token_column_still_names_the_column_option(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    message = failure(invoke_prepack("build", str(corpus), "--column", "tokens", "--out", str(tmp_path / "p")))
    # A file with a text column besides the tokens: the likely fix first, then the column option.
    assert "no column 'tokens' (columns: input_ids, text); it holds text: tokenize it with --tokenizer DIR" in message
    assert message.endswith(", or choose the token column with --column.")


@pytest.mark.slow
def test_tokenize_and_verify_say_what_they_did(tmp_path):
    """One shard is "1 shard"; verify of an index build names its store among what it checked."""
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([list(range(n)) for n in (5, 9, 3, 12)]))
    store, full, index = tmp_path / "store", tmp_path / "full", tmp_path / "index"
    tokenized = run_prepack("tokenize", str(corpus), "--out", str(store))
    assert tokenized.returncode == 0, tokenized.stderr
    assert f"stored 4 documents, 29 tokens in 1 shard under {store} " in " ".join(tokenized.stdout.split())
    for out, extra in ((full, []), (index, ["--index-only"])):
        built = invoke_prepack("build", str(store), "--max-len", "16", "--out", str(out), "--quiet", *extra)
        assert built.returncode == 0, built.stderr
    assert invoke_prepack("verify", str(full)).stdout == f"{full}: no problems (shards and manifest checked).\n"
    assert invoke_prepack("verify", str(index)).stdout == (
        f"{index}: no problems (index shards, manifest and the store's shards and documents checked).\n"
    )
    assert invoke_prepack("verify", str(index), "--source", str(corpus)).stdout == (
        f"{index}: no problems (index shards, manifest, the store's shards and documents"
        " and every token of the source checked).\n"
    )
