"""Read a document store: check it against its manifest, then stream its documents as a build reads a
corpus's (`prepack.read.DocumentBatch`, one corpus file at a time), so a build never tokenizes again.

Every store is untrusted: the manifest is validated strictly, every shard must be a regular file of
the manifest's size and sha256, and each shard's one record batch is validated in full (offsets inside
their buffers, ids non-negative, labels valid) before a value is used.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from prepack.errors import FormatError
from prepack.format import MANIFEST_NAME, Manifest
from prepack.read import Corpus, DocumentBatch
from prepack.store_format import (
    STORE_MANIFEST_NAME,
    StoreManifest,
    StoreShard,
    check_store_files,
    check_store_shard,
    read_store_manifest,
)

__all__ = ["Store", "check_build_store", "is_store", "open_build_store", "open_store"]


def is_store(path: str | os.PathLike) -> bool:
    """Whether `path` is meant as a document store: a directory holding `store.json` (which
    `open_store` then validates)."""
    path = Path(path)
    return path.is_dir() and os.path.lexists(path / STORE_MANIFEST_NAME)


@dataclass(frozen=True)
class Store:
    """A document store whose manifest and shard files (names, sizes) have been checked."""

    root: Path
    manifest: StoreManifest
    location: str | None = None  # the store's URI when it lies in object storage: its files are named by it

    @property
    def corpus(self) -> Corpus:
        """The corpus the store was made from, its files named inside the store (at `location` when
        set): builds record the same `inputs` as a build of that corpus, and their errors name a
        corpus file and row."""
        corpus = Corpus(root=self.root, files=tuple(self.root / f.path for f in self.manifest.inputs))
        return corpus if self.location is None else corpus.located(self.location)

    def documents(self) -> Iterator[DocumentBatch]:
        """The documents in row order, each shard's sha256 and contents checked before its first
        document is yielded, cut at the corpus files' boundaries. The arrays are views of the
        memory-mapped shards."""
        files, rows = self.corpus.files, [f.rows for f in self.manifest.inputs]
        file, row = 0, 0  # the corpus file of the next document, and its row there
        for shard in self.manifest.shards:
            offsets, ids, labels = self.shard_columns(shard)
            start = 0
            while start < shard.documents:
                while row == rows[file]:
                    file, row = file + 1, 0
                end = min(shard.documents, start + rows[file] - row)
                first, last = offsets[start], offsets[end]
                yield DocumentBatch(
                    file=files[file],
                    first_row=row,
                    offsets=offsets[start : end + 1] - first,
                    ids=ids[first:last],
                    labels=None if labels is None else labels[first:last],
                )
                row += end - start
                start = end

    def shard_file(self, shard: StoreShard) -> Path:
        """The local file of one of the store's shards."""
        return self.root / shard.name

    def shard_columns(self, shard: StoreShard) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(token offsets as int64, token ids, labels or None) of one of the store's shards, views of
        its memory map, after its sha256 and contents are checked: document d of the shard is
        ids[offsets[d]:offsets[d + 1]]."""
        path = self.shard_file(shard)
        try:
            with pa.memory_map(str(path)) as source:
                data = source.read_buffer()
            if hashlib.sha256(data).hexdigest() != shard.sha256:
                raise FormatError(f"{path}: its sha256 is not the store manifest's: the shard changed.")
            batches = list(pa.ipc.open_stream(data))
            if len(batches) != 1:
                raise FormatError(f"{path}: a store shard holds exactly one record batch, this one {len(batches)}.")
            batches[0].validate(full=True)
        except (OSError, pa.ArrowException) as exc:
            raise FormatError(f"{path}: not a readable Arrow IPC stream ({exc}).") from None
        batch = batches[0]
        check_store_shard(batch, shard, self.manifest.has_labels, str(path))
        labels = batch.column("labels").values.to_numpy() if self.manifest.has_labels else None
        ids = batch.column("input_ids")
        return ids.offsets.to_numpy().astype(np.int64), ids.values.to_numpy(), labels


def open_store(path: str | os.PathLike, location: str | None = None) -> Store:
    """Read and check a store's manifest and its shard files' names, types and sizes (the contents
    are checked as `Store.documents` reads them); `location`: the URI `path` is a copy of. Raises
    FormatError."""
    root = Path(path)
    manifest = read_store_manifest(root)
    check_store_files(root, manifest)
    return Store(root, manifest, location)


def open_build_store(build: str | os.PathLike, manifest: Manifest) -> Store:
    """The document store of the index build at `build` (whose manifest is `manifest`), opened by
    `open_store` and refused unless it is the store the build was planned from: same fingerprint,
    labels as the build's. Raises FormatError."""
    reference = manifest.store
    if reference is None:
        raise ValueError(f"{build} is a full build; it has no store")
    where = Path(build) / MANIFEST_NAME
    root = Path(build) / reference.path
    if not is_store(root):
        raise FormatError(
            f"{where}: its document store {reference.path!r} ({root}) is not there: an index build reads its "
            "tokens from that store; keep both where they were built, or move them together."
        )
    return check_build_store(open_store(root), build, manifest)


def check_build_store(store: Store, build: str | os.PathLike, manifest: Manifest) -> Store:
    """`store`, refused (FormatError) unless it is the store the index build at `build` (whose manifest
    is `manifest`) was planned from: same fingerprint, labels as the build's."""
    reference = manifest.store
    if store.manifest.fingerprint != reference.fingerprint or store.manifest.has_labels != manifest.has_labels:
        raise FormatError(
            f"{store.location or store.root}: the store's fingerprint is {store.manifest.fingerprint}, but the index "
            f"build {build} was planned from {reference.fingerprint}: the store changed; build the index again."
        )
    return store
