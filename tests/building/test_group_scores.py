"""Groups with per-completion scores or ranks (`prepack build --groups --scores-column S --ranks-column R`): each
value is validated as read (file, row, column), stored beside its completion document, checked by every reader and
by `verify`, and handed to the loss by `PackedCollator` as `group_scores` / `group_ranks` [N, G], in the rows of
`group_logps`, in every layout. Also two leftovers of the group build's review: `inspect`'s wording of a G = 2
group build, and `open_shard(pairs=True)`.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import prepack
from prepack import PackedDataset
from prepack.errors import ArgumentTypeError, FormatError, InputError, UsageError
from prepack.formats.shards import open_shard, read_manifest
from prepack.formats.store import read_store_manifest
from tests.building.test_groups_build import text_groups
from tests.building.test_pairs import gpt2, write_jsonl  # noqa: F401 (fixtures)
from tests.cli import failure, run_prepack
from tests.corpus import record_shard

SIZE = 4


def competition_ranks(keys: list[int]) -> list[int]:
    """1 + how many keys are lower: 1 the best (lowest key), ties sharing a rank (scipy's rankdata "min")."""
    return [1 + sum(other < key for other in keys) for key in keys]


def scored_groups(count: int) -> list[dict]:
    """`text_groups` with a list of scores (of every sign and magnitude) and ranks (with ties) a row."""
    rows = text_groups(count)
    for i, row in enumerate(rows):
        row["scores"] = [i + 0.5, -1.0 / (i + 3), 2.25e10 * i, 1e-300][:SIZE]
        row["ranks"] = competition_ranks([(i * (k + 1)) % 3 for k in range(SIZE)])
    return rows


def batch_rows(dataset: PackedDataset, size: int) -> list[int]:
    """The corpus row of every group of the dataset's packs, in pack order: the rows of a batch of them all."""
    return [int(row) // size for i in range(len(dataset)) for row in dataset.source_rows(i)[::size]]


def layouts(cap: int | None) -> list[dict]:
    """Every PackedCollator layout a group batch comes in: padded and padding-free, two-sequence and shared-prompt,
    and fixed-shape (`max_docs_per_pack`) where the build has a cap."""
    found = [{}, {"layout": "padding_free"}, {"shared_prompt": True}, {"shared_prompt": True, "layout": "padding_free"}]
    return found + ([{"fixed_shape": True}, {"fixed_shape": True, "shared_prompt": True}] if cap is not None else [])


def rendered(build: Path) -> str:
    from prepack.check.report import inspect_build, render

    console = Console(file=io.StringIO(), width=1000)
    console.print(render(inspect_build(build)))
    return console.file.getvalue()


@pytest.mark.slow  # a build and its report: ~1.5 s
def test_a_group_build_of_two_is_worded_as_pairs_are(tmp_path, gpt2):  # noqa: F811
    """A --groups build of G = 2 holds pairs (`unit_name(2)`): inspect compares it with TRL's DPOTrainer as a
    --pairs build, never as "padded" groups."""
    rows = [{"prompt": r["prompt"], "completions": r["completions"][:2]} for r in text_groups(8)]
    corpus = write_jsonl(tmp_path / "two.jsonl", rows)
    prepack.build(corpus, tmp_path / "out", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
    assert read_manifest(tmp_path / "out").options.pairs.group_size == 2
    text = rendered(tmp_path / "out")
    assert "TRL DPOTrainer, random batches of 8 pairs" in text and "padded, random batches" not in text


@pytest.fixture(scope="module")
def scored_build(tmp_path_factory, gpt2):  # noqa: F811
    root = tmp_path_factory.mktemp("scored")
    corpus = write_jsonl(root / "scored.jsonl", scored_groups(30))
    prepack.build(corpus, root / "out", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1,
                  scores_column="scores", ranks_column="ranks", max_docs_per_pack=2 * SIZE)
    return root, corpus


def test_open_shard_refuses_a_bool_group_size(scored_build):
    """`pairs` is the group size: True == 1 would pass an int check and be read as G = 1."""
    root, _ = scored_build
    info = read_manifest(root / "out").shards[0]
    path = root / "out" / info.name
    for size in (True, 1, 2.0):
        with pytest.raises(ArgumentTypeError, match=rf"pairs must be a group size, an int of at least 2, not {size!r}"):
            open_shard(path, True, 256, pairs=size, scores=True, ranks=True)
    with pytest.raises(ArgumentTypeError, match=r"scores and ranks are a group build's: give its group size \(pairs\)"):
        open_shard(path, True, 256, scores=True)
    with pytest.raises(ArgumentTypeError, match=r"scores and ranks are a group build's, desirable an unpaired build's: not both"):
        open_shard(path, True, 256, pairs=SIZE, ranks=True, unpaired=True)
    assert open_shard(path, True, 256, pairs=SIZE, scores=True, ranks=True).num_rows == info.rows


def test_scores_and_ranks_reach_the_batch_in_the_rows_of_group_logps(scored_build):
    """Every layout's `group_scores` / `group_ranks` [N, G] are the corpus's values of the batch's groups, in
    the order of `pair_segments` / the shared-prompt layout's groups (`pair_count` rows, as `group_logps` gives)."""
    from prepack import PackedCollator
    from prepack.training.preference import model_inputs, pair_count

    root, _ = scored_build
    rows = scored_groups(30)
    manifest = read_manifest(root / "out")
    assert (manifest.options.pairs.scores_column, manifest.options.pairs.ranks_column) == ("scores", "ranks")
    dataset = PackedDataset(root / "out")
    packs = [dataset[i] for i in range(len(dataset))]
    order = batch_rows(dataset, SIZE)
    assert len(set(order)) == len(order) == 30 - manifest.pairs.dropped > 1
    documents = {}  # corpus document -> its tokens
    for i, pack in enumerate(packs):
        cu = pack["cu_seqlens"]
        documents |= {int(r): pack["input_ids"][cu[j] : cu[j + 1]].tolist() for j, r in enumerate(dataset.source_rows(i))}
    for options in layouts(manifest.options.max_docs_per_pack):
        batch = PackedCollator.for_dataset(dataset, **options)(packs)
        if "pair_segments" in batch:  # row p's values are those of the documents group_logps' row p reads
            flat, cu = batch["input_ids"].flatten().tolist(), batch["cu_seq_lens_q"].tolist()
            for p, row in enumerate(order):
                read = [flat[cu[s] : cu[s + 1]] for s in batch["pair_segments"][p].tolist()]
                assert read == [documents[SIZE * row + k] for k in range(SIZE)], (options, p)
        assert batch["group_scores"].dtype == torch.float64 and batch["group_ranks"].dtype == torch.int64
        assert batch["group_scores"].tolist() == [rows[r]["scores"] for r in order], options
        assert batch["group_ranks"].tolist() == [rows[r]["ranks"] for r in order], options
        assert len(batch["group_scores"]) == pair_count(batch)
        assert not {"group_scores", "group_ranks"} & set(model_inputs(batch))
    bare = {key: value for key, value in packs[1].items() if key != "group_scores"}
    with pytest.raises(UsageError, match="Pack 1 has no 'group_scores' while others of the batch have: collate packs of one group build"):
        PackedCollator.for_dataset(dataset)([packs[0], bare])


def test_open_hf_dataset_keeps_the_scores_float64(scored_build):
    """datasets' numpy format makes floats float32: the scores stay out of it, as stored."""
    from prepack import PackedCollator
    from prepack.training.dataset import open_hf_dataset

    root, _ = scored_build
    rows = scored_groups(30)
    dataset = open_hf_dataset(root / "out")
    batch = PackedCollator.for_dataset(root / "out")([dataset[i] for i in range(len(dataset))])
    order = batch_rows(PackedDataset(root / "out"), SIZE)
    assert batch["group_scores"].tolist() == [rows[r]["scores"] for r in order]
    assert batch["group_ranks"].tolist() == [rows[r]["ranks"] for r in order]
    pack = PackedDataset(root / "out")[0]
    with pytest.raises(UsageError, match="group_scores are float32, not the stored float64"):
        PackedCollator.for_dataset(root / "out")([pack | {"group_scores": pack["group_scores"].astype(np.float32)}])


@pytest.mark.slow  # a build an example: ~0.5 s each
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_round_trip_from_corpus_to_batch(gpt2, data):  # noqa: F811
    """Random small corpora of groups of 2 to 8, random finite scores and tied ranks: every layout's batch holds
    the corpus's values for every group, in order."""
    from prepack import PackedCollator

    size = data.draw(st.integers(2, 8), label="G")
    words = st.lists(st.sampled_from(["a", "cat", "sun", "no", "hello", "x"]), min_size=1, max_size=3).map(" ".join)
    corpus = []
    for _ in range(data.draw(st.integers(1, 6), label="rows")):
        corpus.append({
            "prompt": "Q: " + data.draw(words),
            "completions": [" " + data.draw(words) for _ in range(size)],
            "scores": data.draw(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=size, max_size=size)),
            "ranks": competition_ranks(data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))),
        })
    cap = data.draw(st.sampled_from([None, size, 2 * size]), label="max_docs_per_pack")
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        prepack.build(write_jsonl(root / "g.jsonl", corpus), root / "out", max_len=512, tokenizer=gpt2, groups=True,
                      overflow="drop", num_proc=1, scores_column="scores", ranks_column="ranks", max_docs_per_pack=cap)
        dataset = PackedDataset(root / "out")
        packs = [dataset[i] for i in range(len(dataset))]
        order = batch_rows(dataset, size)
        assert sorted(order) == list(range(len(corpus)))
        for options in layouts(cap):
            batch = PackedCollator.for_dataset(dataset, **options)(packs)
            assert batch["group_scores"].tolist() == [corpus[r]["scores"] for r in order], options
            assert batch["group_ranks"].tolist() == [corpus[r]["ranks"] for r in order], options


@pytest.mark.slow  # three builds: ~1 s
def test_a_scored_build_is_deterministic_and_an_unscored_one_unchanged(tmp_path, gpt2):  # noqa: F811
    corpus = write_jsonl(tmp_path / "scored.jsonl", scored_groups(12))
    for out in ("a", "b"):
        prepack.build(corpus, tmp_path / out, max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1,
                      scores_column="scores", ranks_column="ranks")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    prepack.build(corpus, tmp_path / "plain", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
    text = (tmp_path / "plain" / "manifest.json").read_text()
    assert "scores_column" not in text and "ranks_column" not in text
    shard = tmp_path / "plain" / read_manifest(tmp_path / "plain").shards[0].name
    assert open_shard(shard, True, 256, pairs=SIZE).schema.names[-1] == "pair_roles"
    assert "group_scores" not in PackedDataset(tmp_path / "plain")[0]


@pytest.mark.parametrize(("column", "value", "message"), [
    ("scores", [1.0, 2.0, 3.0], r"column 'scores': expected a list of 4 scores, one a completion, found 3 values"),
    ("scores", "NaN", r"column 'scores': expected a list of 4 scores, one a completion, found str"),
    ("scores", [1.0, float("nan"), 0.0, 0.0], r"column 'scores'\[1\]: expected a finite number, found nan"),
    ("scores", [1.0, 0.0, float("-inf"), 0.0], r"column 'scores'\[2\]: expected a finite number, found -inf"),
    ("scores", [1.0, 0.0, 0.0, 10**400], r"column 'scores'\[3\]: expected a finite number, found 1000"),
    ("scores", [True, 0.0, 0.0, 0.0], r"column 'scores'\[0\]: expected a finite number, found True"),
    ("scores", [1.0, "high", 0.0, 0.0], r"column 'scores'\[1\]: expected a finite number, found 'high'"),
    ("ranks", [1, 2, 3], r"column 'ranks': expected a list of 4 ranks, one a completion, found 3 values"),
    ("ranks", [1, 2.0, 3, 4], r"column 'ranks'\[1\]: expected an integer rank \(1 the best\), found 2.0"),
    ("ranks", [1, 1, 2, 4], r"column 'ranks': ranks \[1, 1, 2, 4\] are not a competition ranking of 1 to 4"),
    ("ranks", [1, 2, 2, 3], r"column 'ranks': ranks \[1, 2, 2, 3\] are not a competition ranking of 1 to 4"),
    ("ranks", [0, 1, 2, 3], r"column 'ranks': ranks \[0, 1, 2, 3\] are not a competition ranking of 1 to 4"),
    ("ranks", [2, 3, 4, 5], r"column 'ranks': ranks \[2, 3, 4, 5\] are not a competition ranking of 1 to 4"),
])
def test_a_bad_value_is_refused_by_file_row_and_column(tmp_path, gpt2, column, value, message):  # noqa: F811
    rows = scored_groups(3)
    rows[2][column] = value
    corpus = write_jsonl(tmp_path / "bad.jsonl", rows)  # json writes NaN and -Infinity, which the reader takes
    with pytest.raises(InputError, match=r"bad.jsonl, row 2, " + message):
        prepack.build(corpus, tmp_path / "out", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1,
                      scores_column="scores", ranks_column="ranks")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a refused command line: ~3 s
def test_scores_and_ranks_are_refused_outside_a_group_build_and_a_missing_column_by_name(tmp_path, gpt2):  # noqa: F811
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q:", "chosen": " a", "rejected": " b", "scores": [1, 2]}])
    with pytest.raises(InputError, match="--pairs reads .* leave out --scores-column"):
        prepack.build(pairs, tmp_path / "a", max_len=64, tokenizer=gpt2, pairs=True, overflow="drop", scores_column="scores")
    with pytest.raises(InputError, match="--ranks-column: scores and ranks are a group's, one a completion: add --groups"):
        prepack.build(pairs, tmp_path / "b", max_len=64, tokenizer=gpt2, ranks_column="ranks")
    table = pa.Table.from_pylist(text_groups(2))
    pq.write_table(table, tmp_path / "groups.parquet")
    with pytest.raises(InputError, match=r"groups.parquet: there is no column 'score' \(columns: prompt, completions\), which "
                                         "--scores-column names"):
        prepack.build(tmp_path / "groups.parquet", tmp_path / "c", max_len=256, tokenizer=gpt2, groups=True,
                      overflow="drop", scores_column="score")
    rows = scored_groups(2)
    rows[1]["scores"][0] = float("nan")  # NaN in Parquet, a float column's value
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nan.parquet")
    message = failure(run_prepack("build", tmp_path / "nan.parquet", "--out", tmp_path / "d", "--max-len", "256",
                                  "--tokenizer", gpt2, "--groups", "--overflow", "drop", "--scores-column", "scores"))
    assert "nan.parquet, row 1, column 'scores'[0]: expected a finite number, found nan" in message
    assert not (tmp_path / "d").exists()


@pytest.mark.slow  # a store tokenized, two refused command lines: ~4 s
def test_scores_and_ranks_are_refused_for_unpaired_examples_and_for_a_store_by_name(tmp_path, gpt2):  # noqa: F811
    """An unpaired (KTO) build has labels, not scores; a document store holds a group's documents, with no column for
    their scores or ranks: `prepack tokenize --groups` refuses them, and so does a build from a store."""
    from tests.building.test_unpaired import text_rows

    feedback = write_jsonl(tmp_path / "kto.jsonl", text_rows(3))
    with pytest.raises(InputError, match="--unpaired reads .* leave out --scores-column, --ranks-column"):
        prepack.build(feedback, tmp_path / "a", max_len=64, tokenizer=gpt2, unpaired=True, overflow="drop",
                      scores_column="scores", ranks_column="ranks")
    corpus = write_jsonl(tmp_path / "scored.jsonl", scored_groups(3))
    message = failure(run_prepack("tokenize", corpus, "--out", tmp_path / "store", "--tokenizer", gpt2, "--groups",
                                  "--ranks-column", "ranks"))
    assert "a document store holds the groups' documents, not their scores or ranks: leave out --ranks-column" in message
    assert not (tmp_path / "store").exists()
    prepack.build_store(corpus, tmp_path / "store", tokenizer=gpt2, groups=True, num_proc=1)
    with pytest.raises(InputError, match=r"store is a document store, which holds no scores or ranks: leave out --scores-column"):
        prepack.build(tmp_path / "store", tmp_path / "b", max_len=256, overflow="drop", scores_column="scores")
    manifest = json.loads((tmp_path / "store" / "store.json").read_text())
    manifest["pairs"]["scores_column"] = "scores"  # a store.json that claims scores its shards cannot hold
    with pytest.raises(FormatError, match="a store of groups holds no scores or ranks"):
        read_store_manifest(json.dumps(manifest).encode())


def rewritten(build: Path, column: str, change) -> Path:
    """`build`'s first shard with `change` applied to `column`'s first row (a list), its sha256 re-recorded, so
    that only the value checks can notice."""
    path = build / read_manifest(build).shards[0].name
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    field = batch.schema.field(column)
    values = batch.column(column).to_pylist()
    values[0] = change(values[0])
    batch = batch.set_column(batch.schema.get_field_index(column), field, pa.array(values, field.type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    path.write_bytes(sink.getvalue().to_pybytes())
    record_shard(build / "manifest.json", path)
    return path


@pytest.mark.slow  # a verify command line: ~2 s
@pytest.mark.parametrize(("column", "change", "message"), [
    ("group_scores", lambda v: [float("nan"), *v[1:]], "score nan is not a finite number"),
    ("group_scores", lambda v: v[:-1], f"{2 * SIZE - 1} values for {2 * SIZE} documents"),
    ("group_ranks", lambda v: [0, *v[1:]], "are not a competition ranking of 1 to 4"),
])
def test_a_tampered_value_is_a_verify_finding_and_refused_by_the_reader(scored_build, tmp_path, column, change, message):
    root, _ = scored_build
    build = shutil.copytree(root / "out", tmp_path / "out")
    assert len(PackedDataset(build)[0]["pair_roles"]) == 2 * SIZE  # the cap: the first pack holds two groups
    rewritten(build, column, change)
    with pytest.raises(FormatError, match=f"row 0, column '{column}': .*{message}"):
        PackedDataset(build)[0]
    result = run_prepack("verify", build)
    assert result.returncode == 1 and column in result.stdout and message in " ".join(result.stdout.split()), result.stdout


@pytest.mark.slow  # verify against the source twice, inspect, verify twice: ~20 s
def test_verify_and_inspect_read_a_scored_build(scored_build, gpt2):  # noqa: F811
    root, corpus = scored_build
    result = run_prepack("verify", root / "out", "--source", corpus, "--tokenizer", gpt2)
    assert result.returncode == 0, result.stdout + result.stderr
    text = rendered(root / "out")
    assert "scores from column 'scores' (group_scores); ranks, 1 the best, from column 'ranks' (group_ranks)" in text
    report = json.loads(run_prepack("inspect", root / "out", "--json").stdout)
    assert (report["pairs"]["scores_column"], report["pairs"]["ranks_column"]) == ("scores", "ranks")
    build = shutil.copytree(root / "out", root / "changed")
    path = build / read_manifest(build).shards[0].name
    data = bytearray(path.read_bytes())
    needle = np.float64(scored_groups(30)[batch_rows(PackedDataset(build), SIZE)[0]]["scores"][0]).tobytes()
    at = bytes(data).index(needle)  # a finite score changed in place, the shard's sha256 not re-recorded
    data[at : at + 8] = np.float64(7.0).tobytes()
    path.write_bytes(bytes(data))
    result = run_prepack("verify", build)
    assert result.returncode == 1 and "sha256" in result.stdout and "the file changed after the build" in result.stdout
    record_shard(build / "manifest.json", path)  # now only the source can tell
    assert run_prepack("verify", build).returncode == 0
    result = run_prepack("verify", build, "--source", corpus, "--tokenizer", gpt2)
    found = " ".join(result.stdout.split())
    assert result.returncode == 1 and "group_scores" in found and "holds 7.0, but the source gives" in found, found


@pytest.mark.slow  # a build exported: ~3 s
def test_a_parquet_export_carries_the_values(scored_build, tmp_path):
    """`prepack export --to parquet` keeps each completion's score and rank beside its document, as stored."""
    root, _ = scored_build
    prepack.export_build(root / "out", "parquet", tmp_path / "export")
    table = pa.concat_tables(pq.read_table(path) for path in sorted((tmp_path / "export").rglob("*.parquet")))
    dataset = PackedDataset(root / "out")
    for column in ("group_scores", "group_ranks"):
        assert table.column(column).to_pylist() == [dataset[i][column].tolist() for i in range(len(dataset))]
    assert "`group_scores` | document | each completion's score, from column `scores`" in (tmp_path / "export" / "README.md").read_text()


def test_verify_without_a_source_keeps_no_view_into_a_shard(scored_build, monkeypatch):
    """Without --source nothing reads a shard's tokens or values again: verify drops its views (ids, labels,
    the group values) as it reads each shard, so that no shard stays mapped for the whole check."""
    from prepack.check import verify

    root, _ = scored_build
    kept = []
    monkeypatch.setattr(verify, "_provenance_problems", lambda packs: kept.extend(packs.shards.values()) or iter(()))
    assert not list(verify.verify_build(root / "out"))
    assert kept and all(s.ids is None and s.labels is None and not s.group_values for s in kept)
