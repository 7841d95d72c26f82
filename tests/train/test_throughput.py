"""Useful throughput (prepack.training.throughput): real and trained tokens of a batch, counted from the batch alone,
and the Trainer callback that logs them in a real HF Trainer run on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import prepack

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.formats.shards import IGNORE_INDEX
from prepack.model.isolation import random_packs
from prepack.training.context_parallel import split_for_cp
from prepack.training.dataset import PackedDataset
from prepack.training.throughput import UsefulThroughputCallback, batch_tokens
from prepack.training.vision_collate import VisionCollator, VisionSpec
from tests.corpus import corpus_table, write_corpus
from tests.tiny_models import DOCUMENT_VOCAB, tiny_model

MAX_LEN = 64


def _real(packs) -> int:
    return sum(len(pack["input_ids"]) for pack in packs)


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_a_packed_batch_counts_its_documents_not_its_padding(pad_token_id):
    packs = random_packs(6, MAX_LEN, DOCUMENT_VOCAB, seed=3, labels=True)
    batch = PackedCollator(MAX_LEN, pad_token_id=pad_token_id)(packs)
    counts = batch_tokens(batch)
    assert counts.slots == 6 * MAX_LEN
    assert int(counts.real) == _real(packs) < counts.slots
    assert int(counts.trained) == int((batch["labels"] != IGNORE_INDEX).sum())
    assert counts.padding_fraction == pytest.approx(1 - _real(packs) / (6 * MAX_LEN))


def test_a_full_row_and_a_trained_last_document_are_not_padding():
    full = {"input_ids": np.arange(MAX_LEN, dtype=np.int32) % 50, "cu_seqlens": np.array([0, 20, MAX_LEN], np.int32)}
    short = {"input_ids": np.arange(30, dtype=np.int32), "cu_seqlens": np.array([0, 30], np.int32)}
    counts = batch_tokens(PackedCollator(MAX_LEN)([full, short]))
    assert int(counts.real) == MAX_LEN + 30


def test_the_other_layouts_and_collators():
    packs = random_packs(3, MAX_LEN, DOCUMENT_VOCAB, seed=1, labels=True)
    indexed = PackedCollator(MAX_LEN, layout="indexed_mask")(packs)
    assert int(batch_tokens(indexed).real) == _real(packs)
    flat = PackedCollator(layout="padding_free")(packs)
    assert batch_tokens(flat).slots == int(batch_tokens(flat).real) == _real(packs)
    documents = [
        {"input_ids": pack["input_ids"][start:end].tolist()}
        for pack in packs
        for start, end in zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:])
    ]
    hf = DataCollatorWithFlattening(return_tensors="pt")(documents)
    assert int(batch_tokens(hf).real) == _real(packs) == batch_tokens(hf).slots
    padded = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])}
    assert int(batch_tokens(padded).real) == 7 and batch_tokens(padded).padding_fraction == pytest.approx(0.3)


def test_vision_batches_count_their_samples_whatever_the_shape_of_their_positions():
    """VisionCollator's [4, B, L] rotary positions (and a [3, B, L] form without the text row), and its
    [B, L] ones of the other styles: the real tokens are the packs' (text-only packs: no image processor)."""
    packs = random_packs(3, MAX_LEN, DOCUMENT_VOCAB, seed=2, labels=True)
    for spec in (VisionSpec("3-D rotary", DOCUMENT_VOCAB, merge_size=2),
                 VisionSpec("image blocks", DOCUMENT_VOCAB, tokens_per_image=4, token_types="token_type_ids"),
                 VisionSpec("restart", DOCUMENT_VOCAB, tokens_per_image=4)):
        batch = VisionCollator(spec, None, max_len=MAX_LEN, pad_token_id=DOCUMENT_VOCAB + 1)(packs)
        counts = batch_tokens(batch)
        assert (counts.slots, int(counts.real)) == (3 * MAX_LEN, _real(packs)), spec.style
        assert int(counts.trained) == int((batch["labels"] != IGNORE_INDEX).sum())
        if spec.style == "3-D rotary":
            assert batch["position_ids"].shape == (4, 3, MAX_LEN)
            without_text_row = {**batch, "position_ids": batch["position_ids"][1:]}
            assert int(batch_tokens(without_text_row).real) == _real(packs)


def untrained_last_document_build(root) -> PackedDataset:
    """A build of 16-token documents, every other one with no trained label, and two short ones: rows of
    64 filled exactly (each ending with some document) and rows with a padding tail."""
    rng = np.random.default_rng(5)
    documents = [rng.integers(1, 500, size=16).tolist() for _ in range(12)] + [[7, 8, 9], [3, 1, 4, 1, 5]]
    labels = [[IGNORE_INDEX] * len(doc) if number % 2 else [IGNORE_INDEX, *doc[1:]] for number, doc in enumerate(documents)]
    prepack.build(write_corpus(root / "corpus.parquet", corpus_table(documents, labels)), root / "packed", max_len=MAX_LEN)
    return PackedDataset(root / "packed")


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_an_untrained_last_document_of_a_full_row_is_not_padding(tmp_path, pad_token_id):
    dataset = untrained_last_document_build(tmp_path)
    packs = [dataset[index] for index in range(len(dataset))]
    untrained_last = [
        pack for pack in packs
        if len(pack["input_ids"]) == MAX_LEN and (pack["labels"][pack["cu_seqlens"][-2]:] == IGNORE_INDEX).all()
    ]
    assert untrained_last and any(len(pack["input_ids"]) < MAX_LEN for pack in packs)  # both cases are there
    for collator in (PackedCollator(MAX_LEN, pad_token_id=pad_token_id),
                     PackedCollator(MAX_LEN, pad_to="longest", pad_token_id=pad_token_id)):
        assert int(batch_tokens(collator(packs)).real) == _real(packs)
        assert int(batch_tokens(collator(untrained_last)).real) == len(untrained_last) * MAX_LEN


def test_context_parallel_padding_inside_documents_is_not_real():
    """PackedCollator(cp_size=k) pads each document inside its own segment; cu_seqlens gives the real lengths,
    for the whole batch and for each rank's part."""
    packs = random_packs(3, MAX_LEN, DOCUMENT_VOCAB, seed=4, labels=True)
    batch = PackedCollator(layout="padding_free", cp_size=2)(packs)
    assert batch["input_ids"].shape[1] > _real(packs)
    assert int(batch_tokens(batch).real) == _real(packs)
    parts = [batch_tokens(split_for_cp(batch, 2, rank)) for rank in range(2)]
    assert sum(int(part.real) for part in parts) == _real(packs)
    assert sum(part.slots for part in parts) == batch["input_ids"].shape[1]


@pytest.mark.slow
def test_the_callback_logs_real_throughput_in_a_trainer_run(tmp_path):
    packs = random_packs(4, MAX_LEN, DOCUMENT_VOCAB, seed=0, labels=True)
    model = enable_packing(tiny_model("llama", "sdpa", dtype=torch.float32).train())
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, logging_steps=1, learning_rate=1e-3,
        remove_unused_columns=False, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        include_num_input_tokens_seen="non_padding",
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=packs, data_collator=PackedCollator(MAX_LEN),
        callbacks=[UsefulThroughputCallback()],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    # Every step trains the same four packs (the whole dataset), in some order.
    slots = 4 * MAX_LEN
    trained = int((PackedCollator(MAX_LEN)(packs)["labels"] != IGNORE_INDEX).sum())
    for step, entry in enumerate(logs, start=1):
        assert entry["padding_fraction"] == pytest.approx(1 - _real(packs) / slots, abs=1e-4)
        assert entry["real_tokens"] == step * _real(packs)
        assert 0 < entry["trained_tokens_per_second"] < entry["real_tokens_per_second"]
        ratio = entry["trained_tokens_per_second"] / entry["real_tokens_per_second"]
        assert ratio == pytest.approx(trained / _real(packs), rel=1e-3)
    # What the Trainer itself counts as "non-padding" tokens includes prepack's padding: it sees no mask.
    assert trainer.state.num_input_tokens_seen == 3 * slots > logs[-1]["real_tokens"]
