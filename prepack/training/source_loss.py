"""Loss per source of a mixture build, from a packed batch.

A mixture's packs carry each document's source (`source_ids`), and `PackedCollator(source_ids=True)`
spreads it over the tokens. `source_losses` sums the cross-entropy of the trained tokens of each
source and counts them, so that a training loop can log each source's mean loss (and add sums and
counts over micro-batches and ranks before dividing):

    collate = PackedCollator.for_dataset(dataset, source_ids=True)
    batch = collate(packs)
    sources = batch.pop("source_ids")                      # the model takes no such argument
    logits = model(**batch).logits
    sums, counts = source_losses(logits, batch["labels"], sources, len(dataset.manifest.mixture.sources))
    per_source = sums / counts.clamp(min=1)               # 0 where a source had no trained token

A trained token is one whose label is not -100, predicted by the position before it (the collator
masks each document's first token, so no prediction crosses a document boundary); it counts for the
source of its document. This module imports torch; `import prepack` does not load it.
"""

from __future__ import annotations

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX

with optional_imports("source_losses"):
    import torch

__all__ = ["source_losses"]


def source_losses(
    logits: torch.Tensor, labels: torch.Tensor, source_ids: torch.Tensor, sources: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [sources] sums of cross-entropy, int64 [sources] counts) of the trained tokens of each
    source, in a batch of `logits` [B, L, V] whose `labels` and `source_ids` are [B, L] (as the collator
    gives them; -1 = padding). Logits at position t predict the label at t + 1, as in transformers;
    each loss in float32 at least, and the sums carry the gradient of `logits` (detach them to log).
    Their total over sources divided by the total count is the model's own token-mean loss."""
    if labels.shape != source_ids.shape or logits.shape[:2] != labels.shape:
        raise UsageError(
            f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and source_ids {tuple(source_ids.shape)} "
            "must agree on [batch, length]."
        )
    targets, owners = labels[:, 1:].flatten(), source_ids[:, 1:].flatten()
    trained = targets != IGNORE_INDEX
    if trained.any() and (owners[trained].min() < 0 or owners[trained].max() >= sources):
        raise UsageError(f"a trained token's source is outside 0..{sources - 1}: pass the mixture's number of sources.")
    predicting = logits[:, :-1].flatten(0, 1)
    losses = torch.nn.functional.cross_entropy(
        predicting.to(torch.promote_types(predicting.dtype, torch.float32)),
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    owners = torch.where(trained, owners, 0)
    sums = torch.zeros(sources, dtype=torch.float64, device=logits.device).index_add(0, owners, losses.double() * trained)
    counts = torch.zeros(sources, dtype=torch.int64, device=logits.device).index_add(0, owners, trained.long())
    return sums, counts
