"""Loading an index build: every pack gathered from the store by one kernel call, each reference it
follows checked (validated build or not), each store shard checked once on first use; and
`open_hf_dataset` serving the full build's rows, to a trainer too."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from prepack import build, build_store
from prepack.training.collate import PackedCollator
from prepack.errors import FormatError, InputError
from prepack.formats.common import list_array
from prepack.formats import reference as stored
from prepack.storage.files import write_record_batch
from prepack.training import dataset as dataset_module
from prepack.training.dataset import PackedDataset, open_hf_dataset
from prepack.sources.store import Store
from tests.corpus import corpus_table, write_corpus

MAX_LEN = 32


def _store(root: Path, labels: bool) -> Path:
    """120 documents of 1 to 40 tokens (some split at max-len 32) in several store shards."""
    rng = np.random.default_rng(11)
    ids = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(1, 41, 120)]
    masked = [[-100 if rng.random() < 0.3 else t for t in doc] for doc in ids] if labels else None
    write_corpus(root / "corpus.parquet", corpus_table(ids, masked))
    build_store(root / "corpus.parquet", root / "store", shard_size=512)
    return root / "store"


@pytest.fixture(scope="module", params=[True, False], ids=["labels", "no-labels"])
def builds(request, tmp_path_factory) -> tuple[Path, Path]:
    """(full build, index build) of one store, with the same options."""
    root = tmp_path_factory.mktemp("index-load")
    store = _store(root, labels=request.param)
    build(store, root / "full", max_len=MAX_LEN)
    build(store, root / "index", max_len=MAX_LEN, index_only=True, shard_size=256)
    return root / "full", root / "index"


def _equal_rows(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_packs_span_store_shards_and_each_is_checked_once(builds, monkeypatch):
    full, index = builds
    opened = Counter()
    shard_columns = Store.shard_columns

    def counted(store, shard):
        opened[shard.name] += 1
        return shard_columns(store, shard)

    monkeypatch.setattr(Store, "shard_columns", counted)
    dataset, reference = PackedDataset(index), PackedDataset(full)
    assert len(dataset.store.manifest.shards) > 2
    ends = dataset._gather.store_ends
    spanning = 0
    for _ in range(2):
        for i in range(len(dataset)):
            assert _equal_rows(dataset[i], reference[i]), i
            shard, row = dataset._locate(i)
            offsets, rows = dataset._columns(shard)["source_rows"]
            spanning += len(set(np.searchsorted(ends, rows[offsets[row] : offsets[row + 1]], "right"))) > 1
    assert spanning > 0  # some pack gathers from two store shards in one call
    assert opened == Counter({shard.name: 1 for shard in dataset.store.manifest.shards})


def test_rows_come_out_of_dataloader_workers_the_same(builds):
    full, index = builds
    collate = PackedCollator.for_dataset(PackedDataset(full))
    batches = {}
    for name, path in (("full", full), ("index", index)):
        dataset = PackedDataset(path)
        dataset[0]  # the parent's maps and typed lists must not travel to the workers
        again = pickle.loads(pickle.dumps(dataset))
        assert again._open == {} and (name == "full" or again._gather.tokens is None)
        loader = torch.utils.data.DataLoader(again, batch_size=3, collate_fn=collate, num_workers=2)
        batches[name] = list(loader)
    assert len(batches["full"]) == len(batches["index"]) > 1
    for expected, got in zip(batches["full"], batches["index"]):
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value, key


def _rewrite_index_column(build_dir: Path, column: str, change) -> None:
    """Rewrite one list column's values of the first index shard (`change(values)` in place) and the
    manifest's byte count, as a tampered or corrupted build would be."""
    path = build_dir / "shard-00000.arrow"
    with pa.ipc.open_stream(path.read_bytes()) as reader:  # in memory: the file is rewritten below
        batch = reader.read_next_batch()
    array = batch.column(column)
    values = array.values.to_numpy().copy()
    change(values)
    columns = [pa.ListArray.from_arrays(array.offsets, pa.array(values)) if name == column else batch.column(name)
               for name in batch.schema.names]
    with pa.ipc.new_stream(path, batch.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=batch.schema))
    manifest = json.loads((build_dir / "manifest.json").read_text())
    manifest["shards"][0]["bytes"] = path.stat().st_size
    (build_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def index_copy(tmp_path) -> Path:
    """An index build of its own (to be tampered with), the store beside it."""
    store = _store(tmp_path, labels=True)
    build(store, tmp_path / "index", max_len=MAX_LEN, index_only=True)
    return tmp_path / "index"


def test_a_document_outside_the_store_is_refused(index_copy):
    def past_the_store(rows):
        rows[0] = 120  # the store's documents are 0..119

    _rewrite_index_column(index_copy, "source_rows", past_the_store)
    dataset = PackedDataset(index_copy)
    with pytest.raises(FormatError, match=r"shard-00000.arrow: row 0, column 'source_rows': document 1 is store "
                       r"document 120; the store has 120\."):
        dataset[0]
    assert _equal_rows(dataset[1], PackedDataset(index_copy)[1])  # the others are served


@pytest.mark.parametrize(
    ("column", "change", "refused_unvalidated"),
    [
        ("cu_seqlens", lambda cu: cu.__setitem__(1, MAX_LEN + 100), r"row 0, column 'cu_seqlens': \[0, 132"),
        ("cu_seqlens", lambda cu: cu.__setitem__(slice(None), -cu), r"row 0, column 'cu_seqlens': \[0, -"),
        ("source_pieces", lambda pieces: pieces.__setitem__(0, -1), r"row 0, column 'source_pieces': document 1 "
         r"\(store document \d+, piece -1, \d+ tokens\) starts before"),
    ],
    ids=["past-max-len", "decreasing", "negative-piece"],
)
def test_a_build_read_unvalidated_is_still_refused_by_the_gather(index_copy, column, change, refused_unvalidated):
    """`validate=False` skips check_index_shard, not the kernel's own checks: a value that would size
    or index a copy wrongly is refused by name, never read out of bounds."""
    _rewrite_index_column(index_copy, column, change)
    with pytest.raises(FormatError, match=f"row 0, column '{column}'"):
        PackedDataset(index_copy)[0]
    with pytest.raises(FormatError, match=refused_unvalidated):
        PackedDataset(index_copy, validate=False)[0]


# --- open_hf_dataset ----------------------------------------------------------------------------------


def test_open_hf_dataset_serves_the_full_builds_rows(builds, tmp_path):
    full, index = builds
    expected, got = open_hf_dataset(full), open_hf_dataset(index, cache_dir=tmp_path)
    assert len(got) == len(expected) == len(PackedDataset(full)) > 1
    for i in range(len(expected)):
        assert _equal_rows(got[i], expected[i]), i
        assert got[i]["input_ids"].dtype == np.int64
    indices = [3, 0, len(expected) - 1]
    for a, b in zip(got.__getitems__(indices), expected.__getitems__(indices)):  # how a DataLoader reads
        assert _equal_rows(a, b)
    labels = ["labels"] if PackedDataset(full).manifest.has_labels else []
    columns = ["input_ids", "cu_seqlens", "segment_ids", *labels]
    assert list(got[0]) == list(expected[0]) == columns
    assert got.column_names == expected.column_names == columns and got.features == expected.features
    assert _equal_rows(pickle.loads(pickle.dumps(got))[1], expected[1])


def _mask_first_half(row: dict) -> dict:
    """What a user's preprocessing might do: train on the second half of every pack only."""
    labels = np.array(row.get("labels", row["input_ids"]))
    labels[: len(labels) // 2] = -100
    return {"labels": labels}


def test_datasets_operations_on_an_index_build_are_those_on_the_full_build(builds, tmp_path):
    """`map` (changing labels, adding a column), `filter`, column access, `with_format("torch")` and the
    collator: the same results on both builds of one store (the index build's rows used to be gathered
    at read time, over whatever `map` had written)."""
    full, index = shutil.copytree(builds[0], tmp_path / "full"), builds[1]  # map caches its results beside the shards
    expected, got = open_hf_dataset(full), open_hf_dataset(index, cache_dir=tmp_path)
    masked, masked_expected = got.map(_mask_first_half), expected.map(_mask_first_half)
    assert len(masked) == len(masked_expected) == len(got)
    for i, (a, b) in enumerate(zip(masked, masked_expected)):
        assert _equal_rows(a, b), i
        assert (a["labels"][: len(a["labels"]) // 2] == -100).all(), i
    assert not np.array_equal(masked[0]["labels"], got[0].get("labels", got[0]["input_ids"]))
    added = got.map(lambda row: {"tokens": len(row["input_ids"])})
    assert list(added["tokens"]) == list(expected.map(lambda row: {"tokens": len(row["input_ids"])})["tokens"])
    assert list(added["tokens"]) == [len(row["input_ids"]) for row in expected]
    columns = list(got["input_ids"])
    assert len(columns) == len(expected) and all(np.array_equal(a, b) for a, b in zip(columns, expected["input_ids"]))
    many, many_expected = (d.filter(lambda row: len(row["cu_seqlens"]) > 3) for d in (got, expected))
    assert 0 < len(many) == len(many_expected) < len(got) and all(_equal_rows(a, b) for a, b in zip(many, many_expected))
    for a, b in zip(got.with_format("torch"), expected.with_format("torch")):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    collate, collate_expected = PackedCollator.for_dataset(masked), PackedCollator.for_dataset(expected)
    assert collate.max_len == collate_expected.max_len == MAX_LEN == PackedCollator.for_dataset(got).max_len
    batch, batch_expected = collate([masked[i] for i in range(4)]), collate_expected([masked_expected[i] for i in range(4)])
    assert batch.keys() == batch_expected.keys()
    assert all(torch.equal(v, batch_expected[k]) if torch.is_tensor(v) else v == batch_expected[k] for k, v in batch.items())


def test_an_index_builds_gathered_rows_are_written_once_and_checked_when_reused(builds, tmp_path):
    _, index = builds
    first = open_hf_dataset(index, cache_dir=tmp_path)
    files = sorted((tmp_path / "rows").iterdir())
    assert files and all(f.suffix == ".arrow" for f in files)  # no partial file left
    written = {f: f.stat().st_mtime_ns for f in files}
    again = open_hf_dataset(index, cache_dir=tmp_path)
    assert {f: f.stat().st_mtime_ns for f in sorted((tmp_path / "rows").iterdir())} == written  # reused
    assert all(_equal_rows(a, b) for a, b in zip(first, again))
    files[0].write_bytes(files[0].read_bytes()[: files[0].stat().st_size // 2])
    with pytest.raises(FormatError, match=f"^{files[0]}"):
        open_hf_dataset(index, cache_dir=tmp_path)


def _forge(file: Path) -> None:
    """Rewrite the gathered file `file` whole with other valid rows: every token id one higher, the same
    shapes, so that every structural check still holds (what a stale or doctored cache looks like)."""
    batch = pa.ipc.open_stream(file.read_bytes()).read_next_batch()
    ids = batch.column("input_ids")
    forged = batch.set_column(0, batch.schema.field(0), pa.ListArray.from_arrays(ids.offsets, pc.add(ids.values, pa.scalar(1, ids.type.value_type)), type=ids.type))
    write_record_batch(file.with_name("forged"), forged)
    os.replace(file.with_name("forged"), file)


def test_a_gathered_file_rewritten_with_other_rows_is_refused_when_checksums_are_verified(builds, tmp_path):
    full, index = builds
    expected = open_hf_dataset(full)
    open_hf_dataset(index, cache_dir=tmp_path, verify_checksums=True)  # gathered now
    again = open_hf_dataset(index, cache_dir=tmp_path, verify_checksums=True)  # reused, checked against the store
    assert all(_equal_rows(a, b) for a, b in zip(again, expected))
    file = sorted((tmp_path / "rows").iterdir())[0]
    _forge(file)
    forged = open_hf_dataset(index, cache_dir=tmp_path)  # the default: checked as a full build's shard, not hashed
    assert sum(not np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(forged, expected)) > 0
    with pytest.raises(FormatError, match=f"^{re.escape(str(file))}: .*not the packs gathered from the store"):
        open_hf_dataset(index, cache_dir=tmp_path, verify_checksums=True)


def test_an_empty_cache_dir_is_refused_not_taken_for_the_current_directory(builds, tmp_path, monkeypatch):
    _, index = builds
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="^cache_dir '' is empty"):
        open_hf_dataset(index, cache_dir="")
    assert list(tmp_path.iterdir()) == []  # no rows/ gathered here


def _reference_of(build_path: Path, out: Path) -> Path:
    """A reference directory for every document of `build_path` (not a pair build, which no index build is:
    no model computes these; the format holds any build's), document d of the build given -d / 2."""
    dataset = PackedDataset(build_path)
    files, first = [], 0
    out.mkdir()
    for index, (info, path) in enumerate(zip(dataset.manifest.shards, dataset.shard_paths)):
        documents = stored.build_shard_documents(dataset.manifest, path, info)
        values = -0.5 * np.arange(first, first + documents.sum())
        first += documents.sum()
        logps = list_array(np.append(0, np.cumsum(documents)), values)
        name = stored.reference_file_name(index)
        size, sha256 = write_record_batch(out / name, pa.RecordBatch.from_arrays([logps], schema=stored.REFERENCE_SCHEMA))
        files.append(stored.ReferenceFile(name=name, shard_sha256=info.sha256, rows=info.rows, bytes=size, sha256=sha256))
    model = stored.ReferenceModel(name="none", config_sha256="0" * 64, weights_sha256="0" * 64)
    manifest = stored.ReferenceManifest(build_fingerprint=dataset.manifest.fingerprint, shards=len(files), model=model,
                                        files=files)
    (out / stored.REFERENCE_MANIFEST).write_text(json.dumps(manifest.model_dump(mode="json")))
    return out


def test_an_index_builds_reference_values_line_up_with_its_gathered_files(builds, tmp_path, monkeypatch):
    """Gathered files cut the index shards (three packs a file here); each pack still gets its own values."""
    _, index = builds
    reference = _reference_of(index, tmp_path / "reference")
    monkeypatch.setattr(dataset_module, "_ROWS_FILE_BYTES", 3 * MAX_LEN * (8 + 4 + 1))
    packed, got = PackedDataset(index, reference=reference), open_hf_dataset(index, cache_dir=tmp_path, reference=reference)
    shards = packed.manifest.shards
    assert len(list((tmp_path / "rows").iterdir())) > len(shards) and any(shard.rows > 3 for shard in shards)
    assert len(got) == len(packed)
    for i in range(len(packed)):
        values = np.asarray(got[i]["reference_logps"])
        assert np.array_equal(values, packed[i]["reference_logps"]) and len(values) == len(got[i]["cu_seqlens"]) - 1, i
    every = np.concatenate([np.asarray(row["reference_logps"]) for row in got])
    assert np.array_equal(every, -0.5 * np.arange(len(every)))


def test_for_dataset_refuses_a_dataset_it_cannot_size():
    from datasets import Dataset as HFDataset

    with pytest.raises(TypeError, match="give max_len"):
        PackedCollator.for_dataset(HFDataset.from_dict({"input_ids": [[1, 2]]}))


@pytest.mark.slow
def test_trl_trains_on_an_index_build_as_on_the_full_build(tmp_path, monkeypatch):
    """Two SFTTrainer steps (examples/train_trl_sft.py's recipe, two DataLoader workers) on each build
    of one store: the same batches reach the model and the same losses come out."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))  # as the example runs
    from train_trl_sft import placeholder_tokenizer

    store = _store(tmp_path, labels=True)
    runs = {}
    for kind in ("full", "index"):
        build(store, tmp_path / kind, max_len=MAX_LEN, index_only=kind == "index")
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_LEN)
        model = LlamaForCausalLM(config)
        seen = []
        model.register_forward_pre_hook(lambda _, __, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True)
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(
                output_dir=str(tmp_path / f"{kind}-run"), packing=False, dataset_kwargs={"skip_prepare_dataset": True},
                remove_unused_columns=False, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                dataloader_num_workers=2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                bf16=False, seed=0,
            ),
            train_dataset=open_hf_dataset(tmp_path / kind, cache_dir=tmp_path / f"{kind}-cache"),
            data_collator=PackedCollator.for_dataset(PackedDataset(tmp_path / kind)),
            processing_class=placeholder_tokenizer(),
        )
        trainer.train()
        runs[kind] = seen, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    (full_batches, full_losses), (index_batches, index_losses) = runs["full"], runs["index"]
    assert len(full_batches) == len(index_batches) == 2 and len(full_losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(full_batches, index_batches))
    assert index_losses == full_losses
