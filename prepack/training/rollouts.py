"""Rollouts as batches: a rank's micro-batches of an in-memory `RolloutPlan`, collated by `PackedCollator`, and the
per-token and per-sequence arithmetic of a GRPO/PPO step on them.

    plan = plan_rollouts([len(s["input_ids"]) for s in rollouts], max_len=8192, world_size=R, cost="attention")
    for micro in rollout_micro_batches(rollouts, plan, rank, token_fields=("advantages", "old_logps")):
        logits = model(**micro.batch).logits                       # documents isolated as for SFT
        logps = token_logps(logits, micro.batch)                   # [B, L], 0 where nothing is trained
        loss_per_token = policy_loss(logps, micro.fields["old_logps"], micro.fields["advantages"], micro.batch)
        per_sequence = sequence_sums(loss_per_token, micro) / sequence_sums(trained(micro.batch), micro).clamp(min=1)

A rollout is a mapping with `input_ids` (1-D), optional `labels` (-100 on the prompt; without them every token
is trained, as the collator does), and any per-token fields named in `token_fields` (advantages, old or reference
log-probabilities, values...), each as long as its `input_ids`. A micro-batch is one pack of the plan (its
sequences in the plan's order, at most `plan.max_len` tokens), and `micro.batch` is exactly what `PackedCollator`
gives for it: the same fields, the same isolation (each sequence's first label masked, positions restarting); every
per-token field is laid out as `input_ids` is (row 0, the pack's tokens first; 0 at padding) in `micro.fields`.

Per-token values follow the labels: the value at position t belongs to token t, predicted from the tokens before
it in its own sequence (`token_logps` puts the log-probability of label t there, as `old_logps` from an earlier
forward of the same plan are). `sequence_sums` adds a [B, L] tensor over each sequence of the micro-batch, in
collated order, and `unpack_sequences` puts per-sequence results of a rank (or of all ranks) back in the caller's
order, so `old_logps` from the rollout engine, a reference model's, and the policy's line up exactly.

A GRPO group (one prompt, G completions) can also go in the shared-prompt layout
(`prepack.training.shared_prompt`): `shared_prompt_micro_batches` packs each group as [prompt][c1]…[cG], the prompt
computed once and every completion seeing it and itself only, planned as one unit of prompt + Σ completions tokens
(`shared_prompt_lengths`). `token_logps` reads such a batch too (a completion's first token from its prompt's last
position) and `completion_sums` adds per-token values over each completion, so the loss is the plain layout's.

This module imports torch; the plan (`prepack.building.rollouts`) does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from prepack.building.rollouts import RolloutPlan
from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX
from prepack.training.collate import PackedCollator
from prepack.training.preference import shared_token_logps
from prepack.training.shared_prompt import Group, completion_slots, group_parts, shared_prompt_layout

with optional_imports("prepack.training.rollouts"):
    import torch
    import torch.nn.functional as F

__all__ = ["RolloutMicroBatch", "completion_sums", "policy_loss", "rollout_micro_batches", "sequence_sums",
           "shared_prompt_lengths", "shared_prompt_micro_batches", "token_logps", "trained", "unpack_sequences"]


class RolloutMicroBatch(NamedTuple):
    """One micro-batch of a rank: `batch` for `model(**batch)` (PackedCollator's), the per-token `fields` laid out as
    its `input_ids`, and `sequences`, the caller's indices of its sequences in collated order (its first segments)."""

    batch: dict[str, Any]
    fields: dict[str, torch.Tensor]
    sequences: np.ndarray


def rollout_micro_batches(
    rollouts: Sequence[Mapping[str, Any]],
    plan: RolloutPlan,
    rank: int,
    collator: PackedCollator | None = None,
    *,
    token_fields: Sequence[str] = (),
) -> list[RolloutMicroBatch]:
    """`rank`'s micro-batches of `plan` (one a pack), collated by `collator` (default: padding-free rows,
    `PackedCollator(plan.max_len, layout="padding_free")`), with `token_fields` of each rollout carried through.

    The collator may use the `padded` (with `max_docs_per_pack` at least the plan's cap: fixed shapes) or
    `padding_free` layout; not `cp_size`, `shared_prompt`, `source_ids` or `indexed_mask`, whose fields are not laid
    out one token a position or per sequence."""
    if len(rollouts) != len(plan.sequences):
        raise UsageError(f"the plan is of {len(plan.sequences)} sequences, not of {len(rollouts)} rollouts")
    collator = collator or PackedCollator(plan.max_len, layout="padding_free")
    _check_collator(collator, plan)
    micro_batches = []
    for number in range(plan.micro_batches):
        sequences = plan.micro_batch(rank, number)
        taken = [_rollout(rollouts, int(index), token_fields) for index in sequences]
        lengths = [len(rollout["input_ids"]) for rollout in taken]
        if sum(lengths) != plan.tokens[rank, number]:
            raise UsageError(f"rollouts {sequences.tolist()} hold {sum(lengths)} tokens, not the {plan.tokens[rank, number]} "
                             "the plan was made for: plan from their own lengths")
        has_labels = [rollout.get("labels") is not None for rollout in taken]
        if any(has_labels) and not all(has_labels):
            raise UsageError(f"rollout {int(sequences[has_labels.index(False)])} has no labels while others have")
        pack = {
            "input_ids": np.concatenate([np.asarray(rollout["input_ids"]) for rollout in taken]),
            "cu_seqlens": np.concatenate(([0], np.cumsum(lengths))),
            "labels": np.concatenate([np.asarray(rollout["labels"]) for rollout in taken]) if all(has_labels) else None,
        }
        batch = collator([pack])
        fields = {}
        for name in token_fields:
            values = np.concatenate([np.asarray(rollout[name]) for rollout in taken])
            laid = np.zeros(tuple(batch["input_ids"].shape) + values.shape[1:], dtype=values.dtype)
            laid[0, : len(values)] = values  # one pack: row 0 from its start, in both layouts
            fields[name] = torch.from_numpy(laid)
        micro_batches.append(RolloutMicroBatch(batch, fields, sequences))
    return micro_batches


def shared_prompt_lengths(groups: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """The planner's unit of each GRPO group in the shared-prompt layout: its prompt's tokens plus its completions'."""
    return np.array([len(group["prompt"]) + sum(len(c) for c in group["completions"]) for group in groups], np.int64)


def shared_prompt_micro_batches(
    groups: Sequence[Mapping[str, Any]], plan: RolloutPlan, rank: int, *, token_fields: Sequence[str] = ()
) -> list[RolloutMicroBatch]:
    """`rank`'s micro-batches of `plan`, made over `shared_prompt_lengths(groups)`, each one padding-free row of
    its groups in the shared-prompt layout (`shared_prompt_layout`): [prompt][c1]…[cG] a group. A group is a mapping
    with `prompt` (token ids), `completions` (a list of token ids), optional `labels` (one list a completion, -100:
    not trained) and each of `token_fields` as one array a completion, as long as it; `micro.fields` lays them out
    as the tokens, 0 on the prompts. `micro.sequences` are the groups' indices in collated order."""
    if len(groups) != len(plan.sequences):
        raise UsageError(f"the plan is of {len(plan.sequences)} units, not of {len(groups)} groups")
    micro_batches = []
    for number in range(plan.micro_batches):
        sequences = plan.micro_batch(rank, number)
        taken = [_group(groups, int(index), token_fields) for index in sequences]
        if int(shared_prompt_lengths(taken).sum()) != plan.tokens[rank, number]:
            raise UsageError(f"groups {sequences.tolist()} do not hold the {plan.tokens[rank, number]} tokens the plan "
                             "was made for: plan from shared_prompt_lengths(groups)")
        batch = shared_prompt_layout([[Group(g["prompt"], g["completions"], g.get("labels")) for g in taken]],
                                     padding_free=True)
        fields = {}
        for name in token_fields:
            values = np.concatenate([np.concatenate([np.zeros(len(g["prompt"])), *map(np.asarray, g[name])])
                                     for g in taken])
            fields[name] = torch.from_numpy(values[None])
        micro_batches.append(RolloutMicroBatch(batch, fields, sequences))
    return micro_batches


def _group(groups: Sequence[Mapping[str, Any]], index: int, token_fields: Sequence[str]) -> Mapping[str, Any]:
    group = groups[index]
    for name in ("prompt", "completions", *token_fields):
        if name not in group:
            raise UsageError(f"group {index} has no {name!r} (keys: {sorted(group)})")
    lengths = [len(c) for c in group["completions"]]
    for name in ("labels", *token_fields) if group.get("labels") is not None else token_fields:
        if [len(v) for v in group[name]] != lengths:
            raise UsageError(f"group {index}: {name} must be one array a completion, as long as it ({lengths} tokens)")
    return group


def _check_collator(collator: PackedCollator, plan: RolloutPlan) -> None:
    if collator.layout == "indexed_mask" or collator.cp_size is not None or collator.shared_prompt or collator.source_ids:
        raise UsageError("rollout micro-batches take a PackedCollator of the padded or padding_free layout, without "
                         "cp_size, shared_prompt or source_ids")
    if collator.max_len is not None and collator.max_len < plan.max_len:
        raise UsageError(f"the collator's max_len={collator.max_len} is below the plan's {plan.max_len}: a micro-batch "
                         "may not fit its row")
    cap = collator.max_docs_per_pack
    if cap is not None and (plan.max_documents is None or plan.max_documents > cap):
        raise UsageError(f"the collator's fixed shapes hold {cap} sequences a micro-batch; plan with max_documents={cap}")


def _rollout(rollouts: Sequence[Mapping[str, Any]], index: int, token_fields: Sequence[str]) -> Mapping[str, Any]:
    rollout = rollouts[index]
    length = len(rollout["input_ids"]) if "input_ids" in rollout else None
    labels = ("labels",) if rollout.get("labels") is not None else ()
    for name in ("input_ids", *labels, *token_fields):
        if name not in rollout:
            raise UsageError(f"rollout {index} has no {name!r} (keys: {sorted(rollout)})")
        if len(rollout[name]) != length:
            raise UsageError(f"rollout {index}: {name} has {len(rollout[name])} values for {length} tokens")
    return rollout


def trained(batch: Mapping[str, Any]) -> torch.Tensor:
    """[B, L] bool: the labels that are trained (not -100; the collator already masks each sequence's first)."""
    return batch["labels"] != IGNORE_INDEX


def token_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """[B, L]: at every trained label t, its log-probability from the logits of position t - 1 (the tokens before it in
    its own sequence), 0 elsewhere. Half precision is upcast to float32 as transformers' losses do; float64 stays.
    In a shared-prompt batch a completion's first token is predicted from its group's last prompt position."""
    if "shared_prompt_ids" in batch:
        return shared_token_logps(logits, batch)
    labels = batch["labels"].to(logits.device)
    if logits.shape[:2] != labels.shape:
        raise UsageError(f"logits of shape {tuple(logits.shape)} do not match labels of shape {tuple(labels.shape)}")
    predicting = logits[:, :-1]
    logp = -F.cross_entropy(
        predicting.flatten(0, 1).to(torch.promote_types(predicting.dtype, torch.float32)),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(labels.shape[0], -1)
    return F.pad(logp, (1, 0))  # position 0 predicts nothing; ignored labels already give 0


def sequence_sums(values: torch.Tensor, micro: RolloutMicroBatch) -> torch.Tensor:
    """[n]: `values` ([B, L], laid out as the batch's tokens) summed over each of the micro-batch's n sequences, in
    collated order (`micro.sequences`): the first n segments of `cu_seq_lens_q`."""
    cu = micro.batch["cu_seq_lens_q"].to(device=values.device, dtype=torch.int64)
    if values.shape[:2] != micro.batch["input_ids"].shape:
        raise UsageError(f"values of shape {tuple(values.shape)} are not laid out as the batch's tokens")
    segment = torch.searchsorted(cu, torch.arange(values.shape[0] * values.shape[1], device=values.device), right=True) - 1
    sums = torch.zeros(len(cu) - 1, dtype=values.dtype if values.is_floating_point() else torch.float64, device=values.device)
    return sums.index_add(0, segment, values.flatten().to(sums.dtype))[: len(micro.sequences)]


def completion_sums(values: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """[groups, G]: `values` ([B, L], laid out as a shared-prompt batch's tokens) summed over each completion of each
    group, groups in collated order (`micro.sequences`); 0 for the slots of a group of fewer than G."""
    ids = batch["shared_prompt_ids"].to(values.device).flatten()
    if values.shape[:2] != batch["shared_prompt_ids"].shape:
        raise UsageError(f"values of shape {tuple(values.shape)} are not laid out as the batch's tokens")
    parts = group_parts(batch)
    group, part = ids // parts, ids % parts
    completion = (group > 0) & (part > 0)
    slots = completion_slots(group, part, completion, parts)
    sums = torch.zeros(int(group.max()) * (parts - 1), dtype=values.dtype if values.is_floating_point() else torch.float64,
                       device=values.device)
    flat = values.flatten().to(sums.dtype)
    return sums.index_add(0, slots, torch.where(completion, flat, 0)).view(-1, parts - 1)


def policy_loss(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, batch: Mapping[str, Any], clip: float = 0.2
) -> torch.Tensor:
    """[B, L]: the clipped surrogate of PPO (and GRPO) at every trained token, 0 elsewhere:
    −min(ρ·A, clip(ρ, 1 − clip, 1 + clip)·A) with ρ = exp(logp − old_logp).

    The reduction is the caller's. The sequence-level mean (the GRPO paper's, examples/rollouts_grpo_plain.py):
    `sequence_sums(loss, micro) / sequence_sums(trained(batch), micro).clamp(min=1)` summed and divided by the
    step's sequences. The token-level mean (verl's default "token-mean", DAPO): `loss.sum()` divided by the step's
    trained tokens. Under DDP, multiply by the world size before `backward`, as DDP averages the ranks' gradients."""
    ratio = torch.exp(logps - old_logps.to(logps))
    advantages = advantages.to(logps)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return torch.where(trained(batch).to(logps.device), -surrogate, 0.0)


def unpack_sequences(plan: RolloutPlan, values: Sequence[torch.Tensor], rank: int | None = None) -> torch.Tensor:
    """`RolloutPlan.unpack` for tensors: per-sequence results of `rank`'s micro-batches (or all ranks' for None, in
    plan order), back in the caller's order (for one rank, its sequences by ascending index)."""
    index = plan.restoring_index(rank, values)
    joined = torch.cat(list(values))
    return joined[torch.from_numpy(index).to(joined.device)]
