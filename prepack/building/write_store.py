"""Writing a document store (schemas/store-format.md): where its documents are cut into shards, the
shards, and `store.json`; what every engine writes a store with (`prepack.building.engines.base`), for
`prepack.building.build.build_store` (`prepack tokenize`).

Memory stays bounded by the shard size: the local engine gathers documents until the next would
overfill the shard (`StoreShardWriter`), which is then written as one record batch
(`prepack.storage.files.write_record_batch`); only the documents' lengths (for the manifest's summary) grow
with the corpus.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np
import pyarrow as pa

from prepack.sources.documents import Documents
from prepack.building.engines.base import WrittenStore
from prepack.errors import DISTRIBUTION, InputError
from prepack.formats.common import INT32_MAX, arrow_array
from prepack.formats.shards import STORE_MANIFEST_NAME, InputFile
from prepack.storage.output import output_errors
from prepack.sources.corpus import DocumentBatch
from prepack.formats.store import (
    LengthSummary,
    StoreGeneration,
    StoreManifest,
    StoreShard,
    store_schema,
    chained_fingerprint,
    store_shard_name,
    store_version_of,
    write_store_manifest,
)
from prepack.storage.files import write_record_batch

__all__ = [
    "StoreShardWriter",
    "finish_store",
    "store_shard_bounds",
    "store_shard_capacity",
    "too_long_for_a_shard",
    "write_store_shard",
]


def store_shard_capacity(has_labels: bool, shard_size: int) -> int:
    """Tokens a store shard of `shard_size` bytes of tokens (and labels) holds, at most INT32_MAX."""
    return min(max(1, shard_size // (8 if has_labels else 4)), INT32_MAX)


def _shard_end(offsets: np.ndarray, start: int, room: int, empty: bool, group: int = 1) -> int:
    """The end of the documents from `start` (token `offsets` of consecutive documents) that the
    shard being filled takes: those that still fit its `room` tokens, in whole groups of `group`
    documents (a pair store's: `start` begins one), and at least one group when it is `empty` (a
    group larger than a shard is a shard of its own)."""
    end = max(start, int(np.searchsorted(offsets, offsets[start] + room, "right")) - 1)
    end -= (end - start) % group
    return start + group if end == start and empty else end


def store_shard_bounds(lengths: np.ndarray, capacity: int, group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The first document of every store shard, plus the end, and the token each of them starts at:
    where `StoreShardWriter` cuts the documents of `lengths`, computed from the lengths alone
    (`--engine ray` plans shards so), in whole groups of `group` documents. 8 bytes a document while it runs."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    bounds = [0]
    while bounds[-1] < len(lengths):
        bounds.append(_shard_end(offsets, bounds[-1], capacity, empty=True, group=group))
    return np.array(bounds, np.int64), offsets[bounds]


def too_long_for_a_shard(file: Path, row: int, tokens: int) -> InputError:
    return InputError(
        f"{file}, row {row}: {tokens} tokens in one document, more than a store shard holds ({INT32_MAX})."
    )


def write_store_shard(directory: Path, index: int, lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray | None) -> StoreShard:
    """Write consecutive documents (`lengths`, their `ids` and `labels` back to back) as store shard
    `index` and return its manifest entry."""
    path = directory / store_shard_name(index)
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    columns = [ids.astype(np.int32, copy=False)]
    if labels is not None:
        columns.append(labels.astype(np.int32, copy=False))
    arrays = [pa.ListArray.from_arrays(arrow_array(offsets), arrow_array(values)) for values in columns]
    batch = pa.RecordBatch.from_arrays(arrays, schema=store_schema(labels is not None))
    # A new file: an append's staging directory holds the published shards as hard links, never written through.
    size, sha256 = write_record_batch(path, batch, mode="xb")
    return StoreShard(name=path.name, documents=len(lengths), tokens=int(offsets[-1]), bytes=size, sha256=sha256)


class StoreShardWriter:
    """Gathers documents in row order and writes them as store shards of at most `shard_size` bytes
    of tokens (and labels); a document larger than that is a shard of its own. Where shards end
    depends only on the documents' lengths, never on how they arrive in batches. Shards are numbered
    from `first_shard` (an append's: after the store's). A pair store's (`group`: its G) are cut only
    between groups, which its batches hold whole."""

    def __init__(self, directory: Path, has_labels: bool, shard_size: int, first_shard: int = 0, group: int = 1) -> None:
        self.directory, self.has_labels, self.first_shard, self.group = directory, has_labels, first_shard, group
        self.capacity = store_shard_capacity(has_labels, shard_size)
        self.pending: list[DocumentBatch] = []
        self.tokens = 0
        self.shards: list[StoreShard] = []

    def add(self, batch: DocumentBatch) -> None:
        offsets, documents = batch.offsets, len(batch.offsets) - 1
        start = 0
        while start < documents:
            end = _shard_end(offsets, start, self.capacity - self.tokens, empty=not self.pending, group=self.group)
            if end > start:
                first, last = offsets[start], offsets[end]
                self.pending.append(
                    DocumentBatch(
                        file=batch.file,
                        first_row=batch.first_row + start,
                        offsets=offsets[start : end + 1] - first,
                        ids=batch.ids[first:last],
                        labels=None if batch.labels is None else batch.labels[first:last],
                    )
                )
                self.tokens += int(last - first)
            if end < documents:
                self.flush()
            start = end

    def flush(self) -> None:
        if not self.pending:
            return
        if self.tokens > INT32_MAX:
            first = self.pending[0]
            raise too_long_for_a_shard(first.file, first.first_row, self.tokens)
        lengths = np.concatenate([np.diff(p.offsets) for p in self.pending])
        ids = np.concatenate([p.ids for p in self.pending])
        labels = np.concatenate([p.labels for p in self.pending]) if self.has_labels else None
        self.shards.append(write_store_shard(self.directory, self.first_shard + len(self.shards), lengths, ids, labels))
        self.pending, self.tokens = [], 0


def _summary(counts: np.ndarray, untrained: int) -> LengthSummary:
    """The summary of documents whose lengths `counts` tallies ([length, count] rows by rising length):
    the percentiles numpy's 'lower' method gives of the lengths themselves (its index, floor(q (n - 1)),
    computed as numpy computes it), so a grown store's equals that of the store of its corpus at once."""
    documents = int(counts[:, 1].sum())
    quantiles = np.array([0.50, 0.90, 0.99])
    below = np.floor((documents - 1) * quantiles).astype(np.int64)  # numpy's index for 'lower', as numpy computes it
    p50, p90, p99 = counts[np.searchsorted(np.cumsum(counts[:, 1]), below, side="right"), 0]
    return LengthSummary(
        min=int(counts[0, 0]),
        max=int(counts[-1, 0]),
        mean=round(int((counts[:, 0] * counts[:, 1]).sum()) / documents, 3),
        p50=int(p50),
        p90=int(p90),
        p99=int(p99),
        empty=int(counts[0, 1]) if counts[0, 0] == 0 else 0,
        untrained=untrained,
    )


def _length_counts(lengths: np.ndarray) -> np.ndarray:
    """[length, count] rows by rising length (int64) of documents of `lengths`."""
    return np.stack(np.unique(lengths, return_counts=True), axis=1).astype(np.int64)


def _merged_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lengths, where = np.unique(np.concatenate([a[:, 0], b[:, 0]]), return_inverse=True)
    return np.stack([lengths, np.bincount(where, weights=np.concatenate([a[:, 1], b[:, 1]])).astype(np.int64)], axis=1)


def finish_store(
    documents: Documents,
    directory: Path,
    written: WrittenStore,
    appending: StoreManifest | None = None,
    stored_lengths: np.ndarray | None = None,
) -> StoreManifest:
    """Write `store.json` for the shards an engine wrote into `directory` and return it. With `appending`
    (the manifest of the store appended to, and `stored_lengths` its documents' lengths where it records no
    `length_counts`, for the summary), the store's shards and inputs go first, the new ones after, and a
    generation records the append."""
    if not written.shards:
        raise InputError(f"{documents.corpus.root}: the corpus has no documents.")
    inputs = [InputFile(path=documents.corpus.name(path), rows=rows) for path, rows in zip(documents.corpus.files, written.rows_per_file)]
    lengths, fingerprint, untrained, generations = written.lengths, written.fingerprint, written.untrained, None
    counts = _length_counts(lengths)
    if appending is not None:
        inputs, shards = [*appending.inputs, *inputs], [*appending.shards, *written.shards]
        stored = np.array(appending.length_counts, np.int64).reshape(-1, 2) if appending.length_counts else _length_counts(stored_lengths)
        counts = _merged_counts(stored, counts)
        fingerprint = chained_fingerprint(appending.fingerprint, written.fingerprint)
        untrained += appending.lengths.untrained
        generations = [
            *(appending.generations or [StoreGeneration(documents=appending.documents, inputs=len(appending.inputs),
                                                        shards=len(appending.shards), fingerprint=appending.fingerprint)]),
            StoreGeneration(documents=int(counts[:, 1].sum()), inputs=len(inputs), shards=len(shards), fingerprint=fingerprint),
        ]
    pairs = None if documents.pairs is None else documents.pairs.options  # an append's: the store's (`_check_same_reading`)
    manifest = StoreManifest(
        store_version=store_version_of(pairs is not None, generations is not None),
        prepack_version=version(DISTRIBUTION),
        column=documents.column,
        labels_column=documents.labels_column,
        tokenize=documents.tokenize if appending is None else appending.tokenize,  # as recorded (its tokenizer's name)
        has_labels=documents.has_labels,
        fingerprint=fingerprint,
        inputs=inputs,
        documents=int(counts[:, 1].sum()),
        tokens=int((counts[:, 0] * counts[:, 1]).sum()),
        lengths=_summary(counts, untrained),
        shards=written.shards if appending is None else shards,
        generations=generations,
        length_counts=None if generations is None else counts.tolist(),
        pairs=pairs,
    )
    with output_errors(directory / STORE_MANIFEST_NAME):
        write_store_manifest(directory, manifest)
    return manifest
