"""Documents with no trained token (every label after the first -100): counted in the manifest, the
build summary and `inspect`; left out of the packs with `drop_untrained`, which `verify --source`
accounts for; for token-id corpora with a labels column and for chat builds alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prepack import InputError, build
from prepack.building.plan import document_pieces, untrained_documents
from prepack.check.report import inspect_build
from prepack.check.verify import verify_build
from tests.cli import run_prepack
from tests.corpus import corpus_table, read_build, write_corpus
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory

IGNORE = -100


def test_untrained_documents_is_no_label_after_the_first():
    labels = [[IGNORE, IGNORE], [5, IGNORE, IGNORE], [IGNORE, 7], [], [8], [IGNORE, IGNORE, 9, IGNORE]]
    offsets = np.cumsum([0, *map(len, labels)])
    flat = np.array([label for document in labels for label in document], dtype=np.int32)
    # The first label is never trained (the collator masks it): [5, -100, -100] and [8] train nothing.
    assert untrained_documents(offsets, flat).tolist() == [True, True, False, False, True, False]
    assert untrained_documents(offsets, None).tolist() == [False] * 6  # no labels: every token trains
    # An index build scans a store's labels with it: offsets that do not slice them never reach the scan.
    for bad in ([0, 5, 3], [0, 2, len(flat) + 1], [-1, 2]):
        with pytest.raises(ValueError, match="do not slice"):
            untrained_documents(np.array(bad), flat)


def test_dropped_untrained_documents_are_left_out_before_overflow():
    lengths = np.array([3, 25, 0, 4])
    untrained = np.array([False, True, False, True])
    kept = document_pieces(lengths, 10, "split", untrained)
    assert kept.rows.tolist() == [0, 1, 1, 1, 3]
    assert (kept.counts["untrained"], kept.counts["untrained_tokens"], kept.counts["split"]) == (2, 29, 1)
    dropped = document_pieces(lengths, 10, "split", untrained, drop_untrained=True)
    assert dropped.rows.tolist() == [0]
    assert (dropped.counts["untrained"], dropped.counts["untrained_tokens"], dropped.counts["split"]) == (2, 29, 0)


def labelled_corpus(path: Path, seed: int = 0) -> tuple[Path, list[bool]]:
    """80 documents, a third of them prompts only (every label -100), some longer than max_len 64."""
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 500, size=rng.integers(1, 90)).tolist() for _ in range(80)]
    untrained = [i % 3 == 0 or len(doc) == 1 for i, doc in enumerate(documents)]
    labels = [[IGNORE] * len(doc) if no else [IGNORE, *doc[1:]] for doc, no in zip(documents, untrained)]
    return write_corpus(path, corpus_table(documents, labels)), untrained


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_a_labelled_corpus_counts_untrained_documents_and_drops_them_on_request(tmp_path, overflow):
    corpus, untrained = labelled_corpus(tmp_path / "corpus.parquet")
    lengths = [len(labels) for labels in read_labels(corpus)]
    kept = build(corpus, tmp_path / "kept", max_len=64, overflow=overflow)
    dropped = build(corpus, tmp_path / "dropped", max_len=64, overflow=overflow, drop_untrained=True)
    expected_tokens = sum(n for n, no in zip(lengths, untrained) if no)
    for manifest in (kept, dropped):
        assert (manifest.totals.untrained, manifest.totals.untrained_tokens) == (sum(untrained), expected_tokens)
    assert not kept.options.drop_untrained and dropped.options.drop_untrained
    packed_rows = {row for pack in read_build(tmp_path / "dropped")[1] for row in pack["source_rows"]}
    assert packed_rows.isdisjoint(i for i, no in enumerate(untrained) if no)
    assert packed_rows == {i for i, no in enumerate(untrained) if not no and (overflow != "drop" or lengths[i] <= 64)}
    assert dropped.totals.tokens < kept.totals.tokens
    for out in ("kept", "dropped"):
        assert verify_build(tmp_path / out, corpus, all_problems=True) == []
    report = inspect_build(tmp_path / "dropped")
    assert (report.untrained, report.drop_untrained) == (sum(untrained), True)


def read_labels(corpus: Path) -> list[list[int]]:
    import pyarrow.parquet as pq

    return pq.read_table(corpus, columns=["labels"]).column("labels").to_pylist()


def test_verify_catches_an_untrained_count_that_lies(tmp_path):
    corpus, _ = labelled_corpus(tmp_path / "corpus.parquet")
    build(corpus, tmp_path / "packed", max_len=64, drop_untrained=True)
    path = tmp_path / "packed" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["totals"]["untrained"] -= 1
    path.write_text(json.dumps(manifest))
    columns = {problem.column for problem in verify_build(tmp_path / "packed", corpus, all_problems=True)}
    assert "totals.untrained" in columns


def test_a_corpus_without_labels_has_no_untrained_documents(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet", corpus_table([[1], [2, 3], [4, 5, 6]]))
    manifest = build(corpus, tmp_path / "packed", max_len=8, drop_untrained=True)
    assert (manifest.totals.untrained, manifest.totals.segments) == (0, 3)


def test_dropping_every_document_is_refused_and_writes_nothing(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2], [3, 4]], [[IGNORE] * 2, [3, IGNORE]]))
    with pytest.raises(InputError, match="no document is left to pack: .* 0 are longer .* 2 have no trained token"):
        build(corpus, tmp_path / "packed", max_len=8, drop_untrained=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


@pytest.mark.slow
def test_chat_build_counts_conversations_without_an_assistant_turn(tmp_path):
    """chitchat conversations of one turn have no assistant message, so nothing to train on."""
    conversations = chitchat()[:200]
    one_turn = sum(len(turns) == 1 for turns in conversations)
    assert one_turn > 0
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps({"messages": as_chat(turns)}) + "\n" for turns in conversations))
    tokenizer = gpt2_directory(tmp_path / "gpt2", CHATML)
    out = tmp_path / "packed"
    command = ["build", corpus, "--tokenizer", tokenizer, "--chat", "--max-len", "512"]
    result = run_prepack(*command, "--drop-untrained", "--out", out)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["untrained"] == one_turn
    assert "untrained" in result.stdout and f"{one_turn:,} (" in result.stdout
    source_rows = {row for pack in read_build(out)[1] for row in pack["source_rows"]}
    assert source_rows == {i for i, turns in enumerate(conversations) if len(turns) > 1}
    checked = run_prepack("verify", out, "--source", corpus, "--tokenizer", tokenizer)
    assert checked.returncode == 0, checked.stdout + checked.stderr
