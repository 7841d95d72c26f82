"""The local engine (`--engine local`, the default): `prepack.building.engines.base.Engine`'s steps in this process.

Memory stays bounded by the shard size plus a few bytes a document: the first pass copies every
document's tokens once into a flat scratch file beside the output and keeps only their lengths in
memory (2 or 4 bytes each, `compact_lengths`) and whether each is untrained (1 byte); in the second
pass two threads each resolve a shard's documents from the plan, gather their tokens from the scratch
file, in 64 MiB windows each mapped only while its documents are copied, and write it. An index
build copies no token: its first pass reads each store shard's offsets (and labels up to each
document's first trained one), and its shards hold the plan alone. A store is written in one pass,
shard by shard as its documents are read (`StoreShardWriter`), with no scratch file.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prepack.sources.documents import Documents, Reading, corpus_documents
from prepack.building.engines.base import FirstPass, WrittenStore, kept_rows, numbered_on, pack_shard_bounds, rows_from
from prepack.errors import InputError
from prepack.formats.common import Fingerprint
from prepack.formats.shards import IndexOf, ShardInfo
from prepack.formats.store import StoreFingerprint
from prepack.storage.output import Staging, output_errors, output_file
from prepack.building import plan_vectorized
from prepack.building.plan import PackingPlan, compact_lengths, untrained_documents
from prepack.sources.corpus import Corpus, DocumentBatch
from prepack.sources.store import Store, group_prompt_lengths
from prepack.building.write_store import StoreShardWriter
from prepack.building.write_shards import ShardBuffers, TokenFiles, write_shard
from prepack.storage.files import write_in_pieces

if TYPE_CHECKING:  # rich for annotations only: a build without progress bars does not import it
    from rich.progress import Progress

    from prepack.sources.pairs import PairDocuments

__all__ = ["LocalEngine", "Observer", "read_store_lengths"]

# What a first pass may show each batch to: its token offsets and labels (None without labels).
Observer = Callable[[np.ndarray, np.ndarray | None], None]

# Shards written at once; each writer holds one shard's columns in memory. The gathering, hashing and
# writing of a shard all release the GIL: on the benchmark machine (2 cores), before shards were
# synced as they are written, the shard pass took 1.7-2.2 s with two writers, 2.7-3.3 s with one.
_SHARD_WRITERS = 2


def _store_documents(
    corpus: Corpus,
    has_labels: bool,
    batches: Iterator[DocumentBatch],
    scratch: Path | None,
    progress: Progress,
    observe: Observer | None = None,
    keep: np.ndarray | None = None,
    fingerprint: Fingerprint | StoreFingerprint | None = None,
) -> FirstPass:
    """Read the documents of `batches` once: their lengths, untrained flags and fingerprint (`fingerprint`
    fed, a store's `StoreFingerprint`: chained over its generations), and their tokens (and labels) copied
    into `scratch` back to back; with `keep` (bool, one per row), only the rows it keeps; with no
    `scratch`, none (`tokens` None)."""
    rows_per_file = {path: 0 for path in corpus.files}
    lengths, untrained = [], []
    fingerprint = fingerprint or Fingerprint()
    task = progress.add_task("read", total=len(corpus.files), unit="files")
    done_files: set[Path] = set()
    ids_path, labels_path = (None, None) if scratch is None else (scratch / "ids.bin", scratch / "labels.bin")
    with (
        output_file(ids_path) if scratch is not None else nullcontext() as ids_file,
        output_file(labels_path) if scratch is not None else nullcontext() as labels_file,
        # hashlib and file writes release the GIL: a second thread hashes and stores each batch while
        # this one decodes and checks the next (pyarrow releases it too).
        ThreadPoolExecutor(1) as worker,
    ):

        def store(batch: DocumentBatch, batch_lengths: np.ndarray, kept: np.ndarray | None) -> None:
            fingerprint.update(batch_lengths, batch.ids, batch.labels)
            if scratch is None:
                return
            ids, labels = batch.ids, batch.labels
            if kept is not None and not kept.all():
                tokens = np.repeat(kept, batch_lengths)
                ids, labels = ids[tokens], None if labels is None else labels[tokens]
            with output_errors(ids_path):
                write_in_pieces(ids_file, ids.data)
            if labels is not None:
                with output_errors(labels_path):
                    write_in_pieces(labels_file, labels.data)

        stored, row = None, 0
        for batch in batches:
            batch_lengths = np.diff(batch.offsets)
            if observe is not None:
                observe(batch.offsets, batch.labels)
            lengths.append(compact_lengths(batch_lengths))  # int64 would be 8 bytes a document
            untrained.append(untrained_documents(batch.offsets, batch.labels))
            rows_per_file[batch.file] += len(batch_lengths)
            if stored is not None:
                stored.result()  # one batch in flight, so memory holds two batches at most
            kept = None if keep is None else kept_rows(keep, row, len(batch_lengths))
            stored = worker.submit(store, batch, batch_lengths, kept)
            row += len(batch_lengths)
            done_files.add(batch.file)
            progress.update(task, completed=len(done_files) - 1, description=f"read {batch.file.name}")
        if stored is not None:
            stored.result()
    progress.update(task, completed=len(corpus.files), description="read")
    return FirstPass(
        lengths=compact_lengths(np.concatenate(lengths) if lengths else np.empty(0, np.int64)),
        untrained=np.concatenate(untrained) if untrained else np.empty(0, bool),
        rows_per_file=[rows_per_file[path] for path in corpus.files],
        fingerprint=fingerprint.hexdigest(),
        has_labels=has_labels,
        tokens=None if scratch is None else TokenFiles.single(ids_path),
        labels=TokenFiles.single(labels_path) if has_labels and scratch is not None else None,
        generations=tuple(fingerprint.found) if isinstance(fingerprint, StoreFingerprint) else (),
    )


def _collecting(observe) -> tuple[Observer | None, list]:
    """`observe` (None: nothing observed) made to append each of its results to a list, and that list."""
    observed: list = []
    return (None if observe is None else lambda offsets, labels: observed.append(observe(offsets, labels))), observed


def read_store_lengths(store: Store, progress: Progress, observe=None, hashed: bool = False) -> tuple[FirstPass, list]:
    """`LocalEngine.read_lengths` of a store (`_index_documents`, `hashed` as it takes it), with `observe`'s
    results batch by batch."""
    collect, observed = _collecting(observe)
    return _index_documents(store, progress, collect, hashed), observed


def _stored_rows(store: Store, keep: np.ndarray, scratch: Path, progress: Progress) -> tuple[TokenFiles, TokenFiles | None]:
    """The tokens (and labels) of the store's documents that `keep` keeps (bool, one per document),
    copied into `scratch` back to back, read from the shards that hold any (each checked whole:
    `Store.shard_columns`)."""
    ids_path, labels_path = scratch / "ids.bin", scratch / "labels.bin"
    ends = np.cumsum([shard.documents for shard in store.manifest.shards])
    task = progress.add_task("select", total=len(ends), unit="shards")
    with output_file(ids_path) as ids_file, output_file(labels_path) as labels_file:
        for shard, end, kept in zip(store.manifest.shards, ends, np.split(keep, ends[:-1])):
            progress.advance(task)
            if not kept.any():
                continue
            offsets, ids, labels = store.shard_columns(shard)
            tokens = np.repeat(kept, np.diff(offsets))
            with output_errors(ids_path):
                write_in_pieces(ids_file, ids[offsets[0] : offsets[-1]][tokens].data)
            if labels is not None:
                with output_errors(labels_path):
                    write_in_pieces(labels_file, labels[offsets[0] : offsets[-1]][tokens].data)
    return TokenFiles.single(ids_path), TokenFiles.single(labels_path) if store.manifest.has_labels else None


def _index_documents(
    store: Store,
    progress: Progress,
    observe: Observer | None = None,
    hashed: bool = False,
    pairs: PairDocuments | None = None,
) -> FirstPass:
    """An index build's first pass: what `_store_documents` keeps, from the store's offsets and labels
    alone (`Store.shard_labels`: no token copied, no shard hashed), and the fingerprint the store
    manifest records (the same `Fingerprint` of the same documents, computed when the store was
    written; the loader and `verify` check the shards' sha256 where the tokens are used). With `hashed`
    (a full build from the store, whose fingerprint is the store's: every length it plans from is held to
    it) or `observe` (which reads every label), each shard is read whole and checked (`Store.shard_columns`).
    Its labels are read as the build plans (`plans_in_numpy`, on the tokens of `store`: an append's, which holds
    the new documents alone, `StoreManifest.since_generation`, on theirs).
    `pairs`: a pair store's, its groups' prompt lengths recorded there shard by shard, from the same labels
    (`group_prompt_lengths`)."""
    m = store.manifest
    lengths, untrained = [], []
    without_numba = plan_vectorized.plans_in_numpy(m.tokens, m.has_labels)
    task = progress.add_task("read", total=len(m.shards), unit="shards")
    for shard in m.shards:
        if hashed or observe is not None:
            offsets, _, labels = store.shard_columns(shard)
            if observe is not None:
                observe(offsets, labels)
        else:
            offsets, labels = store.shard_labels(shard)
        lengths.append(compact_lengths(np.diff(offsets)))
        untrained.append(untrained_documents(offsets, labels, without_numba))
        if pairs is not None:
            pairs.add_prompt_lengths(group_prompt_lengths(offsets, labels, pairs.options.size, store.shard_where(shard),
                                                          without_numba=without_numba))
        progress.advance(task)
    return FirstPass(
        lengths=compact_lengths(np.concatenate(lengths)),
        untrained=np.concatenate(untrained),
        rows_per_file=[f.rows for f in m.inputs],
        fingerprint=m.fingerprint,
        has_labels=m.has_labels,
        tokens=None,
        labels=None,
    )


def _write_shards(
    plan: PackingPlan,
    staging: Path,
    first: FirstPass,
    shard_size: int,
    progress: Progress,
    store: IndexOf | None,
    first_shard: int = 0,
    first_row: int = 0,
) -> list[ShardInfo]:
    """Write the plan's packs as shards numbered from `first_shard`, their documents' rows counted from
    `first_row` (an append's: after the build's shards and documents)."""
    bounds, largest_shard = pack_shard_bounds(plan, first.has_labels, shard_size, index_only=store is not None)
    idle_buffers: queue.SimpleQueue[ShardBuffers] = queue.SimpleQueue()
    for _ in range(_SHARD_WRITERS):
        idle_buffers.put(ShardBuffers(largest_shard))

    def write(index: int, start: int, end: int) -> ShardInfo:
        buffers = idle_buffers.get()  # never waits: no more tasks than buffers run at once
        try:
            return write_shard(staging, first_shard + index, rows_from(plan.slice(start, end), first_row), first.tokens, first.labels, buffers, store)
        finally:
            idle_buffers.put(buffers)

    task = progress.add_task("write", total=plan.packs, unit="packs")
    with ThreadPoolExecutor(_SHARD_WRITERS) as writers:
        shards = [writers.submit(write, index, *pair) for index, pair in enumerate(zip(bounds[:-1], bounds[1:]))]
        try:
            for shard, end in zip(shards, bounds[1:]):
                shard.result()
                progress.update(task, completed=int(end))
        finally:
            writers.shutdown(cancel_futures=True)  # after an error, start no further shard
    return [shard.result() for shard in shards]


class LocalEngine:
    """The engine's steps in this process, for the output staged in `staging`. With `index_only` (a
    store's build), the first pass reads no token and the packs are written as index shards."""

    def __init__(self, staging: Staging, index_only: bool = False) -> None:
        self.staging, self.index_only = staging, index_only

    def first_pass(self, documents: Documents, reading: Reading, progress: Progress) -> FirstPass:
        if self.index_only:
            # A pair store's prompt lengths, which its batches (not read here) would record, from the labels read here.
            return _index_documents(documents.store, progress, pairs=documents.pairs)
        fingerprint = None if documents.store is None else StoreFingerprint(documents.store.manifest)
        return _store_documents(
            documents.corpus, documents.has_labels, documents.batches, self.staging.scratch, progress, fingerprint=fingerprint
        )

    def for_source(self, number: int) -> LocalEngine:
        """An engine for a mixture's source `number`: this one's, its scratch files in a directory of their own."""
        scratch = self.staging.scratch / f"source-{number:05d}"
        scratch.mkdir()
        return LocalEngine(Staging(self.staging.build, scratch), self.index_only)

    def read_lengths(self, documents: Documents, reading: Reading, progress: Progress, observe=None) -> tuple[FirstPass, list]:
        """What `first_pass` hands back, its tokens copied nowhere (`tokens` None): a store's from its offsets
        and labels alone (`read_store_lengths`), a corpus's read whole (and tokenized), and the results of
        `observe` (a function of a batch's offsets and labels, None without labels), batch by batch in row
        order. A mixture's first pass."""
        if documents.store is not None:
            return read_store_lengths(documents.store, progress, observe, hashed=not self.index_only)
        collect, observed = _collecting(observe)
        first = _store_documents(documents.corpus, documents.has_labels, documents.batches, None, progress, collect)
        return first, observed

    def write_selected(self, documents: Documents, reading: Reading, first: FirstPass, keep: np.ndarray, progress: Progress) -> FirstPass:
        """`first` (from `read_lengths` of `documents`) with the tokens of the rows that `keep` keeps (bool, one
        per row) copied into the scratch directory, back to back: a mixture's second pass, whose scratch holds
        what it selected. A store's shards are checked against the manifest the first pass read
        (`Store.shard_columns`: a shard changed since is refused, FormatError); the corpus files the first
        pass found are read (and tokenized) again, and refused (InputError) unless they give its documents
        (its fingerprint and rows)."""
        if documents.store is not None:
            tokens, labels = _stored_rows(documents.store, keep, self.staging.scratch, progress)
            return replace(first, tokens=tokens, labels=labels)
        reread = corpus_documents(documents.corpus, reading, progress)
        again = _store_documents(reread.corpus, reread.has_labels, reread.batches, self.staging.scratch, progress, keep=keep)
        if again.fingerprint != first.fingerprint or len(again.lengths) != len(first.lengths):
            raise InputError(
                f"{documents.corpus.root}: read a second time, the corpus gives other documents "
                f"(fingerprint {again.fingerprint[:12]}, first {first.fingerprint[:12]}): it changed while the build ran."
            )
        return replace(first, tokens=again.tokens, labels=again.labels)

    def write_packs(self, plan: PackingPlan, first: FirstPass, shard_size: int, progress: Progress) -> list[ShardInfo]:
        # An append (`first` holds the documents after the build's) numbers on from the build's shards and rows.
        first_shard, first_row = numbered_on(self.staging.appending)
        index_of = IndexOf(first_row + len(first.lengths), first.fingerprint) if self.index_only else None
        return _write_shards(plan, self.staging.build, first, shard_size, progress, index_of, first_shard, first_row)

    def write_store(self, documents: Documents, reading: Reading, shard_size: int, progress: Progress) -> WrittenStore:
        files = documents.corpus.files
        rows_per_file = dict.fromkeys(files, 0)
        position = {path: index for index, path in enumerate(files)}
        lengths, untrained = [], 0  # lengths as int32: 4 bytes per document, for the summary
        fingerprint = Fingerprint()
        group = 1 if documents.pairs is None else documents.pairs.options.size  # a pair store's shards hold whole groups
        # An append numbers its shards on from the store's (`Staging.appending`).
        writer = StoreShardWriter(self.staging.build, documents.has_labels, shard_size, numbered_on(self.staging.appending)[0], group)
        task = progress.add_task("store", total=len(files), unit="files")
        for batch in documents.batches:
            batch_lengths = np.diff(batch.offsets)
            fingerprint.update(batch_lengths, batch.ids, batch.labels)
            lengths.append(batch_lengths.astype(np.int32))
            untrained += int(untrained_documents(batch.offsets, batch.labels).sum())
            rows_per_file[batch.file] += len(batch_lengths)
            writer.add(batch)
            progress.update(task, completed=position[batch.file], description=f"store {batch.file.name}")
        writer.flush()
        progress.update(task, completed=len(files), description="store")
        return WrittenStore(
            shards=writer.shards,
            rows_per_file=[rows_per_file[path] for path in files],
            lengths=np.concatenate(lengths) if lengths else np.empty(0, np.int32),
            untrained=untrained,
            fingerprint=fingerprint.hexdigest(),
        )
