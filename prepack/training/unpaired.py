"""Unpaired feedback (KTO) as groups of 2: each example's completion, and after the same prompt its KL completion.

KTO estimates its KL term from mismatched (prompt, completion) pairs: example i's prompt followed by another
example's completion. TRL's KTOTrainer builds them per batch (the batch's completions cycled by one); here they
are planned once, from the examples' indices (`kl_partners`), so that they can be packed:

    partners = kl_partners(len(examples), seed=0)                       # or batch_size=B: TRL's cycling
    groups = kto_groups(prompts, completions, partners)                # Group(prompt_i, [completion_i, completion_p(i)])
    batch = shared_prompt_layout([groups[:k], groups[k:]])             # or packs of 2 documents an example
    policy = group_logps(model(**batch).logits, batch)                 # [N, 2]: completion, KL completion
    loss = kto_loss(policy, reference, desirable).mean()               # prepack.training.preference

Each KL completion then sees its own example's prompt and nothing else (the shared-prompt mask, or its own
document), and the KL estimate is TRL's on the same mismatches (`tests/train/test_kto.py`).

The planning is numpy over indices and token lists; the module imports torch through `Group`
(`prepack.training.shared_prompt`), so it belongs to the training wing, as the loss does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prepack.errors import UsageError
from prepack.training.shared_prompt import Group

__all__ = ["kl_partners", "kto_groups"]


def kl_partners(count: int, *, seed: int | None = None, batch_size: int | None = None) -> np.ndarray:
    """[count] int64: the example whose completion is example i's KL completion, never i itself.

    With `batch_size` B (TRL's `per_device_train_batch_size`, its sequential sampler): TRL's KTOTrainer's
    pairing, each block of B consecutive examples' completions cycled by one (example i of a block takes the
    one before it, the first the block's last); a last block of one example is refused (TRL's KL term would
    be its own reward). With `seed`: one seeded cycle through all the examples (a seeded order, each taking
    the completion of the one before it), the same for the same count and seed."""
    if count < 2:
        raise UsageError(f"the KL term needs two examples or more to mismatch, not {count}.")
    if (seed is None) == (batch_size is None):
        raise UsageError("give kl_partners a seed (a seeded cycle) or a batch_size (TRL's cycling), not both or neither.")
    if batch_size is not None:
        if batch_size < 2 or count % batch_size == 1:
            raise UsageError(f"batches of {batch_size} leave an example alone in its batch: its KL completion would be its own.")
        index = np.arange(count)
        first = index - index % batch_size
        size = np.minimum(batch_size, count - first)
        return first + (index - first - 1) % size
    # The examples in a seeded order, each taking the completion of the one before it: one cycle, no fixed point.
    order = np.random.default_rng(seed).permutation(count)
    partners = np.empty(count, np.int64)
    partners[order] = np.roll(order, 1)
    return partners


def kto_groups(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], partners: np.ndarray) -> list[Group]:
    """Example i as `Group(prompt_i, [completion_i, completion_partners[i]])`: its KL completion's tokens are the
    partner's completion tokens after example i's prompt tokens, as TRL concatenates them (no re-tokenizing)."""
    if not len(prompts) == len(completions) == len(partners):
        raise UsageError(f"{len(prompts)} prompts, {len(completions)} completions and {len(partners)} partners.")
    return [Group(prompt, [completions[i], completions[int(p)]]) for i, (prompt, p) in enumerate(zip(prompts, partners))]
