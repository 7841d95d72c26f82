"""Loss weighting that stays exact when documents are packed, accumulated over micro-batches and spread
over ranks.

A model's own causal-LM loss is the mean over the trained tokens of the batch it is given, so a plain
packed loop weighs a token by how few trained tokens share its micro-batch and rank. Three weightings
are exact instead, over one optimizer step (the gradient-accumulation window, on all ranks):

- `"token"`: every trained token weighs the same, the mean over all of them (what HF Trainer does with
  `num_items_in_batch` and `average_tokens_across_devices`);
- `"document"`: every document with a trained token weighs the same, the mean over documents of each
  document's mean token loss (what unpacked training on one example per row does). A document is a
  segment of the packs: one that `--overflow split` cut counts once per piece;
- `"pair"`: every preference pair weighs the same, the mean over the step's pairs of a per-pair loss of
  `prepack.training.preference` (DPO, IPO, SimPO), what unpacked training on a fixed number of pairs per
  micro-batch does. Packs hold different numbers of pairs (2 to 57 in examples/chitchat_pairs.py's build:
  `prepack inspect pairs-packed`, 4 to 114 documents a pack), so a mean per micro-batch would weigh a pair
  by how few pairs share its micro-batch and rank.

A trained token is one whose label is not -100 and is predicted from the token before it (transformers
shifts labels by one; the collator already masks each document's first token). In a loop:

    weights = [loss_weights(batch, "document") for batch in window]       # the window's micro-batches
    total = sum(w.sum() for w in weights)
    torch.distributed.all_reduce(total)                                    # over every rank
    for batch, w in zip(window, weights):
        logits = model(**batch).logits
        (weighted_loss(logits, batch, w, total) * world_size).backward()  # DDP averages ranks

and for pairs, one weight per pair: `weights = [loss_weights(batch, "pair") for batch in window]`, the same
total, then `(weighted_sum(dpo_loss(policy, reference), w, total) * world_size).backward()`. HF `Trainer`
takes that total as `num_items_in_batch` (examples/train_dpo_trl.py counts pairs there instead of tokens).

A batch with `shift_labels` (what each position predicts, as transformers' losses take it) is weighed
and scored by them instead of `labels`: so is a context-parallel rank's part from
`prepack.training.context_parallel.split_for_cp`, which shifts the labels on the whole batch before the split
and carries each document's trained tokens over all ranks. Its weights are then the whole batch's, at
the rank's positions, and the ranks' losses sum to the whole batch's, gradients included.

This module imports torch; `import prepack` does not load it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX
from prepack.training.preference import pair_count

with optional_imports("weighted_loss"):
    import torch

__all__ = ["Weighting", "loss_weights", "weighted_loss", "weighted_sum"]

Weighting = Literal["token", "document", "pair"]


def loss_weights(batch: Mapping[str, Any], weighting: Weighting) -> torch.Tensor:
    """float64 weight of each label of `batch`, 0 where nothing is trained: shaped as `batch["labels"]`,
    or as `batch["shift_labels"]` (each weight at the position that predicts) when the batch has them.

    `"token"`: 1 per trained token. `"document"`: 1 / (the document's trained tokens), so each document
    sums to 1. Either way the weights of a whole optimizer step sum to the normalizer `weighted_loss`
    takes. Documents are found from `cu_seq_lens_q` (the `padded` and `padding_free` layouts); on a
    context-parallel part, from its `cp_indices`, and counted over every rank by
    `cp_trained_per_document` (`split_for_cp` adds both).

    `"pair"`: 1 per preference pair of the batch instead, shaped [P] as the per-pair losses of
    `prepack.training.preference` (the pairs of `pair_segments`, or of a shared-prompt batch), for
    `weighted_sum`.
    """
    if weighting not in ("token", "document", "pair"):
        raise UsageError(f"weighting must be 'token', 'document' or 'pair', not {weighting!r}")
    if weighting == "pair":
        return torch.ones(pair_count(batch), dtype=torch.float64, device=batch["input_ids"].device)
    if "shift_labels" in batch:
        trained = batch["shift_labels"] != IGNORE_INDEX
    else:
        trained = batch["labels"] != IGNORE_INDEX
        trained[:, 0] = False  # no token before it to predict it from
    weights = trained.to(torch.float64)
    if weighting == "token":
        return weights
    if "cu_seq_lens_q" not in batch:
        raise UsageError("document weighting needs cu_seq_lens_q: use PackedCollator's padded or padding_free layout")
    cu = batch["cu_seq_lens_q"].to(torch.int64)
    if "cp_indices" in batch:  # a context-parallel part: its positions in the whole batch, its documents' totals
        if "cp_trained_per_document" not in batch:
            raise UsageError(
                "document weighting of a context-parallel part needs cp_trained_per_document: split with split_for_cp"
            )
        positions, per_document = batch["cp_indices"].to(torch.int64), batch["cp_trained_per_document"]
        document = torch.searchsorted(cu, positions, right=True) - 1
    else:
        positions = torch.arange(trained.numel(), device=trained.device)
        document = torch.searchsorted(cu, positions, right=True) - 1  # segment of each flattened position
        per_document = torch.bincount(document, weights=weights.flatten(), minlength=len(cu) - 1)
    share = torch.where(per_document > 0, 1 / per_document.clamp(min=1), 0)
    return (weights.flatten() * share[document]).reshape(trained.shape)


def weighted_loss(
    logits: torch.Tensor, labels: torch.Tensor | Mapping[str, Any], weights: torch.Tensor, total: torch.Tensor | float
) -> torch.Tensor:
    """Σ weight × cross-entropy over the batch's trained tokens, divided by `total` (the weights of the
    whole step, all ranks). `labels` is the batch (or its `labels` tensor): logits at position t predict
    the label at t + 1, as in transformers, or `shift_labels[t]` when the batch has them (then `weights`
    are `loss_weights` of that batch, at the predicting positions)."""
    if isinstance(labels, Mapping):
        if "shift_labels" in labels:
            return _weighted_cross_entropy(logits, labels["shift_labels"], weights, total)
        labels = labels["labels"]
    return _weighted_cross_entropy(logits[:, :-1], labels[:, 1:], weights[:, 1:], total)


def _weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, total) -> torch.Tensor:
    predicting = logits.flatten(0, 1)
    losses = torch.nn.functional.cross_entropy(
        predicting.to(torch.promote_types(predicting.dtype, torch.float32)),  # half precision upcast, as transformers
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return weighted_sum(losses, weights.flatten(), total)


def weighted_sum(values: torch.Tensor, weights: torch.Tensor, total: torch.Tensor | float) -> torch.Tensor:
    """Σ weight × value, divided by `total` (the weights of the whole step, all ranks): a micro-batch's share
    of the step's weighted mean. `weighted_loss` reduces its token losses so; per-pair losses go here with
    `loss_weights(batch, "pair")`."""
    return (values * weights.to(values.dtype)).sum() / total
