"""Context-parallel shapes: `PackedCollator(cp_size=k)` pads each document to a multiple of 2k with
THD offsets, the padding never trained and harmless to the model; `split_for_cp` gives each rank
chunks r and 2k−1−r of every document, and the ranks' pieces reassemble the batch exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.context_parallel import cp_indices, split_for_cp
from prepack.training.loss import loss_weights, weighted_loss

documents_strategy = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), min_size=1, max_size=4)


def make_packs(pack_lengths: list[list[int]], labelled: bool) -> list[dict]:
    rng = np.random.default_rng(sum(map(sum, pack_lengths)))
    packs = []
    for lengths in pack_lengths:
        tokens = rng.integers(1, 60, size=sum(lengths))
        pack = {"input_ids": tokens, "cu_seqlens": np.append(0, np.cumsum(lengths))}
        if labelled:
            pack["labels"] = np.where(rng.random(len(tokens)) < 0.3, -100, tokens)
        packs.append(pack)
    return packs


@settings(max_examples=100, deadline=None)
@given(pack_lengths=documents_strategy, cp_size=st.integers(1, 4), labelled=st.booleans(), pad=st.sampled_from([None, 0]))
@pytest.mark.slow
def test_documents_are_padded_to_2k_and_the_ranks_pieces_reassemble_the_batch(pack_lengths, cp_size, labelled, pad):
    packs = make_packs(pack_lengths, labelled)
    plain = PackedCollator(layout="padding_free")(packs)
    batch = PackedCollator(layout="padding_free", cp_size=cp_size, pad_token_id=pad)(packs)
    lengths = np.concatenate([np.diff(p["cu_seqlens"]) for p in packs])
    padded = -(-lengths // (2 * cp_size)) * (2 * cp_size)
    assert batch["cu_seqlens"].tolist() == np.append(0, np.cumsum(lengths)).tolist()
    assert batch["cu_seqlens_padded"].tolist() == batch["cu_seq_lens_q"].tolist() == np.append(0, np.cumsum(padded)).tolist()
    # Real tokens at the padded offsets, labelled as without CP; padding never trained.
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(np.append(0, np.cumsum(padded))[:-1].tolist(), lengths.tolist())])
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(batch[key][0, real], plain[key][0]), key
    is_padding = torch.ones(batch["input_ids"].shape[1], dtype=torch.bool)
    is_padding[real] = False
    assert (batch["labels"][0, is_padding] == -100).all()
    if pad is not None:
        assert (batch["input_ids"][0, is_padding] == pad).all()

    pieces = [split_for_cp(batch, cp_size, rank) for rank in range(cp_size)]
    indices = [cp_indices(batch["cu_seqlens_padded"], cp_size, rank) for rank in range(cp_size)]
    assert sorted(torch.cat(indices).tolist()) == list(range(batch["input_ids"].shape[1]))
    for key in ("input_ids", "labels", "position_ids"):
        whole = torch.empty_like(batch[key])
        for index, piece in zip(indices, pieces):
            whole[:, index] = piece[key]
        assert torch.equal(whole, batch[key]), key
    for rank, index in enumerate(indices):
        document = torch.searchsorted(batch["cu_seqlens_padded"].to(torch.int64), index, right=True) - 1
        assert torch.bincount(document, minlength=len(padded)).tolist() == (padded // cp_size).tolist()
        assert pieces[rank]["cu_seqlens_padded"] is batch["cu_seqlens_padded"]  # offsets stay global


def test_rank_r_holds_chunks_r_and_2k_minus_1_minus_r():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # chunks of 2 and of 1 for cp_size 2
    assert cp_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_the_padding_changes_neither_the_outputs_nor_the_loss():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = enable_packing(LlamaForCausalLM(config).to(torch.float64))
    packs = make_packs([[5, 17, 3], [30, 1]], labelled=True)
    plain = PackedCollator(layout="padding_free")(packs)
    batch = PackedCollator(layout="padding_free", cp_size=4)(packs)
    with torch.no_grad():
        expected, got = model(**plain), model(**batch)
    starts, lengths = batch["cu_seqlens_padded"][:-1].tolist(), batch["cu_seqlens"].diff().tolist()
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert len(real) < batch["input_ids"].shape[1]  # there is padding
    torch.testing.assert_close(got.logits[0, real], expected.logits[0])
    torch.testing.assert_close(got.loss, expected.loss)


def test_refusals():
    with pytest.raises(ValueError, match="padding_free"):
        PackedCollator(max_len=64, cp_size=2)
    with pytest.raises(ValueError, match="cp_size"):
        PackedCollator(layout="padding_free", cp_size=0)
    packs = make_packs([[3, 5]], labelled=False)
    with pytest.raises(ValueError, match="cp_size=2"):
        split_for_cp(PackedCollator(layout="padding_free", cp_size=1)(packs), 2, 0)
    with pytest.raises(ValueError, match="padding_free"):
        split_for_cp(PackedCollator(layout="padding_free")(packs), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_indices(torch.tensor([0, 4]), 2, 2)
    part = split_for_cp(PackedCollator(layout="padding_free", cp_size=2)(make_packs([[3, 5]], labelled=True)), 2, 0)
    del part["cp_trained_per_document"]
    with pytest.raises(ValueError, match="cp_trained_per_document"):
        loss_weights(part, "document")


# --- a split batch trains exactly as the whole one ------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(pack_lengths=documents_strategy, cp_size=st.integers(1, 4))
@pytest.mark.slow
def test_the_ranks_weights_and_shifted_labels_are_the_whole_batchs(pack_lengths, cp_size):
    batch = PackedCollator(layout="padding_free", cp_size=cp_size)(make_packs(pack_lengths, labelled=True))
    labels = batch["labels"]
    expected_shift = torch.cat([labels[:, 1:], torch.full((1, 1), -100)], 1)  # documents' first labels are -100
    pieces = [split_for_cp(batch, cp_size, rank) for rank in range(cp_size)]
    shift = torch.empty_like(labels)
    for piece in pieces:
        shift[:, piece["cp_indices"]] = piece["shift_labels"]
    assert torch.equal(shift, expected_shift)
    given_shift = torch.randint(0, 60, labels.shape)  # a batch's own shift_labels are split with the inputs
    for rank, piece in enumerate(pieces):
        assert torch.equal(split_for_cp(batch | {"shift_labels": given_shift}, cp_size, rank)["shift_labels"],
                           given_shift[:, piece["cp_indices"]])
    for weighting in ("token", "document"):
        whole = loss_weights(batch, weighting)  # at each label's position
        at_predicting = torch.cat([whole[:, 1:], torch.zeros(1, 1, dtype=whole.dtype)], 1)
        weights = torch.empty_like(at_predicting)
        for piece in pieces:
            weights[:, piece["cp_indices"]] = loss_weights(piece, weighting)
        assert torch.equal(weights, at_predicting), weighting
        summed = sum(loss_weights(piece, weighting).sum() for piece in pieces)
        torch.testing.assert_close(summed, whole.sum(), rtol=1e-12, atol=0)  # the same terms, in another order


def check_ranks_train_as_the_whole_batch(packs: list[dict], cp_sizes: tuple[int, ...]) -> None:
    """k context-parallel ranks simulated in one process: each rank's logits are the whole batch's at its
    positions (what ring attention computes there), its loss `weighted_loss` of its part; the ranks'
    losses and their gradients sum to the whole batch's."""
    config = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = enable_packing(LlamaForCausalLM(config).to(torch.float64))
    for cp_size in cp_sizes:
        batch = PackedCollator(layout="padding_free", cp_size=cp_size)(packs)
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        pieces = [split_for_cp(batch, cp_size, rank) for rank in range(cp_size)]
        for weighting in ("token", "document"):
            model.zero_grad()
            weights = loss_weights(batch, weighting)
            expected = weighted_loss(model(**inputs).logits, batch, weights, weights.sum())
            expected.backward()
            expected_grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            logits = model(**inputs).logits
            rank_weights = [loss_weights(piece, weighting) for piece in pieces]
            total = sum(w.sum() for w in rank_weights)  # the all_reduce over the CP ranks
            summed = sum(weighted_loss(logits[:, piece["cp_indices"]], piece, w, total)
                         for piece, w in zip(pieces, rank_weights))
            summed.backward()
            torch.testing.assert_close(total, weights.sum(), rtol=1e-12, atol=0)
            torch.testing.assert_close(summed, expected, rtol=1e-12, atol=0)
            for got, want in zip((p.grad for p in model.parameters()), expected_grads):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_the_ranks_losses_and_gradients_sum_to_the_whole_batchs():
    check_ranks_train_as_the_whole_batch(make_packs([[5, 17, 3], [30, 1, 9]], labelled=True), (2,))


@pytest.mark.slow
def test_a_real_builds_packs_train_across_ranks_as_the_whole_batch(tmp_path):
    from prepack.training.dataset import PackedDataset
    from tests.corpus import training_build

    dataset = PackedDataset(training_build(tmp_path, documents=40, longest=60, max_len=256))
    check_ranks_train_as_the_whole_batch([dataset[i] for i in range(3)], (2, 3))
