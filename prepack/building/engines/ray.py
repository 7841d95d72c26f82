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

A mixture (`prepack.building.mixture_build`) reads each source twice, as the local engine does: phase 1
with each unit's scratch files deleted once the driver has hashed them (`read_lengths`; a store's
lengths on the driver, each shard checked against its sha256), then, once the selection is known, a task
per unit of the first pass's (its files, its store's manifest) holding a selected document writes the
selected documents' tokens alone (`write_selected`; a corpus file's second read held to its first by a
digest of all its tokens and labels, a store shard to the first pass's manifest), and phase 3 writes the packs.

Tasks are Ray core tasks, a few per CPU in flight, their results taken in row order, so that memory
on the driver stays bounded and the first error in row order is the one reported. Not Ray Data: its
datasets are made of their items up front, and the items of the write phase are the shards' resolved
packs (~40 bytes a document in all), which the driver makes one shard at a time as tasks start;
broadcasting the plan to every node instead would cost each node ~8 bytes a document of object
store. A bad row is the local engine's `PrepackError`, returned by the task as a value and raised on
the driver (Ray would print the worker's traceback). Ray retries a task whose worker died; a task writes its files from the
start (its partial file deleted first), so a retry changes no byte. A failure of Ray's own (a task that raised something else, or was
lost after its retries; a cluster that cannot be joined) is an `EngineError`.

Workers open the local paths the driver names, from the driver's working directory where the node has
it: local corpora, tokenizers and outputs must lie on a file system the nodes share. Object storage
needs none: a corpus file or store shard at a URI is fetched by its task into the node's `TMPDIR` (and
named by its URI in errors, as by the local engine); for an output at a URI the scratch files are
objects under `prepack.storage.remote.scratch_prefix` (uploaded by phase 1, which the driver reads back to hash,
and of which a phase-3 task fetches the byte ranges its shard's documents lie in), and each phase-3
task uploads its shard to its final name through the build's `prepack.storage.remote.Publication`, which
records it as this build's; the driver uploads the manifest last, and a failed build deletes what it
uploaded and its scratch objects.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import socket
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import ray
from rich.progress import Progress

from prepack.sources.documents import Documents, Reading, corpus_documents
from prepack.building.engines.base import FirstPass, WrittenStore, kept_rows, locate_row, numbered_on, pack_shard_bounds, rows_from
from prepack.building.engines.local import read_store_lengths
from prepack.errors import EngineError, InputError, OutputError, PrepackError
from prepack.formats.common import INT32_MAX, Fingerprint
from prepack.formats.shards import ShardInfo, shard_name
from prepack.storage.output import Staging, output_errors, output_file
from prepack.building.plan import PackingPlan, ShardPacks, compact_lengths, untrained_documents
from prepack.sources.corpus import Corpus, LocalCopy
from prepack.storage.remote import fetch, filesystem, scratch_prefix, upload
from prepack.formats.store import StoreFingerprint, StoreShard, store_shard_name
from prepack.sources.store import Store, group_prompt_lengths
from prepack.building.write_store import store_shard_bounds, store_shard_capacity, too_long_for_a_shard, write_store_shard
from prepack.building.write_shards import ShardBuffers, TokenFiles, gather_tokens, write_shard
from prepack.storage.files import write_in_pieces

if TYPE_CHECKING:  # tokenizers is needed only for text and chat
    from prepack.sources.pairs import GroupValues
    from prepack.sources.tokenize import LocalTokenizer

__all__ = ["RayEngine", "check_ray_address", "ray_engine"]

# Attempts after the first of a task whose worker died (a killed process, a lost node).
_RETRIES = 3
# Tasks in flight per CPU of the cluster: enough that a slow unit at the head of the row order
# leaves the others busy for a while, few enough that results waiting for it stay small.
_IN_FLIGHT_PER_CPU = 4
# Bytes of the scratch files hashed at a time for the fingerprint.
_HASH_PIECE = 16 * 2**20
# Byte ranges of scratch objects fetched in one `cat_ranges` call (concurrently, by fsspec).
_RANGES_AT_ONCE = 1024
# Seconds to wait for a cluster's address to answer before Ray's own minutes of retrying.
_CONNECT_TIMEOUT = 10
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
    file: Path | LocalCopy | None  # a corpus file (a copy on the driver of an object: fetched again), or
    shard: StoreShard | None  # a shard of the source's store
    ids: Path | str  # the scratch files it writes: local paths, or URIs of objects
    labels: Path | str | None
    keep: np.ndarray | None = None  # bool, one per document of the unit: those whose tokens it writes (None: all)
    observe: Callable[[np.ndarray, np.ndarray | None], object] | None = None  # called on every batch, its results returned
    digest: bool = False  # return `_UnitRead.digest`


@contextmanager
def _node_directory() -> Iterator[Path]:
    """A temporary directory on the task's node (`TMPDIR`), for what it fetches and what it uploads."""
    with tempfile.TemporaryDirectory(prefix="prepack-task-") as directory:
        yield Path(directory)


def _scratch_file(location: Path | str, directory: Path) -> Path:
    """Where a task writes the scratch file `location`: there, or for an object, in `directory`."""
    return Path(directory, location.rsplit("/", 1)[1]) if isinstance(location, str) else location


@dataclass(frozen=True)
class _UnitRead:
    lengths: np.ndarray  # `compact_lengths`, one per document of the unit
    untrained: np.ndarray  # bool, one per document
    prompt_lengths: np.ndarray | None = None  # a preference-pair corpus's: one per pair of the unit
    group_values: GroupValues | None = None  # a group corpus's scores and ranks, one a document of the unit
    digest: str = ""  # with `_Unit.digest`: sha256 of the unit's token ids, then of its labels, every document's, kept or not
    observed: list | None = None  # `_Unit.observe`'s results, batch by batch


_tokenizers: dict[tuple[str, str], LocalTokenizer] = {}  # by (path, sha256)


def _tokenizer(path: str | os.PathLike, sha256: str) -> LocalTokenizer:
    """The tokenizer at `path`, loaded once per worker process (0.2 s for GPT-2's), and kept only when
    its files are those the driver loaded (`sha256`): a worker serves every build of a cluster."""
    from prepack.sources.tokenize import load_tokenizer

    key = (os.path.abspath(path), sha256)
    if key not in _tokenizers:
        loaded = load_tokenizer(path)
        if loaded.info.sha256 != sha256:
            return loaded  # other files: `_unit_arrays` refuses what it reads
        _tokenizers[key] = loaded
    return _tokenizers[key]


def _unit_arrays(
    source: _Source, unit: _Unit, directory: Path, prompts: list[np.ndarray]
) -> Generator[tuple[np.ndarray, np.ndarray, np.ndarray | None], None, GroupValues | None]:
    """(offsets, ids, labels) of the unit's documents, batch by batch, in row order; a preference-pair
    corpus's prompt lengths appended to `prompts` as they are read. Returns a group corpus file's group values
    (scores, ranks) once it is read; None for any other unit (a store holds no scores or ranks). A unit in
    object storage is fetched into `directory` first, and named by its URI still."""
    store = source.store
    if unit.shard is not None:
        if store.location is not None:
            fetch(f"{store.location}/{unit.shard.name}", directory / unit.shard.name)
            store = replace(store, root=directory)
        offsets, _, labels = columns = store.shard_columns(unit.shard)
        if store.manifest.pairs is not None:  # a pair store's groups, whole in each shard
            prompts.append(group_prompt_lengths(offsets, labels, store.manifest.pairs.size, store.shard_where(unit.shard)))
        yield columns
        return None
    file = unit.file
    if isinstance(file, LocalCopy):
        file = LocalCopy(file.location, directory / file.name)
        fetch(file.location, file.copy)
    expected = source.documents
    tokenizer = None if expected.tokenize is None else _tokenizer(source.reading.tokenizer, expected.tokenize.tokenizer.sha256)
    # One core a task: Ray's tasks are the parallelism. A group corpus's files are read with its G (its first row's).
    group_size = None if expected.pairs is None else expected.pairs.options.group_size
    found = corpus_documents(Corpus(Path(file).parent, (file,)), replace(source.reading, num_proc=1), None, tokenizer, group_size)
    if (found.tokenize, found.has_labels, found.labels_column) != (expected.tokenize, expected.has_labels, expected.labels_column):
        raise InputError(
            f"{unit.file}: read on a worker, it gives other documents than on the driver (the tokenizer, the chat "
            "template or the file changed while the build ran, or they differ between nodes)."
        )
    for batch in found.batches:
        if found.pairs is not None:
            prompts.append(found.pairs.latest_prompt_lengths())
        yield batch.offsets, batch.ids, batch.labels
    return None if group_size is None else found.pairs.group_values()


@ray.remote(max_retries=_RETRIES)
def _read_unit(source: _Source, unit: _Unit) -> _UnitRead | PrepackError:
    lengths, untrained, prompts, observed = [], [], [], []
    ids_hash, labels_hash = hashlib.sha256(), hashlib.sha256()
    with _working_directory(source.cwd), _node_directory() as directory:
        ids_path = _scratch_file(unit.ids, directory)
        labels_path = None if unit.labels is None else _scratch_file(unit.labels, directory)
        try:
            with ExitStack() as files:
                ids_file = files.enter_context(output_file(ids_path))
                labels_file = files.enter_context(output_file(labels_path)) if labels_path is not None else None
                row = 0
                arrays = _unit_arrays(source, unit, directory, prompts)
                while True:
                    try:
                        offsets, ids, labels = next(arrays)
                    except StopIteration as done:  # its return value: a group corpus file's scores and ranks
                        group_values = done.value
                        break
                    batch_lengths = np.diff(offsets)
                    lengths.append(batch_lengths)
                    untrained.append(untrained_documents(offsets, labels))
                    if unit.observe is not None:
                        observed.append(unit.observe(offsets, labels))
                    ids, labels = ids[offsets[0] : offsets[-1]], None if labels is None else labels[offsets[0] : offsets[-1]]
                    if unit.digest:  # a mixture's: its second read of the unit is held to its first
                        ids_hash.update(ids.data)
                        if labels is not None:
                            labels_hash.update(labels.data)
                    if unit.keep is not None:
                        kept = np.repeat(kept_rows(unit.keep, row, len(batch_lengths)), batch_lengths)
                        ids, labels = ids[kept], None if labels is None else labels[kept]
                    row += len(batch_lengths)
                    with output_errors(ids_path):
                        write_in_pieces(ids_file, ids.data)
                    if labels_file is not None:
                        with output_errors(labels_path):
                            write_in_pieces(labels_file, labels.data)
            for location, path in ((unit.ids, ids_path), (unit.labels, labels_path)):
                if isinstance(location, str):
                    upload(path, location)
        except PrepackError as exc:
            return exc
    return _UnitRead(
        lengths=compact_lengths(np.concatenate(lengths) if lengths else _NO_DOCUMENTS),
        untrained=np.concatenate(untrained) if untrained else np.empty(0, bool),
        prompt_lengths=None if source.documents.pairs is None else np.concatenate(prompts or [_NO_DOCUMENTS]),
        group_values=group_values,
        digest=ids_hash.hexdigest() + labels_hash.hexdigest() if unit.digest else "",
        observed=observed if unit.observe is not None else None,
    )


def _local_tokens(files: list[TokenFiles | None], starts: np.ndarray, lengths: np.ndarray, directory: Path) -> tuple[list[TokenFiles | None], np.ndarray]:
    """`files` and the segments' `starts` when the files are local; when they are objects, the
    segments (`starts`, `lengths`, in tokens) fetched by byte ranges, one range per run of segments
    back to back in one object, into one local file per entry of `files` (the same ranges of each),
    and the segments' starts there."""
    if files[0] is None or not isinstance(files[0].paths[0], str):
        return files, starts
    firsts = files[0].firsts
    order = np.argsort(starts, kind="stable")
    first, end = starts[order], starts[order] + lengths[order]
    file_of = np.searchsorted(firsts, first, "right") - 1
    new_run = np.ones(len(first), bool)
    new_run[1:] = (first[1:] > np.maximum.accumulate(end)[:-1]) | (file_of[1:] != file_of[:-1])
    heads = np.flatnonzero(new_run)
    run_first, run_end = first[heads], np.maximum.reduceat(end, heads) if len(heads) else end[:0]
    run_files = file_of[heads]
    at = np.cumsum(run_end - run_first) - (run_end - run_first)
    run_of = np.cumsum(new_run) - 1
    local_starts = np.empty_like(starts)
    local_starts[order] = at[run_of] + first - run_first[run_of]
    byte_first, byte_end = (run_first - firsts[run_files]) * 4, (run_end - firsts[run_files]) * 4
    localized = []
    for index, tokens in enumerate(files):
        if tokens is None:
            localized.append(None)
            continue
        path = directory / f"segments-{index}.bin"
        fs, _ = filesystem(tokens.paths[0])
        with output_file(path) as out:
            for piece in range(0, len(heads), _RANGES_AT_ONCE):
                part = slice(piece, piece + _RANGES_AT_ONCE)
                objects = [tokens.paths[f] for f in run_files[part].tolist()]
                try:
                    ranges = fs.cat_ranges(objects, byte_first[part].tolist(), byte_end[part].tolist(), on_error="raise")
                except OSError as exc:
                    raise OutputError(f"cannot read this build's scratch objects ({objects[0]}, …): {exc}.") from None
                for data, uri, low, high in zip(ranges, objects, byte_first[part].tolist(), byte_end[part].tolist()):
                    if len(data) != high - low:
                        raise OutputError(f"{uri}: this build's scratch object is shorter than it was written.")
                    with output_errors(path):
                        out.write(data)
        localized.append(TokenFiles.single(path))
    return localized, local_starts


def _publish_shard(directory: Path, name: str, target: str | None) -> None:
    """Upload a shard written into the task's `directory` to its place in object storage, if it has one."""
    if target is not None:
        upload(directory / name, target)


@ray.remote(max_retries=_RETRIES)
def _write_pack_shard(
    cwd: str, directory: Path, target: str | None, index: int, layout: ShardPacks, tokens: TokenFiles, labels: TokenFiles | None
) -> ShardInfo | PrepackError:
    with _working_directory(cwd), _node_directory() as local:
        try:
            (tokens, labels), starts = _local_tokens([tokens, labels], layout.starts, layout.lengths, local)
            written = local if target is not None else directory
            (written / shard_name(index)).unlink(missing_ok=True)  # a retried task's partial file (shards are new files)
            shard = write_shard(written, index, replace(layout, starts=starts), tokens, labels, ShardBuffers(int(layout.lengths.sum())))
            _publish_shard(written, shard.name, target)
            return shard
        except PrepackError as exc:
            return exc


@ray.remote(max_retries=_RETRIES)
def _write_store_shard(
    cwd: str, directory: Path, target: str | None, index: int, lengths: np.ndarray, first_token: int, tokens: TokenFiles, labels: TokenFiles | None
) -> StoreShard | PrepackError:
    lengths = lengths.astype(np.int64)
    starts = first_token + np.cumsum(lengths) - lengths
    stored = lengths > 0  # an empty document has nothing to gather, and may start past the last file

    def gathered(files: TokenFiles, starts: np.ndarray) -> np.ndarray:
        out = np.empty(int(lengths.sum()), np.int32)
        gather_tokens(files, starts, lengths[stored], out)
        return out

    with _working_directory(cwd), _node_directory() as local:
        try:
            (tokens, labels), starts = _local_tokens([tokens, labels], starts[stored], lengths[stored], local)
            label_values = None if labels is None else gathered(labels, starts)
            written = local if target is not None else directory
            (written / store_shard_name(index)).unlink(missing_ok=True)  # a retried task's partial file (shards are new files)
            shard = write_store_shard(written, index, lengths, gathered(tokens, starts), label_values)
            _publish_shard(written, shard.name, target)
            return shard
        except PrepackError as exc:
            return exc


def _discard(location: Path | str | None) -> None:
    """Delete a scratch file (or object) of this build, if there is one."""
    if location is None:
        return
    if isinstance(location, str):
        fs, path = filesystem(location)
        with output_errors(location, "delete"):
            fs.rm(path)
    else:
        location.unlink(missing_ok=True)


def _hash_file(update, location: Path | str) -> None:
    """Feed a scratch file (or object) to a fingerprint stream (`update`), a piece at a time."""
    if isinstance(location, str):
        fs, path = filesystem(location)
        opened = lambda: fs.open(path, "rb", block_size=_HASH_PIECE)  # noqa: E731
    else:
        opened = lambda: open(location, "rb")  # noqa: E731
    with output_errors(location, "read"), opened() as file:
        while piece := file.read(_HASH_PIECE):
            update(np.frombuffer(piece, np.int32))


class RayEngine:
    """The three phases on a connected Ray cluster, as `prepack.building.engines.base.Engine`'s steps; one instance per build."""

    def __init__(self, staging: Staging, scratch: Path | str) -> None:
        """`staging`: where the build is written (its `publication` when it goes to object storage:
        tasks upload their shards); `scratch`: where the read phase's token files go, a directory or,
        for a build to object storage, a prefix of objects (tasks on any node read them)."""
        self.staging, self.scratch = staging, scratch
        self.cwd = os.getcwd()
        self._digests: list[str] = []  # a mixture source's: each unit's digest as `read_lengths` read it
        self.in_flight = max(1, int(ray.cluster_resources().get("CPU", 1))) * _IN_FLIGHT_PER_CPU

    def _in_order(self, submitted: Iterator[ray.ObjectRef]) -> Iterator:
        """The results of the tasks `submitted` (started as they are drawn, at most `in_flight` ahead
        of the one awaited), in order; a returned PrepackError is raised. On the way out, tasks still
        running are cancelled and awaited, so that none writes into a staging directory being deleted;
        the one awaited among them (it leaves the window with its result), when an error or SIGTERM
        interrupts the wait."""
        window: deque[ray.ObjectRef] = deque()

        def first_result():
            try:
                result = _result(window[0])
            except Exception:  # the task ended, with an error: done, it is neither cancelled nor awaited
                window.popleft()
                raise
            window.popleft()
            return result

        try:
            for ref in submitted:
                window.append(ref)
                if len(window) >= self.in_flight:
                    yield first_result()
            while window:
                yield first_result()
        finally:
            if window:
                # Only tasks not finished yet are cancelled: Ray 2.x's driver aborts on a check when a task it
                # is told to cancel has completed ("Tried to complete task that was not pending"). This narrows
                # the window to a task that finishes between the wait and its cancel; it does not close it.
                _, running = ray.wait(list(window), num_returns=len(window), timeout=0)
                for ref in running:
                    ray.cancel(ref)
                ray.wait(list(window), num_returns=len(window))

    def first_pass(self, documents: Documents, reading: Reading, progress: Progress) -> FirstPass:
        """Phase 1 over the corpus (or document store) whose documents the driver found as
        `documents`."""
        return self._read_all(documents, reading, progress)[0]

    def _source(self, documents: Documents, reading: Reading) -> ray.ObjectRef:
        """What workers must find (`_Source`), without the driver's streams (a generator does not pickle)."""
        pairs = None if documents.pairs is None else replace(documents.pairs, batches=iter(()), _prompt_lengths=[], _values=[])
        return ray.put(_Source(reading, replace(documents, batches=iter(()), pairs=pairs), documents.store, self.cwd))

    def _read_all(
        self, documents: Documents, reading: Reading, progress: Progress, observe=None, lengths_only: bool = False
    ) -> tuple[FirstPass, list, list[str]]:
        """Phase 1, and what a mixture's first pass asks of it besides: every batch's `observe` results in
        row order, each unit's digest, and with `lengths_only` each unit's scratch files deleted once hashed
        (`tokens` None): scratch holds the units in flight, not the corpus."""
        store = documents.store
        source = self._source(documents, reading)
        if store is not None:
            parts = [(None, shard) for shard in store.manifest.shards]
        else:
            parts = [(path, None) for path in documents.corpus.files]
        units = [
            _Unit(
                file=path,
                shard=shard,
                ids=self._scratch(f"ids-{index:05d}.bin"),
                labels=self._scratch(f"labels-{index:05d}.bin") if documents.has_labels else None,
                observe=observe,
                digest=lengths_only,
            )
            for index, (path, shard) in enumerate(parts)
        ]
        task = progress.add_task("read", total=len(units), unit="files")
        # A store's chained over its generations (a unit is a shard: no generation ends inside one).
        fingerprint = Fingerprint() if store is None else StoreFingerprint(store.manifest)
        lengths, untrained, firsts, tokens, observed, digests = [], [], [], 0, [], []
        submitted = (_read_unit.remote(source, unit) for unit in units)
        # The labels are hashed by a second thread while this one hashes the ids.
        with closing(self._in_order(submitted)) as results, ThreadPoolExecutor(1) as labels_hasher:
            for unit, read in zip(units, results):
                hashed = labels_hasher.submit(_hash_file, fingerprint.update_labels, unit.labels) if unit.labels else None
                _hash_file(fingerprint.update_ids, unit.ids)
                if hashed is not None:
                    hashed.result()
                fingerprint.update(read.lengths, _NO_TOKENS, None)  # last: a StoreFingerprint may end a generation
                if lengths_only:
                    for location in (unit.ids, unit.labels):
                        _discard(location)
                lengths.append(read.lengths)
                untrained.append(read.untrained)
                observed.extend(read.observed or ())
                digests.append(read.digest)
                if documents.pairs is not None:
                    documents.pairs.add_prompt_lengths(read.prompt_lengths)
                    if read.group_values is not None:  # a group corpus file's (`_unit_arrays`)
                        documents.pairs.add_group_values(read.group_values)
                firsts.append(tokens)
                tokens += int(read.lengths.sum(dtype=np.int64))
                progress.update(task, advance=1, description=f"read {unit.file.name if unit.file else unit.shard.name}")
        progress.update(task, description="read")
        if store is not None:
            rows_per_file = [f.rows for f in store.manifest.inputs]
        else:
            rows_per_file = [len(part) for part in lengths]
        starts = np.array(firsts, np.int64)
        first = FirstPass(
            lengths=compact_lengths(np.concatenate(lengths) if lengths else _NO_DOCUMENTS),
            untrained=np.concatenate(untrained) if untrained else np.empty(0, bool),
            rows_per_file=rows_per_file,
            fingerprint=fingerprint.hexdigest(),
            has_labels=documents.has_labels,
            tokens=None if lengths_only else TokenFiles(tuple(u.ids for u in units), starts),
            labels=TokenFiles(tuple(u.labels for u in units), starts) if documents.has_labels and not lengths_only else None,
            generations=tuple(fingerprint.found) if store is not None else (),
        )
        return first, observed, digests

    def for_source(self, number: int) -> RayEngine:
        """An engine for a mixture's source `number`: this one's, its scratch files in a place of their own."""
        scratch = self._scratch(f"source-{number:05d}")
        if isinstance(scratch, Path):
            scratch.mkdir()
        return RayEngine(self.staging, scratch)

    def read_lengths(self, documents: Documents, reading: Reading, progress: Progress, observe=None) -> tuple[FirstPass, list]:
        """A mixture's first pass (`LocalEngine.read_lengths`): a store's on the driver, each shard checked
        against its sha256, a corpus's by a task per file, each file's scratch deleted once the driver has hashed it."""
        if documents.store is not None:
            return read_store_lengths(documents.store, progress, observe, hashed=True)
        first, observed, self._digests = self._read_all(documents, reading, progress, observe, lengths_only=True)
        return first, observed

    def write_selected(self, documents: Documents, reading: Reading, first: FirstPass, keep: np.ndarray, progress: Progress) -> FirstPass:
        """A mixture's second pass (`LocalEngine.write_selected`): a task per corpus file or store shard that
        holds a kept row writes the kept rows' tokens, the units those of `documents` as `read_lengths` read
        them (its files, its store's manifest: a shard changed since is refused); a corpus file is read again
        and refused unless it gives what its first read gave (its digest: every document's tokens and labels)."""
        store = documents.store
        if store is not None:
            rows = [shard.documents for shard in store.manifest.shards]
            parts = [(None, shard) for shard in store.manifest.shards]
        else:
            rows = first.rows_per_file
            parts = [(path, None) for path in documents.corpus.files]
        ends = np.cumsum(rows, dtype=np.int64)
        chosen = [
            (index, _Unit(
                file=path,
                shard=shard,
                ids=self._scratch(f"selected-ids-{index:05d}.bin"),
                labels=self._scratch(f"selected-labels-{index:05d}.bin") if documents.has_labels else None,
                keep=kept,
                digest=store is None,
            ))
            for index, ((path, shard), kept) in enumerate(zip(parts, np.split(keep, ends[:-1]), strict=True))
            if kept.any()
        ]
        source = self._source(documents, reading)
        task = progress.add_task("select", total=len(chosen), unit="files")
        firsts, tokens, lengths = [], 0, first.lengths.astype(np.int64)
        submitted = (_read_unit.remote(source, unit) for _, unit in chosen)
        with closing(self._in_order(submitted)) as results:
            for (index, unit), read in zip(chosen, results):
                begin = int(ends[index] - rows[index])
                if store is None and (read.digest != self._digests[index] or not np.array_equal(read.lengths, lengths[begin : ends[index]])):
                    raise InputError(
                        f"{unit.file}: read a second time, the corpus gives other documents: it changed while the build ran."
                    )
                firsts.append(tokens)
                tokens += int(lengths[begin : ends[index]][unit.keep].sum())
                progress.update(task, advance=1)
        starts = np.array(firsts, np.int64)
        return replace(
            first,
            tokens=TokenFiles(tuple(unit.ids for _, unit in chosen), starts),
            labels=TokenFiles(tuple(unit.labels for _, unit in chosen), starts) if documents.has_labels else None,
        )

    def _scratch(self, name: str) -> Path | str:
        return self.scratch / name if isinstance(self.scratch, Path) else f"{self.scratch}/{name}"

    def _recording(self, names: list[str]) -> None:
        """Record the shards `names` as this build's before any is uploaded, when the build goes to object storage."""
        if self.staging.publication is not None:
            self.staging.publication.uploading(names)

    def _target(self, name: str) -> str | None:
        """Where a task uploads the shard `name`, when the build goes to object storage (checked to be
        still this build's prefix first)."""
        publication = self.staging.publication
        if publication is None:
            return None
        publication.check_claim()
        return publication.shard_uri(name)

    def write_packs(self, plan: PackingPlan, first: FirstPass, shard_size: int, progress: Progress) -> list[ShardInfo]:
        """Phase 3 of a build: the plan's packs cut into shards as the local engine cuts them, each
        resolved on the driver (`plan.slice`) as its task starts, and written by the task."""
        bounds, _ = pack_shard_bounds(plan, first.has_labels, shard_size, index_only=False)
        # An append (`first` holds the documents after the build's) numbers on from the build's shards and rows.
        first_shard, first_row = numbered_on(self.staging.appending)
        self._recording([shard_name(first_shard + index) for index in range(len(bounds) - 1)])
        tokens, labels = ray.put(first.tokens), ray.put(first.labels)
        submitted = (
            _write_pack_shard.remote(
                self.cwd, self.staging.build, self._target(shard_name(number)), number, rows_from(plan.slice(start, end), first_row), tokens, labels
            )
            for number, (start, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()), start=first_shard)
        )
        task = progress.add_task("write", total=plan.packs, unit="packs")
        shards = []
        with closing(self._in_order(submitted)) as results:
            for shard, end in zip(results, bounds[1:]):
                shards.append(shard)
                progress.update(task, completed=int(end))
        return shards

    def write_store(self, documents: Documents, reading: Reading, shard_size: int, progress: Progress) -> WrittenStore:
        """Phases 1 and 3 of a store: its documents read as for a build, then cut into shards by
        `StoreShardWriter`'s rule, each written by a task from the scratch files."""
        first = self.first_pass(documents, reading, progress)
        lengths = first.lengths
        if len(lengths) and lengths.max() > INT32_MAX:
            row = int(np.argmax(lengths > INT32_MAX))
            raise too_long_for_a_shard(*locate_row(documents.corpus, first.rows_per_file, row), int(lengths[row]))
        group = 1 if documents.pairs is None else documents.pairs.options.size  # a pair store's shards hold whole groups
        bounds, first_tokens = store_shard_bounds(lengths, store_shard_capacity(first.has_labels, shard_size), group)
        first_shard = numbered_on(self.staging.appending)[0]  # an append's shards after the store's
        self._recording([store_shard_name(first_shard + index) for index in range(len(bounds) - 1)])
        tokens, labels = ray.put(first.tokens), ray.put(first.labels)
        submitted = (
            _write_store_shard.remote(
                self.cwd, self.staging.build, self._target(store_shard_name(number)), number, lengths[start:end], first_token, tokens, labels
            )
            for number, (start, end, first_token) in enumerate(
                zip(bounds[:-1].tolist(), bounds[1:].tolist(), first_tokens.tolist()), start=first_shard
            )
        )
        task = progress.add_task("store", total=len(bounds) - 1, unit="shards")
        shards = []
        with closing(self._in_order(submitted)) as results:
            for shard in results:
                shards.append(shard)
                progress.update(task, advance=1)
        untrained = int(first.untrained.sum())
        return WrittenStore(shards, first.rows_per_file, lengths, untrained, first.fingerprint)


def _result(ref: ray.ObjectRef):
    """A task's result; its PrepackError raised; a failure of Ray's (the task raised something else,
    or was lost with its worker or node after its retries) an EngineError of one line."""
    try:
        value = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        raise EngineError(f"a Ray task of this build failed: {type(cause).__name__}: {_first_line(cause)}") from None
    except ray.exceptions.RayError as exc:
        raise EngineError(f"the Ray cluster lost a task of this build: {type(exc).__name__}: {_first_line(exc)}") from None
    if isinstance(value, PrepackError):
        raise value
    return value


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


# What a Ray address may be: Ray's own words, or [ray://]HOST:PORT (an IPv6 host in brackets).
_RAY_ADDRESS = re.compile(r"(?:ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})")


def check_ray_address(address: str | None, named: str | None = None) -> None:
    """Refuse at once (InputError naming it) an address Ray could never join, which it would retry for
    minutes: anything but "auto", "local" or [ray://]HOST:PORT with a port from 1 to 65535. `named`:
    how the message names it (default: `--ray-address ADDRESS`)."""
    if address is None or address in ("auto", "local"):
        return
    match = _RAY_ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise InputError(
            f"{named or f'--ray-address {address}'}: not a Ray address; give auto, HOST:PORT (a cluster's GCS, "
            "as `ray start --head` prints it) or ray://HOST:PORT (a Ray Client server)."
        )


def _check_listening(address: str, named: str) -> None:
    """Refuse at once an address `HOST:PORT` (or `ray://HOST:PORT`) where nothing listens, which Ray
    would retry for minutes. `named`: the address as the user gave it, for the message."""
    check_ray_address(address, named)
    if address in ("auto", "local"):
        return  # Ray's to resolve
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT) as connection:
            grpc = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true") or _speaks_grpc(connection)
    except OSError as exc:
        raise EngineError(f"{named}: no Ray cluster answers there ({exc.strerror or exc}).") from None
    if not grpc:
        raise EngineError(f"{named}: something answers there, but not a Ray cluster (its GCS, or a Ray Client server, speaks gRPC).")


# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server (a Ray GCS, a Ray
# Client server) answers with a SETTINGS frame (type 4) at once; an HTTP/1 server, or anything else, not.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(connection: socket.socket) -> bool:
    """Whether the server at the other end of `connection` answers HTTP/2's preface (within its timeout),
    as Ray's servers do; with TLS (RAY_USE_TLS) it cannot be asked so, and is not."""
    connection.sendall(_HTTP2_PREFACE)
    head = b""
    try:
        while len(head) < 9 and (piece := connection.recv(9 - len(head))):
            head += piece
    except OSError:  # a timeout, a reset: not an HTTP/2 server
        return False
    return len(head) == 9 and head[3] == 4


@contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Put back the caller's SIGTERM handler after `ray.init`, which replaces it twice: with one that
    exits at once, and (the driver's core worker) with one that prints a stack and aborts. Either way
    SIGTERM would skip this build's cleanup, where the caller's handler (the CLI's raises SystemExit)
    runs it: `ray_engine`'s `ray.shutdown()` stops the Ray processes it started. Python sets handlers
    in the main thread only, and cannot put back one set outside Python (`getsignal` gives None)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def ray_engine(address: str | None, staging: Staging) -> Iterator[RayEngine]:
    """A `RayEngine` for a build written into `staging`, on the Ray instance this process is connected
    to; else on the cluster at `address` ("auto", "ray://HOST:PORT", …), or when it is None at Ray's
    own `RAY_ADDRESS` (what `ray job submit` sets for its entrypoint), or on a new local instance, shut
    down when the build ends. A build to object storage keeps its scratch objects under
    `prepack.storage.remote.scratch_prefix`, deleted when the build ends."""
    started = not ray.is_initialized()
    if started:
        joining = address or os.environ.get("RAY_ADDRESS") or None
        named = f"--ray-address {address}" if address else f"RAY_ADDRESS {joining}" if joining else None
        if named is not None:
            _check_listening(joining, named)
        try:
            # Quiet: the build reports progress and errors itself; workers' output is not relayed.
            # "local", not None: ray.init() would otherwise join any cluster that RAY_TMPDIR's
            # ray_current_cluster names (a `ray start`, a test's Cluster), whose workers may run in
            # another environment (other credentials, another AWS_ENDPOINT_URL).
            with _sigterm_handler_kept():
                ray.init(
                    address=joining or "local",
                    log_to_driver=False,
                    logging_level=logging.ERROR,
                    **({"include_dashboard": False} if joining is None else {}),
                )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            problem = f"{named}: cannot join a Ray cluster there" if named else "cannot start a local Ray instance"
            raise EngineError(f"{problem} ({_first_line(exc)}).") from None
    try:
        with ExitStack() as scratch:
            if staging.publication is None:
                location = staging.scratch
            else:
                location = scratch.enter_context(scratch_prefix(staging.publication))
            yield RayEngine(staging, location)
    finally:
        if started:
            ray.shutdown()
