"""`verify` and `inspect` on an unpaired (KTO) build: the shards' `desirable` labels are counted against the
manifest's `pairs.desirable` / `undesirable` and, with the source, held to each row's label; each KL completion
must be the completion of the example `kl_partners` planned for it. A flipped label, a wrong count or a KL
completion that is not its partner's is a finding naming its file, row and column."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import prepack
from prepack.check.report import inspect_build
from prepack.check.verify import verify_build
from tests.building.test_unpaired import text_rows
from tests.corpus import edit_json, record_shard
from tests.demo_inputs import gpt2_directory

EXAMPLES = 10


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """A text unpaired build (`packed/`) of its corpus (`kto.jsonl`) with its tokenizer (`gpt2/`)."""
    root = tmp_path_factory.mktemp("unpaired-checks")
    rows = text_rows(EXAMPLES)
    (root / "kto.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = gpt2_directory(root / "gpt2")
    prepack.build(root / "kto.jsonl", root / "packed", max_len=256, tokenizer=tokenizer, unpaired=True, kl_seed=2,
                  overflow="drop", num_proc=1)
    return root / "packed"


@pytest.fixture
def packed(clean, tmp_path) -> Path:
    return shutil.copytree(clean, tmp_path / "packed")


def _source(clean: Path) -> dict:
    return {"source": clean.parent / "kto.jsonl", "tokenizer": clean.parent / "gpt2"}


def _rewrite_first_pack(build: Path, edits: dict) -> str:
    """Give the first shard's first pack the values `edits` (column -> list), its size and sha256 recorded anew."""
    manifest = json.loads((build / "manifest.json").read_text())
    path = build / manifest["shards"][0]["name"]
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    for column, values in edits.items():
        rows = batch.column(column).to_pylist()
        rows[0] = list(values)
        field = batch.schema.field(column)
        batch = batch.set_column(batch.schema.get_field_index(column), field, pa.array(rows, field.type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    path.write_bytes(sink.getvalue().to_pybytes())
    record_shard(build / "manifest.json", path)
    return path.name


def _first_pack(build: Path) -> dict:
    manifest = json.loads((build / "manifest.json").read_text())
    return pa.ipc.open_stream((build / manifest["shards"][0]["name"]).read_bytes()).read_next_batch().slice(0, 1).to_pylist()[0]


def _where(problems) -> set[tuple]:
    return {(p.file, p.row, p.column) for p in problems}


@pytest.mark.slow  # verify with the source tokenizes the corpus again: ~2 s
def test_an_unpaired_build_verifies_and_inspect_counts_its_examples(clean):
    assert verify_build(clean, all_problems=True) == []
    assert verify_build(clean, all_problems=True, **_source(clean)) == []
    report = inspect_build(clean)
    said = json.loads((clean / "manifest.json").read_text())["pairs"]
    assert (report.pairs.examples, report.pairs.desirable, report.pairs.undesirable) == (
        EXAMPLES, said["desirable"], said["undesirable"])
    assert said["desirable"] == sum(row["label"] for row in text_rows(EXAMPLES))


@pytest.mark.slow  # verify with the source: ~2 s
def test_a_flipped_label_is_found(clean, packed):
    pack = _first_pack(packed)
    flipped = [not pack["desirable"][0], *pack["desirable"][1:]]
    name = _rewrite_first_pack(packed, {"desirable": flipped})
    alone = verify_build(packed, all_problems=True)  # the counts no longer hold
    assert {("manifest.json", None, "pairs.desirable"), ("manifest.json", None, "pairs.undesirable")} <= _where(alone), alone
    sourced = verify_build(packed, all_problems=True, **_source(clean))
    label = [p for p in sourced if p.column == "desirable"]
    example = pack["source_rows"][0] // 2
    assert [(p.file, p.row, p.source_file, p.source_row) for p in label] == [(name, 0, "kto.jsonl", example)], sourced


def test_a_wrong_count_is_found(packed):
    def move(raw: dict) -> None:  # their sum still holds
        raw["pairs"]["desirable"] += 1
        raw["pairs"]["undesirable"] -= 1

    edit_json(packed / "manifest.json", move)
    problems = verify_build(packed, all_problems=True)
    assert {("manifest.json", None, "pairs.desirable"), ("manifest.json", None, "pairs.undesirable")} == _where(problems), problems

    def more(raw: dict) -> None:
        raw["pairs"]["desirable"] += 1

    edit_json(packed / "manifest.json", more)
    problems = verify_build(packed, all_problems=True)
    assert any("pairs - dropped" in p.message for p in problems), problems


def test_a_kl_completion_that_is_not_the_planned_partners_is_found(packed):
    pack = _first_pack(packed)
    cu, ids, labels = pack["cu_seqlens"], list(pack["input_ids"]), list(pack["labels"])
    kl_last = cu[2] - 1  # the first example's KL document ends with a completion token
    assert labels[kl_last] != -100
    ids[kl_last] = labels[kl_last] = (ids[kl_last] + 1) % 50_000
    name = _rewrite_first_pack(packed, {"input_ids": ids, "labels": labels})
    problems = verify_build(packed, all_problems=True)
    assert _where(problems) == {(name, 0, "input_ids")}, problems
    assert f"example {pack['source_rows'][1] // 2}'s KL completion) is not the completion of example" in problems[0].message
