"""Load a build for training: a map-style torch `Dataset` over the shards (the sampler is `prepack.training.sampler`).

`PackedDataset` memory-maps each shard when a row of it is first asked for and serves rows as
read-only numpy views into the map: nothing is copied or decoded until the collator pads the batch.
Every shard passes `check_shard` before any of its rows is served, because the offsets in a file from
elsewhere end up indexing GPU memory; and only the build's own regular files are opened (`shard_path`,
`open_shard`), so a manifest cannot point the loader at another file, a pipe or a device.

An index build (`Manifest.store`) holds no token: its rows are gathered from the document store it
names (`open_build_store` refuses a store whose fingerprint changed), one copy per pack by one numba
kernel call (`prepack.sources.gather.IndexGather`) that checks every reference it follows, and come out identical to the
rows of the full build of that store with the same options. `open_hf_dataset` writes them once as
full shards (`_gathered_shards`), so that `datasets` works on a real Arrow table there too.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prepack.storage.cache import ShardCache, cache_directory
from prepack.errors import FormatError, InputError, PackIndexError, optional_imports
from prepack.formats.common import list_column
from prepack.formats.reference import ReferenceLogps
from prepack.formats.shards import (
    DESIRABLE,
    FORMAT_VERSION,
    GROUP_RANKS,
    GROUP_SCORES,
    PAIR_ROLES,
    Manifest,
    check_index_shard,
    check_shard,
    check_shard_sha256,
    open_shard,
    pack_layout,
    read_manifest,
    shard_file_problems,
    segment_id_type,
    shard_path,
    shard_sha256,
)
from prepack.storage.remote import is_uri
from prepack.sources.gather import IndexGather, index_columns
from prepack.sources.mixture_stores import StoreChain, open_mixture_stores
from prepack.sources.store import Store, open_build_store
from prepack.storage.files import record_batch_sha256, write_record_batch

with optional_imports("PackedDataset"):
    from torch.utils.data import Dataset

__all__ = ["PackedDataset", "open_hf_dataset"]

# Columns served per row; the per-document bookkeeping columns stay in the file.
_ROW_COLUMNS = ("input_ids", "cu_seqlens", "segment_ids")

_ListColumn = tuple[np.ndarray, np.ndarray]  # (offsets, values): row r is values[offsets[r]:offsets[r + 1]]


class PackedDataset(Dataset):
    """The packs of a build directory, in stored order, as dicts of int32 numpy arrays.

    A row is `{"input_ids": [n], "cu_seqlens": [k + 1], "segment_ids": [n], "labels": [n]}` (labels only
    when the build has them): read-only views of the memory-mapped shard, except `segment_ids`, stored
    in 16 bits and widened into a copy (torch has few uint16 kernels); a mixture's rows also carry
    `source_ids` [k], each document's source (uint16, numbered as `manifest.mixture.sources`), which
    `PackedCollator(source_ids=True)` passes on; a pair or group build's carry `pair_roles` [k], and a group
    build's read with scores or ranks `group_scores` [k] float64 and `group_ranks` [k] uint8, each completion's
    value, which `PackedCollator` hands on per group. Shards are opened on first use,
    in each DataLoader worker separately: pickling the dataset carries paths, never memory maps.

    `validate` (default) checks the manifest against the directory (shard names, sizes, row counts)
    now and each shard's contents with `check_shard` when it is first opened. `verify_checksums` also
    hashes each shard against the manifest's sha256 on first open; off by default because hashing
    reads the whole file, which a memory map otherwise avoids. Problems raise `FormatError`.

    `path` may be a URI (`s3://bucket/packed`, needs `prepack-llm[s3]`): each shard is then downloaded into
    `cache_dir` on first use and checked against the manifest's sha256 before it is mapped; processes
    sharing `cache_dir` download it once (`prepack.storage.cache`).

    On an index build the store is opened now (`open_build_store`): the one its manifest names, inside
    the build's parent directory, or `store`, a local directory, for a store that moved since; and each of its shards is checked
    in full (sha256, contents) when a pack first needs it; a row's input_ids, labels and segment_ids
    are new arrays, gathered by one kernel call per pack, which checks every document's (row, piece)
    against the store's document and, `validate` or not, every index value it reads before using it.

    `reference`: the directory of a preference-pair build's stored reference log-probabilities
    (`prepack.training.reference.write_reference_logps`), complete and of this build; each row then also
    holds `reference_logps` [k] float64, one per document, checked (rows, values per pack, finite; with
    `verify_checksums` the sha256) when its shard is first opened.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        validate: bool = True,
        verify_checksums: bool = False,
        cache_dir: str | os.PathLike | None = None,
        store: str | os.PathLike | None = None,
        reference: str | os.PathLike | None = None,
    ):
        # A build in object storage (a URI): its shards are downloaded into `cache_dir` on first use,
        # size and sha256 checked, then served as a local build's (`prepack.storage.cache`).
        self.cache = ShardCache(path, cache_dir) if is_uri(path) else None
        self.path = Path(path) if self.cache is None else path
        self.manifest: Manifest = read_manifest(self.path) if self.cache is None else self.cache.manifest
        self.validate = validate
        self.verify_checksums = verify_checksums
        if validate and self.cache is None:
            _check_directory(self.path, self.manifest)
        self._row_ends = np.cumsum([shard.rows for shard in self.manifest.shards], dtype=np.int64)
        self._open: dict[int, dict[str, _ListColumn]] = {}
        # A preference-pair build's stored reference log-probabilities, served per pack (`prepack.training.reference`).
        self.reference = None if reference is None else ReferenceLogps(reference, self.manifest)
        self.store: Store | StoreChain | None = None
        if self.manifest.index_of is None and store is not None:
            raise InputError(f"{path} is a full build; it reads no store (leave out store=).")
        if self.manifest.mixture is not None and self.manifest.mixture.index_only:
            if store is not None or self.cache is not None:
                raise InputError(
                    f"{path} is a mixture's index build: it reads the stores its manifest names, beside it, in a local "
                    "directory (no store=, no URI); build the mixture in full to move it or read it from object storage."
                )
            self.store = open_mixture_stores(self.path, self.manifest)
        elif self.manifest.store is not None:
            local = self.cache is None or store is not None
            self.store = open_build_store(self.path, self.manifest, store) if local else self.cache.store()
        if self.store is not None:
            index_shards = [f"{self.path}/{info.name}" for info in self.manifest.shards]  # self.path: a directory or a URI
            self._gather = IndexGather(self.store, self.manifest.options.max_len, index_shards)
        else:
            self._gather = None

    @property
    def shard_paths(self) -> list[Path]:
        """The shards' local files; for a build in object storage, their cached copies (downloaded now
        if need be)."""
        if self.cache is not None:
            return [self.cache.shard(info) for info in self.manifest.shards]
        return [shard_path(self.path, index, info) for index, info in enumerate(self.manifest.shards)]

    def __len__(self) -> int:
        return int(self._row_ends[-1]) if len(self._row_ends) else 0

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard, row = self._locate(index)
        columns = self._columns(shard)
        if self.store is not None:
            return self._gathered(shard, row, columns)
        packed = {
            name: values[offsets[row] : offsets[row + 1]]
            for name, (offsets, values) in columns.items()
            if name != "source_rows"  # opened for `source_rows` only
        }
        packed["segment_ids"] = packed["segment_ids"].astype(np.int32, copy=False)
        return packed

    def source_rows(self, index: int) -> np.ndarray:
        """The corpus rows of pack `index`'s documents, in pack order (its `source_rows`)."""
        shard, row = self._locate(index)
        offsets, values = self._columns(shard)["source_rows"]
        return values[offsets[row] : offsets[row + 1]]

    def __getstate__(self) -> dict[str, Any]:
        # Workers reopen (and recheck) shards themselves; a memory map does not survive pickling anyway.
        return {**self.__dict__, "_open": {}}  # `IndexGather` drops its store maps itself

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
        """An index build's pack: its documents' tokens (and labels) copied out of the store, in order
        (`IndexGather.pack`)."""
        ids, labels, segment_ids = self._gather.pack(columns, row, shard)
        cu_off, cu = columns["cu_seqlens"]
        packed = {"input_ids": ids, "cu_seqlens": cu[cu_off[row] : cu_off[row + 1]], "segment_ids": segment_ids}
        if labels is not None:
            packed["labels"] = labels
        for name in ("source_ids", PAIR_ROLES, "reference_logps"):  # a mixture's; a pair build's; stored reference log-probabilities
            if name in columns:
                offsets, values = columns[name]
                packed[name] = values[offsets[row] : offsets[row + 1]]
        return packed

    def _locate(self, index: int) -> tuple[int, int]:
        """Global pack index → (shard, row in shard)."""
        size = len(self)
        if not -size <= index < size:
            raise PackIndexError(f"pack {index} is out of range for {size} packs")
        index %= size
        shard = int(np.searchsorted(self._row_ends, index, "right"))
        first_row = int(self._row_ends[shard]) - self.manifest.shards[shard].rows
        return shard, index - first_row

    def _columns(self, shard: int) -> dict[str, _ListColumn]:
        if shard not in self._open:
            batch, where = self._open_checked(shard), self.manifest.shards[shard].name
            names = index_columns(batch) if self.store is not None else [*_row_columns(batch), "source_rows"]
            columns = {name: list_column(batch, name, where) for name in names}
            if self.reference is not None:  # a value per document of each pack, checked against cu_seqlens
                documents = np.diff(columns["cu_seqlens"][0]).astype(np.int64) - 1
                columns["reference_logps"] = self.reference.shard(shard, documents, check_sha256=self.verify_checksums)
            self._open[shard] = columns
        return self._open[shard]

    def _open_checked(self, shard: int) -> pa.RecordBatch:
        info = self.manifest.shards[shard]
        path = shard_path(self.path, shard, info) if self.cache is None else self.cache.shard(info)
        where = str(path) if self.cache is None else self.cache.name(info)  # a cached copy is named by its URI
        if self.verify_checksums and self.cache is None:
            check_shard_sha256(path, info)
        index_only = self.store is not None
        m = self.manifest
        batch = m.open_shard(path, where)
        if self.validate:
            if batch.num_rows != info.rows:
                raise FormatError(f"{where}: {batch.num_rows} rows, but the manifest says {info.rows}.")
            (check_index_shard if index_only else check_shard)(batch, m.options.max_len, where)
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
    return [*_ROW_COLUMNS, *(name for name in ("labels", "source_ids", PAIR_ROLES, GROUP_SCORES, GROUP_RANKS, DESIRABLE)
                             if name in batch.schema.names)]


def open_hf_dataset(
    path: str | os.PathLike,
    *,
    validate: bool = True,
    verify_checksums: bool = False,
    cache_dir: str | os.PathLike | None = None,
    store: str | os.PathLike | None = None,
    reference: str | os.PathLike | None = None,
):
    """The build as one Hugging Face `datasets.Dataset` (numpy format) for trainers that only take those,
    such as TRL's `SFTTrainer` and `DPOTrainer`. Every shard is checked first, as `PackedDataset` would (with
    `validate=False`, still its file and schema: `datasets` then maps a full build's shards unchecked).

    Rows hold the same columns as `PackedDataset` rows, as int64 arrays (`datasets` hands out a full
    build's rows as int64 copies): input_ids, cu_seqlens, segment_ids, labels when the build has them, and a
    preference-pair build's pair_roles, and a group build's group_scores (Python floats, float64 as stored: the
    numpy format would make them float32) and group_ranks when it was built with them (and an unpaired build's
    desirable, one label an example).
    The dataset's `info.description` names the build's max_len (and cap), for `PackedCollator.for_dataset`.

    `reference`: a preference-pair build's stored reference log-probabilities, as `PackedDataset` takes
    them (`ReferenceLogps`: of this build and complete, else FormatError; every file checked against its
    shard now). Each row then also holds `reference_logps`, its pack's values, exactly `PackedDataset`'s:
    each shard's reference file, an Arrow stream with a row per pack, is mapped as it is and joined beside
    the packs served from that shard (`check_all` has checked it against the shard). The column is left out of the
    numpy format, whose floats are float32: a row's values are Python floats, float64 as stored (a `map`
    under the numpy or torch format rounds them to float32 too; map over `with_format(None)` instead).

    A full build's shards are memory-mapped as they are. An index build's packs are gathered from the
    store once and written, as full shards of at most `_ROWS_FILE_BYTES` each (memory stays bounded by
    one), into `cache_dir/rows` (default: the `datasets` cache, `HF_DATASETS_CACHE/prepack-rows`), where
    later calls and other ranks find them: each file is named by the sha256 of the index shard it comes
    from, the store's fingerprint and its first pack, and is written whole under a temporary name before
    it takes that name. So the dataset is a real Arrow-backed one, as a full build's is, and everything
    `datasets` offers (`map`, `filter`, `ds["input_ids"]`, `with_format("torch")`, …) works on it the same
    way, at the cost of the full build's disk space. A reused file is checked as a full build's shard is
    (`validate`); by default it is not hashed, so a file rewritten in the cache with other valid rows would
    be served. With `verify_checksums` its packs are gathered again from the store (in memory, one file at
    a time: the cost of the first gather, less the write) and the file's sha256 must be theirs, else
    FormatError names it (delete it to gather it again): its record is the build and its store, never a
    note in the cache, which could be rewritten with it.

    A build at a URI is read through `cache_dir`, as `PackedDataset` reads it: a full build's rows are
    then mapped from the cached copies of its shards, which must stay there while the dataset is used.
    """
    with optional_imports("open_hf_dataset"):
        from datasets import Dataset as HFDataset, DatasetInfo, concatenate_datasets

    packed = PackedDataset(path, validate=validate, verify_checksums=verify_checksums, cache_dir=cache_dir, store=store,
                           reference=reference)
    if packed.manifest.mixture is not None and packed.manifest.mixture.index_only:
        raise InputError(
            f"{path} is a mixture's index build, which open_hf_dataset does not gather (its shards would need the "
            "sources' column): use PackedDataset, or build the mixture in full."
        )
    packed.check_all()  # and, with a reference, each of its files against its shard
    pairs = packed.manifest.options.pairs
    optional = {"labels": packed.manifest.has_labels, PAIR_ROLES: packed.manifest.pairs is not None,
                GROUP_SCORES: pairs is not None and pairs.scores_column is not None,
                GROUP_RANKS: pairs is not None and pairs.ranks_column is not None,
                DESIRABLE: packed.manifest.options.unpaired}
    columns = [*_ROW_COLUMNS, *(name for name, present in optional.items() if present)]
    # numpy's format makes floats float32: a group build's scores stay out of it, Python floats, float64 as stored.
    numeric = [name for name in columns if name != GROUP_SCORES]
    files = packed.shard_paths if packed.store is None else _gathered_shards(packed, _rows_directory(cache_dir))
    options = packed.manifest.options
    cap = "" if options.max_docs_per_pack is None else _HF_CAP.format(cap=options.max_docs_per_pack)
    info = DatasetInfo(description=_HF_DESCRIPTION.format(max_len=options.max_len, cap=cap))
    dataset = concatenate_datasets([HFDataset.from_file(str(file), info=info) for file in files]).select_columns(columns)
    if packed.reference is None and GROUP_SCORES not in columns:
        return dataset.with_format("numpy")
    dataset = dataset if packed.reference is None else _with_reference(dataset, packed.reference)
    return dataset.with_format("numpy", columns=numeric, output_all_columns=True)  # reference_logps, group_scores: float64


# What `open_hf_dataset` writes into a dataset's `info.description`, read back by `hf_dataset_options`.
_HF_DESCRIPTION = "Packs of a prepack build, max_len {max_len}{cap}."
_HF_CAP = ", max_docs_per_pack {cap}"
_HF_OPTIONS = re.compile(r"Packs of a prepack build, max_len (\d+)(?:, max_docs_per_pack (\d+))?\.")
# The most bytes of tokens, labels and segment ids that one gathered file of an index build holds.
_ROWS_FILE_BYTES = 64 << 20


def hf_dataset_options(dataset) -> tuple[int | None, int | None]:
    """The max_len and max_docs_per_pack (None without a cap) of the build a `datasets.Dataset` from
    `open_hf_dataset` holds (kept through `map`, `select`, `with_format`, …, which carry `info` along), or
    (None, None) for any other dataset."""
    match = _HF_OPTIONS.search(dataset.info.description or "")
    if match is None:
        return None, None
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


def _rows_directory(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return cache_directory(cache_dir) / "rows"
    from datasets import config

    return Path(config.HF_DATASETS_CACHE) / "prepack-rows"


def _with_reference(dataset, reference: ReferenceLogps):
    """`dataset`, a build's packs in order, with each pack's stored reference values beside it as
    `reference_logps`: the reference files, an Arrow stream a build shard with a row per pack (each
    checked against its shard by `check_all`), mapped as they are, in shard order."""
    from datasets import Dataset as HFDataset, concatenate_datasets

    parts = [HFDataset.from_file(str(reference.directory / file.name)) for file in reference.manifest.files]
    values = concatenate_datasets(parts).rename_column("logps", "reference_logps")
    return concatenate_datasets([dataset, values], axis=1)


def _gathered_shards(packed: PackedDataset, directory: Path) -> list[Path]:
    """An index build's packs as full shards in `directory`, each gathered and written unless a file
    of its name is there already, and opened and checked as a full build's shard before it is used."""
    manifest, store_fingerprint = packed.manifest, packed.manifest.store.fingerprint
    has_labels, max_len = manifest.has_labels, manifest.options.max_len
    pairs = None if manifest.options.pairs is None else manifest.options.pairs.size
    bytes_per_token = 8 + (4 if has_labels else 0) + segment_id_type(max_len).byte_width
    per_file = max(1, _ROWS_FILE_BYTES // (bytes_per_token * max_len))
    files = []
    for shard, (info, index_file) in enumerate(zip(manifest.shards, packed.shard_paths)):
        # A local index shard is hashed here (a few bytes a document); a cached one was on download.
        digest = info.sha256 if packed.cache is not None else shard_sha256(index_file)
        for first in range(0, info.rows, per_file):
            stop = min(first + per_file, info.rows)
            key = hashlib.sha256(f"{FORMAT_VERSION} {digest} {store_fingerprint} {first} {stop}".encode()).hexdigest()
            file = directory / f"{key}.arrow"
            if not file.exists():
                _write_gathered(_gathered_batch(packed, shard, first, stop), file)
            elif packed.verify_checksums:  # checked against the store, the only record a rewrite cannot reach
                expected, found = record_batch_sha256(_gathered_batch(packed, shard, first, stop)), shard_sha256(file)
                if found != expected:
                    raise FormatError(
                        f"{file}: not the packs gathered from the store (packs {first}-{stop - 1} of {packed.path}/"
                        f"{info.name}): its sha256 is {found}, theirs {expected}; the cached file changed after it was "
                        "gathered. Delete it to gather it again."
                    )
            batch = open_shard(file, has_labels, max_len, where=str(file), pairs=pairs)
            if batch.num_rows != stop - first:
                raise FormatError(f"{file}: {batch.num_rows} rows, but packs {first}-{stop - 1} of "
                                  f"{packed.path}/{info.name} are {stop - first}.")
            if packed.validate:
                check_shard(batch, max_len, str(file))
            files.append(file)
    return files


def _gathered_batch(packed: PackedDataset, shard: int, first: int, stop: int) -> pa.RecordBatch:
    """Packs `first` to `stop` of index shard `shard`, gathered, as one full shard's record batch."""
    return packed._gather.batch(packed._columns(shard), first, stop, shard)


def _write_gathered(batch: pa.RecordBatch, file: Path) -> None:
    """`batch` (`_gathered_batch`) written to `file`."""
    file.parent.mkdir(parents=True, exist_ok=True)
    # Written whole under a name of its own, then renamed: a reader (another rank) never maps a part.
    partial = file.with_name(f".{file.name}.{os.getpid()}-{threading.get_ident()}.partial")
    try:
        write_record_batch(partial, batch)
        os.replace(partial, file)
    finally:
        partial.unlink(missing_ok=True)

