"""`PackedSampler`: which packs each rank trains on, in which order, and where a resumed run picks up.

It is `DistributedSampler` with a cursor: (epoch, position) says exactly which indices this rank has
left, so a job stopped mid-epoch resumes with the same remaining packs in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["PackedSampler"]


class PackedSampler(Sampler[int]):
    """Pack indices for one rank, shuffled per epoch, with an exact mid-epoch resume point.

    Same contract as `torch.utils.data.DistributedSampler`: every rank gets `len(self)` indices, dealt
    round-robin from one epoch order, so the ranks' slices are disjoint; unless `drop_last` (which
    leaves out the last `len % world_size`), a few indices from the start of the epoch are dealt again
    so that all ranks have as many. The order of epoch e is a permutation drawn from
    (seed, e) alone, so every rank computes the same one without communicating. `rank` and
    `world_size` default to torch.distributed's when it is initialised, else 0 and 1.

    `state_dict()` records (epoch, position), position being how many indices of this epoch were
    handed out; after `load_state_dict`, iterating yields exactly the indices that were left.
    A DataLoader with worker processes draws indices ahead of the training loop (`prefetch_factor`
    batches per worker); pass `consumed=` (indices the loop actually trained on this epoch) to save
    the loop's position rather than the loader's.
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ):
        self.size = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_samples = self.size // self.world_size if drop_last else math.ceil(self.size / self.world_size)
        self.epoch = 0
        self._position = 0  # indices of this epoch handed out so far
        self._resume_pending = False  # the next iteration continues from _position instead of 0

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order; setting the epoch a loaded state is in keeps its position."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self._position, self._resume_pending = epoch, 0, False

    def __iter__(self) -> Iterator[int]:
        """The epoch from its beginning, as DistributedSampler; right after `load_state_dict`, the rest."""
        if not self._resume_pending:
            self._position = 0
        self._resume_pending = False
        return self._iterate(self._epoch_indices(), self._position)

    def _iterate(self, indices: np.ndarray, start: int) -> Iterator[int]:
        for position in range(start, len(indices)):
            self._position = position + 1  # counted before the yield: state_dict() sees this index as used
            yield int(indices[position])

    def _epoch_indices(self) -> np.ndarray:
        """All of this rank's indices for the current epoch, from its beginning."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        # np.resize repeats from the start when growing: DistributedSampler's padding.
        order = np.resize(order, self.num_samples * self.world_size)
        return order[self.rank :: self.world_size]

    def state_dict(self, consumed: int | None = None) -> dict[str, int | bool]:
        """Where this rank is: JSON-serialisable, for a checkpoint. See the class docstring for `consumed`."""
        position = self._position if consumed is None else consumed
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"consumed must be in [0, {self.num_samples}], got {consumed}")
        return {"epoch": self.epoch, "position": position, **self._identity()}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume from `state_dict()`; refuses a state from a different dataset size, seed or world."""
        mismatched = [key for key, value in self._identity().items() if state.get(key) != value]
        if mismatched:
            details = ", ".join(f"{key} {state.get(key)!r} (now {getattr(self, key)!r})" for key in mismatched)
            raise ValueError(f"the sampler state is for another setup: {details}; its order would not match.")
        if not 0 <= state["position"] <= self.num_samples:
            raise ValueError(f"position {state['position']} is out of range for {self.num_samples} indices")
        self.epoch, self._position = int(state["epoch"]), int(state["position"])
        self._resume_pending = True

    def _identity(self) -> dict[str, int | bool]:
        """What must be the same for a saved position to mean the same indices."""
        return {
            "size": self.size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
        }


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if world_size is None:
        world_size = torch.distributed.get_world_size() if distributed else 1
    if rank is None:
        rank = torch.distributed.get_rank() if distributed else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank} and world_size {world_size}")
    return rank, world_size
