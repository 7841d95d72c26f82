"""Useful throughput (prepack.training.throughput): real and trained tokens of a batch, counted from the batch alone,
and the Trainer callback that logs them in a real HF Trainer run on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.formats.shards import IGNORE_INDEX
from prepack.model.isolation import random_packs
from prepack.training.throughput import UsefulThroughputCallback, batch_tokens
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
