"""`--engine ray`: the reading, tokenizing and shard writing of `build` and `build_store` run as Ray
tasks across a cluster, and write the local engine's bytes.

    build("corpus/", "packed/", max_len=8192, tokenizer="tok/", engine="ray", ray_address="auto")

1. Read: one task per unit (a corpus file, or a shard of a document store) reads and tokenizes it as
   the local engine does (`corpus_documents`, `Store.shard_columns`), writes its tokens (and labels)
   as int32 files into the scratch directory, and returns its documents' lengths and which of them
   are untrained.
2. Plan, on the driver, from lengths alone: the fingerprint, whose token streams the driver hashes
   from the scratch files in row order while later units are still read, ids and labels in two
   threads (sha256 is sequential: no task can hash its part alone); then the packing plan (`plan_packs`) or the store shards' bounds
   (`store_shard_bounds`).
3. Write: one task per shard writes it from the scratch files (`write_shard`, `write_store_shard`)
   into the staging directory and returns its manifest entry; the driver writes the manifest.

Tasks are Ray core tasks, a few per CPU in flight, their results taken in row order, so that memory
on the driver stays bounded and the first error in row order is the one reported. Not Ray Data: its
datasets are made of their items up front, and the items of the write phase are the shards' resolved
packs (~40 bytes a document in all), which the driver makes one shard at a time as tasks start;
broadcasting the plan to every node instead would cost each node ~8 bytes a document of object
store. A bad row is the local engine's `PrepackError`, returned by the task as a value and raised on
the driver (Ray would print the worker's traceback). Ray retries a task whose worker died; a task writes its files from the
start, so a retry changes no byte. Workers open the paths the driver names, from the driver's working
directory where the node has it: a cluster's nodes need the corpus, the tokenizer and the output on a
shared file system.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import ray
from rich.progress import Progress

from prepack.build import _locate_row, _StoredCorpus, pack_shard_bounds
from prepack.documents import Documents, Reading, corpus_documents
from prepack.errors import InputError, PrepackError
from prepack.format import Fingerprint, ShardInfo
from prepack.output import output_errors, output_file
from prepack.plan import PackingPlan, ShardPacks, compact_lengths, untrained_documents
from prepack.read import Corpus
from prepack.store_format import StoreShard
from prepack.store_read import Store
from prepack.store_write import store_shard_bounds, store_shard_capacity, too_long_for_a_shard, write_store_shard
from prepack.write import ShardBuffers, TokenFiles, gather_tokens, write_in_pieces, write_shard

if TYPE_CHECKING:  # tokenizers is needed only for text and chat
    from prepack.tokenize import LocalTokenizer

__all__ = ["RayEngine", "ReadCorpus", "ray_engine"]

# Attempts after the first of a task whose worker died (a killed process, a lost node).
_RETRIES = 3
# Tasks in flight per CPU of the cluster: enough that a slow unit at the head of the row order
# leaves the others busy for a while, few enough that results waiting for it stay small.
_IN_FLIGHT_PER_CPU = 4
# Bytes of the scratch files hashed at a time for the fingerprint.
_HASH_PIECE = 16 * 2**20
_NO_DOCUMENTS = np.empty(0, np.int64)
_NO_TOKENS = np.empty(0, np.int32)


@contextmanager
def _working_directory(path: str) -> Iterator[None]:
    """Run in the driver's working directory, so that the paths it names (as the user gave them)
    open here and errors name them as the local engine does; stay where we are on a node that has
    no such directory (absolute paths on a shared file system still work there)."""
    previous = os.getcwd()
    try:
        os.chdir(path)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.chdir(previous)


@dataclass(frozen=True)
class _Source:
    """How a worker reads a unit: a corpus file as `reading` says, or a shard of `store`."""

    reading: Reading
    documents: Documents  # what the driver found (no batches): the workers must find the same
    store: Store | None
    cwd: str


@dataclass(frozen=True)
class _Unit:
    file: Path | None  # a corpus file, or
    shard: StoreShard | None  # a shard of the source's store
    ids: Path  # the scratch files it writes
    labels: Path | None


@dataclass(frozen=True)
class _UnitRead:
    lengths: np.ndarray  # `compact_lengths`, one per document of the unit
    untrained: np.ndarray  # bool, one per document


_tokenizers: dict[tuple[str, str], LocalTokenizer] = {}  # by (path, sha256)


def _tokenizer(path: str | os.PathLike, sha256: str) -> LocalTokenizer:
    """The tokenizer at `path`, loaded once per worker process (0.2 s for GPT-2's), and kept only when
    its files are those the driver loaded (`sha256`): a worker serves every build of a cluster."""
    from prepack.tokenize import load_tokenizer

    key = (os.path.abspath(path), sha256)
    if key not in _tokenizers:
        loaded = load_tokenizer(path)
        if loaded.info.sha256 != sha256:
            return loaded  # other files: `_unit_arrays` refuses what it reads
        _tokenizers[key] = loaded
    return _tokenizers[key]


def _unit_arrays(source: _Source, unit: _Unit) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """(offsets, ids, labels) of the unit's documents, batch by batch, in row order."""
    if unit.shard is not None:
        yield source.store.shard_columns(unit.shard)
        return
    expected = source.documents
    tokenizer = None if expected.tokenize is None else _tokenizer(source.reading.tokenizer, expected.tokenize.tokenizer.sha256)
    # One core a task: Ray's tasks are the parallelism.
    found = corpus_documents(Corpus(unit.file.parent, (unit.file,)), replace(source.reading, num_proc=1), None, tokenizer)
    if (found.tokenize, found.has_labels, found.labels_column) != (expected.tokenize, expected.has_labels, expected.labels_column):
        raise InputError(
            f"{unit.file}: read on a worker, it gives other documents than on the driver (the tokenizer, the chat "
            "template or the file changed while the build ran, or they differ between nodes)."
        )
    for batch in found.batches:
        yield batch.offsets, batch.ids, batch.labels


@ray.remote(max_retries=_RETRIES)
def _read_unit(source: _Source, unit: _Unit) -> _UnitRead | PrepackError:
    lengths, untrained = [], []
    with _working_directory(source.cwd):
        try:
            with ExitStack() as files:
                ids_file = files.enter_context(output_file(unit.ids))
                labels_file = files.enter_context(output_file(unit.labels)) if unit.labels is not None else None
                for offsets, ids, labels in _unit_arrays(source, unit):
                    lengths.append(np.diff(offsets))
                    untrained.append(untrained_documents(offsets, labels))
                    with output_errors(unit.ids):
                        write_in_pieces(ids_file, ids.data)
                    if labels_file is not None:
                        with output_errors(unit.labels):
                            write_in_pieces(labels_file, labels.data)
        except PrepackError as exc:
            return exc
    return _UnitRead(
        lengths=compact_lengths(np.concatenate(lengths) if lengths else _NO_DOCUMENTS),
        untrained=np.concatenate(untrained) if untrained else np.empty(0, bool),
    )


@ray.remote(max_retries=_RETRIES)
def _write_pack_shard(
    cwd: str, directory: Path, index: int, layout: ShardPacks, tokens: TokenFiles, labels: TokenFiles | None
) -> ShardInfo | PrepackError:
    with _working_directory(cwd):
        try:
            return write_shard(directory, index, layout, tokens, labels, ShardBuffers(int(layout.lengths.sum())))
        except PrepackError as exc:
            return exc


@ray.remote(max_retries=_RETRIES)
def _write_store_shard(
    cwd: str, directory: Path, index: int, lengths: np.ndarray, first_token: int, tokens: TokenFiles, labels: TokenFiles | None
) -> StoreShard | PrepackError:
    lengths = lengths.astype(np.int64)
    starts = first_token + np.cumsum(lengths) - lengths
    stored = lengths > 0  # an empty document has nothing to gather, and may start past the last file

    def gathered(files: TokenFiles) -> np.ndarray:
        out = np.empty(int(lengths.sum()), np.int32)
        gather_tokens(files, starts[stored], lengths[stored], out)
        return out

    with _working_directory(cwd):
        try:
            label_values = None if labels is None else gathered(labels)
            return write_store_shard(directory, index, lengths, gathered(tokens), label_values)
        except PrepackError as exc:
            return exc


@dataclass(frozen=True)
class ReadCorpus:
    """What the read phase leaves: the local engine's first-pass result, and where the tokens lie."""

    stored: _StoredCorpus
    tokens: TokenFiles
    labels: TokenFiles | None


def _hash_file(update, path: Path) -> None:
    """Feed a scratch file to a fingerprint stream (`update`), a piece at a time."""
    with output_errors(path, "read"), open(path, "rb") as file:
        while piece := file.read(_HASH_PIECE):
            update(np.frombuffer(piece, np.int32))


class RayEngine:
    """The three phases on a connected Ray cluster; one instance per build."""

    def __init__(self) -> None:
        self.cwd = os.getcwd()
        self.in_flight = max(1, int(ray.cluster_resources().get("CPU", 1))) * _IN_FLIGHT_PER_CPU

    def _in_order(self, submitted: Iterator[ray.ObjectRef]) -> Iterator:
        """The results of the tasks `submitted` (started as they are drawn, at most `in_flight` ahead
        of the one awaited), in order; a returned PrepackError is raised. On the way out, tasks still
        running are cancelled and awaited, so that none writes into a staging directory being deleted."""
        window: deque[ray.ObjectRef] = deque()
        try:
            for ref in submitted:
                window.append(ref)
                if len(window) >= self.in_flight:
                    yield _result(window.popleft())
            while window:
                yield _result(window.popleft())
        finally:
            for ref in window:
                ray.cancel(ref)
            if window:
                ray.wait(list(window), num_returns=len(window))

    def read(self, documents: Documents, reading: Reading, scratch: Path, progress: Progress) -> ReadCorpus:
        """Phase 1 over the corpus (or document store) whose documents the driver found as
        `documents`; the scratch files go into `scratch`."""
        store = documents.store
        source = ray.put(_Source(reading, replace(documents, batches=iter(())), store, self.cwd))
        if store is not None:
            parts = [(None, shard) for shard in store.manifest.shards]
        else:
            parts = [(path, None) for path in documents.corpus.files]
        units = [
            _Unit(
                file=path,
                shard=shard,
                ids=scratch / f"ids-{index:05d}.bin",
                labels=scratch / f"labels-{index:05d}.bin" if documents.has_labels else None,
            )
            for index, (path, shard) in enumerate(parts)
        ]
        task = progress.add_task("read", total=len(units), unit="files")
        fingerprint = Fingerprint()
        lengths, untrained, firsts, tokens = [], [], [], 0
        submitted = (_read_unit.remote(source, unit) for unit in units)
        # The labels are hashed by a second thread while this one hashes the ids.
        with closing(self._in_order(submitted)) as results, ThreadPoolExecutor(1) as labels_hasher:
            for unit, read in zip(units, results):
                fingerprint.update(read.lengths, _NO_TOKENS, None)
                hashed = labels_hasher.submit(_hash_file, fingerprint.update_labels, unit.labels) if unit.labels else None
                _hash_file(fingerprint.update_ids, unit.ids)
                if hashed is not None:
                    hashed.result()
                lengths.append(read.lengths)
                untrained.append(read.untrained)
                firsts.append(tokens)
                tokens += int(read.lengths.sum(dtype=np.int64))
                progress.update(task, advance=1, description=f"read {unit.file.name if unit.file else unit.shard.name}")
        progress.update(task, description="read")
        if store is not None:
            rows_per_file = [f.rows for f in store.manifest.inputs]
        else:
            rows_per_file = [len(part) for part in lengths]
        stored = _StoredCorpus(
            lengths=compact_lengths(np.concatenate(lengths)),
            untrained=np.concatenate(untrained),
            rows_per_file=rows_per_file,
            fingerprint=fingerprint.hexdigest(),
            has_labels=documents.has_labels,
        )
        starts = np.array(firsts, np.int64)
        label_files = TokenFiles(tuple(u.labels for u in units), starts) if documents.has_labels else None
        return ReadCorpus(stored, TokenFiles(tuple(u.ids for u in units), starts), label_files)

    def write_pack_shards(self, plan: PackingPlan, directory: Path, read: ReadCorpus, shard_size: int, progress: Progress) -> list[ShardInfo]:
        """Phase 3 of a build: the plan's packs cut into shards as the local engine cuts them, each
        resolved on the driver (`plan.slice`) as its task starts, and written by the task."""
        bounds, _ = pack_shard_bounds(plan, read.stored.has_labels, shard_size, index_only=False)
        tokens, labels = ray.put(read.tokens), ray.put(read.labels)
        submitted = (
            _write_pack_shard.remote(self.cwd, directory, index, plan.slice(first, end), tokens, labels)
            for index, (first, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        )
        task = progress.add_task("write", total=plan.packs, unit="packs")
        shards = []
        with closing(self._in_order(submitted)) as results:
            for shard, end in zip(results, bounds[1:]):
                shards.append(shard)
                progress.update(task, completed=int(end))
        return shards

    def write_store_shards(self, documents: Documents, directory: Path, read: ReadCorpus, shard_size: int, progress: Progress) -> list[StoreShard]:
        """Phase 3 of a store: its documents cut into shards by `_ShardWriter`'s rule, each written
        by a task from the scratch files."""
        lengths = read.stored.lengths
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            row = int(np.argmax(lengths > np.iinfo(np.int32).max))
            raise too_long_for_a_shard(*_locate_row(documents.corpus, read.stored.rows_per_file, row), int(lengths[row]))
        bounds, first_tokens = store_shard_bounds(lengths, store_shard_capacity(read.stored.has_labels, shard_size))
        tokens, labels = ray.put(read.tokens), ray.put(read.labels)
        submitted = (
            _write_store_shard.remote(self.cwd, directory, index, lengths[first:end], first_token, tokens, labels)
            for index, (first, end, first_token) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), first_tokens.tolist()))
        )
        task = progress.add_task("store", total=len(bounds) - 1, unit="shards")
        shards = []
        with closing(self._in_order(submitted)) as results:
            for shard in results:
                shards.append(shard)
                progress.update(task, advance=1)
        return shards


def _result(ref: ray.ObjectRef):
    value = ray.get(ref)
    if isinstance(value, PrepackError):
        raise value
    return value


@contextmanager
def ray_engine(address: str | None) -> Iterator[RayEngine]:
    """A `RayEngine` on the Ray instance this process is connected to; else on the cluster at
    `address` ("auto", "ray://HOST:PORT", …), or a new local instance when it is None, shut down
    when the build ends."""
    started = not ray.is_initialized()
    if started:
        local = {"include_dashboard": False} if address is None else {}
        try:
            # Quiet: the build reports progress and errors itself; workers' output is not relayed.
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, **local)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise InputError(f"--ray-address {address}: cannot join a Ray cluster there ({exc}).") from None
    try:
        yield RayEngine()
    finally:
        if started:
            ray.shutdown()
