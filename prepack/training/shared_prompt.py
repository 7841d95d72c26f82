"""The shared-prompt layout: a group's prompt computed once, each of its completions after it.

A group is one prompt and G completions: a preference pair (G = 2, chosen then rejected), a group of a
`--groups` build, or any caller's (best-of-N samples, a GRPO group). A pack of such a build holds each group
as G documents, [prompt + c1]…[prompt + cG]; `PackedCollator(..., shared_prompt=True)` re-lays each group as
[prompt][c1]…[cG] (the prompt: the leading tokens whose labels are -100; every document of a group must
have the same ones), and `shared_prompt_layout` lays out groups given as token lists. Every completion's
position ids continue from the prompt's end, and the batch carries

    shared_prompt_ids    [B, L] int64   parts * group + part: group numbered from 1 over the batch (in pack
                                        order, the order of `pair_segments` and `reference_logps`), part 0
                                        the prompt, k the k-th completion; 0 at a row's padding tail
    shared_prompt_parts  int            parts = 1 + the batch's largest group (3 for pairs); required: read
                                        with another stride, one completion would see its sibling

from which `prepack.model.shared_prompt` builds the attention (`shared_prompt_mask` for sdpa and eager,
`shared_prompt_block_mask` for flex_attention): a token sees the earlier tokens of its own part and its group's
prompt, never a sibling completion or another group. A model passed to `prepack.enable_packing` builds it
itself (varlen kernels cannot express it, and are refused).
`prepack.training.preference.group_logps` (and `pair_logps`) reads each completion's log-probabilities from
such a batch, its first token predicted from the last prompt position in every completion.

This module imports torch (the batch's tensors); the layout itself is numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX, unit_name

with optional_imports("prepack.training.shared_prompt"):
    import torch

__all__ = [
    "Group", "completion_slots", "group_parts", "pack_groups", "shared_prompt_layout", "shared_trained_tokens",
]


class Group(NamedTuple):
    """One prompt and its completions, as token ids; `labels`, one list a completion (-100: not trained), by
    default every completion token. The prompt is never trained on."""

    prompt: Sequence[int]
    completions: Sequence[Sequence[int]]
    labels: Sequence[Sequence[int]] | None = None


def group_parts(batch: Mapping[str, Any]) -> int:
    """The stride of a shared-prompt batch's ids, its `shared_prompt_parts`; a batch without it is refused:
    no stride can be assumed (a G = 4 batch read as pairs would let completions see a sibling)."""
    if batch.get("shared_prompt_parts") is None:
        raise UsageError(
            "A shared-prompt batch (shared_prompt_ids) without 'shared_prompt_parts', the stride of its ids: pass "
            "the batch of PackedCollator(shared_prompt=True) or shared_prompt_layout whole (with a Hugging Face "
            "Trainer, remove_unused_columns=False)."
        )
    return int(batch["shared_prompt_parts"])


def _prompt_length(labels: np.ndarray) -> int:
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    return int(trained[0]) if len(trained) else len(labels)


def pack_groups(input_ids: np.ndarray, cu_seqlens: np.ndarray, labels: np.ndarray, size: int, number: int) -> list[Group]:
    """The groups of pack `number`, whose documents make whole groups of `size` (checked by the caller), each
    as its prompt (the first document's leading -100 labels) and its completions with their labels. A group
    whose documents do not all start with the same prompt (same length of leading -100 labels, same tokens),
    or has no prompt, is refused by pack and group."""
    unit = unit_name(size)
    groups = []
    for first in range(0, len(cu_seqlens) - 1, size):
        spans = [slice(cu_seqlens[d], cu_seqlens[d + 1]) for d in range(first, first + size)]
        prompt = _prompt_length(labels[spans[0]])
        for member, span in enumerate(spans[1:], 1):
            problem = None
            if prompt != _prompt_length(labels[span]):
                problem = f"prompts of {prompt} and {_prompt_length(labels[span])} tokens (leading -100 labels)"
            elif prompt == 0:
                problem = "no prompt (its first label is trained)"
            elif not np.array_equal(input_ids[spans[0]][:prompt], input_ids[span][:prompt]):
                problem = f"different tokens in their {prompt}-token prompts"
            if problem is not None:
                which = "chosen and rejected have" if size == 2 else f"completions 0 and {member} have"
                raise UsageError(
                    f"Pack {number}, {unit} {first // size}: {which} {problem}, so they share no prompt; "
                    f"collate this build without shared_prompt (one sequence a completion)."
                )
        groups.append(Group(
            input_ids[spans[0]][:prompt],
            [input_ids[span][prompt:] for span in spans],
            [labels[span][prompt:] for span in spans],
        ))
    return groups


def _laid_row(groups: Sequence[Group], first_group: int, parts: int) -> tuple[np.ndarray, ...]:
    """One row's groups re-laid: tokens, labels, position ids and shared_prompt_ids, each [n] int64."""
    columns: list[tuple[np.ndarray, ...]] = []
    for number, group in enumerate(groups, first_group):
        prompt = np.asarray(group.prompt, np.int64)
        columns.append((prompt, np.full(len(prompt), IGNORE_INDEX), np.arange(len(prompt)), np.full(len(prompt), parts * number)))
        labels = group.completions if group.labels is None else group.labels
        for part, (completion, trained) in enumerate(zip(group.completions, labels, strict=True), 1):
            completion = np.asarray(completion, np.int64)
            columns.append((completion, np.asarray(trained, np.int64), len(prompt) + np.arange(len(completion)),
                            np.full(len(completion), parts * number + part)))
    return tuple(np.concatenate(column).astype(np.int64) for column in zip(*columns))


def shared_prompt_layout(
    rows: Sequence[Sequence[Group]],
    *,
    padding_free: bool = False,
    row_length: int | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The batch of `rows` (each a list of `Group`s) in the shared-prompt layout: `input_ids`, `labels`,
    `position_ids`, `shared_prompt_ids` [B, L] int64, `shared_prompt_parts` and `use_cache=False`, what a model
    passed to `enable_packing` and `group_logps` take. Rows are padded to `row_length` (default: the longest),
    or with `padding_free` laid back to back in one row. A row's padding tail: its own segment (ids 0, labels
    -100, positions from 0), `pad_token_id` or the row's last token (a real token's embedding)."""
    if not rows or not all(rows):
        raise UsageError("shared_prompt_layout takes at least one row, each of at least one group.")
    for group in (group for row in rows for group in row):
        if len(group.prompt) == 0 or len(group.completions) == 0 or any(len(c) == 0 for c in group.completions):
            raise UsageError("Each group of the shared-prompt layout needs a prompt and completions of one token or more.")
        if group.labels is not None and [len(c) for c in group.labels] != [len(c) for c in group.completions]:
            raise UsageError("A group's labels must be one list a completion, as long as it.")
    parts = 1 + max(len(group.completions) for row in rows for group in row)
    laid, first_group = [], 1
    for row in rows:
        laid.append(_laid_row(row, first_group, parts))
        first_group += len(row)
    lengths = [len(row[0]) for row in laid]
    if padding_free:
        shape, starts = (1, sum(lengths)), [(0, start) for start in np.cumsum([0, *lengths[:-1]])]
    else:
        width = max(lengths) if row_length is None else row_length
        if width < max(lengths):
            raise UsageError(f"row_length {width} is shorter than a laid-out row of {max(lengths)} tokens.")
        shape, starts = (len(laid), width), [(row, 0) for row in range(len(laid))]
    input_ids = np.full(shape, pad_token_id or 0, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.tile(np.arange(shape[1], dtype=np.int64), (shape[0], 1))
    shared_prompt_ids = np.zeros(shape, dtype=np.int64)
    for (tokens, trained, positions, ids), (row, start) in zip(laid, starts):
        end = start + len(tokens)
        input_ids[row, start:end], labels[row, start:end] = tokens, trained
        position_ids[row, start:end], shared_prompt_ids[row, start:end] = positions, ids
        if not padding_free:
            position_ids[row, end:] -= end
            if pad_token_id is None:
                input_ids[row, end:] = tokens[-1]  # a real token's embedding (PackedCollator's pad_token_id)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "shared_prompt_ids": torch.from_numpy(shared_prompt_ids),
        "shared_prompt_parts": parts,
        "use_cache": False,
    }


def shared_trained_tokens(batch: Mapping[str, Any]) -> torch.Tensor:
    """[groups, parts - 1] int64: the trained tokens of each group's completions in a shared-prompt batch (a
    pair's chosen and rejected: [P, 2]); 0 for the slots of a group smaller than the batch's largest."""
    parts = group_parts(batch)
    ids = batch["shared_prompt_ids"].flatten()
    group, part = ids // parts, ids % parts
    trained = (batch["labels"].to(ids.device).flatten() != IGNORE_INDEX) & (part > 0)
    groups = int(group.max())
    slots = completion_slots(group, part, trained, parts)
    counts = torch.bincount(slots, weights=trained.to(torch.float64), minlength=(parts - 1) * groups)
    return counts.to(torch.int64).view(groups, parts - 1)


def completion_slots(group: torch.Tensor, part: torch.Tensor, trained: torch.Tensor, parts: int) -> torch.Tensor:
    """Each token's place among the batch's completions, (group - 1) * (parts - 1) + part - 1; 0 where not trained."""
    return torch.where(trained, (group - 1) * (parts - 1) + part - 1, 0)
