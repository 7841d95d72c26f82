"""`verify` and `inspect` on a preference-pair build: every figure of the manifest's `pairs` is counted
from the shards (and, with the source, from the corpus), and the two documents of a pair hold the same
prompt tokens; a manifest or a shard that no longer agrees is a finding, and `inspect` refuses to
print figures the shards do not give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prepack.check.report import inspect_build
from prepack.check.verify import verify_build
from prepack.errors import FormatError
from tests.cli import WIDE, run_prepack
from tests.corpus import edit_json, preference_pairs, record_shard


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """A text pair build (`packed/`), its corpus (`pairs.jsonl`) and tokenizer (`gpt2/`)."""
    packed = preference_pairs(tmp_path_factory.mktemp("pair-checks"))
    assert json.loads((packed / "manifest.json").read_text())["pairs"]["truncated"] > 1
    return packed


@pytest.fixture
def packed(clean, tmp_path) -> Path:
    """A copy of the pair build to damage."""
    return shutil.copytree(clean, tmp_path / "packed")


def _source(clean: Path) -> dict:
    """verify's arguments to check a build against `clean`'s corpus."""
    return {"source": clean.parent / "pairs.jsonl", "tokenizer": clean.parent / "gpt2"}


def _columns(build: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, cu_seqlens) of the first shard's first pack."""
    manifest = json.loads((build / "manifest.json").read_text())
    batch = pa.ipc.open_stream((build / manifest["shards"][0]["name"]).read_bytes()).read_next_batch()
    return tuple(np.asarray(batch.column(name)[0].values) for name in ("input_ids", "labels", "cu_seqlens"))


def _rewrite_first_pack(build: Path, column: str, values: np.ndarray) -> str:
    """Give the first shard's first pack `values` in `column`, the shard's size and sha256 recorded anew."""
    manifest = json.loads((build / "manifest.json").read_text())
    path = build / manifest["shards"][0]["name"]
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    rows = batch.column(column).to_pylist()
    rows[0] = values.tolist()
    field = batch.schema.field(column)
    batch = batch.set_column(batch.schema.get_field_index(column), field, pa.array(rows, field.type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    path.write_bytes(sink.getvalue().to_pybytes())
    record_shard(build / "manifest.json", path)
    return path.name


def test_a_pair_build_verifies_and_inspect_shows_the_split_the_shards_hold(clean):
    assert verify_build(clean, all_problems=True) == []
    assert verify_build(clean, all_problems=True, **_source(clean)) == []
    said = json.loads((clean / "manifest.json").read_text())["pairs"]
    shown = inspect_build(clean).pairs
    assert (shown.prompt_tokens, shown.completion_tokens, shown.truncated) == (said["prompt_tokens"], said["completion_tokens"], said["truncated"])


@pytest.mark.parametrize("with_source", [False, True], ids=["alone", "with the source"])
def test_tokens_moved_between_prompt_and_completion_are_found(clean, packed, with_source):
    def move(raw: dict) -> None:
        raw["pairs"]["prompt_tokens"] -= 7
        raw["pairs"]["completion_tokens"] += 7  # their sum, totals.tokens, still holds

    edit_json(packed / "manifest.json", move)
    problems = verify_build(packed, all_problems=True, **(_source(clean) if with_source else {}))
    assert {"pairs.prompt_tokens", "pairs.completion_tokens"} <= {p.column for p in problems}, problems
    with pytest.raises(FormatError, match="prompt_tokens .* the shards hold"):
        inspect_build(packed)
    shown = run_prepack("inspect", packed, env=WIDE)
    assert shown.returncode == 2 and "run `prepack verify`" in shown.stderr


def test_a_truncated_count_is_recounted_with_the_source(clean, packed):
    def fewer(raw: dict) -> None:
        raw["pairs"]["truncated"] -= 1  # still between totals.truncated / 2 and totals.truncated

    edit_json(packed / "manifest.json", fewer)
    problems = verify_build(packed, all_problems=True, **_source(clean))
    assert "pairs.truncated" in [p.column for p in problems], problems


def test_more_truncated_pairs_than_fill_max_len_are_found_without_the_source(packed):
    def more(raw: dict) -> None:
        raw["pairs"]["truncated"] += 1
        raw["totals"]["truncated"] += 1  # keeps the manifest's own arithmetic
        raw["totals"]["truncated_tokens"] += 1
        raw["totals"]["input_tokens"] += 1

    edit_json(packed / "manifest.json", more)
    problems = verify_build(packed, all_problems=True)
    assert "pairs.truncated" in [p.column for p in problems], problems


def test_a_prompt_token_changed_in_a_rejected_document_is_found_without_the_source(packed):
    ids, labels, cu = _columns(packed)
    rejected = cu[1]  # the first pair's rejected document starts here; its first token is the prompt's
    assert labels[rejected] == -100
    ids = ids.copy()
    ids[rejected] += 1
    name = _rewrite_first_pack(packed, "input_ids", ids)
    problems = verify_build(packed, all_problems=True)
    assert [(p.file, p.row, p.column) for p in problems] == [(name, 0, "input_ids")], problems
    assert "prompt" in problems[0].message


def test_a_prompt_label_inside_a_completion_is_found_without_the_source(packed):
    ids, labels, cu = _columns(packed)
    labels = labels.copy()
    labels[cu[1] - 1] = -100  # the chosen document's last token: a completion token
    name = _rewrite_first_pack(packed, "labels", labels)
    problems = verify_build(packed, all_problems=True)
    assert (name, 0, "labels") in [(p.file, p.row, p.column) for p in problems], problems
