"""`prepack build --unpaired`: KTO's unpaired feedback (TRL's format) packed as units of 2 documents, each
example's completion and its KL completion (the completion of its planned partner, `kl_partners` from
`--kl-seed`) after the example's own prompt; each example's label in the shards' `desirable` column and the
counts in the manifest; the same input and options give the same bytes; bad input is refused by file, row and
column (exit 2).
"""

from __future__ import annotations

import filecmp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepack
from prepack import PackedDataset
from prepack.building.kl_plan import kl_partners
from prepack.errors import InputError
from prepack.formats.common import list_column
from prepack.formats.shards import read_manifest
from prepack.sources.corpus import find_corpus
from prepack.sources.pairs import unpaired_examples
from prepack.sources.tokenize import load_tokenizer
from tests.building.test_pairs import gpt2, write_jsonl  # noqa: F401 (fixtures)
from tests.building.test_unpaired import chat_rows, text_rows
from tests.cli import failure, run_prepack

EXAMPLES = 9


def unpaired_build(tmp_path, gpt2, name="out", rows=None, **options):  # noqa: F811
    corpus = write_jsonl(tmp_path / "kto.jsonl", rows or text_rows(EXAMPLES))
    options = {"max_len": 256, "overflow": "drop", "num_proc": 1, **options}
    prepack.build(corpus, tmp_path / name, tokenizer=gpt2, unpaired=True, **options)
    return corpus, tmp_path / name


def documents_by_row(build) -> dict[int, tuple[list[int], list[int], int]]:
    """Every document of the build by its corpus row: (token ids, labels, its example's label as the pack says)."""
    found = {}
    manifest = read_manifest(build)
    for info in manifest.shards:
        batch = manifest.open_shard(build / info.name)
        ids_off, ids = list_column(batch, "input_ids")
        lab_off, labels = list_column(batch, "labels")
        cu_off, cu = list_column(batch, "cu_seqlens")
        row_off, rows = list_column(batch, "source_rows")
        des_off, desirable = list_column(batch, "desirable")
        for pack in range(batch.num_rows):
            bounds = cu[cu_off[pack] : cu_off[pack + 1]]
            pack_ids, pack_labels = ids[ids_off[pack] : ids_off[pack + 1]], labels[lab_off[pack] : lab_off[pack + 1]]
            for j, row in enumerate(rows[row_off[pack] : row_off[pack + 1]]):
                label = bool(desirable[des_off[pack] + j // 2])
                found[int(row)] = (pack_ids[bounds[j] : bounds[j + 1]].tolist(), pack_labels[bounds[j] : bounds[j + 1]].tolist(), label)
    return found


@pytest.mark.slow  # two builds, chat rendered: ~2-6 s
@pytest.mark.parametrize("chat", [False, True])
def test_each_example_packs_with_its_planned_kl_completion_and_label(tmp_path, gpt2, chat):  # noqa: F811
    rows = chat_rows(EXAMPLES) if chat else text_rows(EXAMPLES)
    corpus, build = unpaired_build(tmp_path, gpt2, rows=rows, chat=chat, kl_seed=5)
    examples = unpaired_examples(find_corpus(corpus), load_tokenizer(gpt2), chat=chat)
    partners = kl_partners(EXAMPLES, seed=5)
    documents = documents_by_row(build)
    assert sorted(documents) == list(range(2 * EXAMPLES))
    for r in range(EXAMPLES):
        prompt = examples.prompts[r]
        for document, completion in ((2 * r, examples.completions[r]), (2 * r + 1, examples.completions[int(partners[r])])):
            ids, labels, label = documents[document]
            assert ids == prompt + completion, (r, document)
            assert labels == [-100] * len(prompt) + completion
            assert label == rows[r]["label"]
    manifest = read_manifest(build)
    assert manifest.options.pairs.kind == "unpaired" and manifest.options.pairs.kl_seed == 5
    said = [row["label"] for row in rows]
    assert (manifest.pairs.pairs, manifest.pairs.desirable, manifest.pairs.undesirable) == (EXAMPLES, sum(said), EXAMPLES - sum(said))


@pytest.mark.slow  # a build and three collations: ~1 s
def test_the_collator_passes_each_examples_label_in_pair_order(tmp_path, gpt2):  # noqa: F811
    torch = pytest.importorskip("torch")
    from prepack.training.collate import PackedCollator

    rows = text_rows(EXAMPLES)
    _, build = unpaired_build(tmp_path, gpt2, rows=rows, max_len=128)
    dataset = PackedDataset(build)
    packs = [dataset[i] for i in range(len(dataset))]
    assert len(packs) > 1
    row_of = {tuple(ids): row for row, (ids, _, _) in documents_by_row(build).items()}  # every document differs here
    expected = []
    for pack in packs:  # each example's label, found by its completion document's tokens
        cu = pack["cu_seqlens"]
        expected += [rows[row_of[tuple(pack["input_ids"][cu[j] : cu[j + 1]].tolist())] // 2]["label"] for j in range(0, len(cu) - 1, 2)]
    assert len(expected) == EXAMPLES and len(set(expected)) == 2
    for options in ({}, {"layout": "padding_free"}, {"shared_prompt": True}):
        batch = PackedCollator.for_dataset(dataset, **options)(packs)
        assert batch["desirable"].dtype == torch.bool and batch["desirable"].tolist() == expected, options


@pytest.mark.slow  # three builds: ~2 s
def test_same_input_and_options_give_the_same_bytes(tmp_path, gpt2):  # noqa: F811
    _, first = unpaired_build(tmp_path, gpt2, "first", kl_seed=3)
    _, second = unpaired_build(tmp_path, gpt2, "second", kl_seed=3)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert all(filecmp.cmp(first / name, second / name, shallow=False) for name in names)
    _, other = unpaired_build(tmp_path, gpt2, "other", kl_seed=4)  # another plan: other KL completions
    assert read_manifest(other).fingerprint != read_manifest(first).fingerprint


@pytest.mark.slow  # seven commands in subprocesses: ~11 s
def test_bad_input_exits_2_naming_file_row_and_column(tmp_path, gpt2):  # noqa: F811
    def refused(rows_or_path, *flags) -> str:
        corpus = rows_or_path if not isinstance(rows_or_path, list) else write_jsonl(tmp_path / "bad.jsonl", rows_or_path)
        out = tmp_path / "out"
        message = failure(run_prepack("build", corpus, "--unpaired", "--tokenizer", gpt2, "--out", out, "--max-len", 256,
                                      *(flags or ("--overflow", "drop"))))
        assert not out.exists()
        return message

    rows = text_rows(3)
    rows[1]["label"] = "yes"
    assert "bad.jsonl, row 1, column 'label': expected a boolean (true: desirable), found str" in refused(rows)
    rows = text_rows(3)
    del rows[2]["completion"]
    assert "bad.jsonl, row 2: the record has no 'completion'" in refused(rows)
    table = pa.table({"prompt": ["a", "b"], "completion": [" x", " y"]})
    pq.write_table(table, tmp_path / "nolabel.parquet")
    assert f"{tmp_path / 'nolabel.parquet'}: there is no column 'label'" in refused(tmp_path / "nolabel.parquet")
    assert "bad.jsonl: 1 example(s); KTO's KL term" in refused(text_rows(1))
    assert "--unpaired never splits an example" in refused(text_rows(3), "--overflow", "split")
    assert "--pairs and --unpaired are different kinds of corpus" in refused(text_rows(3), "--overflow", "drop", "--pairs")
    assert "--kl-seed name" in failure(run_prepack("build", write_jsonl(tmp_path / "ok.jsonl", text_rows(3)), "--tokenizer", gpt2,
                                                   "--out", tmp_path / "out", "--kl-seed", 2))


def test_an_example_too_long_is_refused_or_dropped_whole(tmp_path, gpt2):  # noqa: F811
    rows = text_rows(EXAMPLES)
    rows[4]["completion"] = " long" * 300
    # Example 4, and the example whose KL completion is 4's completion: each longer than max_len.
    long = {4, int(np.flatnonzero(kl_partners(EXAMPLES, seed=0) == 4)[0])}
    with pytest.raises(InputError, match=rf"kto.jsonl, row {min(long)}: the example's \d+ tokens \(prompt \+ completion, prompt \+ KL"):
        unpaired_build(tmp_path, gpt2, rows=rows, overflow="error")
    _, build = unpaired_build(tmp_path, gpt2, "dropped", rows=rows)
    manifest = read_manifest(build)
    documents = documents_by_row(build)
    assert sorted(documents) == [d for r in range(EXAMPLES) if r not in long for d in (2 * r, 2 * r + 1)]
    assert manifest.pairs.dropped == 2
    kept = [row["label"] for r, row in enumerate(rows) if r not in long]
    assert (manifest.pairs.desirable, manifest.pairs.undesirable) == (sum(kept), len(kept) - sum(kept))


@pytest.mark.slow  # a build and an export: ~3 s
def test_a_parquet_export_keeps_each_examples_label(tmp_path, gpt2):  # noqa: F811
    from prepack.exports import export_build

    _, build = unpaired_build(tmp_path, gpt2, max_len=128)
    export_build(build, "parquet", tmp_path / "exported")
    table = pq.read_table(sorted((tmp_path / "exported").rglob("*.parquet")))
    stored = [list_column(read_manifest(build).open_shard(build / info.name), "desirable") for info in read_manifest(build).shards]
    expected = [[bool(v) for v in values[offsets[p] : offsets[p + 1]]] for offsets, values in stored for p in range(len(offsets) - 1)]
    assert table.column("desirable").to_pylist() == expected
    assert "| `desirable` |" in (tmp_path / "exported" / "README.md").read_text()


def test_options_an_unpaired_build_cannot_honour_are_refused_before_reading(tmp_path, gpt2):  # noqa: F811
    corpus = write_jsonl(tmp_path / "kto.jsonl", text_rows(3))
    for options, says in (
        ({"unpaired": True, "overflow": "drop", "engine": "ray"}, "--unpaired builds run on the local engine"),
        ({"unpaired": True, "overflow": "drop", "drop_untrained": True}, "--drop-untrained would break unpaired"),
        ({"unpaired": True, "overflow": "drop", "chosen_column": "good"}, "--unpaired reads --prompt-column, --completion-column and --label-column"),
        ({"unpaired": True, "groups": True, "overflow": "drop"}, "--groups and --unpaired are different kinds of corpus"),
        ({"label_column": "thumbs_up"}, "--label-column names the columns and plan of unpaired feedback: add --unpaired"),
    ):
        with pytest.raises(InputError, match=says):
            prepack.build(corpus, tmp_path / "out", max_len=64, tokenizer=gpt2, **options)
        assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="not unpaired examples"):
        prepack.build_store(corpus, tmp_path / "store", tokenizer=gpt2, unpaired=True)
