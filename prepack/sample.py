"""`PackedSampler`: which packs each rank trains on, in which order, and where a resumed run picks up.

It is `DistributedSampler` with a cursor over the whole job: every epoch is one permutation of the
packs, drawn from (seed, epoch) alone, dealt round-robin to the ranks. The ranks of a job step
together, so after each rank has drawn c indices the packs used are exactly the first `c · world_size`
of the epoch's order: the state records that prefix, and a resumed job deals out the rest of the
epoch over however many ranks it now has.

With `balance="attention"` the order dealt out is the epoch's permutation regrouped within windows of
steps for this world size and batch size (`prepack.balance`), so the used prefix depends on the world
size it was dealt for. The state then also records the job's passes over the epoch, `[start, world
size, batch size]` each: the order of a pass is the packs used before its start, then the rest of the
epoch's permutation balanced for its world and batch size. A run resumed on the same world and batch
size continues its pass exactly; one on another deals the rest of the epoch, rebalanced, as a new pass.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sized
from typing import Literal

import numpy as np

from prepack.balance import DEFAULT_TOKEN_COST, balanced_order, epoch_order, pack_costs
from prepack.errors import optional_imports

with optional_imports("PackedSampler"):
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

    `balance="attention"` (with `batch_size`, the DataLoader's, and `drop_last=True`) evens out the
    ranks' work in every step: each rank's consecutive `batch_size` indices are its micro-batch of a
    step, and the packs are regrouped, only within windows of `prepack.balance.WINDOW_STEPS` (64)
    consecutive steps, so that the ranks' costs in each step are as equal as possible. A pack's cost
    is Σ l² over its documents plus `token_cost` × its tokens (default and its derivation in
    `prepack.balance`; 0 balances attention alone), read from the build's `cu_seqlens` (no token is
    read), so `dataset_or_len` must be a `PackedDataset`. The epoch is still one seeded shuffle, each
    pack once across the ranks; the state also records the world and batch sizes the epoch was dealt
    for, and a run resumed on others rebalances the rest of the epoch (module docstring).
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
        batch_size: int | None = None,
        balance: Literal["attention"] | None = None,
        token_cost: float = DEFAULT_TOKEN_COST,
    ):
        self.size = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        self._distributed_default = world_size is None
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.balance = balance
        self.token_cost = float(token_cost)
        self._costs = self._pack_costs(dataset_or_len) if balance is not None else None
        self.num_samples = self.size // self.world_size if drop_last else math.ceil(self.size / self.world_size)
        self.epoch = 0
        self._start = 0  # packs of the epoch's order used before this pass began (a resumed run's)
        self._position = 0  # indices of this pass handed out so far, on this rank
        self._resume_pending = False  # the next iteration continues after _start instead of from 0
        self._passes = self._first_pass()  # balanced only: [start, world_size, batch_size] of each pass
        self._pass_cache: tuple[tuple, np.ndarray] | None = None  # the last balanced pass order, by its key

    def _pack_costs(self, dataset: Sized | int) -> np.ndarray:
        if self.balance != "attention":
            raise ValueError(f"balance must be 'attention' or None, not {self.balance!r}")
        if self.batch_size is None or self.batch_size < 1:
            raise ValueError(f"balance needs batch_size (the DataLoader's), at least 1; got {self.batch_size}")
        if not self.drop_last:
            raise ValueError("balance needs drop_last=True: repeating packs to fill the last step would unbalance it")
        if not hasattr(dataset, "document_lengths"):
            raise TypeError(
                f"balance reads each pack's document lengths from a PackedDataset, not a {type(dataset).__name__}"
            )
        shards = dataset.document_lengths()
        return np.concatenate([np.empty(0), *(pack_costs(documents, lengths, self.token_cost) for documents, lengths in shards)])

    def _first_pass(self) -> list[list[int]]:
        return [[0, self.world_size, self.batch_size]] if self.balance is not None else []

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order; setting the epoch a loaded state is in keeps its position."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self._start, self._position, self._resume_pending = epoch, 0, 0, False
            self._passes = self._first_pass()

    def __iter__(self) -> Iterator[int]:
        """The epoch from its beginning, as DistributedSampler; right after `load_state_dict`, the rest."""
        self._refuse_wrong_world()
        if not self._resume_pending:
            self._start, self._passes = 0, self._first_pass()
        self._position, self._resume_pending = 0, False
        return self._iterate(self._pass_indices())

    def _iterate(self, indices: np.ndarray) -> Iterator[int]:
        for position, index in enumerate(indices.tolist(), start=1):
            self._position = position  # counted before the yield: state_dict() sees this index as used
            yield index

    def _pass_indices(self) -> np.ndarray:
        """This rank's indices for the packs of the epoch from `_start` on, dealt round-robin."""
        if self.balance is not None:
            return self._balanced_pass()[self._start :][self.rank :: self.world_size]
        order = epoch_order(self.size, self.seed, self.epoch, self.shuffle)
        rest = order[self._start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif padding := -len(rest) % self.world_size:
            # DistributedSampler's padding: the first packs of the epoch again (repeated if fewer).
            rest = np.concatenate([rest, np.resize(order, padding)])
        return rest[self.rank :: self.world_size]

    def _balanced_pass(self) -> np.ndarray:
        """The current pass's order of the epoch: the packs used before it began, then the rest balanced.

        Replays the job's passes: each one's start counts packs of the order before it; the rest of the
        epoch's permutation, cut to a multiple of the pass's world size, is balanced for its sizes.
        """
        key = (self.epoch, tuple(map(tuple, self._passes)))
        if self._pass_cache is not None and self._pass_cache[0] == key:  # state_dict() asks for it on every save
            return self._pass_cache[1]
        order = epoch_order(self.size, self.seed, self.epoch, self.shuffle)
        used = np.zeros(self.size, dtype=bool)
        pass_order = order[:0]
        for start, world_size, batch_size in self._passes:
            before = pass_order[:start]
            used[before] = True
            rest = order[~used[order]]
            rest = rest[: len(rest) - len(rest) % world_size]
            balanced = balanced_order(rest, self._costs, world_size, batch_size, [self.seed, self.epoch, start])
            pass_order = np.concatenate([before, balanced])
        self._pass_cache = (key, pass_order)
        return pass_order

    def state_dict(self, consumed: int | None = None) -> dict[str, int | bool]:
        """Where the job is: JSON-serialisable, for a checkpoint. See the class docstring for `consumed`."""
        position = self._position if consumed is None else consumed
        if not 0 <= position <= (length := len(self._pass_indices())):
            raise ValueError(f"consumed must be in [0, {length}], got {consumed}")
        used = min(self._start + position * self.world_size, self.size)  # padding is not a pack of its own
        state = {"epoch": self.epoch, "used": used, **self._identity()}
        if self.balance is not None:
            state["passes"] = [list(entry) for entry in self._passes]
        return state

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume from `state_dict()` of any rank; refuses a state from another dataset size or order."""
        if "used" not in state:
            raise ValueError(f"not a PackedSampler state of this version (keys: {sorted(state)}).")
        identity = {"balance": None, "token_cost": None} | self._identity()  # a balanced state is another order
        mismatched = [key for key, value in identity.items() if state.get(key) != value]
        if mismatched:
            details = ", ".join(f"{key} {state.get(key)!r} (now {getattr(self, key)!r})" for key in mismatched)
            raise ValueError(f"the sampler state is for another setup: {details}; its order would not match.")
        if not 0 <= state["used"] <= self.size:
            raise ValueError(f"used {state['used']} is out of range for {self.size} packs")
        self.epoch, self._start, self._position = int(state["epoch"]), int(state["used"]), 0
        self._resume_pending = True
        if self.balance is not None:
            self._passes = self._resumed_passes(state.get("passes"), self._start)

    def _resumed_passes(self, passes: object, used: int) -> list[list[int]]:
        """The saved passes, and a new one from `used` on when this sampler's sizes differ."""
        valid = (
            isinstance(passes, list)
            and len(passes) > 0
            and all(isinstance(p, list) and len(p) == 3 and all(type(v) is int for v in p) for p in passes)
            and passes[0][0] == 0
            and all(a[0] <= b[0] for a, b in zip(passes, passes[1:]))
            and passes[-1][0] <= used
            and all(p[1] >= 1 and p[2] >= 1 for p in passes)
        )
        if not valid:
            raise ValueError(f"passes {passes!r} are not [start, world_size, batch_size] lists starting at 0 up to used")
        passes = [list(p) for p in passes]
        sizes = [self.world_size, self.batch_size]
        if passes[-1][1:] != sizes:
            if passes[-1][0] == used:  # nothing was trained in that pass: replace it
                passes[-1][1:] = sizes
            else:
                passes.append([used, *sizes])
        return passes

    def _identity(self) -> dict[str, int | bool]:
        """What must be the same for a saved count to mean the same packs (the world size need not)."""
        identity = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}
        if self.balance is not None:  # a state without balancing stays as it always was
            identity |= {"balance": self.balance, "token_cost": self.token_cost}
        return identity

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
