"""Preference losses (DPO, IPO, SimPO) on packed pairs: one forward over packs of whole pairs, exact.

A preference-pair build (`prepack build --pairs`) packs each pair's two documents, prompt + chosen and
prompt + rejected, into one pack; `PackedCollator` turns its packs into a batch with `pair_segments`
([P, 2]: each pair's chosen and rejected document among the batch's segments). Then, per micro-batch:

    logits = model(**model_inputs(batch)).logits                  # documents isolated as for SFT
    policy = pair_logps(logits, batch)                           # summed log-probs of each completion
    with torch.no_grad():
        reference = pair_logps(ref_model(**model_inputs(batch)).logits, batch)
    loss = dpo_loss(policy, reference, beta=0.1).mean()          # or ipo_loss, simpo_loss(policy)

or, with the reference's values computed once and stored beside the build (`prepack.training.reference`):
`reference = stored_reference(batch)`, no reference forward.

`sequence_logps` sums, over each segment of `cu_seq_lens_q`, the log-probability of every trained token
(labels not -100: the completion) given the tokens before it in its own document; the collator already
masks each document's first token. Since no token attends across documents, these are exactly the
numbers an unpacked forward of each sequence alone gives (TRL's `chosen_logps` / `rejected_logps`),
and the losses follow TRL 1.16's DPOTrainer formulas on them ("sigmoid", "ipo" with its length
normalisation, and SimPO as TRL's CPOTrainer writes it). Every loss is per pair [P]. A micro-batch alone
takes their mean; an optimizer step of several micro-batches, or of several ranks, divides each micro-batch's
sum by the pairs of the whole step, as `prepack.training.loss` does for tokens, so that every pair weighs the
same however many share its pack:

    weights = [loss_weights(batch, "pair") for batch in window]     # prepack.training.loss; 1 per pair
    total = sum(w.sum() for w in weights); torch.distributed.all_reduce(total)
    (weighted_sum(dpo_loss(policy, reference), w, total) * world_size).backward()   # per micro-batch

This module imports torch; `import prepack` does not load it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX
from prepack.training.shared_prompt import PARTS, completion_slots, shared_trained_tokens

with optional_imports("prepack.training.preference"):
    import torch
    import torch.nn.functional as F

__all__ = [
    "PAIR_FIELDS", "PairLogps", "dpo_loss", "ipo_loss", "model_inputs", "pair_count", "pair_logps", "sequence_logps", "shared_pair_logps",
    "simpo_loss", "trained_tokens",
]

# What a batch of pairs carries besides the model's inputs (reference_logps: a build's stored reference
# log-probabilities, `prepack.training.reference`).
PAIR_FIELDS = ("pair_segments", "reference_logps")


class PairLogps(NamedTuple):
    """Per pair [P]: the summed log-probability of its chosen and rejected completions, and their trained
    token counts (float64 and int64)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch without the pairing fields, which the model does not take."""
    return {key: value for key, value in batch.items() if key not in PAIR_FIELDS}


def sequence_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probabilities [S], trained tokens [S]) of every segment of `batch["cu_seq_lens_q"]`:
    position t of a row predicts label t + 1, counted for the segment that label lies in. `logits` is
    [B, L, V] (half precision is upcast to float32, as transformers' losses do; float64 stays)."""
    if "cu_seq_lens_q" not in batch:
        raise UsageError("sequence_logps needs cu_seq_lens_q: use PackedCollator's padded or padding_free layout")
    if "cp_indices" in batch:
        raise UsageError("sequence_logps takes a whole batch, not a context-parallel part of one")
    labels = batch["labels"]
    if logits.shape[:2] != labels.shape:
        raise UsageError(f"logits of shape {tuple(logits.shape)} do not match labels of shape {tuple(labels.shape)}")
    targets, trained, segment, segments = _label_segments(batch, logits.device)
    predicting = logits[:, :-1].flatten(0, 1)
    logp = -F.cross_entropy(
        predicting.to(torch.promote_types(predicting.dtype, torch.float32)),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    sums = torch.zeros(segments, dtype=logp.dtype, device=logits.device).index_add(0, segment, logp * trained.flatten())
    return sums, _count(segment, trained, segments)


def trained_tokens(batch: Mapping[str, Any]) -> torch.Tensor:
    """The trained tokens [S] (int64) of every segment of `batch["cu_seq_lens_q"]`, as `sequence_logps`
    counts them, from the labels alone."""
    _, trained, segment, segments = _label_segments(batch, batch["labels"].device)
    return _count(segment, trained, segments)


def _label_segments(batch: Mapping[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(labels predicted [B, L - 1], which are trained, the segment of each (flattened), the segment count)."""
    labels = batch["labels"]
    cu = batch["cu_seq_lens_q"].to(device=device, dtype=torch.int64)
    width = labels.shape[1]
    targets = labels[:, 1:].to(device)
    # The flat position of each label (row b, column t + 1), and the segment it belongs to.
    rows = torch.arange(labels.shape[0], device=device).unsqueeze(1) * width
    positions = (rows + torch.arange(1, width, device=device)).flatten()
    return targets, targets != IGNORE_INDEX, torch.searchsorted(cu, positions, right=True) - 1, len(cu) - 1


def _count(segment: torch.Tensor, trained: torch.Tensor, segments: int) -> torch.Tensor:
    return torch.bincount(segment, weights=trained.flatten().to(torch.float64), minlength=segments).to(torch.int64)


def pair_count(batch: Mapping[str, Any]) -> int:
    """The pairs of `batch`, as many as `pair_logps` gives: its `pair_segments`, or the pairs numbered in a
    shared-prompt batch's `shared_prompt_ids`."""
    if "shared_prompt_ids" in batch:
        return int(batch["shared_prompt_ids"].max()) // PARTS
    if "pair_segments" not in batch:
        raise UsageError("a batch of pairs needs pair_segments: collate packs of a preference-pair build (prepack build --pairs)")
    return len(batch["pair_segments"])


def pair_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> PairLogps:
    """`sequence_logps` of each pair's chosen and rejected document (`batch["pair_segments"]`), or on a
    shared-prompt batch (`shared_prompt_ids`) `shared_pair_logps`."""
    if "shared_prompt_ids" in batch:
        return shared_pair_logps(logits, batch)
    if "pair_segments" not in batch:
        raise UsageError("pair_logps needs pair_segments: collate packs of a preference-pair build (prepack build --pairs)")
    sums, tokens = sequence_logps(logits, batch)
    pairs = batch["pair_segments"].to(sums.device)
    return PairLogps(sums[pairs[:, 0]], sums[pairs[:, 1]], tokens[pairs[:, 0]], tokens[pairs[:, 1]])


def shared_pair_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> PairLogps:
    """`PairLogps` of a shared-prompt batch: each completion's trained tokens, the first one predicted from
    its pair's last prompt position, every other from the position before it (same part)."""
    labels, ids = batch["labels"], batch["shared_prompt_ids"]
    if logits.shape[:2] != labels.shape or ids.shape != labels.shape:
        raise UsageError(f"logits of shape {tuple(logits.shape)} do not match labels of shape {tuple(labels.shape)}")
    device = logits.device
    ids, labels = ids.to(device).flatten(), labels.to(device).flatten()
    width = batch["labels"].shape[1]
    token = torch.arange(len(ids), device=device)
    pair, part = ids // PARTS, ids % PARTS
    pairs = int(pair.max())
    # Each pair's last prompt token predicts the first token of both completions.
    prompt_end = torch.zeros(pairs + 1, dtype=torch.int64, device=device).scatter_reduce(
        0, pair, torch.where(part == 0, token, 0), "amax"
    )
    previous = (token - 1).clamp(min=0)
    first = (token % width == 0) | (ids[previous] != ids)
    predictor = torch.where(first & (part > 0), prompt_end[pair], previous)
    trained = (labels != IGNORE_INDEX) & (part > 0)  # padding and prompts are part 0
    targets = torch.where(trained, labels, IGNORE_INDEX)
    predicting = logits.flatten(0, 1)[predictor]
    logp = -F.cross_entropy(
        predicting.to(torch.promote_types(predicting.dtype, torch.float32)), targets, ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    slot = completion_slots(pair, part, trained)
    sums = torch.zeros(2 * pairs, dtype=logp.dtype, device=device).index_add(0, slot, logp * trained).view(pairs, 2)
    counts = shared_trained_tokens(batch).to(device)
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1])


def _margins(policy: PairLogps, reference: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    return policy.chosen - reference.chosen, policy.rejected - reference.rejected


def dpo_loss(policy: PairLogps, reference: PairLogps, beta: float = 0.1) -> torch.Tensor:
    """Per pair: -log σ(β ((πc - refc) - (πr - refr))), TRL's DPO ("sigmoid")."""
    chosen, rejected = _margins(policy, reference)
    return -F.logsigmoid(beta * (chosen - rejected))


def ipo_loss(policy: PairLogps, reference: PairLogps, beta: float = 0.1) -> torch.Tensor:
    """Per pair: ((πc - refc) / nc - (πr - refr) / nr - 1 / (2β))², TRL's IPO with its normalisation by each
    completion's tokens."""
    chosen, rejected = _margins(policy, reference)
    delta = chosen / policy.chosen_tokens.clamp(min=1) - rejected / policy.rejected_tokens.clamp(min=1)
    return (delta - 1 / (2 * beta)) ** 2


def simpo_loss(policy: PairLogps, beta: float = 2.0, gamma: float = 0.5) -> torch.Tensor:
    """Per pair: -log σ(β (πc / nc - πr / nr) - γ), SimPO (reference-free, length-normalised), as TRL's
    CPOTrainer computes it."""
    delta = policy.chosen / policy.chosen_tokens.clamp(min=1) - policy.rejected / policy.rejected_tokens.clamp(min=1)
    return -F.logsigmoid(beta * delta - gamma)
