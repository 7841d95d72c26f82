"""Misuse of the training API raises a named PrepackError (`prepack.errors`: UsageError and its subclasses),
with the message it always had, and stays the ValueError, TypeError or IndexError that callers caught
before: each documented refusal of the sampler, collator, loss weighting, context-parallel split,
throughput count, cost model and dataset, called the wrong way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import prepack
from prepack.building.balance import balanced_order, pack_costs, validated_token_cost
from prepack.training.collate import PackedCollator
from prepack.training.context_parallel import cp_indices, split_for_cp
from prepack.errors import ArgumentTypeError, PackIndexError, PrepackError, UsageError
from prepack.training.dataset import PackedDataset
from prepack.training.loss import loss_weights
from prepack.training.sampler import PackedSampler
from prepack.training.throughput import batch_tokens
from tests.corpus import training_build

PACK = {"input_ids": [5, 6, 7, 8, 9], "cu_seqlens": [0, 2, 5]}


def _cp_part_without_document_totals() -> dict:
    part = split_for_cp(PackedCollator(layout="padding_free", cp_size=2)([PACK | {"labels": PACK["input_ids"]}]), 2, 0)
    del part["cp_trained_per_document"]
    return part


# (what is wrong, the error class, a piece of its message, the builtin class it raised before, the call)
MISUSES: list[tuple[str, type[PrepackError], str, type[Exception], Callable[[], object]]] = [
    # prepack.training.sampler
    ("sampler seed", UsageError, "seed must be non-negative", ValueError,
     lambda: PackedSampler(10, seed=-1, rank=0, world_size=1)),
    ("sampler rank", UsageError, "need 0 <= rank < world_size", ValueError,
     lambda: PackedSampler(10, rank=2, world_size=2)),
    ("sampler world size", UsageError, "need 0 <= rank < world_size", ValueError,
     lambda: PackedSampler(10, rank=0, world_size=0)),
    ("sampler epoch", UsageError, "epoch must be non-negative", ValueError,
     lambda: PackedSampler(10, rank=0, world_size=1).set_epoch(-1)),
    ("sampler balance", UsageError, "balance must be 'attention' or None", ValueError,
     lambda: PackedSampler(10, rank=0, world_size=1, balance="tokens", batch_size=2, drop_last=True)),
    ("balance without batch_size", UsageError, "balance needs batch_size", ValueError,
     lambda: PackedSampler(10, rank=0, world_size=1, balance="attention", drop_last=True)),
    ("balance without drop_last", UsageError, "balance needs drop_last=True", ValueError,
     lambda: PackedSampler(10, rank=0, world_size=1, balance="attention", batch_size=2)),
    ("balance of a length", ArgumentTypeError, "from a PackedDataset, not a int", TypeError,
     lambda: PackedSampler(10, rank=0, world_size=1, balance="attention", batch_size=2, drop_last=True)),
    ("sampler token_cost", UsageError, "token_cost must be finite", ValueError,
     lambda: PackedSampler(10, rank=0, world_size=1, token_cost=float("nan"))),
    # prepack.training.collate
    ("collator layout", UsageError, "layout must be one of", ValueError, lambda: PackedCollator(8, layout="bshd")),
    ("collator pad_to", UsageError, "pad_to must be 'max_len' or 'longest'", ValueError,
     lambda: PackedCollator(8, pad_to="max")),
    ("collator without max_len", UsageError, "Give max_len", ValueError, lambda: PackedCollator()),
    ("collator max_len", UsageError, "max_len must be at least 1", ValueError, lambda: PackedCollator(0)),
    ("collator pad_to_multiple_of", UsageError, "pad_to_multiple_of must be at least 1", ValueError,
     lambda: PackedCollator(layout="padding_free", pad_to_multiple_of=8)),
    ("collator cp_size", UsageError, "only the padding_free layout (THD) takes it", ValueError,
     lambda: PackedCollator(8, cp_size=2)),
    ("collator for a list", ArgumentTypeError, "give max_len: PackedCollator(max_len)", TypeError,
     lambda: PackedCollator.for_dataset([PACK])),
    ("no packs", UsageError, "Cannot collate an empty list of packs.", ValueError, lambda: PackedCollator(8)([])),
    ("pack without cu_seqlens", UsageError, "Pack 0 has no 'cu_seqlens'", ValueError,
     lambda: PackedCollator(8)([{"input_ids": [1, 2]}])),
    ("pack of 2-D input_ids", UsageError, "input_ids must be a non-empty 1-D sequence", ValueError,
     lambda: PackedCollator(8)([{"input_ids": [[1, 2]], "cu_seqlens": [0, 1]}])),
    ("pack longer than max_len", UsageError, "Pack 0 has 5 tokens, more than max_len=4.", ValueError,
     lambda: PackedCollator(4)([PACK])),
    ("pack labels", UsageError, "Pack 0: labels have shape (2,)", ValueError,
     lambda: PackedCollator(8)([PACK | {"labels": [1, 2]}])),
    # prepack.training.loss
    ("loss weighting", UsageError, "weighting must be 'token', 'document' or 'pair'", ValueError,
     lambda: loss_weights(PackedCollator(8)([PACK]), "row")),
    ("pair weighting of a batch without pairs", UsageError, "a batch of pairs needs pair_segments", ValueError,
     lambda: loss_weights(PackedCollator(8)([PACK]), "pair")),
    ("document weighting of a mask", UsageError, "document weighting needs cu_seq_lens_q", ValueError,
     lambda: loss_weights(PackedCollator(8, layout="indexed_mask")([PACK]), "document")),
    ("document weighting of a CP part", UsageError, "needs cp_trained_per_document", ValueError,
     lambda: loss_weights(_cp_part_without_document_totals(), "document")),
    # prepack.training.context_parallel
    ("split of a padded batch", UsageError, "split_for_cp needs a batch from PackedCollator", ValueError,
     lambda: split_for_cp(PackedCollator(8)([PACK]), 2, 0)),
    ("split for another cp_size", UsageError, "collate with cp_size=2", ValueError,
     lambda: split_for_cp(PackedCollator(layout="padding_free", cp_size=1)([PACK]), 2, 0)),
    ("cp rank", UsageError, "need 0 <= cp_rank < cp_size", ValueError, lambda: cp_indices(torch.tensor([0, 4]), 2, 2)),
    # prepack.training.throughput
    ("batch without input_ids", UsageError, "batch_tokens needs a batch with input_ids", ValueError,
     lambda: batch_tokens({"labels": torch.zeros(1, 4)})),
    ("batch of 1-D input_ids", UsageError, "of shape [rows, width]", ValueError,
     lambda: batch_tokens({"input_ids": torch.zeros(4)})),
    # prepack.building.balance
    ("token_cost of a bool", UsageError, "token_cost must be a number, not True", ValueError,
     lambda: validated_token_cost(True)),
    ("pack without documents", UsageError, "every pack needs at least one document", ValueError,
     lambda: pack_costs(np.array([1, 0, 1]), np.array([5, 6]), 0.0)),
    ("balance over no ranks", UsageError, "world_size and batch_size must be at least 1", ValueError,
     lambda: balanced_order(np.arange(4), np.ones(4), 0, 1, [0])),
    ("balance of an uneven order", UsageError, "5 packs cannot be dealt evenly to 2 ranks", ValueError,
     lambda: balanced_order(np.arange(5), np.ones(5), 2, 1, [0])),
]


@pytest.mark.parametrize(("error", "message", "builtin", "call"), [case[1:] for case in MISUSES],
                         ids=[case[0] for case in MISUSES])
def test_each_misuse_of_the_training_api_raises_a_named_prepack_error(error, message, builtin, call):
    with pytest.raises(PrepackError) as raised:
        call()
    assert type(raised.value) is error
    assert message in str(raised.value)
    assert isinstance(raised.value, builtin)  # `except ValueError` (TypeError) around these calls still works


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> PackedDataset:
    return PackedDataset(training_build(Path(tmp_path_factory.mktemp("usage")), documents=20, longest=40, max_len=64))


def test_a_pack_index_out_of_range_is_a_pack_index_error_that_still_ends_iteration(dataset):
    for index in (len(dataset), -len(dataset) - 1):
        with pytest.raises(PackIndexError, match=f"pack {index} is out of range for {len(dataset)} packs"):
            dataset[index]
    assert issubclass(PackIndexError, IndexError)
    # Iterating by index stops at the IndexError: every pack once, then the end.
    assert [pack["input_ids"].tolist() for pack in dataset] == [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]


def test_the_usage_errors_are_public_and_in_the_tree():
    assert {"UsageError", "ArgumentTypeError", "PackIndexError"} <= set(prepack.__all__)
    assert prepack.UsageError is UsageError and issubclass(UsageError, PrepackError)
    assert issubclass(ArgumentTypeError, UsageError) and issubclass(PackIndexError, UsageError)
    for name in ("UsageError", "ArgumentTypeError", "PackIndexError"):
        assert name in prepack.errors.__doc__
