"""`build_store` (`prepack tokenize`): a corpus in, a document store out — its documents read and
tokenized once, as `build` would read them, and written in row order for any number of builds.

Memory stays bounded by the shard size: documents are gathered until the next would overfill the
shard, which is then written as one record batch (`prepack.write.write_record_batch`); only the
documents' lengths (for the manifest's summary) grow with the corpus.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.progress import Progress

from prepack.build import DEFAULT_SHARD_SIZE, progress_bars
from prepack.documents import Documents, Reading, open_documents
from prepack.errors import InputError
from prepack.format import STORE_MANIFEST_NAME, Fingerprint, InputFile
from prepack.output import output_errors, staged_directory
from prepack.plan import untrained_documents
from prepack.read import DocumentBatch
from prepack.remote import is_uri, local_input, staged_prefix
from prepack.store_format import (
    LengthSummary,
    StoreManifest,
    StoreShard,
    store_schema,
    store_shard_name,
    write_store_manifest,
)
from prepack.store_read import is_store
from prepack.write import write_record_batch

__all__ = ["build_store"]

_INT32_MAX = 2**31 - 1  # list<int32> offsets: the most tokens one shard holds


class _ShardWriter:
    """Gathers documents in row order and writes them as store shards of at most `shard_size` bytes
    of tokens (and labels); a document larger than that is a shard of its own. Where shards end
    depends only on the documents' lengths, never on how they arrive in batches."""

    def __init__(self, directory: Path, has_labels: bool, shard_size: int) -> None:
        self.directory, self.has_labels = directory, has_labels
        self.capacity = min(max(1, shard_size // (8 if has_labels else 4)), _INT32_MAX)
        self.pending: list[DocumentBatch] = []
        self.tokens = 0
        self.shards: list[StoreShard] = []

    def add(self, batch: DocumentBatch) -> None:
        offsets, documents = batch.offsets, len(batch.offsets) - 1
        start = 0
        while start < documents:
            # The documents that still fit this shard (none when a document alone overfilled it); a
            # shard takes at least one.
            room = self.capacity - self.tokens
            end = max(start, int(np.searchsorted(offsets, offsets[start] + room, "right")) - 1)
            if end == start and not self.pending:
                end = start + 1
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
        path = self.directory / store_shard_name(len(self.shards))
        if self.tokens > _INT32_MAX:
            first = self.pending[0]
            raise InputError(
                f"{first.file}, row {first.first_row}: {self.tokens} tokens in one document, more than a "
                f"store shard holds ({_INT32_MAX})."
            )
        lengths = np.concatenate([np.diff(p.offsets) for p in self.pending])
        offsets = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        columns = [np.concatenate([p.ids for p in self.pending]).astype(np.int32, copy=False)]
        if self.has_labels:
            columns.append(np.concatenate([p.labels for p in self.pending]).astype(np.int32, copy=False))
        arrays = [pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)) for values in columns]
        batch = pa.RecordBatch.from_arrays(arrays, schema=store_schema(self.has_labels))
        size, sha256 = write_record_batch(path, batch)
        self.shards.append(
            StoreShard(name=path.name, documents=len(lengths), tokens=self.tokens, bytes=size, sha256=sha256)
        )
        self.pending, self.tokens = [], 0


def _summary(lengths: np.ndarray, untrained: int) -> LengthSummary:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99], method="lower")
    return LengthSummary(
        min=int(lengths.min()),
        max=int(lengths.max()),
        mean=round(float(lengths.mean(dtype=np.float64)), 3),
        p50=int(p50),
        p90=int(p90),
        p99=int(p99),
        empty=int((lengths == 0).sum()),
        untrained=untrained,
    )


def _write_store(documents: Documents, directory: Path, shard_size: int, bar: Progress) -> StoreManifest:
    """Write the documents as store shards and then `store.json` into `directory`; return the manifest."""
    files = documents.corpus.files
    rows_per_file = dict.fromkeys(files, 0)
    position = {path: index for index, path in enumerate(files)}
    lengths, untrained = [], 0  # lengths as int32: 4 bytes per document, for the summary
    fingerprint = Fingerprint()
    writer = _ShardWriter(directory, documents.has_labels, shard_size)
    task = bar.add_task("store", total=len(files), unit="files")
    for batch in documents.batches:
        batch_lengths = np.diff(batch.offsets)
        fingerprint.update(batch_lengths, batch.ids, batch.labels)
        lengths.append(batch_lengths.astype(np.int32))
        untrained += int(untrained_documents(batch.offsets, batch.labels).sum())
        rows_per_file[batch.file] += len(batch_lengths)
        writer.add(batch)
        bar.update(task, completed=position[batch.file], description=f"store {batch.file.name}")
    writer.flush()
    bar.update(task, completed=len(files), description="store")
    if not writer.shards:
        raise InputError(f"{documents.corpus.root}: the corpus has no documents.")
    all_lengths = np.concatenate(lengths)
    manifest = StoreManifest(
        prepack_version=version("prepack"),
        column=documents.column,
        labels_column=documents.labels_column,
        tokenize=documents.tokenize,
        has_labels=documents.has_labels,
        fingerprint=fingerprint.hexdigest(),
        inputs=[InputFile(path=documents.corpus.name(path), rows=rows) for path, rows in rows_per_file.items()],
        documents=len(all_lengths),
        tokens=int(all_lengths.sum(dtype=np.int64)),
        lengths=_summary(all_lengths, untrained),
        shards=writer.shards,
    )
    with output_errors(directory / STORE_MANIFEST_NAME):
        write_store_manifest(directory, manifest)
    return manifest


def build_store(
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = False,
    console: Console | None = None,
    **reading: Any,
) -> StoreManifest:
    """Read (and tokenize) a corpus once into a document store under `out`, and return the store
    manifest written there. Every build of the store (`build(out, ...)`) is then byte for byte the
    build of the corpus with these reading options, without reading or tokenizing the corpus again.

    >>> build_store("chats.jsonl", "store/", tokenizer="./tok", chat=True)   # doctest: +SKIP
    >>> build("store/", "packed-8k/", max_len=8192)                           # doctest: +SKIP

    `reading` takes `build`'s reading and tokenizing options (`column`, `labels_column`, `tokenizer`,
    `chat`, `text_column`, `messages_column`, `eos`, `chat_template`, `train_on`, `num_proc`: the
    fields of `prepack.documents.Reading`); `shard_size` bounds the bytes of tokens (and labels) per
    shard. Raises `InputError` for bad input (a store given as the corpus among it), and
    `OutputError` as `build` does; in every case nothing is published.
    """
    if shard_size < 1:
        raise InputError(f"invalid shard size {shard_size}: at least 1 byte.")
    try:
        options = Reading(**reading)
    except TypeError as exc:
        raise InputError(f"invalid reading option: {exc}") from None
    with progress_bars(progress, console) as bar, local_input(corpus) as source:
        if is_store(source.spec):
            raise InputError(f"{corpus} is a document store already: build from it (prepack build {corpus} ...).")
        documents = open_documents(source.spec, options, out, bar, source.location)
        with (staged_prefix if is_uri(out) else staged_directory)(out, overwrite, STORE_MANIFEST_NAME) as staging:
            manifest = _write_store(documents, staging.build, shard_size, bar)
    return manifest
