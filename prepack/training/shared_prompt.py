"""The shared-prompt layout of preference pairs: each pair's prompt computed once, both completions after it.

A pack of a preference-pair build holds each pair as two documents, [prompt + chosen][prompt + rejected].
`PackedCollator(..., shared_prompt=True)` re-lays each pair as [prompt][chosen][rejected] (the prompt: the
leading tokens whose labels are -100; both documents must have the same ones). Both completions' position ids
continue from the prompt's end, and the batch carries

    shared_prompt_ids  [B, L] int64   3 * pair + part: pair numbered from 1 over the batch (in pack order, the
                                      order of `pair_segments` and `reference_logps`), part 0 prompt,
                                      1 chosen, 2 rejected; 0 at a row's padding tail

from which `prepack.model.shared_prompt` builds the attention (`shared_prompt_mask` for sdpa and eager,
`shared_prompt_block_mask` for flex_attention): a token sees the earlier tokens of its own part and its pair's
prompt, never the other completion or another pair. A model passed to `prepack.enable_packing` builds it
itself (varlen kernels cannot express it, and are refused).
`prepack.training.preference.pair_logps` reads each completion's log-probabilities from such a batch, its first
token predicted from the last prompt position in both completions.

This module imports torch (the trained-token counts); the layout itself is numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX

with optional_imports("prepack.training.shared_prompt"):
    import torch

__all__ = ["PARTS", "SharedPromptPack", "completion_slots", "shared_prompt_pack", "shared_trained_tokens"]

PARTS = 3  # prompt, chosen, rejected


class SharedPromptPack(NamedTuple):
    """One pack re-laid: tokens, labels, position ids and `shared_prompt_ids`, each [n] int64."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    shared_prompt_ids: np.ndarray


def _prompt_length(labels: np.ndarray) -> int:
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    return int(trained[0]) if len(trained) else len(labels)


def shared_prompt_pack(
    input_ids: np.ndarray, cu_seqlens: np.ndarray, labels: np.ndarray, number: int, first_pair: int
) -> SharedPromptPack:
    """Pack `number` (whole pairs, chosen then rejected, as `_pair_segments` checked) in the shared-prompt
    layout, its pairs numbered from `first_pair`. A pair whose two documents do not start with the same prompt
    (same length of leading -100 labels, same tokens), or has no prompt, is refused by pack and pair."""
    parts: list[tuple[np.ndarray, ...]] = []
    for pair in range(0, len(cu_seqlens) - 1, 2):
        chosen = slice(cu_seqlens[pair], cu_seqlens[pair + 1])
        rejected = slice(cu_seqlens[pair + 1], cu_seqlens[pair + 2])
        prompt = _prompt_length(labels[chosen])
        problem = None
        if prompt != _prompt_length(labels[rejected]):
            problem = f"prompts of {prompt} and {_prompt_length(labels[rejected])} tokens (leading -100 labels)"
        elif prompt == 0:
            problem = "no prompt (its first label is trained)"
        elif not np.array_equal(input_ids[chosen][:prompt], input_ids[rejected][:prompt]):
            problem = f"different tokens in their {prompt}-token prompts"
        if problem is not None:
            raise UsageError(
                f"Pack {number}, pair {pair // 2}: chosen and rejected have {problem}, so they share no prompt; "
                "collate this build without shared_prompt (the two-sequence layout)."
            )
        pair_id = PARTS * (first_pair + pair // 2)
        for part, (span, skip) in enumerate(((chosen, 0), (chosen, prompt), (rejected, prompt))):
            start, stop = span.start + skip, span.stop if part else span.start + prompt
            positions = np.arange(stop - start) + (prompt if part else 0)
            parts.append((input_ids[start:stop], labels[start:stop], positions, np.full(stop - start, pair_id + part)))
    return SharedPromptPack(*(np.concatenate(column).astype(np.int64) for column in zip(*parts)))


def shared_trained_tokens(batch: Mapping[str, Any]) -> torch.Tensor:
    """[P, 2] int64: the trained tokens of each pair's chosen and rejected completion in a shared-prompt batch."""
    ids = batch["shared_prompt_ids"].flatten()
    pair, part = ids // PARTS, ids % PARTS
    trained = (batch["labels"].to(ids.device).flatten() != IGNORE_INDEX) & (part > 0)
    pairs = int(pair.max())
    slots = completion_slots(pair, part, trained)
    return torch.bincount(slots, weights=trained.to(torch.float64), minlength=2 * pairs).to(torch.int64).view(pairs, 2)


def completion_slots(pair: torch.Tensor, part: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Each token's place among the batch's completions, (pair - 1) * 2 + role; 0 where not trained."""
    return torch.where(trained, (pair - 1) * 2 + part - 1, 0)
