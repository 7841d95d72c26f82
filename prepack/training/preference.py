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

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX
from prepack.training.shared_prompt import completion_slots, group_parts, shared_trained_tokens

with optional_imports("prepack.training.preference"):
    import torch
    import torch.nn.functional as F

__all__ = [
    "GroupLogps", "PAIR_FIELDS", "PairLogps", "chosen_nll", "cpo_loss", "dpo_loss", "group_logps", "ipo_loss", "kto_loss", "model_inputs", "orpo_loss", "pair_count", "plackett_luce_loss", "ranking_order",
    "pair_logps", "prompt_logps", "sequence_logps", "shared_pair_logps", "shared_token_logps", "simpo_loss", "trained_tokens",
]

# What a batch of pairs carries besides the model's inputs (reference_logps: a build's stored reference
# log-probabilities, `prepack.training.reference`; group_scores, group_ranks: a group build's values per completion;
# desirable: an unpaired build's labels).
PAIR_FIELDS = ("pair_segments", "reference_logps", "group_scores", "group_ranks", "desirable")


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
    """The pairs (or groups) of `batch`, as many as `pair_logps` and `group_logps` give: its `pair_segments`, or
    the groups numbered in a shared-prompt batch's `shared_prompt_ids`."""
    if "shared_prompt_ids" in batch:
        return int(batch["shared_prompt_ids"].max()) // group_parts(batch)
    if "pair_segments" not in batch:
        raise UsageError("a batch of pairs needs pair_segments: collate packs of a preference-pair build (prepack build --pairs)")
    return len(batch["pair_segments"])


class GroupLogps(NamedTuple):
    """Per group and completion [P, G]: the summed log-probability of its trained tokens (float64 for a float64
    model) and their count (int64). A shared-prompt batch whose groups differ in size has G of its largest, the
    missing completions 0 tokens."""

    logps: torch.Tensor
    tokens: torch.Tensor


def group_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> GroupLogps:
    """`sequence_logps` of each group's documents (`batch["pair_segments"]`, [P, G]), or on a shared-prompt
    batch (`shared_prompt_ids`) each completion's trained tokens, the first one predicted from its group's last
    prompt position, every other from the position before it (same part)."""
    if "shared_prompt_ids" in batch:
        layout = _shared_layout(logits, batch)
        trained = (layout.labels != IGNORE_INDEX) & (layout.part > 0)  # padding and prompts are part 0
        logp = shared_token_logps(logits, batch).flatten()
        slot = completion_slots(layout.group, layout.part, trained, layout.parts)
        size = layout.parts - 1
        sums = torch.zeros(size * layout.groups, dtype=logp.dtype, device=logits.device).index_add(0, slot, logp * trained)
        return GroupLogps(sums.view(layout.groups, size), shared_trained_tokens(batch).to(logits.device))
    if "pair_segments" not in batch:
        raise UsageError("group_logps needs pair_segments: collate packs of a preference-pair or group build (prepack build --pairs, --groups)")
    sums, tokens = sequence_logps(logits, batch)
    segments = batch["pair_segments"].to(sums.device)
    return GroupLogps(sums[segments], tokens[segments])


def shared_token_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """[B, L]: in a shared-prompt batch, each trained completion token's log-probability, a completion's first token
    predicted from its group's last prompt position, every other from the position before it; 0 elsewhere."""
    layout = _shared_layout(logits, batch)
    trained = (layout.labels != IGNORE_INDEX) & (layout.part > 0)  # padding and prompts are part 0
    logp = _token_logps(logits, layout.predictor, torch.where(trained, layout.labels, IGNORE_INDEX))
    return logp.view(batch["labels"].shape)


def pair_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> PairLogps:
    """`group_logps` of a batch of pairs (groups of 2: chosen, rejected), as `PairLogps`."""
    logps, tokens = group_logps(logits, batch)
    if logps.shape[1] != 2:
        raise UsageError(f"pair_logps takes a batch of pairs, not of groups of {logps.shape[1]}: use group_logps.")
    return PairLogps(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1])


def shared_pair_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> PairLogps:
    """`pair_logps` of a shared-prompt batch of pairs."""
    if "shared_prompt_ids" not in batch:
        raise UsageError("shared_pair_logps takes a shared-prompt batch: PackedCollator(shared_prompt=True)")
    return pair_logps(logits, batch)


class _SharedLayout(NamedTuple):
    """A shared-prompt batch's tokens, flattened: labels, group (from 1; 0 padding) and part of each, the
    position whose logits predict it, whether it starts its part, the batch's group count and id stride."""

    labels: torch.Tensor
    group: torch.Tensor
    part: torch.Tensor
    predictor: torch.Tensor
    first: torch.Tensor
    groups: int
    parts: int


def _shared_layout(logits: torch.Tensor, batch: Mapping[str, Any]) -> _SharedLayout:
    labels, ids = batch["labels"], batch["shared_prompt_ids"]
    if logits.shape[:2] != labels.shape or ids.shape != labels.shape:
        raise UsageError(f"logits of shape {tuple(logits.shape)} do not match labels of shape {tuple(labels.shape)}")
    device = logits.device
    ids, labels = ids.to(device).flatten(), labels.to(device).flatten()
    width = batch["labels"].shape[1]
    token = torch.arange(len(ids), device=device)
    parts = group_parts(batch)
    group, part = ids // parts, ids % parts
    groups = int(group.max())
    # Each group's last prompt token predicts the first token of every completion.
    prompt_end = torch.zeros(groups + 1, dtype=torch.int64, device=device).scatter_reduce(
        0, group, torch.where(part == 0, token, 0), "amax"
    )
    previous = (token - 1).clamp(min=0)
    first = (token % width == 0) | (ids[previous] != ids)
    predictor = torch.where(first & (part > 0), prompt_end[group], previous)
    return _SharedLayout(labels, group, part, predictor, first, groups, parts)


def _token_logps(logits: torch.Tensor, predictor: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The log-probability of each target (flat; 0 at -100) under the logits at its predictor position."""
    predicting = logits.flatten(0, 1)[predictor]
    return -F.cross_entropy(
        predicting.to(torch.promote_types(predicting.dtype, torch.float32)), targets, ignore_index=IGNORE_INDEX,
        reduction="none",
    )


def prompt_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probabilities [P], token counts [P] int64) of each pair's prompt tokens, every one but its
    first (which nothing in its document predicts): what TRL's ORPOTrainer adds to the chosen completion in its
    NLL term (`chosen_nll`). Read from the chosen document (`pair_segments`), or from the prompt, stored once,
    of a shared-prompt batch; the same forward as `pair_logps`."""
    if "shared_prompt_ids" in batch:
        layout = _shared_layout(logits, batch)
        tokens = batch["input_ids"].to(logits.device).flatten()
        in_prompt = (layout.group > 0) & (layout.part == 0) & ~layout.first
        logp = _token_logps(logits, layout.predictor, torch.where(in_prompt, tokens, IGNORE_INDEX))
        group = torch.where(in_prompt, layout.group - 1, 0)
        zeros = torch.zeros(layout.groups, dtype=logp.dtype, device=logits.device)
        counts = torch.bincount(group, weights=in_prompt.to(torch.float64), minlength=layout.groups).to(torch.int64)
        return zeros.index_add(0, group, logp * in_prompt), counts
    if "pair_segments" not in batch or "position_ids" not in batch:
        raise UsageError("prompt_logps needs pair_segments and position_ids: collate packs of a preference-pair build")
    # A document's untrained tokens past its first are its prompt (the collator masks the first token).
    labels, positions = batch["labels"], batch["position_ids"].to(batch["labels"].device)
    prompt = torch.where((labels == IGNORE_INDEX) & (positions > 0), batch["input_ids"].to(labels.device), IGNORE_INDEX)
    sums, tokens = sequence_logps(logits, {**batch, "labels": prompt})
    chosen = batch["pair_segments"][:, 0].to(sums.device)
    return sums[chosen], tokens[chosen]


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


def ranking_order(ranks: torch.Tensor) -> torch.Tensor:
    """[P, G]: each group's completions best first, by `ranks` ([P, G], 1 the best). A group whose ranks are not
    1 … G, each once (ties), is refused (UsageError): a caller may check a batch with it before the forward."""
    ranks = torch.as_tensor(ranks)
    order = ranks.argsort(dim=1)
    strict = torch.arange(1, ranks.shape[1] + 1, device=ranks.device)
    if (bad := (ranks.gather(1, order) != strict).any(dim=1)).any():
        group = int(bad.nonzero()[0])
        raise UsageError(f"group {group} has ranks {ranks[group].tolist()}: the Plackett-Luce model takes a strict "
                         f"ranking, 1 to {ranks.shape[1]} each once (tied completions have no order to learn).")
    return order


def plackett_luce_loss(policy: GroupLogps, reference: GroupLogps, ranks: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """Per group [P]: DPO under the Plackett-Luce model of a ranking (Rafailov et al. 2023, "Direct Preference
    Optimization", Appendix A.3). With h = β (π - ref) each completion's implicit reward and τ the group's order by
    `ranks` ([P, G], 1 the best: a group build's `batch["group_ranks"]`, in the rows of `group_logps`),
    -Σₖ log(exp(h_τ(k)) / Σ_{j ≥ k} exp(h_τ(j))); at G = 2 it is `dpo_loss` of the better against the worse.
    The model ranks strictly: a group whose ranks are not 1 … G, each once (ties), is refused (UsageError)."""
    ranks = torch.as_tensor(ranks, device=policy.logps.device)
    if ranks.shape != policy.logps.shape or ranks.shape != reference.logps.shape:
        raise UsageError(f"ranks of shape {tuple(ranks.shape)} for log-probabilities of shape {tuple(policy.logps.shape)} "
                         f"and {tuple(reference.logps.shape)}: one rank a completion, [groups, G].")
    order = ranking_order(ranks)
    rewards = (beta * (policy.logps - reference.logps)).gather(1, order)
    below = torch.logcumsumexp(rewards.flip(1), dim=1).flip(1)  # log Σ_{j ≥ k} exp(h_τ(j))
    return (below - rewards).sum(dim=1)


def simpo_loss(policy: PairLogps, beta: float = 2.0, gamma: float = 0.5) -> torch.Tensor:
    """Per pair: -log σ(β (πc / nc - πr / nr) - γ), SimPO (reference-free, length-normalised), as TRL's
    CPOTrainer computes it."""
    delta = policy.chosen / policy.chosen_tokens.clamp(min=1) - policy.rejected / policy.rejected_tokens.clamp(min=1)
    return -F.logsigmoid(beta * delta - gamma)


def chosen_nll(policy: PairLogps, prompt: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The batch's negative log-likelihood per chosen token, the supervised term of CPO (the chosen completions'
    tokens) and, given `prompt` (`prompt_logps` of the same forward), of ORPO as TRL's ORPOTrainer computes it
    (prompt and chosen completion). A scalar: a mean over the batch's tokens, as TRL's `nn.CrossEntropyLoss`;
    over several micro-batches, sum -logps and tokens over the step instead."""
    summed, tokens = policy.chosen.sum(), policy.chosen_tokens.sum()
    if prompt is not None:
        summed, tokens = summed + prompt[0].sum(), tokens + prompt[1].sum()
    return -summed / tokens.clamp(min=1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, by the branch that does not cancel (Mächler 2012), as TRL's ORPO computes it."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(policy: PairLogps, beta: float = 0.1) -> torch.Tensor:
    """Per pair: -β log σ(log odds(chosen) - log odds(rejected)), odds(y) = P / (1 - P) of each completion's
    mean log-probability per token, ORPO's odds-ratio term (Hong et al. 2024, eq. 6-7; TRL's
    `ORPOTrainer.odds_ratio_loss`, without its cast to float32). ORPO's objective on a batch is
    `chosen_nll(policy, prompt_logps(...)) + orpo_loss(policy).mean()`."""
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds)


def cpo_loss(policy: PairLogps, beta: float = 0.1, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per pair: -(1 - ε) log σ(β (πc - πr)) - ε log σ(-β (πc - πr)) of the summed log-probabilities, CPO's
    preference term (Xu et al. 2024, eq. 3; TRL's CPOTrainer "sigmoid"; its "simpo" is `simpo_loss`). CPO's
    objective on a batch is `cpo_loss(policy).mean() + alpha * chosen_nll(policy)`."""
    logits = beta * (policy.chosen - policy.rejected)
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def kto_loss(
    policy: GroupLogps,
    reference: GroupLogps,
    desirable: torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per example [N]: KTO's loss (Ethayarajh et al. 2024, eq. 7; TRL's KTOTrainer "kto"), the desirable
    ones' w_d (1 - σ(β (r - z))), the undesirable ones' w_u (1 - σ(β (z - r))), r = π - ref of the example's
    completion and z the KL estimate, the mean over the examples given of π - ref of their mismatched KL
    completions, detached and at least 0.

    `policy` and `reference` are `group_logps` of examples laid out as groups of 2 (the completion, then the
    KL completion after the same prompt: `logps[:, 0]`, `logps[:, 1]`); `desirable` [N] bool, each example's
    label. z is the mean over these N examples, TRL's over its batch; `kl_reduce`, given, takes that mean to the
    estimate used (before the clamp), e.g. `lambda z: accelerator.gather(z).mean()` for TRL's mean over the
    ranks' estimates. Pass a step's examples together to estimate it over the step."""
    if policy.logps.shape[1] != 2 or reference.logps.shape != policy.logps.shape:
        raise UsageError("kto_loss takes group_logps of examples laid out as (completion, KL completion) pairs.")
    desirable = desirable.to(device=policy.logps.device, dtype=torch.bool)
    if desirable.shape != policy.logps.shape[:1]:
        raise UsageError(f"{tuple(desirable.shape)} labels for {policy.logps.shape[0]} examples.")
    kl = (policy.logps[:, 1] - reference.logps[:, 1]).mean().detach()
    if kl_reduce is not None:
        kl = kl_reduce(kl)
    kl = kl.clamp(min=0)
    logratios = policy.logps[:, 0] - reference.logps[:, 0]
    return torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))),
    )
