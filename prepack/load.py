"""Load a build for training: a map-style torch `Dataset` over the shards, and a resumable sampler.

`PackedDataset` memory-maps each shard when a row of it is first asked for and serves rows as
read-only numpy views into the map: nothing is copied or decoded until the collator pads the batch.
Every shard passes `check_shard` before any of its rows is served, because the offsets in a file from
elsewhere end up indexing GPU memory.

`PackedSampler` is `DistributedSampler` with a cursor: (epoch, position) says exactly which indices
this rank has left, so a job stopped mid-epoch resumes with the same remaining packs in the same order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset, Sampler

from prepack.errors import FormatError
from prepack.format import (
    Manifest,
    check_shard,
    list_column,
    open_shard,
    read_manifest,
    shard_file_problems,
    shard_sha256,
)

__all__ = ["PackedDataset", "PackedSampler", "open_hf_dataset"]

# Columns served per row; the per-document bookkeeping columns stay in the file.
_ROW_COLUMNS = ("input_ids", "cu_seqlens", "segment_ids")

_ListColumn = tuple[np.ndarray, np.ndarray]  # (offsets, values): row r is values[offsets[r]:offsets[r + 1]]


class PackedDataset(Dataset):
    """The packs of a build directory, in stored order, as dicts of int32 numpy arrays.

    A row is `{"input_ids": [n], "cu_seqlens": [k + 1], "segment_ids": [n], "labels": [n]}` (labels only
    when the build has them): read-only views of the memory-mapped shard, except `segment_ids`, stored
    in 16 bits and widened into a copy (torch has few uint16 kernels). Shards are opened on first use,
    in each DataLoader worker separately: pickling the dataset carries paths, never memory maps.

    `validate` (default) checks the manifest against the directory (shard names, sizes, row counts)
    now and each shard's contents with `check_shard` when it is first opened. `verify_checksums` also
    hashes each shard against the manifest's sha256 on first open; off by default because hashing
    reads the whole file, which a memory map otherwise avoids. Problems raise `FormatError`.
    """

    def __init__(self, path: str | os.PathLike, *, validate: bool = True, verify_checksums: bool = False):
        self.path = Path(path)
        self.manifest: Manifest = read_manifest(self.path)
        self.validate = validate
        self.verify_checksums = verify_checksums
        if validate:
            _check_directory(self.path, self.manifest)
        self._row_ends = np.cumsum([shard.rows for shard in self.manifest.shards], dtype=np.int64)
        self._open: dict[int, dict[str, _ListColumn]] = {}

    @property
    def shard_paths(self) -> list[Path]:
        return [self.path / shard.name for shard in self.manifest.shards]

    def __len__(self) -> int:
        return int(self._row_ends[-1]) if len(self._row_ends) else 0

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard, row = self._locate(index)
        columns = self._columns(shard)
        packed = {name: values[offsets[row] : offsets[row + 1]] for name, (offsets, values) in columns.items()}
        packed["segment_ids"] = packed["segment_ids"].astype(np.int32, copy=False)
        return packed

    def __getstate__(self) -> dict[str, Any]:
        # Workers reopen (and recheck) shards themselves; a memory map does not survive pickling anyway.
        return {**self.__dict__, "_open": {}}

    def check_all(self) -> None:
        """Open and check every shard now instead of on first use."""
        for shard in range(len(self.manifest.shards)):
            self._columns(shard)

    def _locate(self, index: int) -> tuple[int, int]:
        """Global pack index → (shard, row in shard)."""
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"pack {index} is out of range for {size} packs")
        index %= size
        shard = int(np.searchsorted(self._row_ends, index, "right"))
        first_row = int(self._row_ends[shard]) - self.manifest.shards[shard].rows
        return shard, index - first_row

    def _columns(self, shard: int) -> dict[str, _ListColumn]:
        if shard not in self._open:
            self._open[shard] = _list_columns(self._open_checked(shard))
        return self._open[shard]

    def _open_checked(self, shard: int) -> pa.RecordBatch:
        info = self.manifest.shards[shard]
        path = self.path / info.name
        if self.verify_checksums and (digest := shard_sha256(path)) != info.sha256:
            raise FormatError(f"{path}: sha256 {digest} does not match the manifest's {info.sha256}.")
        batch = open_shard(path, self.manifest.has_labels, self.manifest.options.max_len)
        if self.validate:
            if batch.num_rows != info.rows:
                raise FormatError(f"{path}: {batch.num_rows} rows, but the manifest says {info.rows}.")
            check_shard(batch, self.manifest.options.max_len, str(path))
        return batch


def _check_directory(path: Path, manifest: Manifest) -> None:
    """What the manifest promises about the files, checked with `stat` only (no shard is read)."""
    if (problem := next(shard_file_problems(path, manifest), None)) is not None:
        raise FormatError(f"{path / problem.file}: {problem.message}")
    rows = sum(info.rows for info in manifest.shards)
    if rows != manifest.totals.packs:
        raise FormatError(f"{path}: the shards hold {rows} packs, but the manifest totals say {manifest.totals.packs}.")


def _list_columns(batch: pa.RecordBatch) -> dict[str, _ListColumn]:
    """Zero-copy (offsets, values) views of the served list columns."""
    names = [*_ROW_COLUMNS, *(["labels"] if "labels" in batch.schema.names else [])]
    return {name: list_column(batch, name) for name in names}


def open_hf_dataset(path: str | os.PathLike, *, validate: bool = True, verify_checksums: bool = False):
    """The build as one Hugging Face `datasets.Dataset` (memory-mapped, numpy format) for trainers that
    only take those, such as TRL's `SFTTrainer`. Every shard is checked first, as `PackedDataset` would.

    Rows hold the same columns as `PackedDataset` rows; `datasets` hands them out as int64 copies.
    """
    from datasets import Dataset as HFDataset, concatenate_datasets

    packed = PackedDataset(path, validate=validate, verify_checksums=verify_checksums)
    if validate or verify_checksums:
        packed.check_all()
    parts = [HFDataset.from_file(str(shard)) for shard in packed.shard_paths]
    columns = [*_ROW_COLUMNS, *(["labels"] if packed.manifest.has_labels else [])]
    return concatenate_datasets(parts).select_columns(columns).with_format("numpy")


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
