"""`--max-docs-per-pack`: at most K documents a pack beside max_len, in every build kind, recorded in the
manifest and held by `verify`; a build without it is the build of before (tests/formats/test_golden.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import prepack
from prepack import build, build_store
from prepack.check.verify import verify_build
from prepack.formats.shards import read_manifest
from tests.cli import WIDE, failure, invoke_prepack, run_prepack
from tests.corpus import corpus_table, edit_json, read_build, write_corpus, write_mixture, mixture_sources
from tests.demo_inputs import gpt2_directory

MAX_LEN = 128


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(5)
    # Mostly short documents, so that an uncapped pack holds many; a few longer than max_len.
    lengths = np.concatenate([rng.integers(1, 12, 600), rng.integers(100, 300, 10)])
    documents = [rng.integers(0, 5000, n).tolist() for n in lengths]
    labels = [[-100, *d[1:]] for d in documents]
    return write_corpus(tmp_path_factory.mktemp("cap") / "c.parquet", corpus_table(documents, labels))


def documents_per_pack(out: Path) -> list[int]:
    _, packs = read_build(out)
    return [len(pack["cu_seqlens"]) - 1 for pack in packs]


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_every_pack_holds_at_most_k_documents_and_every_document_is_packed_once(corpus, tmp_path, algorithm):
    plain = build(corpus, tmp_path / "plain", max_len=MAX_LEN, algorithm=algorithm)
    assert max(documents_per_pack(tmp_path / "plain")) > 8  # the cap below binds
    capped = build(corpus, tmp_path / "capped", max_len=MAX_LEN, algorithm=algorithm, max_docs_per_pack=8)
    assert max(documents_per_pack(tmp_path / "capped")) == 8
    assert capped.options.max_docs_per_pack == 8 and plain.options.max_docs_per_pack is None
    assert capped.totals.segments == plain.totals.segments and capped.totals.tokens == plain.totals.tokens
    assert capped.totals.packs > plain.totals.packs
    assert verify_build(tmp_path / "capped", corpus) == []  # every document in exactly one pack
    assert "max_docs_per_pack" not in (tmp_path / "plain" / "manifest.json").read_text()


def test_a_cap_no_pack_reaches_writes_the_uncapped_packs(corpus, tmp_path):
    build(corpus, tmp_path / "plain", max_len=MAX_LEN)
    build(corpus, tmp_path / "capped", max_len=MAX_LEN, max_docs_per_pack=10_000)
    for shard in read_manifest(tmp_path / "plain").shards:
        assert (tmp_path / "plain" / shard.name).read_bytes() == (tmp_path / "capped" / shard.name).read_bytes()


def test_an_index_build_of_a_store_is_capped_as_the_full_build(corpus, tmp_path):
    build_store(corpus, tmp_path / "store")
    index = build(tmp_path / "store", tmp_path / "index", max_len=MAX_LEN, max_docs_per_pack=5, index_only=True)
    full = build(corpus, tmp_path / "full", max_len=MAX_LEN, max_docs_per_pack=5)
    assert index.totals == full.totals and max(documents_per_pack(tmp_path / "full")) == 5
    dataset = prepack.PackedDataset(tmp_path / "index")
    assert max(len(dataset[i]["cu_seqlens"]) - 1 for i in range(len(dataset))) == 5
    assert verify_build(tmp_path / "index") == []


def test_a_mixture_is_capped(tmp_path):
    root = tmp_path / "sources"
    root.mkdir()
    mixture_sources(root)
    mixture = write_mixture(root, "mix.yaml", 20_000, False)
    build(mixture, tmp_path / "out", max_len=MAX_LEN, max_docs_per_pack=3)
    assert max(documents_per_pack(tmp_path / "out")) == 3
    assert verify_build(tmp_path / "out") == []


def test_a_pair_counts_as_two_documents(tmp_path):
    gpt2 = gpt2_directory(tmp_path / "gpt2")
    rows = [{"prompt": f"Q{i}:", "chosen": " yes" * (i % 5 + 1), "rejected": " no"} for i in range(60)]
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for cap in (5, 4):  # 5 holds two pairs, as 4 does: never half a pair
        build(corpus, tmp_path / f"k{cap}", max_len=MAX_LEN, tokenizer=gpt2, pairs=True, overflow="drop", max_docs_per_pack=cap)
        assert max(documents_per_pack(tmp_path / f"k{cap}")) == 4
    result = invoke_prepack(
        "build", corpus, "--tokenizer", gpt2, "--pairs", "--overflow", "drop", "--max-docs-per-pack", "1",
        "--out", tmp_path / "k1", env=WIDE,
    )
    assert "no room for a pair's 2 documents" in failure(result) and not (tmp_path / "k1").exists()


def test_verify_finds_a_pack_over_the_recorded_cap(corpus, tmp_path):
    build(corpus, tmp_path / "out", max_len=MAX_LEN, max_docs_per_pack=8)
    edit_json(tmp_path / "out" / "manifest.json", lambda m: m["options"].update(max_docs_per_pack=7))
    problems = verify_build(tmp_path / "out", all_problems=True)
    assert problems and all(p.column == "cu_seqlens" and "max_docs_per_pack = 7" in p.message for p in problems)


@pytest.mark.parametrize("cap", ["0", "-3", "2147483648"])
def test_the_cli_refuses_a_cap_below_one_or_past_int32(corpus, tmp_path, cap):
    result = invoke_prepack("build", corpus, "--max-len", "64", "--max-docs-per-pack", cap, "--out", tmp_path / "out", env=WIDE)
    assert result.returncode == 2 and "max_docs_per_pack" in failure(result) and not (tmp_path / "out").exists()


def test_the_cli_records_the_cap(corpus, tmp_path):
    result = run_prepack("build", corpus, "--max-len", "64", "--max-docs-per-pack", "3", "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert read_manifest(tmp_path / "out").options.max_docs_per_pack == 3
    assert max(documents_per_pack(tmp_path / "out")) == 3


def test_inspect_prices_a_cap_as_the_capped_build_packs(corpus, tmp_path):
    from prepack.check.report import inspect_build

    build(corpus, tmp_path / "plain", max_len=MAX_LEN, algorithm="bfd")
    report = inspect_build(tmp_path / "plain", caps=[3, 8])
    for priced in report.caps:
        capped = build(corpus, tmp_path / f"k{priced.max_docs_per_pack}", max_len=MAX_LEN, algorithm="bfd",
                       max_docs_per_pack=priced.max_docs_per_pack)
        assert priced.packs == capped.totals.packs > report.packs
        assert priced.fill == pytest.approx(capped.totals.tokens / (capped.totals.packs * MAX_LEN))
    fullest = report.documents_per_pack.max
    assert [c.max_docs_per_pack for c in inspect_build(tmp_path / "plain").caps] == [k for k in (2, 4, 8, 16, 32, 64, 128) if k < fullest]
    shown = invoke_prepack("inspect", tmp_path / "plain", "--caps", "3,8", env=WIDE)
    assert shown.returncode == 0 and "--max-docs-per-pack K" in shown.stdout, shown.stderr
    assert "give comma-separated integers" in failure(invoke_prepack("inspect", tmp_path / "plain", "--caps", "8,x", env=WIDE))


def test_inspect_prices_a_pair_build_in_whole_pairs(tmp_path):
    from prepack.check.report import inspect_build

    gpt2 = gpt2_directory(tmp_path / "gpt2")
    rows = [{"prompt": f"Q{i}:", "chosen": " yes" * (i % 5 + 1), "rejected": " no"} for i in range(60)]
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    build(corpus, tmp_path / "plain", max_len=MAX_LEN, tokenizer=gpt2, pairs=True, overflow="drop")
    [priced] = inspect_build(tmp_path / "plain", caps=[4]).caps
    capped = build(corpus, tmp_path / "k4", max_len=MAX_LEN, tokenizer=gpt2, pairs=True, overflow="drop", max_docs_per_pack=4)
    assert priced.packs == capped.totals.packs
