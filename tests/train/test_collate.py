"""`PackedCollator` against a plain per-token computation of every field, over random packs, batch sizes
and layouts; `segment_fields` on indexed masks; and the inputs it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack import IsolationError
from prepack.training.collate import PackedCollator, segment_fields

IGNORE = -100


@st.composite
def packs_and_collator(draw):
    """B packs of 1-5 documents within max_len, and a collator with random options."""
    max_len = draw(st.integers(1, 40))
    with_labels = draw(st.booleans())
    packs = []
    for _ in range(draw(st.integers(1, 5))):
        tokens = draw(st.integers(1, max_len))
        cuts = draw(st.sets(st.integers(1, tokens - 1), max_size=4)) if tokens > 1 else set()
        input_ids = np.array(draw(st.lists(st.integers(0, 999), min_size=tokens, max_size=tokens)), dtype=np.int32)
        input_ids.flags.writeable = False  # like a view into a memory map
        pack = {"input_ids": input_ids, "cu_seqlens": np.array([0, *sorted(cuts), tokens], dtype=np.int32)}
        if with_labels:
            trained = draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens))
            pack["labels"] = np.where(trained, input_ids + 1, IGNORE).astype(np.int32)
        if draw(st.booleans()):
            pack = {key: value.tolist() for key, value in pack.items()}  # Hugging Face datasets rows are lists
        packs.append(pack)
    layout = draw(st.sampled_from(["padded", "padding_free", "indexed_mask"]))
    options = {"layout": layout, "seq_idx": draw(st.booleans()), "pad_token_id": draw(st.none() | st.integers(0, 5))}
    if layout != "padding_free":
        options["pad_to"] = draw(st.sampled_from(["max_len", "longest"]))
        options["pad_to_multiple_of"] = draw(st.sampled_from([None, 1, 8]))
    return packs, PackedCollator(max_len, **options)


def expected_batch(packs, collator: PackedCollator) -> dict:
    """Every field computed token by token, rows as Python lists."""
    rows = []  # per row: a list of segments, each (token ids, labels, document number or 0 for padding)
    for pack in packs:
        cu_seqlens = list(pack["cu_seqlens"])
        labels = list(pack["labels"]) if "labels" in pack else list(pack["input_ids"])
        row = []
        for number, (start, end) in enumerate(zip(cu_seqlens, cu_seqlens[1:]), start=1):
            document_labels = [IGNORE] + [int(label) for label in labels[start + 1 : end]]
            row.append(([int(t) for t in pack["input_ids"][start:end]], document_labels, number))
        rows.append(row)
    if collator.layout == "padding_free":
        rows = [[segment for row in rows for segment in row]]
    else:
        width = max(sum(len(s[0]) for s in row) for row in rows) if collator.pad_to == "longest" else collator.max_len
        multiple = collator.pad_to_multiple_of or 1
        width = (width + multiple - 1) // multiple * multiple
        for row in rows:
            padding = width - sum(len(segment[0]) for segment in row)
            if padding:
                pad = row[-1][0][-1] if collator.pad_token_id is None else collator.pad_token_id
                row.append(([pad] * padding, [IGNORE] * padding, 0))
    segments = [segment for row in rows for segment in row]
    offsets = np.cumsum([0] + [len(segment[0]) for segment in segments]).tolist()
    return {
        "input_ids": [[t for s in row for t in s[0]] for row in rows],
        "labels": [[label for s in row for label in s[1]] for row in rows],
        "position_ids": [[i for s in row for i in range(len(s[0]))] for row in rows],
        "attention_mask": [[s[2] for s in row for _ in s[0]] for row in rows],
        "cu_seq_lens": offsets,
        "max_length": max(len(segment[0]) for segment in segments),
        "seq_idx": np.repeat(np.arange(len(segments)), [len(s[0]) for s in segments]).reshape(len(rows), -1).tolist(),
    }


@settings(max_examples=300, deadline=None)
@given(packs_and_collator())
def test_fields_equal_a_token_by_token_computation(example):
    packs, collator = example
    batch = collator(packs)
    expected = expected_batch(packs, collator)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].tolist() == expected["input_ids"]
    assert batch["labels"].tolist() == expected["labels"]
    native = {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    if collator.layout == "indexed_mask":
        assert "position_ids" not in batch and not native & batch.keys()
        assert batch["attention_mask"].dtype == torch.int64
        assert batch["attention_mask"].tolist() == expected["attention_mask"]
    else:
        assert "attention_mask" not in batch and native <= batch.keys()
        assert batch["position_ids"].dtype == torch.int64
        assert batch["position_ids"].tolist() == expected["position_ids"]
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            assert batch[key].dtype == torch.int32
            assert batch[key].tolist() == expected["cu_seq_lens"]
        for key in ("max_length_q", "max_length_k"):
            assert type(batch[key]) is int and batch[key] == expected["max_length"]
    assert batch["use_cache"] is False  # a model's default cache turns sdpa/eager isolation off
    assert ("seq_idx" in batch) == collator.seq_idx
    if collator.seq_idx:
        assert batch["seq_idx"].dtype == torch.int32
        assert batch["seq_idx"].tolist() == expected["seq_idx"]


@settings(max_examples=100, deadline=None)
@given(packs_and_collator())
def test_segment_fields_of_the_indexed_mask_equal_the_native_fields(example):
    """What enable_packing derives from the legacy mask is what the default layout carries."""
    packs, collator = example
    if collator.layout == "padding_free":
        return
    padding = {"pad_to": collator.pad_to, "pad_to_multiple_of": collator.pad_to_multiple_of}
    expected = PackedCollator(collator.max_len, **padding)(packs)
    legacy = PackedCollator(collator.max_len, layout="indexed_mask", **padding)(packs)
    fields = segment_fields(legacy["attention_mask"].numpy())
    assert fields.position_ids.tolist() == expected["position_ids"].tolist()
    assert fields.cu_seq_lens.tolist() == expected["cu_seq_lens_q"].tolist()
    assert fields.max_length == expected["max_length_q"]


def test_segment_fields_of_indexed_masks():
    fields = segment_fields(np.array([[1, 1, 2, 2, 2, 0], [0, 0, 1, 1, 2, 2]]))
    assert fields.position_ids.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 0, 1, 0, 1]]
    assert fields.cu_seq_lens.tolist() == [0, 2, 5, 6, 8, 10, 12]
    assert fields.max_length == 3
    assert fields.seq_idx.tolist() == [[0, 0, 1, 1, 1, 2], [3, 3, 4, 4, 5, 5]]


PACK = {"input_ids": np.arange(5, dtype=np.int32), "cu_seqlens": np.array([0, 2, 5], dtype=np.int32)}


@pytest.mark.parametrize(
    "pack, error, message",
    [
        ({**PACK, "input_ids": np.arange(6)}, IsolationError, "cu_seqlens"),
        ({**PACK, "cu_seqlens": [0, 2, 4]}, IsolationError, "rise strictly from 0"),
        ({**PACK, "cu_seqlens": [1, 2, 5]}, IsolationError, "rise strictly from 0"),
        ({**PACK, "cu_seqlens": [0, 2, 2, 5]}, IsolationError, "rise strictly from 0"),
        ({**PACK, "cu_seqlens": [0]}, IsolationError, "rise strictly from 0"),
        ({**PACK, "labels": [1, 2]}, ValueError, "labels have shape"),
        ({"input_ids": PACK["input_ids"]}, ValueError, "remove_unused_columns=False"),
        ({"input_ids": [], "cu_seqlens": [0]}, ValueError, "non-empty"),
        ({"input_ids": np.arange(7), "cu_seqlens": [0, 7]}, ValueError, "more than max_len=6"),
    ],
)
def test_bad_packs_are_refused_with_the_pack_named(pack, error, message):
    with pytest.raises(error, match=message):
        PackedCollator(6)([PACK, pack])
    with pytest.raises(error, match="Pack 1"):
        PackedCollator(6)([PACK, pack])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_len": 0},
        {"max_len": 8, "layout": "bshd"},
        {"max_len": 8, "pad_to": "max"},
        {"layout": "padding_free", "pad_to_multiple_of": 8},
    ],
)
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        PackedCollator(**options)


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError, match="empty"):
        PackedCollator(8)([])


def test_padding_free_needs_no_max_len_and_has_no_padding():
    batch = PackedCollator(layout="padding_free")([PACK, PACK])
    assert batch["input_ids"].shape == (1, 10)
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5, 7, 10]


def test_for_dataset_takes_max_len_from_the_build(tmp_path):
    from prepack import build
    from prepack.training.dataset import PackedDataset
    from tests.corpus import corpus_table, write_corpus

    corpus = write_corpus(tmp_path / "corpus.parquet", corpus_table([[1, 2, 3], [4, 5]]))
    build(corpus, tmp_path / "packed", max_len=7)
    dataset = PackedDataset(tmp_path / "packed")
    for source in (dataset, tmp_path / "packed", str(tmp_path / "packed")):
        collator = PackedCollator.for_dataset(source, pad_token_id=3)
        assert (collator.max_len, collator.pad_token_id) == (7, 3)
        assert collator([dataset[0]])["input_ids"].shape == (1, 7)
