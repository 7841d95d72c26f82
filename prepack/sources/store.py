"""Read a document store: check it against its manifest, then stream its documents as a build reads a
corpus's (`prepack.sources.corpus.DocumentBatch`, one corpus file at a time), so a build never tokenizes again.

Every store is untrusted: the manifest is validated strictly and every shard must be a regular file of
the manifest's size. Where tokens are used (`Store.documents`, `Store.shard_columns`) a shard's sha256
is checked and its one record batch validated in full (offsets inside their buffers, ids non-negative,
labels valid) before a value is used. An index build needs only the documents' lengths and untrained
flags (`Store.shard_lengths`): the offsets are checked, no shard is hashed and no token id is read; of a
store of pairs or groups, its groups' prompt lengths too, from the same labels (`group_prompt_lengths`), each
document's read up to its first trained one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from prepack.errors import FormatError, InputError
from prepack.formats.common import map_regular, numpy_view, read_one_batch
from prepack.formats.shards import MANIFEST_NAME, Manifest, store_location_problem
from prepack.building import plan_vectorized
from prepack.building.plan import first_trained_labels, untrained_documents
from prepack.sources.corpus import Corpus, DocumentBatch
from prepack.storage.remote import join
from prepack.formats.store import (
    STORE_MANIFEST_NAME,
    StoreManifest,
    StoreShard,
    check_store_files,
    check_store_offsets,
    check_store_shard,
    read_store_manifest,
    store_error,
)

__all__ = ["ShardColumns", "Store", "check_build_store", "group_prompt_lengths", "is_store", "open_build_store", "open_store", "store_location"]

ShardColumns = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # `Store.shard_columns`: offsets, ids, labels


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

    def documents(self, checked: Sequence[ShardColumns] | None = None) -> Iterator[DocumentBatch]:
        """The documents in row order, each shard's sha256 and contents checked before its first
        document is yielded (unless `checked` holds every shard's `shard_columns` already, in
        order), cut at the corpus files' boundaries. The arrays are views of the memory-mapped shards."""
        files, rows = self.corpus.files, [f.rows for f in self.manifest.inputs]
        file, row = 0, 0  # the corpus file of the next document, and its row there
        for index, shard in enumerate(self.manifest.shards):
            offsets, ids, labels = self.shard_columns(shard) if checked is None else checked[index]
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

    def shard_where(self, shard: StoreShard) -> str:
        """What the problems of one of the store's shards name it by: its URI when the store lies in
        object storage (`location`), else its file (`shard_file`, which a cached store downloads)."""
        return str(self.root / shard.name) if self.location is None else f"{self.location}/{shard.name}"

    def shard_columns(self, shard: StoreShard) -> ShardColumns:
        """(token offsets as int64, token ids, labels or None) of one of the store's shards, views of
        its memory map, after its sha256 and contents are checked: document d of the shard is
        ids[offsets[d]:offsets[d + 1]]. Raises FormatError naming the shard, row and column
        (`FormatError.problem`)."""
        batch, where = self._batch(shard, whole=True)
        offsets = check_store_shard(batch, shard, self.manifest.has_labels, where)
        return offsets, numpy_view(batch.column("input_ids").values), self._labels(batch)

    def shard_labels(self, shard: StoreShard) -> tuple[np.ndarray, np.ndarray | None]:
        """(token offsets as int64, labels or None) of one of the store's shards, views of its memory map: no
        hash, no token id read. The offsets are checked (`check_store_offsets`); the tokens are checked where
        they are used (`shard_columns`)."""
        batch, where = self._batch(shard, whole=False)
        return check_store_offsets(batch, shard, self.manifest.has_labels, where), self._labels(batch)

    def shard_lengths(self, shard: StoreShard, without_numba: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(every document's length as int64, whether it is untrained: `untrained_documents`) of one
        of the store's shards, from its offsets and labels alone (`shard_labels`), and of the labels only
        each document's first up to its first trained one. `without_numba`: as `untrained_documents` takes it."""
        offsets, labels = self.shard_labels(shard)
        return np.diff(offsets), untrained_documents(offsets, labels, without_numba)

    def shard_document_lengths(self, shard: StoreShard) -> np.ndarray:
        """Every document's length (int64) of one of the store's shards, from its offsets alone,
        checked as `shard_lengths` checks them, no label read."""
        batch, where = self._batch(shard, whole=False)
        return np.diff(check_store_offsets(batch, shard, self.manifest.has_labels, where))

    def prompt_lengths(self) -> np.ndarray:
        """`group_prompt_lengths` of every shard of a store of pairs or groups (`StoreManifest.pairs`; a shard holds
        whole groups), in order, each read for them (`shard_labels`): for a store whose labels are not in hand.
        A small store's labels are read in numpy, as an index build reads them (`_index_documents`)."""
        without_numba = plan_vectorized.labels_in_numpy(self.manifest.tokens)
        return np.concatenate([
            group_prompt_lengths(*self.shard_labels(shard), self.manifest.pairs.size, self.shard_where(shard),
                                 without_numba=without_numba)
            for shard in self.manifest.shards
        ])

    def _batch(self, shard: StoreShard, whole: bool) -> tuple[pa.RecordBatch, str]:
        """(the one record batch of one of the store's shards, memory-mapped, what its problems name it
        by). Its buffers are validated: as long as their lengths say, and, when `whole`, in full
        (offsets inside their values), after the shard's sha256 is checked. Its schema is checked with
        its offsets (`check_store_offsets`)."""
        where = self.shard_where(shard)
        data = map_regular(self.shard_file(shard), "store shard", where)
        if whole and hashlib.sha256(data).hexdigest() != shard.sha256:
            raise store_error(where, "its sha256 is not the store manifest's: the shard changed.")
        batch = read_one_batch(data, "store shard", where)
        try:
            batch.validate(full=whole)
        except pa.ArrowException as exc:
            raise store_error(where, f"not valid Arrow data ({exc}).") from None
        return batch, where

    def _labels(self, batch: pa.RecordBatch) -> np.ndarray | None:
        return numpy_view(batch.column("labels").values) if self.manifest.has_labels else None


def group_prompt_lengths(
    offsets: np.ndarray, labels: np.ndarray, size: int, where: str, first_row: int = 0, without_numba: bool = False
) -> np.ndarray:
    """Every group's prompt tokens (int64, one a group in row order) of documents of a store of pairs or groups
    (whole groups of `size`), their token offsets and labels in hand: where its documents' labels start training,
    as a pair build labels them (`prepack.sources.pairs`: -100 on the prompt, the ids on the completion), each
    document's labels read only up to there (`first_trained_labels`, which takes `without_numba`). Raises
    FormatError naming `where` and the row (the first document's being `first_row`) of a document with no
    trained token, or of a group whose documents start training at different tokens (a prompt they do not share)."""
    first = first_trained_labels(offsets, labels, without_numba)
    if (none := np.flatnonzero(first == np.diff(offsets))).size:
        raise store_error(where, "a document of a pair store with no trained token (no completion).",
                          first_row + int(none[0]), "labels")
    prompts = first.reshape(-1, size)
    if (apart := np.flatnonzero((prompts != prompts[:, :1]).any(axis=1))).size:
        group = int(apart[0])
        row = first_row + size * group + int(np.flatnonzero(prompts[group] != prompts[group, 0])[0])
        raise store_error(where, f"the documents of one group start training at tokens {prompts[group].tolist()}, "
                          "but they share their prompt.", row, "labels")
    return prompts[:, 0]


def open_store(path: str | os.PathLike, location: str | None = None) -> Store:
    """Read and check a store's manifest and its shard files' names, types and sizes (the contents
    are checked as `Store.documents` reads them); `location`: the URI `path` is a copy of. Raises
    FormatError."""
    root = Path(path)
    manifest = read_store_manifest(root)
    check_store_files(root, manifest)
    return Store(root, manifest, location)


# How a user reads an index build whose store is not where its manifest says.
_MOVED_STORE = "name where the store is now (PackedDataset(build, store=...), prepack verify --store)."


def open_build_store(build: str | os.PathLike, manifest: Manifest, store: str | os.PathLike | None = None) -> Store:
    """The document store of the index build at `build` (whose manifest is `manifest`), opened by
    `open_store` and refused unless it is the store the build was planned from: same fingerprint,
    labels as the build's. The store is the one the manifest names (`StoreReference.path`), held to
    `store_location_problem` (inside the build's parent directory, through no symbolic link) before
    anything there is opened, or `store`, a local directory the caller names (a store that moved).
    Raises FormatError, or InputError for a `store` that is none."""
    reference = manifest.store
    if reference is None:
        raise ValueError(f"{build} is a full build; it has no store")
    if store is not None:
        if not is_store(store):
            raise InputError(f"{store}: not a prepack document store (no {STORE_MANIFEST_NAME}), named as the store of {build}.")
        return check_build_store(open_store(store), build, manifest)
    where = Path(build) / MANIFEST_NAME
    if (problem := store_location_problem(build, reference.path)) is not None:
        raise FormatError(f"{where}: store.path {reference.path!r} {problem}; {_MOVED_STORE}")
    root = Path(build) / reference.path
    if not is_store(root):
        raise FormatError(
            f"{where}: its document store {reference.path!r} ({root}) is not there: an index build reads its "
            f"tokens from that store; keep both where they were built, move them together, or {_MOVED_STORE}"
        )
    return check_build_store(open_store(root), build, manifest)


def store_location(build: str, manifest: Manifest) -> str:
    """The URI of the store of the index build at the URI `build`: its `store.path` (which
    `read_manifest` held to '../' and a path without '..') joined to the build's prefix. Refused
    (FormatError) for a build at a bucket's root, whose parent would be another bucket."""
    scheme, path = build.rstrip("/").split("://", 1)
    if "/" not in path:
        raise FormatError(
            f"{build}/{MANIFEST_NAME}: an index build at a bucket's root has no parent prefix to hold its store "
            f"({manifest.store.path!r} would name another bucket)."
        )
    return join(build, manifest.store.path)


def check_build_store(store: Store, build: str | os.PathLike, manifest: Manifest) -> Store:
    """`store` as it stood when the index build at `build` (whose manifest is `manifest`) was planned
    from it (`StoreManifest.at_generation`: a store appended to since keeps serving the build its first
    documents), refused (FormatError) unless it ever had the build's fingerprint and labels as the build's."""
    reference = manifest.store
    generation = store.manifest.generation_of(reference.fingerprint)
    if generation is None or store.manifest.has_labels != manifest.has_labels:
        raise FormatError(
            f"{store.location or store.root}: the store's fingerprint is {store.manifest.fingerprint}, but the index "
            f"build {build} was planned from {reference.fingerprint}: the store changed; build the index again."
        )
    return replace(store, manifest=store.manifest.at_generation(generation))
