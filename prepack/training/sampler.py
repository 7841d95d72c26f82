"""`PackedSampler`: which packs each rank trains on, in which order, and where a resumed run picks up.

It is `DistributedSampler` with a cursor over the whole job: every epoch is one permutation of the
packs, drawn from (seed, epoch) alone, dealt round-robin to the ranks. The ranks of a job step
together, so after each rank has drawn c indices the packs used are exactly the first `c · world_size`
of the epoch's order: the state records that prefix, and a resumed job deals out the rest of the
epoch over however many ranks it now has.

With `balance="attention"` the order dealt out is the epoch's permutation regrouped within windows of
steps for this world size and batch size (`prepack.building.balance`), so the used prefix depends on the world
size it was dealt for. The state then also records the job's passes over the epoch, `[start, world
size, batch size]` each: the order of a pass is the packs used before its start, then the rest of the
epoch's permutation balanced for its world and batch size. A run resumed on the same world and batch
size continues its pass exactly; one on another deals the rest of the epoch, rebalanced, as a new pass.
A balanced epoch is dealt over the packs it began with: resumed on a build grown by appends (`grown`), its
passes replay over the old packs alone, and the new ones join from the next epoch.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sized
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prepack.building.balance import (
    DEFAULT_TOKEN_COST,
    MAX_TOKEN_COST,
    balanced_order,
    epoch_order,
    pack_costs,
    validated_token_cost,
)
from prepack.errors import ArgumentTypeError, DistributedSetupError, SamplerStateError, UsageError, optional_imports

with optional_imports("PackedSampler"):
    import torch
    from torch.utils.data import Sampler

__all__ = ["MAX_PASSES", "PackedSampler"]

# Passes a balanced state may record. Each is a resume onto other world or batch sizes within one epoch,
# and every iteration replays them all (O(packs) each): the bound keeps a hostile state's cost small.
MAX_PASSES = 64
_INT_MAX = 2**63 - 1
_SIZE_MAX = 2**20  # a pass's world size and batch size: 64 steps of R·B packs stay far inside int64


_Pass = Annotated[list[Annotated[int, Field(ge=0, le=_INT_MAX)]], Field(min_length=3, max_length=3)]  # start, R, B


class _State(BaseModel):
    """A `PackedSampler.state_dict()`, validated as strictly as a manifest before any value is used:
    exact types (no bool for an int, no string or float for a count), bounded ints, finite token_cost,
    no unknown key; `balance`, `token_cost` and `passes` together or not at all."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    epoch: int = Field(ge=0, le=_INT_MAX)
    used: int = Field(ge=0, le=_INT_MAX)
    size: int = Field(ge=0, le=_INT_MAX)
    seed: int = Field(ge=0, le=_INT_MAX)
    shuffle: bool
    drop_last: bool
    balance: Literal["attention"] | None = None
    token_cost: float | None = Field(default=None, ge=0, le=MAX_TOKEN_COST, allow_inf_nan=False)
    passes: list[_Pass] | None = Field(default=None, min_length=1, max_length=MAX_PASSES)
    # The epoch's earlier pack counts, when the build grew by appends while it ran (`PackedSampler`'s
    # "Growing builds"): strictly rising, each below `size`. Absent from a state of a build that did not.
    # A balanced epoch is dealt over the first of them alone.
    grown: list[Annotated[int, Field(ge=1, le=_INT_MAX)]] | None = Field(default=None, min_length=1, max_length=MAX_PASSES)

    @model_validator(mode="after")
    def _consistent(self) -> _State:  # ValueError is how a pydantic validator fails: SamplerStateError below
        if self.used > self.size:
            raise ValueError(f"used {self.used} is more than the {self.size} packs")
        if self.grown is not None and (any(a >= b for a, b in zip(self.grown, [*self.grown[1:], self.size]))):
            raise ValueError(f"grown {self.grown} must rise strictly, below size {self.size}")
        balanced = self.balance is not None
        if (self.token_cost is not None) != balanced or (self.passes is not None) != balanced:
            raise ValueError("balance, token_cost and passes come together (a balanced state) or not at all")
        if balanced:
            starts = [start for start, _, _ in self.passes]
            if starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])) or starts[-1] > self.used:
                raise ValueError(f"passes must start at 0 and rise strictly up to used {self.used}, not at {starts}")
            if not all(1 <= world <= _SIZE_MAX and 1 <= batch <= _SIZE_MAX for _, world, batch in self.passes):
                raise ValueError(f"passes {self.passes}: each world and batch size must be in [1, {_SIZE_MAX}]")
        return self


def _validated_state(state: object) -> _State:
    """The state as `_State`, or SamplerStateError naming each field that is wrong."""
    try:
        return _State.model_validate(state)
    except ValidationError as exc:
        problems = "; ".join(
            ": ".join(filter(None, [".".join(map(str, error["loc"])), error["msg"].removeprefix("Value error, ")]))
            for error in exc.errors()[:5]
        )
        raise SamplerStateError(f"not a PackedSampler state this version can resume from: {problems}.") from None


class PackedSampler(Sampler[int]):
    """Pack indices for one rank, shuffled per epoch, with an exact mid-epoch resume point.

    Same contract as `torch.utils.data.DistributedSampler`: every rank gets `len(self)` indices, dealt
    round-robin from one epoch order, so the ranks' slices are disjoint; unless `drop_last` (which
    leaves out the last `len % world_size`), a few indices from the start of the epoch are dealt again
    so that all ranks have as many. `rank` and `world_size` default to torch.distributed's.

    It refuses (DistributedSetupError), when built and again before the first index, the ways a job
    silently trains on the wrong packs or unsynchronised models:
    - in a process launched as one of several (`WORLD_SIZE` > 1, as torchrun and `accelerate
      launch` set it) without `torch.distributed.init_process_group`, with `rank` or `world_size` (or
      both) left to default: it would be rank 0 or world size 1 on every process, each training on
      the same packs (`DistributedSampler` raises there too);
    - under an `Accelerator` that set up fewer processes than the process group has (without GPUs,
      `Accelerator()` under torchrun initialises the group, then reports one process and wraps no
      model in DDP): each rank would train a model of its own on its share (`Accelerator(cpu=True)`
      uses the group);
    - iterated through a loader that Accelerate has sharded (`accelerator.prepare(loader)`, and so
      HF `Trainer`): the loader deals each rank's batches out again, and the ranks together train
      on 1/world_size of the epoch. Either leave the loader out of `prepare`, or let Accelerate shard
      alone with `PackedSampler(dataset, rank=0, world_size=1)`.

    `state_dict()` records the epoch and how many packs of its order the job has used: JSON-
    serialisable, the same on every rank. `load_state_dict` validates a state strictly (exact types,
    bounded values, at most `MAX_PASSES` passes) and raises SamplerStateError (a ValueError) for one
    that is malformed or for another setup, before anything changes. After `load_state_dict`, the
    next iteration deals out the packs not used yet, over this sampler's ranks, which may be more or
    fewer than when it was saved: each pack of the epoch is trained on once either way. torchdata's
    `StatefulDataLoader` saves and loads this state by itself, at the batch the training loop last
    received, workers and prefetch included. A plain DataLoader with workers draws indices ahead of
    the loop; there, pass `consumed=` (indices this rank's loop trained on since the epoch began or
    the sampler was resumed) to save the loop's position.

    `balance="attention"` (with `batch_size`, the DataLoader's, and `drop_last=True`) evens out the
    ranks' work in every step: each rank's consecutive `batch_size` indices are its micro-batch of a
    step, and the packs are regrouped, only within windows of `prepack.building.balance.WINDOW_STEPS` (64)
    consecutive steps, so that the ranks' costs in each step are as equal as possible. A pack's cost
    is Σ l² over its documents plus `token_cost` × its tokens (default and its derivation in
    `prepack.building.balance`; 0 balances attention alone), read from the build's `cu_seqlens` (no token is
    read), so `dataset_or_len` must be a `PackedDataset`. The epoch is still one seeded shuffle, each
    pack once across the ranks; the state also records the world and batch sizes the epoch was dealt
    for, and a run resumed on others rebalances the rest of the epoch (module docstring).

    Growing builds: a build grown by appends (`prepack build STORE --out DIR --append`) is one dataset
    whose old packs keep their indices and whose new packs come after them. A state saved before the
    append loads into a sampler over the grown `PackedDataset` (its manifest's `generations` must end a
    generation where the state's packs end): the rest of the saved epoch is its order over the old packs,
    from where it stopped, then the new packs in a seeded shuffle of their own (`grown` in the state), so
    no old pack is repeated or skipped and every new pack is trained once; the next epoch shuffles all.
    A balanced sampler (`balance`) resumes across an append too, by another rule: the rest of the saved epoch
    is dealt over the old packs alone, step for step as it would have been without the append (rebalanced,
    on other world or batch sizes, as any resume), and the new packs join from the next epoch, which deals
    every pack once (a state saved before the epoch dealt its first pack begins it on every pack). Its steps
    were balanced over the old packs, the last of them possibly short: new packs after it would shift every
    later step against the loader's batches, so none of them would be balanced.
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
        self._defaulted = _defaulted(rank, world_size)
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        if seed < 0:
            raise UsageError(f"seed must be non-negative, got {seed}")
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.balance = balance
        self.token_cost = validated_token_cost(token_cost)
        self._costs = self._pack_costs(dataset_or_len) if balance is not None else None
        # Where the build's generations end (a build grown by appends), so that a state saved on its
        # earlier packs can resume over the grown build; none for a dataset given by its length.
        generations = getattr(getattr(dataset_or_len, "manifest", None), "generations", None) or []
        self._generation_ends = {g.packs for g in generations}
        self._grown: list[int] = []  # this epoch's earlier pack counts, after resuming on a grown build
        self.num_samples = self.size // self.world_size if drop_last else math.ceil(self.size / self.world_size)
        self.epoch = 0
        self._start = 0  # packs of the epoch's order used before this pass began (a resumed run's)
        self._position = 0  # indices of this pass handed out so far, on this rank
        self._resume_pending = False  # the next iteration continues after _start instead of from 0
        self._passes = self._first_pass()  # balanced only: [start, world_size, batch_size] of each pass
        self._pass_cache: tuple[tuple, np.ndarray] | None = None  # the last balanced pass order, by its key

    def _pack_costs(self, dataset: Sized | int) -> np.ndarray:
        if self.balance != "attention":
            raise UsageError(f"balance must be 'attention' or None, not {self.balance!r}")
        if self.batch_size is None or self.batch_size < 1:
            raise UsageError(f"balance needs batch_size (the DataLoader's), at least 1; got {self.batch_size}")
        if not self.drop_last:
            raise UsageError("balance needs drop_last=True: repeating packs to fill the last step would unbalance it")
        if not hasattr(dataset, "document_lengths"):
            raise ArgumentTypeError(
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
            raise UsageError(f"epoch must be non-negative, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self._from_the_start()

    def __iter__(self) -> Iterator[int]:
        """The epoch from its beginning, as DistributedSampler; right after `load_state_dict`, the rest."""
        self._refuse_wrong_world()
        if not self._resume_pending:
            self._from_the_start()
        self._position, self._resume_pending = 0, False
        return self._iterate(self._pass_indices())

    def _from_the_start(self) -> None:
        """Deal the epoch from its beginning, on every pack: no loaded state's position, passes or earlier
        pack counts (a resumed epoch's `grown` ends with it, as its passes do)."""
        self._start, self._position, self._resume_pending = 0, 0, False
        self._passes, self._grown = self._first_pass(), []

    def _iterate(self, indices: np.ndarray) -> Iterator[int]:
        for position, index in enumerate(indices.tolist(), start=1):
            self._position = position  # counted before the yield: state_dict() sees this index as used
            yield index

    def _pass_indices(self) -> np.ndarray:
        """This rank's indices for the packs of the epoch from `_start` on, dealt round-robin."""
        if self.balance is not None:
            return self._balanced_pass(self.epoch, self._passes, self._grown)[self._start :][self.rank :: self.world_size]
        order = self._epoch_order()
        rest = order[self._start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif padding := -len(rest) % self.world_size:
            # DistributedSampler's padding: the first packs of the epoch again (repeated if fewer).
            rest = np.concatenate([rest, np.resize(order, padding)])
        return rest[self.rank :: self.world_size]

    def _epoch_order(self) -> np.ndarray:
        """The epoch's order: of all packs, or, resumed on a grown build (`_grown`), the epoch's order of
        the packs it began with, then each generation's new packs, shuffled among themselves."""
        sizes = [*self._grown, self.size]
        order = [epoch_order(sizes[0], self.seed, self.epoch, self.shuffle)]
        for low, high in zip(sizes, sizes[1:]):
            added = np.random.default_rng([self.seed, self.epoch, low]).permutation(high - low) if self.shuffle else np.arange(high - low)
            order.append(low + added)
        return np.concatenate(order)

    def _balanced_pass(self, epoch: int, passes: list[list[int]], grown: list[int]) -> np.ndarray:
        """The order of the last of `passes` in `epoch`: the packs used before it began, then the rest
        balanced.

        Replays the job's passes: each one's start counts packs of the order before it; the rest of the
        epoch's permutation, cut to a multiple of the pass's world size, is balanced for its sizes. The
        permutation is of the packs the epoch began with: the first of `grown` (the build grew since), else all.
        """
        size = grown[0] if grown else self.size
        key = (epoch, size, tuple(map(tuple, passes)))
        if self._pass_cache is not None and self._pass_cache[0] == key:  # state_dict() asks for it on every save
            return self._pass_cache[1]
        order = epoch_order(size, self.seed, epoch, self.shuffle)
        used = np.zeros(size, dtype=bool)
        pass_order = order[:0]
        for start, world_size, batch_size in passes:
            if start > len(pass_order):
                raise SamplerStateError(
                    f"a pass starts at {start}, beyond the {len(pass_order)} packs the one before deals out."
                )
            before = pass_order[:start]
            used[before] = True
            rest = order[~used[order]]
            rest = rest[: len(rest) - len(rest) % world_size]
            balanced = balanced_order(rest, self._costs, world_size, batch_size, [self.seed, epoch, start])
            pass_order = np.concatenate([before, balanced])
        self._pass_cache = (key, pass_order)
        return pass_order

    def state_dict(self, consumed: int | None = None) -> dict[str, int | bool]:
        """Where the job is: JSON-serialisable, for a checkpoint. See the class docstring for `consumed`."""
        length = len(self._pass_indices())
        position = self._position if consumed is None else consumed
        if type(position) is not int or not 0 <= position <= length:
            raise SamplerStateError(f"consumed must be an int in [0, {length}], got {consumed!r}")
        used = min(self._start + position * self.world_size, self.size)  # padding is not a pack of its own
        state = {"epoch": self.epoch, "used": used, **self._identity()}
        if self._grown:
            state["grown"] = list(self._grown)
        if self.balance is not None:
            state["passes"] = [list(entry) for entry in self._passes]
        return state

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume from `state_dict()` of any rank. Raises SamplerStateError (a ValueError) for a state that
        is malformed (`_State`) or from another dataset size or order, before anything changes."""
        saved = _validated_state(state)
        grew = self._grew_from(saved)
        grown = [*(saved.grown or []), saved.size] if grew else saved.grown or []
        if not set(grown) <= self._generation_ends:
            raise SamplerStateError(
                f"the sampler state's epoch began on {grown[0]} packs, which no generation of this dataset ends at "
                f"(its generations end at {sorted(self._generation_ends) or 'none'}): its order would not match."
            )
        if self.balance is not None and saved.used == 0:  # nothing dealt yet: the epoch begins on every pack
            grown = []
        mismatched = [key for key, value in self._identity().items() if getattr(saved, key) != value and not (key == "size" and grew)]
        if saved.balance is not None and self.balance is None:
            mismatched += ["balance", "token_cost"]  # a balanced state is another order
        if mismatched:
            details = ", ".join(f"{key} {getattr(saved, key)!r} (now {getattr(self, key)!r})" for key in mismatched)
            raise SamplerStateError(f"the sampler state is for another setup: {details}; its order would not match.")
        passes = self._resumed_passes(saved.passes, saved.used) if self.balance is not None else []
        if passes:  # replayed now, so that a pass starting beyond the packs its order deals out is refused here
            order = self._balanced_pass(saved.epoch, passes, grown)
            if saved.used > len(order) or (len(order) - saved.used) % self.world_size:
                raise SamplerStateError(
                    f"used {saved.used} is not where a step of its last pass ends (its order deals out "
                    f"{len(order)} packs, {passes[-1][1]} a step from {passes[-1][0]} on)."
                )
        self.epoch, self._start, self._position, self._passes = saved.epoch, saved.used, 0, passes
        self._grown, self._resume_pending = grown, True

    def _grew_from(self, saved: _State) -> bool:
        """Whether `saved` is a state of this build before it grew by appends: fewer packs, ending where
        one of its generations ends (see the class docstring)."""
        return saved.size < self.size and saved.size in self._generation_ends

    def _resumed_passes(self, passes: list[list[int]], used: int) -> list[list[int]]:
        """The saved passes, and a new one from `used` on when this sampler's sizes differ."""
        passes = [list(p) for p in passes]
        sizes = [self.world_size, self.batch_size]
        if passes[-1][1:] != sizes:
            if passes[-1][0] == used:  # nothing was trained in that pass: replace it
                passes[-1][1:] = sizes
            elif len(passes) == MAX_PASSES:
                raise SamplerStateError(
                    f"this resume would be the epoch's {MAX_PASSES + 1}th pass on other world or batch sizes, "
                    f"more than a state may record ({MAX_PASSES}); resume on world size {passes[-1][1]} and "
                    f"batch size {passes[-1][2]} until the epoch ends."
                )
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
        if self._defaulted:  # explicit ranks: the caller says how the job is synchronised
            self._refuse_unsynchronised_world()
        self._refuse_accelerate_sharding()

    def _refuse_unsynchronised_world(self) -> None:
        _refuse_unsynchronised_launch(self._defaulted)
        if _distributed_world_size() not in (None, self.world_size):
            raise DistributedSetupError(
                f"PackedSampler was built before torch.distributed was initialised, as world size "
                f"{self.world_size}, and the job now has {_distributed_world_size()} ranks: every rank would "
                "train on the same packs. Build it after init_process_group (or Accelerator())."
            )
        if self.world_size > 1 and (processes := _accelerate_processes()) not in (None, self.world_size):
            raise DistributedSetupError(
                f"PackedSampler deals rank {self.rank} 1/{self.world_size} of the packs, but Accelerate set up "
                f"{processes} process{'es' if processes != 1 else ''} over this process group: it wraps no model "
                "in DDP, and each rank would train a model of its own on its share. On a machine without GPUs "
                "make Accelerate use the group: Accelerator(cpu=True) (HF Trainer: use_cpu=True), or "
                "`accelerate launch --multi_gpu --num_processes N` with it; or pass rank= and world_size= "
                "for a job you synchronise yourself."
            )

    def _refuse_accelerate_sharding(self) -> None:
        if self.world_size > 1 and (wrapper := _accelerate_sharding()) is not None:
            raise DistributedSetupError(
                f"PackedSampler already gives rank {self.rank} its 1/{self.world_size} of the packs, and "
                f"Accelerate's {wrapper} shards the loader again: the ranks would train on 1/{self.world_size} "
                "of the epoch. Leave the DataLoader out of accelerator.prepare() (move batches with "
                ".to(accelerator.device)), or build PackedSampler(dataset, rank=0, world_size=1) and let "
                "Accelerate shard."
            )


def _refuse_unsynchronised_launch(defaulted: list[str]) -> None:
    """Raise when the launcher says this process is one of several (`WORLD_SIZE` > 1, as torchrun and
    `accelerate launch` set it), torch.distributed has no process group, and `defaulted` names what of rank=
    and world_size= was left to it: the ranks' models would never be synchronised, and a default rank of 0 or
    world size of 1 would train every process on the same packs."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if defaulted and launched.strip().isdigit() and int(launched) > 1 and _distributed_world_size() is None:
        this = f"; RANK {os.environ['RANK']}" if "RANK" in os.environ else ""
        defaults = {"rank": "rank 0", "world_size": "world size 1"}
        raise DistributedSetupError(
            f"This process is one of {launched} (WORLD_SIZE{this}), but torch.distributed is not initialised and "
            f"no {' or '.join(f'{name}=' for name in defaulted)} given: PackedSampler would be "
            f"{' and '.join(defaults[name] for name in defaulted)} on every process, and the ranks would train on "
            "the same packs, with no gradient synchronised. Call torch.distributed.init_process_group (or "
            "Accelerator(); without GPUs Accelerator(cpu=True)) before building and iterating it, or pass rank= "
            "and world_size= explicitly."
        )


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    _refuse_unsynchronised_launch(_defaulted(rank, world_size))
    distributed = _distributed_world_size() is not None
    if world_size is None:
        world_size = torch.distributed.get_world_size() if distributed else 1
    if rank is None:
        rank = torch.distributed.get_rank() if distributed else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"need 0 <= rank < world_size, got rank {rank} and world_size {world_size}")
    return rank, world_size


def _defaulted(rank: int | None, world_size: int | None) -> list[str]:
    """Which of rank= and world_size= were left to torch.distributed's."""
    return [name for name, value in (("rank", rank), ("world_size", world_size)) if value is None]


def _distributed_world_size() -> int | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return None


def _accelerate_processes() -> int | None:
    """How many processes Accelerate set up, once an `Accelerator` (or `PartialState`) exists; else None.

    Without GPUs, `Accelerator()` under torchrun initialises the default process group and then reports
    one process (DistributedType.NO): it wraps no model in DDP. Read from its shared state, never built.
    """
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "PartialState", None), "_shared_state", None) or {}
    return shared.get("num_processes")


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
