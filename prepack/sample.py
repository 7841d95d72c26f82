"""`PackedSampler`: which packs each rank trains on, in which order, and where a resumed run picks up.

It is `DistributedSampler` with a cursor over the whole job: every epoch is one permutation of the
packs, drawn from (seed, epoch) alone, dealt round-robin to the ranks. The ranks of a job step
together, so after each rank has drawn c indices the packs used are exactly the first `c · world_size`
of the epoch's order: the state records that prefix, and a resumed job deals out the rest of the
epoch over however many ranks it now has.
"""

from __future__ import annotations

import math
import os
import sys
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
    so that all ranks have as many. `rank` and `world_size` default to torch.distributed's.

    It refuses, before the first index, the two ways a job silently trains on the wrong packs:
    - built in a process launched as one of several (`WORLD_SIZE` > 1, as torchrun and `accelerate
      launch` set it) before `torch.distributed.init_process_group`: it would be world size 1 on
      every rank, each training on every pack (`DistributedSampler` raises there too);
    - iterated through a loader that Accelerate has sharded (`accelerator.prepare(loader)`, and so
      HF `Trainer`): the loader deals each rank's batches out again, and the ranks together train
      on 1/world_size of the epoch. Either leave the loader out of `prepare`, or let Accelerate shard
      alone with `PackedSampler(dataset, rank=0, world_size=1)`.

    `state_dict()` records the epoch and how many packs of its order the job has used: JSON-
    serialisable, the same on every rank. After `load_state_dict`, the next iteration deals out the
    packs not used yet, over this sampler's ranks, which may be more or fewer than when it was saved:
    each pack of the epoch is trained on once either way. torchdata's `StatefulDataLoader` saves and
    loads this state by itself, at the batch the training loop last received, workers and prefetch
    included. A plain DataLoader with workers draws indices ahead of the loop; there, pass
    `consumed=` (indices this rank's loop trained on since the epoch began or the sampler was
    resumed) to save the loop's position.
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
        self._distributed_default = world_size is None
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_samples = self.size // self.world_size if drop_last else math.ceil(self.size / self.world_size)
        self.epoch = 0
        self._start = 0  # packs of the epoch's order used before this pass began (a resumed run's)
        self._position = 0  # indices of this pass handed out so far, on this rank
        self._resume_pending = False  # the next iteration continues after _start instead of from 0

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order; setting the epoch a loaded state is in keeps its position."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self._start, self._position, self._resume_pending = epoch, 0, 0, False

    def __iter__(self) -> Iterator[int]:
        """The epoch from its beginning, as DistributedSampler; right after `load_state_dict`, the rest."""
        self._refuse_wrong_world()
        if not self._resume_pending:
            self._start = 0
        self._position, self._resume_pending = 0, False
        return self._iterate(self._pass_indices())

    def _iterate(self, indices: np.ndarray) -> Iterator[int]:
        for position, index in enumerate(indices.tolist(), start=1):
            self._position = position  # counted before the yield: state_dict() sees this index as used
            yield index

    def _pass_indices(self) -> np.ndarray:
        """This rank's indices for the packs of the epoch from `_start` on, dealt round-robin."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        rest = order[self._start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif padding := -len(rest) % self.world_size:
            # DistributedSampler's padding: the first packs of the epoch again (repeated if fewer).
            rest = np.concatenate([rest, np.resize(order, padding)])
        return rest[self.rank :: self.world_size]

    def state_dict(self, consumed: int | None = None) -> dict[str, int | bool]:
        """Where the job is: JSON-serialisable, for a checkpoint. See the class docstring for `consumed`."""
        position = self._position if consumed is None else consumed
        if not 0 <= position <= (length := len(self._pass_indices())):
            raise ValueError(f"consumed must be in [0, {length}], got {consumed}")
        used = min(self._start + position * self.world_size, self.size)  # padding is not a pack of its own
        return {"epoch": self.epoch, "used": used, **self._identity()}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume from `state_dict()` of any rank; refuses a state from another dataset size or order."""
        if "used" not in state:
            raise ValueError(f"not a PackedSampler state of this version (keys: {sorted(state)}).")
        mismatched = [key for key, value in self._identity().items() if state.get(key) != value]
        if mismatched:
            details = ", ".join(f"{key} {state.get(key)!r} (now {getattr(self, key)!r})" for key in mismatched)
            raise ValueError(f"the sampler state is for another setup: {details}; its order would not match.")
        if not 0 <= state["used"] <= self.size:
            raise ValueError(f"used {state['used']} is out of range for {self.size} packs")
        self.epoch, self._start, self._position = int(state["epoch"]), int(state["used"]), 0
        self._resume_pending = True

    def _identity(self) -> dict[str, int | bool]:
        """What must be the same for a saved count to mean the same packs (the world size need not)."""
        return {"size": self.size, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def _refuse_wrong_world(self) -> None:
        """Raise where the ranks together would not train on each pack once (see the class docstring)."""
        if self._distributed_default and _distributed_world_size() not in (None, self.world_size):
            raise RuntimeError(
                f"PackedSampler was built before torch.distributed was initialised, as world size "
                f"{self.world_size}, and the job now has {_distributed_world_size()} ranks: every rank would "
                "train on the same packs. Build it after init_process_group (or Accelerator())."
            )
        if self.world_size > 1 and (wrapper := _accelerate_sharding()) is not None:
            raise RuntimeError(
                f"PackedSampler already gives rank {self.rank} its 1/{self.world_size} of the packs, and "
                f"Accelerate's {wrapper} shards the loader again: the ranks would train on 1/{self.world_size} "
                "of the epoch. Leave the DataLoader out of accelerator.prepare() (move batches with "
                ".to(accelerator.device)), or build PackedSampler(dataset, rank=0, world_size=1) and let "
                "Accelerate shard."
            )


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size is None and _distributed_world_size() is None and launched > 1:
        raise RuntimeError(
            f"This process is one of {launched} (WORLD_SIZE), but torch.distributed is not initialised: "
            "PackedSampler would be world size 1 and every rank would train on the same packs. Build it "
            "after init_process_group (or Accelerator()), or pass rank= and world_size=."
        )
    distributed = _distributed_world_size() is not None
    if world_size is None:
        world_size = torch.distributed.get_world_size() if distributed else 1
    if rank is None:
        rank = torch.distributed.get_rank() if distributed else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank} and world_size {world_size}")
    return rank, world_size


def _distributed_world_size() -> int | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return None


def _accelerate_sharding() -> str | None:
    """The Accelerate wrapper that is iterating this sampler for several processes, if any.

    Accelerate shards a prepared loader by wrapping its batch sampler (`BatchSamplerShard`) or by
    iterating it on rank 0 and scattering the batches (`DataLoaderDispatcher`); the sampler is given no
    sign of either, so look for them among the frames that are iterating it right now.
    """
    module = sys.modules.get("accelerate.data_loader")
    if module is None:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, module.BatchSamplerShard) and owner.num_processes > 1:
            return "BatchSamplerShard"
        if isinstance(owner, module.DataLoaderDispatcher) and owner.state.num_processes > 1:
            return "DataLoaderDispatcher"
        frame = frame.f_back
    return None
