"""Unpaired feedback (KTO) as groups of 2: each example's completion, and after the same prompt its KL completion.

KTO estimates its KL term from mismatched (prompt, completion) pairs: example i's prompt followed by another
example's completion. TRL's KTOTrainer builds them per batch (the batch's completions cycled by one); here they
are planned once, from the examples' indices (`kl_partners`, from the building wing's `prepack.building.kl_plan`,
which `prepack build --unpaired` plans with), so that they can be packed:

    partners = kl_partners(len(examples), seed=0)                       # or batch_size=B: TRL's cycling
    groups = kto_groups(prompts, completions, partners)                # Group(prompt_i, [completion_i, completion_p(i)])
    batch = shared_prompt_layout([groups[:k], groups[k:]])             # or packs of 2 documents an example
    policy = group_logps(model(**batch).logits, batch)                 # [N, 2]: completion, KL completion
    loss = kto_loss(policy, reference, desirable).mean()               # prepack.training.preference

Each KL completion then sees its own example's prompt and nothing else (the shared-prompt mask, or its own
document), and the KL estimate is TRL's on the same mismatches (`tests/train/test_kto.py`).

The layout imports torch through `Group` (`prepack.training.shared_prompt`), so it belongs to the training wing,
as the loss does; the plan is numpy and lives in the building wing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prepack.building.kl_plan import kl_partners
from prepack.errors import UsageError
from prepack.training.shared_prompt import Group

__all__ = ["kl_partners", "kto_groups"]


def kto_groups(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], partners: np.ndarray) -> list[Group]:
    """Example i as `Group(prompt_i, [completion_i, completion_partners[i]])`: its KL completion's tokens are the
    partner's completion tokens after example i's prompt tokens, as TRL concatenates them (no re-tokenizing)."""
    if not len(prompts) == len(completions) == len(partners):
        raise UsageError(f"{len(prompts)} prompts, {len(completions)} completions and {len(partners)} partners.")
    return [Group(prompt, [completions[i], completions[int(p)]]) for i, (prompt, p) in enumerate(zip(prompts, partners))]
