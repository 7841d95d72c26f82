"""Load a build for training: a map-style torch `Dataset` over the shards (the sampler is `prepack.sample`).

`PackedDataset` memory-maps each shard when a row of it is first asked for and serves rows as
read-only numpy views into the map: nothing is copied or decoded until the collator pads the batch.
Every shard passes `check_shard` before any of its rows is served, because the offsets in a file from
elsewhere end up indexing GPU memory; and only the build's own regular files are opened (`shard_path`,
`open_shard`), so a manifest cannot point the loader at another file, a pipe or a device.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from torch.utils.data import Dataset

from prepack.errors import FormatError
from prepack.format import (
    Manifest,
    check_shard,
    list_column,
    open_shard,
    pack_layout,
    read_manifest,
    shard_file_problems,
    shard_path,
    shard_sha256,
)

__all__ = ["PackedDataset", "open_hf_dataset"]

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
        return [shard_path(self.path, index, info) for index, info in enumerate(self.manifest.shards)]

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

    def document_lengths(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Per shard, in order: (documents of each pack, every document's length in pack order), int32,
        from `cu_seqlens` alone (shards opened and checked as for serving rows; no token page is touched)."""
        for shard in range(len(self.manifest.shards)):
            layout = pack_layout(*self._columns(shard)["cu_seqlens"])
            yield layout.documents.astype(np.int32), layout.lengths.astype(np.int32)

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
            self._open[shard] = _list_columns(self._open_checked(shard), self.manifest.shards[shard].name)
        return self._open[shard]

    def _open_checked(self, shard: int) -> pa.RecordBatch:
        info = self.manifest.shards[shard]
        path = shard_path(self.path, shard, info)
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


def _list_columns(batch: pa.RecordBatch, where: str) -> dict[str, _ListColumn]:
    """Zero-copy (offsets, values) views of the served list columns."""
    names = [*_ROW_COLUMNS, *(["labels"] if "labels" in batch.schema.names else [])]
    return {name: list_column(batch, name, where) for name in names}


def open_hf_dataset(path: str | os.PathLike, *, validate: bool = True, verify_checksums: bool = False):
    """The build as one Hugging Face `datasets.Dataset` (memory-mapped, numpy format) for trainers that
    only take those, such as TRL's `SFTTrainer`. Every shard is checked first, as `PackedDataset` would
    (with `validate=False`, still its file and schema: `datasets` then maps it unchecked).

    Rows hold the same columns as `PackedDataset` rows; `datasets` hands them out as int64 copies.
    """
    from datasets import Dataset as HFDataset, concatenate_datasets

    packed = PackedDataset(path, validate=validate, verify_checksums=verify_checksums)
    packed.check_all()
    parts = [HFDataset.from_file(str(shard)) for shard in packed.shard_paths]
    columns = [*_ROW_COLUMNS, *(["labels"] if packed.manifest.has_labels else [])]
    return concatenate_datasets(parts).select_columns(columns).with_format("numpy")
