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

from prepack.build import DEFAULT_SHARD_SIZE, check_engine, engine_session, progress_bars
from prepack.documents import Documents, Reading, open_documents
from prepack.errors import DISTRIBUTION, InputError
from prepack.format import INT32_MAX, STORE_MANIFEST_NAME, Fingerprint, InputFile, arrow_array
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


def store_shard_capacity(has_labels: bool, shard_size: int) -> int:
    """Tokens a store shard of `shard_size` bytes of tokens (and labels) holds, at most INT32_MAX."""
    return min(max(1, shard_size // (8 if has_labels else 4)), INT32_MAX)


def _shard_end(offsets: np.ndarray, start: int, room: int, empty: bool) -> int:
    """The end of the documents from `start` (token `offsets` of consecutive documents) that the
    shard being filled takes: those that still fit its `room` tokens, and at least one when it is
    `empty` (a document larger than a shard is a shard of its own)."""
    end = max(start, int(np.searchsorted(offsets, offsets[start] + room, "right")) - 1)
    return start + 1 if end == start and empty else end


def store_shard_bounds(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The first document of every store shard, plus the end, and the token each of them starts at:
    where `_ShardWriter` cuts the documents of `lengths`, computed from the lengths alone
    (`--engine ray` plans shards so). 8 bytes a document while it runs."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    bounds = [0]
    while bounds[-1] < len(lengths):
        bounds.append(_shard_end(offsets, bounds[-1], capacity, empty=True))
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
    size, sha256 = write_record_batch(path, batch)
    return StoreShard(name=path.name, documents=len(lengths), tokens=int(offsets[-1]), bytes=size, sha256=sha256)


class _ShardWriter:
    """Gathers documents in row order and writes them as store shards of at most `shard_size` bytes
    of tokens (and labels); a document larger than that is a shard of its own. Where shards end
    depends only on the documents' lengths, never on how they arrive in batches."""

    def __init__(self, directory: Path, has_labels: bool, shard_size: int) -> None:
        self.directory, self.has_labels = directory, has_labels
        self.capacity = store_shard_capacity(has_labels, shard_size)
        self.pending: list[DocumentBatch] = []
        self.tokens = 0
        self.shards: list[StoreShard] = []

    def add(self, batch: DocumentBatch) -> None:
        offsets, documents = batch.offsets, len(batch.offsets) - 1
        start = 0
        while start < documents:
            end = _shard_end(offsets, start, self.capacity - self.tokens, empty=not self.pending)
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
        self.shards.append(write_store_shard(self.directory, len(self.shards), lengths, ids, labels))
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
    all_lengths = np.concatenate(lengths) if lengths else np.empty(0, np.int32)
    rows = [rows_per_file[path] for path in files]
    return finish_store(documents, directory, rows, all_lengths, untrained, fingerprint.hexdigest(), writer.shards)


def finish_store(
    documents: Documents,
    directory: Path,
    rows_per_file: list[int],
    lengths: np.ndarray,
    untrained: int,
    fingerprint: str,
    shards: list[StoreShard],
) -> StoreManifest:
    """Write `store.json` for the `shards` written into `directory` and return it: every engine's
    last step. `lengths` are the documents', `untrained` how many have no trained token."""
    if not shards:
        raise InputError(f"{documents.corpus.root}: the corpus has no documents.")
    manifest = StoreManifest(
        prepack_version=version(DISTRIBUTION),
        column=documents.column,
        labels_column=documents.labels_column,
        tokenize=documents.tokenize,
        has_labels=documents.has_labels,
        fingerprint=fingerprint,
        inputs=[InputFile(path=documents.corpus.name(path), rows=rows) for path, rows in zip(documents.corpus.files, rows_per_file)],
        documents=len(lengths),
        tokens=int(lengths.sum(dtype=np.int64)),
        lengths=_summary(lengths, untrained),
        shards=shards,
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
    engine: str = "local",
    ray_address: str | None = None,
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
    shard. `engine` and `ray_address` as for `build`: with "ray", the store is written by Ray tasks,
    byte for byte as the local engine writes it. Raises `InputError` for bad input (a store given as the corpus among it), and
    `OutputError` as `build` does; in every case nothing is published.
    """
    if shard_size < 1:
        raise InputError(f"invalid shard size {shard_size}: at least 1 byte.")
    try:
        options = Reading(**reading)
    except TypeError as exc:
        raise InputError(f"invalid reading option: {exc}") from None
    check_engine(engine, ray_address, options)
    with progress_bars(progress, console) as bar, local_input(corpus) as source:
        if is_store(source.spec):
            raise InputError(f"{corpus} is a document store already: build from it (prepack build {corpus} ...).")
        documents = open_documents(source.spec, options, out, bar, source.location)
        staged = staged_prefix if is_uri(out) else staged_directory
        with staged(out, overwrite, STORE_MANIFEST_NAME) as staging, engine_session(engine, ray_address, staging) as session:
            if session is None:
                return _write_store(documents, staging.build, shard_size, bar)
            read = session.read(documents, options, bar)
            shards = session.write_store_shards(documents, read, shard_size, bar)
            stored = read.stored
            untrained = int(stored.untrained.sum())
            return finish_store(documents, staging.build, stored.rows_per_file, stored.lengths, untrained, stored.fingerprint, shards)
