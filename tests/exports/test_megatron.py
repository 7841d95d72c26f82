"""The Megatron export, read back by megatron-core's own `IndexedDataset` (0.16.1) and as Megatron-Bridge's
packed Parquet loader reads it (`GPTSFTPackedParquetDataset` and its collate, Bridge 0.7.0, which is not
installed: its reads are done here with pyarrow as its source does them), equals what prepack trains on:
every pack's tokens, document boundaries and trained tokens."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from prepack.errors import InputError
from prepack.exports import export_build, megatron, verify_export
from prepack.exports.common import open_export_build, pack_batches
from tests.cli import invoke_prepack
from tests.corpus import preference_pairs
from tests.exports.rows import Expected
from tests.exports.trainer_builds import KINDS, files, labelled_corpus_build, targets_from_next_token_mask


def export(build_dir: Path, out: Path) -> Path:
    export_build(build_dir, "megatron", out)
    return out


def indexed_dataset_mismatches(out: Path, expected: Expected) -> list[str]:
    """Where megatron-core's IndexedDataset over tokens.* and loss_mask.* differs from the build: one
    Megatron document per pack, one sequence per prepack document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokens, loss_mask = IndexedDataset(str(out / "tokens")), IndexedDataset(str(out / "loss_mask"))
    problems = []
    if not np.array_equal(tokens.document_indices, loss_mask.document_indices):
        problems.append("the two datasets group their sequences differently")
    if len(tokens.document_indices) - 1 != len(expected):
        return problems + [f"{len(tokens.document_indices) - 1} documents for {len(expected)} packs"]
    for p in range(len(expected)):
        first, stop = tokens.document_indices[p], tokens.document_indices[p + 1]
        documents, masks = tokens[first:stop], loss_mask[first:stop]
        ids, mask = np.concatenate(documents), np.concatenate(masks)
        cu = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
        if not np.array_equal(ids, expected.ids(p)):
            problems.append(f"pack {p}: tokens")
        elif not np.array_equal(cu, expected.cu_seqlens(p)):
            problems.append(f"pack {p}: document boundaries")
        elif not np.array_equal(targets_from_next_token_mask(ids, cu, mask), expected.targets(p)):
            problems.append(f"pack {p}: loss mask")
    return problems


def bridge_rows(out: Path) -> list[dict]:
    """The packed Parquet rows as GPTSFTPackedParquetDataset.__getitem__ serves them (a directory spec:
    every *.parquet in it, sorted; each row group read with the three columns, rows as Python lists)."""
    rows = []
    for path in sorted(glob.glob(str(out / "*.parquet"))):
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group, columns=["input_ids", "seq_start_id", "loss_mask"])
            for r in range(table.num_rows):
                input_ids = table.column("input_ids")[r].as_py()
                rows.append({"input_ids": input_ids, "seq_boundaries": table.column("seq_start_id")[r].as_py()
                             + [len(input_ids)], "loss_mask": table.column("loss_mask")[r].as_py()})
    return rows


def bridge_mismatches(out: Path, expected: Expected) -> list[str]:
    rows = bridge_rows(out)
    if len(rows) != len(expected):
        return [f"{len(rows)} packed rows for {len(expected)} packs"]
    problems = []
    for p, row in enumerate(rows):
        ids, cu = np.array(row["input_ids"]), np.array(row["seq_boundaries"])
        if len(row["loss_mask"]) != len(ids):
            problems.append(f"pack {p}: loss_mask length")  # GPTSFTPackedParquetDataset.validate_row
        elif not np.array_equal(ids, expected.ids(p)):
            problems.append(f"pack {p}: tokens")
        elif not np.array_equal(cu, expected.cu_seqlens(p)):
            problems.append(f"pack {p}: document boundaries")
        elif not np.array_equal(targets_from_next_token_mask(ids, cu, row["loss_mask"]), expected.targets(p)):
            problems.append(f"pack {p}: loss mask")
    return problems


@pytest.fixture(scope="module", params=KINDS)
def exported(request, builds, tmp_path_factory) -> tuple[Path, Path]:
    build_dir = builds[request.param]
    return build_dir, export(build_dir, tmp_path_factory.mktemp("megatron") / "out")


@pytest.mark.slow
def test_indexed_dataset_holds_every_pack(exported):
    build_dir, out = exported
    assert indexed_dataset_mismatches(out, Expected(build_dir)) == []


@pytest.mark.slow
def test_bridge_packed_parquet_holds_every_pack(exported):
    build_dir, out = exported
    expected = Expected(build_dir)
    assert bridge_mismatches(out, expected) == []
    assert [Path(p).name for p in glob.glob(str(out / "*.parquet"))] == ["packed.idx.parquet"]
    # the metadata GPTSFTPackedDataset reads for pad_cu_seqlens (a list of dicts, as Bridge appends them)
    (metadata,) = json.loads((out / "packed_metadata.json").read_text())
    lengths = [np.diff(expected.cu_seqlens(p)) for p in range(len(expected))]
    assert metadata["max_samples_per_bin"] == max(len(d) for d in lengths)
    assert metadata["dataset_max_seqlen"] == max(d.max() for d in lengths)
    assert metadata["min_packed_seqlen"] == min(d.sum() for d in lengths)
    assert metadata["pack_size"] == expected.manifest.options.max_len
    if expected.manifest.mixture is not None:  # the extra column Bridge does not read
        source_ids = pq.read_table(out / "packed.idx.parquet", columns=["source_ids"]).column(0).to_pylist()
        assert source_ids == [expected.source_ids(p).tolist() for p in range(len(expected))]


@pytest.mark.slow
def test_the_indexed_datasets_are_the_bytes_megatron_cores_own_builder_writes(exported, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    build_dir, out = exported
    expected = Expected(build_dir)
    for name, dtype in (("tokens", np.int32), ("loss_mask", np.uint8)):
        builder = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=dtype)
        for p in range(len(expected)):
            ids, cu = expected.ids(p), expected.cu_seqlens(p)
            if name == "tokens":
                values = ids
            else:  # 1 where the next token of the same document is trained
                values = np.append(expected.targets(p)[1:] != -100, False)
            builder.add_document(values, np.diff(cu).tolist())
        builder.finalize(str(tmp_path / f"{name}.idx"))
        for suffix in (".bin", ".idx"):
            assert (out / f"{name}{suffix}").read_bytes() == (tmp_path / f"{name}{suffix}").read_bytes(), name + suffix


@pytest.mark.slow
def test_the_comparisons_see_a_changed_loss_mask_token_or_boundary(builds, tmp_path):
    build_dir = builds["chat"]
    expected = Expected(build_dir)
    out = export(build_dir, tmp_path / "out")
    mask = out / "loss_mask.bin"
    data = bytearray(mask.read_bytes())
    trained = data.index(1)
    data[trained] = 0  # one trained token no longer trained
    mask.write_bytes(bytes(data))
    assert indexed_dataset_mismatches(out, expected) != []

    out = export(build_dir, tmp_path / "again")
    tokens = np.fromfile(out / "tokens.bin", np.int32)
    tokens[7] += 1
    tokens.tofile(out / "tokens.bin")
    assert indexed_dataset_mismatches(out, expected) == ["pack 0: tokens"]

    table = pq.read_table(out / "packed.idx.parquet")
    starts = table.column("seq_start_id").to_pylist()
    p = next(p for p, s in enumerate(starts) if len(s) > 1)
    starts[p][1] += 1  # a boundary moved by one token
    pq.write_table(table.set_column(2, "seq_start_id", [starts]), out / "packed.idx.parquet")
    assert bridge_mismatches(out, expected) == [f"pack {p}: document boundaries"]


@pytest.mark.slow
def test_a_rerun_writes_the_same_bytes(builds, tmp_path):
    build_dir = builds["mixture"]
    assert files(export(build_dir, tmp_path / "a")) == files(export(build_dir, tmp_path / "b"))


def test_labels_other_than_the_token_ids_are_refused(tmp_path):
    # Megatron and Bridge take every target from the next token id: a label of another value has no place
    build_dir = labelled_corpus_build(tmp_path, lambda doc: [-100] + [t + 1 for t in doc[1:]])
    with pytest.raises(InputError, match=r"Pack \d+, token \d+, column .labels.*token id"):
        export(build_dir, tmp_path / "out")


@pytest.mark.slow
def test_a_preference_pair_build_is_refused_by_name(tmp_path):
    build_dir = preference_pairs(tmp_path)
    with pytest.raises(InputError, match="preference-pair build"):
        export(build_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_line_exports_and_verifies(builds, tmp_path):
    build_dir, out = builds["chat-index"], tmp_path / "export"
    result = invoke_prepack("export", str(build_dir), "--to", "megatron", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert indexed_dataset_mismatches(out, Expected(build_dir)) == []
    record = json.loads((out / "export.json").read_text())
    assert record["format"] == "megatron" and record["build"]["kind"] == "index"
    assert [f["path"] for f in record["files"]] == [
        "loss_mask.bin", "loss_mask.idx", "packed.idx.parquet", "packed_metadata.json", "tokens.bin", "tokens.idx"]
    checked = invoke_prepack("verify", str(build_dir), "--export", str(out))
    assert checked.returncode == 0 and "the export's files and build checked" in checked.stdout
    data = bytearray((out / "loss_mask.bin").read_bytes())
    data[data.index(1)] = 0
    (out / "loss_mask.bin").write_bytes(bytes(data))
    (problem,) = verify_export(out, build_dir)
    assert problem.startswith(f"{out / 'loss_mask.bin'}: sha256 ") and problem.endswith("the file changed.")
    tampered = invoke_prepack("verify", str(build_dir), "--export", str(out))
    assert tampered.returncode == 1 and "loss_mask.bin" in tampered.stdout and "the file changed" in tampered.stdout


def test_the_spools_are_written_to_scratch_never_into_the_export(tmp_path):
    build = open_export_build(labelled_corpus_build(tmp_path, lambda doc: doc))
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    seen = []

    def batches():
        for batch in pack_batches(build):
            yield batch
            seen.append(({path.name for path in out.iterdir()}, {path.name for path in scratch.iterdir()}))

    megatron.write(batches(), out, build, scratch)
    assert seen and all(exported.isdisjoint(spools) and spools for exported, spools in seen)
    assert sorted(path.name for path in out.iterdir()) == sorted(
        [f"{megatron.TOKENS}.bin", f"{megatron.TOKENS}.idx", f"{megatron.LOSS_MASK}.bin", f"{megatron.LOSS_MASK}.idx",
         megatron.PACKED, megatron.PACKED_METADATA]
    )
