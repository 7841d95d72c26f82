"""Load a build for training: a map-style torch `Dataset` over the shards (the sampler is `prepack.sample`).

`PackedDataset` memory-maps each shard when a row of it is first asked for and serves rows as
read-only numpy views into the map: nothing is copied or decoded until the collator pads the batch.
Every shard passes `check_shard` before any of its rows is served, because the offsets in a file from
elsewhere end up indexing GPU memory; and only the build's own regular files are opened (`shard_path`,
`open_shard`), so a manifest cannot point the loader at another file, a pipe or a device.

An index build (`Manifest.store`) holds no token: its rows are gathered from the document store it
names (`open_build_store` refuses a store whose fingerprint changed), one copy per pack, and come out
identical to the rows of the full build of that store with the same options.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from torch.utils.data import Dataset

from prepack.cache import ShardCache
from prepack.errors import FormatError, InputError
from prepack.format import (
    Manifest,
    check_index_shard,
    check_shard,
    list_column,
    open_shard,
    pack_layout,
    read_manifest,
    shard_file_problems,
    shard_path,
    shard_sha256,
)
from prepack.remote import is_uri
from prepack.store_read import Store, open_build_store

__all__ = ["PackedDataset", "open_hf_dataset"]

# Columns served per row; the per-document bookkeeping columns stay in the file.
_ROW_COLUMNS = ("input_ids", "cu_seqlens", "segment_ids")
# What an index shard's rows are gathered from.
_INDEX_COLUMNS = ("cu_seqlens", "source_rows", "source_pieces")

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

    `path` may be a URI (`s3://bucket/packed`, needs `prepack[s3]`): each shard is then downloaded into
    `cache_dir` on first use and checked against the manifest's sha256 before it is mapped; processes
    sharing `cache_dir` download it once (`prepack.cache`).

    On an index build the store is opened now (`open_build_store`) and each of its shards is checked
    in full (sha256, contents) when a pack first needs it; every document's (row, piece) is checked
    against the store's document as its tokens are gathered.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        validate: bool = True,
        verify_checksums: bool = False,
        cache_dir: str | os.PathLike | None = None,
    ):
        # A build in object storage (a URI): its shards are downloaded into `cache_dir` on first use,
        # size and sha256 checked, then served as a local build's (`prepack.cache`).
        self.cache = ShardCache(path, cache_dir) if is_uri(path) else None
        self.path = Path(path) if self.cache is None else path
        self.manifest: Manifest = read_manifest(self.path) if self.cache is None else self.cache.manifest
        self.validate = validate
        self.verify_checksums = verify_checksums
        if validate and self.cache is None:
            _check_directory(self.path, self.manifest)
        self._row_ends = np.cumsum([shard.rows for shard in self.manifest.shards], dtype=np.int64)
        self._open: dict[int, dict[str, _ListColumn]] = {}
        self.store: Store | None = None
        if self.manifest.store is not None:
            self.store = open_build_store(self.path, self.manifest) if self.cache is None else self.cache.store()
        if self.store is not None:
            self._store_ends = np.cumsum([s.documents for s in self.store.manifest.shards], dtype=np.int64)
            self._store_open: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    @property
    def shard_paths(self) -> list[Path]:
        return [shard_path(self.path, index, info) for index, info in enumerate(self.manifest.shards)]

    def __len__(self) -> int:
        return int(self._row_ends[-1]) if len(self._row_ends) else 0

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard, row = self._locate(index)
        columns = self._columns(shard)
        if self.store is not None:
            return self._gathered(shard, row, columns)
        packed = {name: values[offsets[row] : offsets[row + 1]] for name, (offsets, values) in columns.items()}
        packed["segment_ids"] = packed["segment_ids"].astype(np.int32, copy=False)
        return packed

    def __getstate__(self) -> dict[str, Any]:
        # Workers reopen (and recheck) shards themselves; a memory map does not survive pickling anyway.
        return {**self.__dict__, "_open": {}, **({"_store_open": {}} if self.store is not None else {})}

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

    def _gathered(self, shard: int, row: int, columns: dict[str, _ListColumn]) -> dict[str, np.ndarray]:
        """An index build's pack: its documents' tokens (and labels) copied out of the store, in order."""
        cu_off, cu = columns["cu_seqlens"]
        cu_seqlens = cu[cu_off[row] : cu_off[row + 1]]
        lengths = np.diff(cu_seqlens).astype(np.int64)
        (row_off, rows), (_, pieces) = columns["source_rows"], columns["source_pieces"]
        rows, pieces = rows[row_off[row] : row_off[row + 1]], pieces[row_off[row] : row_off[row + 1]]
        max_len = self.manifest.options.max_len
        ids_parts, label_parts = [], []
        for number, (document, piece, length) in enumerate(zip(rows.tolist(), pieces.tolist(), lengths.tolist())):
            store_shard = int(np.searchsorted(self._store_ends, document, "right"))
            if not 0 <= document < (int(self._store_ends[-1])):
                self._refuse(shard, row, "source_rows", f"document {number + 1} is store document {document}; "
                             f"the store has {int(self._store_ends[-1])}.")
            offsets, ids, labels = self._store_shard(store_shard)
            local = document - int(self._store_ends[store_shard] - self.store.manifest.shards[store_shard].documents)
            first = int(offsets[local]) + piece * max_len
            if first + length > offsets[local + 1]:
                self._refuse(shard, row, "source_pieces", f"document {number + 1} (store document {document}, piece "
                             f"{piece}, {length} tokens) runs past that document's {offsets[local + 1] - offsets[local]} tokens.")
            ids_parts.append(ids[first : first + length])
            if labels is not None:
                label_parts.append(labels[first : first + length])
        packed = {
            "input_ids": np.concatenate(ids_parts),
            "cu_seqlens": cu_seqlens,
            "segment_ids": np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths),
        }
        if self.store.manifest.has_labels:
            packed["labels"] = np.concatenate(label_parts)
        return packed

    def _refuse(self, shard: int, row: int, column: str, message: str) -> None:
        path = f"{self.path}/{self.manifest.shards[shard].name}"  # self.path: a directory or a URI
        raise FormatError(f"{path}: row {row}, column {column!r}: {message}")

    def _store_shard(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if index not in self._store_open:
            self._store_open[index] = self.store.shard_columns(self.store.manifest.shards[index])
        return self._store_open[index]

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
            batch, where = self._open_checked(shard), self.manifest.shards[shard].name
            names = _INDEX_COLUMNS if self.store is not None else _row_columns(batch)
            self._open[shard] = {name: list_column(batch, name, where) for name in names}
        return self._open[shard]

    def _open_checked(self, shard: int) -> pa.RecordBatch:
        info = self.manifest.shards[shard]
        path = shard_path(self.path, shard, info) if self.cache is None else self.cache.shard(info)
        if self.verify_checksums and self.cache is None and (digest := shard_sha256(path)) != info.sha256:
            raise FormatError(f"{path}: sha256 {digest} does not match the manifest's {info.sha256}.")
        index_only = self.store is not None
        batch = open_shard(path, self.manifest.has_labels, self.manifest.options.max_len, self.manifest.store_documents)
        if self.validate:
            if batch.num_rows != info.rows:
                raise FormatError(f"{path}: {batch.num_rows} rows, but the manifest says {info.rows}.")
            (check_index_shard if index_only else check_shard)(batch, self.manifest.options.max_len, str(path))
        return batch


def _check_directory(path: Path, manifest: Manifest) -> None:
    """What the manifest promises about the files, checked with `stat` only (no shard is read)."""
    if (problem := next(shard_file_problems(path, manifest), None)) is not None:
        raise FormatError(f"{path / problem.file}: {problem.message}")
    rows = sum(info.rows for info in manifest.shards)
    if rows != manifest.totals.packs:
        raise FormatError(f"{path}: the shards hold {rows} packs, but the manifest totals say {manifest.totals.packs}.")


def _row_columns(batch: pa.RecordBatch) -> list[str]:
    """The list columns a full shard serves (as zero-copy views)."""
    return [*_ROW_COLUMNS, *(["labels"] if "labels" in batch.schema.names else [])]


def open_hf_dataset(path: str | os.PathLike, *, validate: bool = True, verify_checksums: bool = False):
    """The build as one Hugging Face `datasets.Dataset` (memory-mapped, numpy format) for trainers that
    only take those, such as TRL's `SFTTrainer`. Every shard is checked first, as `PackedDataset` would
    (with `validate=False`, still its file and schema: `datasets` then maps it unchecked).

    Rows hold the same columns as `PackedDataset` rows; `datasets` hands them out as int64 copies.
    """
    from datasets import Dataset as HFDataset, concatenate_datasets

    packed = PackedDataset(path, validate=validate, verify_checksums=verify_checksums)
    if packed.store is not None:
        raise InputError(
            f"{path} is an index build: open_hf_dataset reads full builds only (for now); use PackedDataset, "
            "or build the store without --index-only."
        )
    packed.check_all()
    parts = [HFDataset.from_file(str(shard)) for shard in packed.shard_paths]
    columns = [*_ROW_COLUMNS, *(["labels"] if packed.manifest.has_labels else [])]
    return concatenate_datasets(parts).select_columns(columns).with_format("numpy")
