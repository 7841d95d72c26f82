"""Plan KTO's KL term offline: each unpaired example's KL completion, the completion of another example.

KTO estimates its KL term from mismatched (prompt, completion) pairs: example i's prompt followed by another
example's completion. TRL's KTOTrainer builds them per batch (the batch's completions cycled by one); an unpaired
build (`prepack build --unpaired`) plans them once, from the examples' indices and a seed, so that each example
and its KL completion pack together (`prepack.sources.pairs.unpaired_documents`). numpy only: the building wing
plans, and `prepack.training.unpaired` lays examples out in memory with the same plan.
"""

from __future__ import annotations

import numpy as np

from prepack.errors import UsageError

__all__ = ["kl_partners"]


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
