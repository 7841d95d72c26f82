"""`prepack build --groups`: a prompt and a list of G completions a row, each group packed whole as G documents
(roles 0 … G - 1), tokenized as pairs are (the prompt alone, then prompt + each completion + EOS, the completion
starting where they diverge); a group longer than max_len follows --overflow (truncate, drop, error), never
split; `verify` recounts it from the source, `inspect` reports its groups; the collated packs give each
completion's log-probabilities as prompt + completion alone, in the shared-prompt layout too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import prepack
from prepack import PackedDataset
from prepack.errors import InputError
from prepack.formats.shards import read_manifest
from tests.building.test_pairs import gpt2, hf_tokenizer, write_jsonl  # noqa: F401 (fixtures)
from tests.cli import WIDE, failure, run_prepack
from tests.demo_inputs import chitchat

SIZE = 4
ANSWERS = [" no idea", " maybe", " yes, and more besides that"]


def text_groups(count: int, prompt_chars: int | None = None) -> list[dict]:
    """Each chitchat exchange as a prompt (its first `prompt_chars` characters) and four completions: its answer
    and three others."""
    turns = [c for c in chitchat() if len(c) >= 2][:count]
    return [{"prompt": f"Q: {t[0][:prompt_chars]} A:", "completions": [f" {t[1]}", *ANSWERS]} for t in turns]


def groups_of(build: Path) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Every packed group, as its documents' (ids, labels), in pack order."""
    groups = []
    for pack in PackedDataset(build):
        cu, roles = pack["cu_seqlens"], pack["pair_roles"]
        assert roles.tolist() == list(range(SIZE)) * ((len(cu) - 1) // SIZE)
        documents = [(pack["input_ids"][cu[j] : cu[j + 1]], pack["labels"][cu[j] : cu[j + 1]]) for j in range(len(cu) - 1)]
        groups += [documents[i : i + SIZE] for i in range(0, len(documents), SIZE)]
    return groups


@pytest.fixture(scope="module")
def group_build(tmp_path_factory, gpt2):  # noqa: F811
    root = tmp_path_factory.mktemp("groups")
    corpus = write_jsonl(root / "groups.jsonl", text_groups(30))
    prepack.build(corpus, root / "out", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
    return root, corpus


def test_groups_are_tokenized_as_pairs_are_and_packed_whole(group_build, hf_tokenizer):  # noqa: F811
    root, corpus = group_build
    manifest = read_manifest(root / "out")
    assert (manifest.options.pairs.completions_column, manifest.options.pairs.group_size) == ("completions", SIZE)
    assert manifest.options.pairs.chosen_column is None and manifest.pairs.pairs == 30
    assert manifest.totals.documents == SIZE * 30
    rows = text_groups(30)
    packed = groups_of(root / "out")
    assert len(packed) == 30 - manifest.pairs.dropped > 0
    eos = hf_tokenizer.eos_token
    texts = {tuple(hf_tokenizer(rows[r]["prompt"] + rows[r]["completions"][0] + eos)["input_ids"]): r for r in range(30)}
    for group in packed:
        row = rows[texts[tuple(group[0][0].tolist())]]
        prompt = hf_tokenizer(row["prompt"])["input_ids"]
        fulls = [hf_tokenizer(row["prompt"] + c + eos)["input_ids"] for c in row["completions"]]
        start = min(next((i for i, (a, b) in enumerate(zip(prompt, f)) if a != b), len(prompt)) for f in fulls)
        for (ids, labels), full in zip(group, fulls, strict=True):
            assert ids.tolist() == full
            assert (labels[:start] == -100).all() and labels[start:].tolist() == full[start:]
    manifest_text = (root / "out" / "manifest.json").read_text()
    assert '"chosen_column"' not in manifest_text and '"group_size": 4' in manifest_text


def test_verify_and_inspect_read_a_group_build(group_build, gpt2):  # noqa: F811
    root, corpus = group_build
    result = run_prepack("verify", root / "out", "--source", corpus, "--tokenizer", gpt2)
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_prepack("inspect", root / "out", env=WIDE)
    assert result.returncode == 0, result.stderr
    assert "groups of 4" in result.stdout and "a prompt stored once" in result.stdout
    manifest = json.loads((root / "out" / "manifest.json").read_text())
    manifest["pairs"]["pairs"] += 1
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text(json.dumps(manifest))
    for shard in (root / "out").glob("shard-*.arrow"):
        (root / "broken" / shard.name).write_bytes(shard.read_bytes())
    result = run_prepack("verify", root / "broken")
    assert result.returncode == 1 and "4 times the groups are totals.documents" in result.stdout


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_an_overlong_group_follows_overflow_never_split(tmp_path, gpt2, overflow):  # noqa: F811
    corpus = write_jsonl(tmp_path / "groups.jsonl", text_groups(12, prompt_chars=30))
    manifest = prepack.build(corpus, tmp_path / "out", max_len=80, tokenizer=gpt2, groups=True, overflow=overflow, num_proc=1)
    cut = manifest.pairs.truncated if overflow == "truncate" else manifest.pairs.dropped
    assert cut > 0 and manifest.pairs.truncated + manifest.pairs.dropped == cut  # 80 tokens cannot hold every group
    packed = groups_of(tmp_path / "out")
    assert len(packed) == 12 - manifest.pairs.dropped
    for pack in PackedDataset(tmp_path / "out"):
        assert len(pack["input_ids"]) <= 80
    result = run_prepack("verify", tmp_path / "out", "--source", corpus, "--tokenizer", gpt2)
    assert result.returncode == 0, result.stdout + result.stderr


def test_overlong_groups_and_bad_rows_are_refused_by_row(tmp_path, gpt2):  # noqa: F811
    corpus = write_jsonl(tmp_path / "groups.jsonl", text_groups(5))
    message = failure(run_prepack("build", corpus, "--out", tmp_path / "a", "--max-len", "40", "--tokenizer", gpt2,
                                  "--groups", "--overflow", "error", env=WIDE))
    assert "groups.jsonl, row " in message and "the group's" in message and "--max-len 40" in message
    rows = text_groups(3)
    rows[2]["completions"] = rows[2]["completions"][:3]
    corpus = write_jsonl(tmp_path / "short.jsonl", rows)
    with pytest.raises(InputError, match=r"short.jsonl, row 2, column 'completions': expected a list of 4 completions .*found 3"):
        prepack.build(corpus, tmp_path / "b", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
    with pytest.raises(InputError, match="--pairs and --groups"):
        prepack.build(corpus, tmp_path / "c", max_len=256, tokenizer=gpt2, groups=True, pairs=True, overflow="drop")
    with pytest.raises(InputError, match="--completions-column names the completions of groups: add --groups"):
        prepack.build(corpus, tmp_path / "d", max_len=256, tokenizer=gpt2, completions_column="c")


@pytest.mark.slow  # a tiny float64 model over the build: ~3 s
@pytest.mark.parametrize("shared_prompt", [False, True])
def test_collated_groups_give_each_completion_its_prompt_and_it_alone(group_build, shared_prompt):
    from prepack.training.collate import PackedCollator
    from prepack.training.preference import group_logps, model_inputs
    from tests.train.test_groups import alone, model_on
    from tests.train.test_preference import small
    from prepack.training.shared_prompt import Group

    root, _ = group_build
    dataset = PackedDataset(root / "out")
    packs = [dataset[i] for i in range(min(3, len(dataset)))]
    batch = PackedCollator.for_dataset(dataset, shared_prompt=shared_prompt)(packs)
    batch["input_ids"], batch["labels"] = small(batch["input_ids"]), small(batch["labels"])
    model = model_on("sdpa")
    with torch.no_grad():
        got = group_logps(model(**model_inputs(batch)).logits, batch)
    expected = []
    for pack in packs:
        cu = pack["cu_seqlens"]
        for first in range(0, len(cu) - 1, SIZE):
            docs = [(small(pack["input_ids"][cu[j] : cu[j + 1]]), pack["labels"][cu[j] : cu[j + 1]]) for j in range(first, first + SIZE)]
            start = int(np.flatnonzero(docs[0][1] != -100)[0])
            expected += alone(model, Group(docs[0][0][:start].tolist(), [d[0][start:].tolist() for d in docs]))
    assert got.logps.shape[1] == SIZE
    torch.testing.assert_close(got.logps.flatten(), torch.stack([e for e, _ in expected]), rtol=0, atol=1e-10)


@pytest.mark.slow  # a reference pass over the build with a tiny model of the tokenizer's vocabulary: ~5 s
def test_stored_reference_log_probabilities_cover_a_group_build(group_build, tmp_path):
    """`prepack.training.reference.write_reference_logps` on a group build: every completion's stored value is
    the reference's own `group_logps` of it, in the two-sequence and shared-prompt layouts (`stored_group_reference`),
    and `stored_reference` (pairs) refuses groups by name."""
    from prepack.errors import UsageError
    from prepack.model.packing import enable_packing
    from prepack.training.collate import PackedCollator
    from prepack.training.preference import group_logps, model_inputs
    from prepack.training.reference import stored_group_reference, stored_reference, write_reference_logps
    from tests.train.test_reference_logps import tiny_llama

    root, _ = group_build
    model = enable_packing(tiny_llama(1)).eval()
    write_reference_logps(root / "out", model, tmp_path / "values", batch_size=2)
    dataset = PackedDataset(root / "out", reference=tmp_path / "values")
    packs = [dataset[i] for i in range(len(dataset))]
    for shared_prompt in (False, True):
        batch = PackedCollator.for_dataset(dataset, shared_prompt=shared_prompt)(packs)
        stored = stored_group_reference(batch)
        with torch.no_grad():
            computed = group_logps(model(**model_inputs(batch)).logits, batch)
        assert stored.logps.shape == (read_manifest(root / "out").pairs.pairs - read_manifest(root / "out").pairs.dropped, SIZE)
        torch.testing.assert_close(stored.logps, computed.logps, rtol=0, atol=1e-10)
        assert torch.equal(stored.tokens, computed.tokens)
        with pytest.raises(UsageError, match="not of groups of 4"):
            stored_reference(batch)


def test_a_shard_whose_roles_make_smaller_groups_than_the_manifest_is_refused(group_build, tmp_path):
    """Roles 0, 1, 0, 1 … in a G = 4 build's shard are whole pairs, sound on their own: the manifest's G is what
    they are held to, by the reader and by the collator of the build."""
    import shutil

    import pyarrow as pa

    from prepack.errors import FormatError, IsolationError
    from prepack.training.collate import PackedCollator
    from tests.corpus import record_shard

    root, _ = group_build
    build = shutil.copytree(root / "out", tmp_path / "out")
    path = build / read_manifest(build).shards[0].name
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    field = batch.schema.field("pair_roles")
    roles = [[j % 2 for j in range(len(row))] for row in batch.column("pair_roles").to_pylist()]
    batch = batch.set_column(batch.schema.get_field_index("pair_roles"), field, pa.array(roles, field.type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    path.write_bytes(sink.getvalue().to_pybytes())
    record_shard(build / "manifest.json", path)
    with pytest.raises(FormatError, match=f"pair_roles.*groups of {SIZE}|groups of {SIZE}.*pair_roles"):
        PackedDataset(build)[0]
    pack = PackedDataset(root / "out")[0]
    pairs = pack | {"pair_roles": np.arange(len(pack["pair_roles"])) % 2}
    with pytest.raises(IsolationError, match=f"groups of {SIZE}"):
        PackedCollator.for_dataset(root / "out")([pairs])


def test_a_cap_below_the_group_size_is_refused_before_the_corpus_is_read(tmp_path, gpt2):  # noqa: F811
    """The group size is known once the corpus is opened (its first row): a cap of fewer documents is refused
    then, not after every row is tokenized (row 2 here is bad, and is never reached)."""
    rows = text_groups(3)
    rows[2]["completions"] = rows[2]["completions"][:3]
    corpus = write_jsonl(tmp_path / "short.jsonl", rows)
    with pytest.raises(InputError, match=f"--max-docs-per-pack 3 leaves no room for a group's {SIZE} documents"):
        prepack.build(corpus, tmp_path / "a", max_len=256, tokenizer=gpt2, groups=True, overflow="drop",
                      max_docs_per_pack=3, num_proc=1)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q:", "chosen": " a", "rejected": " b"}])
    with pytest.raises(InputError, match="--max-docs-per-pack 1 leaves no room for a pair's 2 documents"):
        prepack.build(pairs, tmp_path / "b", max_len=256, tokenizer=gpt2, pairs=True, overflow="drop",
                      max_docs_per_pack=1, num_proc=1)


def test_a_group_of_more_than_255_completions_is_refused_by_row(tmp_path, gpt2):  # noqa: F811
    """`pair_roles` are one byte: G is at most 255, refused by file, row and column (not a schema error)."""
    corpus = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "Q:", "completions": [f" {k}" for k in range(256)]}])
    with pytest.raises(InputError, match=r"big.jsonl, row 0, column 'completions': 256 completions, more than 255"):
        prepack.build(corpus, tmp_path / "a", max_len=4096, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
