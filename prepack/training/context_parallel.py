"""Split a packed batch across context-parallel ranks in the load-balanced zig-zag layout.

With context parallelism each of k ranks holds part of every sequence. Causal attention makes a
document's later tokens costlier (they attend to more), so each document, padded to a multiple of 2k
(`PackedCollator(layout="padding_free", cp_size=k)`), is cut into 2k equal chunks and rank r takes
chunks r and 2k − 1 − r: every rank holds the same number of tokens of every document and about the
same attention work. This is the layout of Transformer Engine's `thd_get_partitioned_indices` and
Megatron's `get_batch_on_this_cp_rank` for THD batches; the batch's `cu_seqlens` and
`cu_seqlens_padded` stay global, as those kernels take them.

A rank's tokens are not contiguous, so its labels cannot be shifted on the rank: the token after a
chunk's last lies on another rank. `split_for_cp` shifts them on the whole batch first, into
`shift_labels` (what position t predicts; transformers' losses take it in place of `labels`), and
splits that with the inputs. It also carries `cp_indices` (the rank's positions in the whole batch,
to put outputs back together) and `cp_trained_per_document` (each document's trained tokens over
all ranks), so that `prepack.training.loss` weighs a split batch exactly as the whole one:

    piece = split_for_cp(batch, cp_size, cp_rank)
    weights = loss_weights(piece, "document")
    total = weights.sum(); torch.distributed.all_reduce(total)      # over the CP (and DP) ranks
    loss = weighted_loss(model(**piece).logits, piece, weights, total)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prepack.errors import UsageError, optional_imports

with optional_imports("split_for_cp"):
    import torch

from prepack.formats.shards import IGNORE_INDEX

__all__ = ["cp_indices", "shifted_labels", "split_for_cp"]

# Per-token fields of a padding_free batch, [1, T] each; everything else is per batch.
_TOKEN_FIELDS = ("input_ids", "labels", "shift_labels", "position_ids", "seq_idx")


def cp_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 positions, in order, of the tokens rank `cp_rank` of `cp_size` holds: of each document,
    chunks `cp_rank` and `2·cp_size − 1 − cp_rank` of 2·cp_size."""
    if not 0 <= cp_rank < cp_size:
        raise UsageError(f"need 0 <= cp_rank < cp_size, got cp_rank {cp_rank} and cp_size {cp_size}")
    offsets = cu_seqlens_padded.to(torch.int64)
    lengths = offsets.diff()
    if (lengths % (2 * cp_size)).any():
        raise UsageError(f"every document must be padded to a multiple of {2 * cp_size}: collate with cp_size={cp_size}")
    chunk = lengths // (2 * cp_size)
    starts = torch.stack([offsets[:-1] + cp_rank * chunk, offsets[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], 1)
    pieces = chunk.repeat_interleave(2)
    first_of_piece = torch.cumsum(pieces, 0) - pieces  # where each piece starts in the output
    total = int(pieces.sum())
    return torch.repeat_interleave(starts.flatten() - first_of_piece, pieces, output_size=total) + torch.arange(total)


def shifted_labels(labels: torch.Tensor, cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """[1, T] the label each position of a padding_free batch predicts: the next position's label within
    its document, -100 at a document's last position (the next token is another document's)."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    shifted[:, cu_seq_lens[1:].to(torch.int64) - 1] = IGNORE_INDEX
    return shifted


def split_for_cp(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """Rank `cp_rank`'s part of a batch from `PackedCollator(layout="padding_free", cp_size=cp_size)`:
    its tokens of every per-token field (position ids keep their values, as RoPE needs), the rest as
    is, and (module docstring) `shift_labels` shifted on the whole batch, `cp_indices` and
    `cp_trained_per_document`. A batch that already has `shift_labels` keeps them."""
    if "cu_seqlens_padded" not in batch:
        raise UsageError("split_for_cp needs a batch from PackedCollator(layout='padding_free', cp_size=...)")
    index = cp_indices(batch["cu_seqlens_padded"], cp_size, cp_rank)
    whole = dict(batch)
    if "shift_labels" not in whole and "labels" in whole:
        whole["shift_labels"] = shifted_labels(whole["labels"], whole["cu_seqlens_padded"])
    piece = {key: value[:, index] if key in _TOKEN_FIELDS else value for key, value in whole.items()}
    piece["cp_indices"] = index
    if "shift_labels" in whole:
        offsets = whole["cu_seqlens_padded"].to(torch.int64)
        document = torch.searchsorted(offsets, torch.arange(int(offsets[-1]), device=offsets.device), right=True) - 1
        trained = (whole["shift_labels"][0] != IGNORE_INDEX).to(torch.float64)
        piece["cp_trained_per_document"] = torch.bincount(document, weights=trained, minlength=len(offsets) - 1)
    return piece
