"""`build`: corpus in, shard directory out — read → plan → write, with progress and a manifest.

Memory stays bounded by the shard size plus a few bytes a document: the first pass copies every
document's tokens once into a flat scratch file beside the output and keeps only their lengths in
memory (2 or 4 bytes each, `compact_lengths`) and whether each is untrained (1 byte); the plan is
computed from the lengths (`prepack.plan`: under 5 more bytes a segment, 4 more while planning);
in the second pass two threads each resolve a shard's documents from the plan, gather their tokens
from the scratch file, in 64 MiB windows each mapped only while its documents are copied, and
write it. An index build copies no token: its first pass reads each store shard's offsets (and labels
up to each document's first trained one), and its shards hold the plan alone.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from prepack.documents import Reading, open_documents
from prepack.errors import DISTRIBUTION, InputError, require
from prepack.format import (
    MANIFEST_NAME,
    BuildOptions,
    Fingerprint,
    IndexOf,
    InputFile,
    Manifest,
    ShardInfo,
    StoreReference,
    Totals,
    segment_id_type,
    store_path_problem,
    write_manifest,
)
from prepack.output import Staging, output_errors, output_file, staged_directory
from prepack.plan import PackingPlan, compact_lengths, plan_packs, untrained_documents
from prepack.read import Corpus, DocumentBatch
from prepack.remote import is_uri, local_input, relative_location, staged_prefix
from prepack.store_read import Store, is_store
from prepack.write import ShardBuffers, TokenFiles, shard_bounds, write_in_pieces, write_shard

__all__ = ["DEFAULT_SHARD_SIZE", "ENGINES", "build", "check_engine", "engine_session", "progress_bars"]

# Bytes. ~1,300 full 8k-token packs. Each of the `_SHARD_WRITERS` holds a shard's columns while it
# writes it, and those pages are new to the process: at 256 MiB the shard pass took half as long
# again as at 64 MiB on the benchmark machine, and held 4x the memory. 64 MiB is also MosaicML
# streaming's default shard size; a billion 350-token documents make ~33k shards.
DEFAULT_SHARD_SIZE = 64 * 2**20


@dataclass(frozen=True)
class _StoredCorpus:
    """What the first pass keeps: document lengths, per-file row counts and the fingerprint."""

    lengths: np.ndarray  # one per corpus row, `compact_lengths`
    untrained: np.ndarray  # bool, one per corpus row: tokens but no trained token (`untrained_documents`)
    rows_per_file: list[int]
    fingerprint: str
    has_labels: bool


def _store_documents(
    corpus: Corpus,
    has_labels: bool,
    batches: Iterator[DocumentBatch],
    scratch: Path,
    progress: Progress,
) -> _StoredCorpus:
    rows_per_file = {path: 0 for path in corpus.files}
    lengths, untrained = [], []
    fingerprint = Fingerprint()
    task = progress.add_task("read", total=len(corpus.files), unit="files")
    done_files: set[Path] = set()
    ids_path, labels_path = scratch / "ids.bin", scratch / "labels.bin"
    with (
        output_file(ids_path) as ids_file,
        output_file(labels_path) as labels_file,
        # hashlib and file writes release the GIL: a second thread hashes and stores each batch while
        # this one decodes and checks the next (pyarrow releases it too).
        ThreadPoolExecutor(1) as worker,
    ):

        def store(batch: DocumentBatch, batch_lengths: np.ndarray) -> None:
            fingerprint.update(batch_lengths, batch.ids, batch.labels)
            with output_errors(ids_path):
                write_in_pieces(ids_file, batch.ids.data)
            if batch.labels is not None:
                with output_errors(labels_path):
                    write_in_pieces(labels_file, batch.labels.data)

        stored = None
        for batch in batches:
            batch_lengths = np.diff(batch.offsets)
            lengths.append(compact_lengths(batch_lengths))  # int64 would be 8 bytes a document
            untrained.append(untrained_documents(batch.offsets, batch.labels))
            rows_per_file[batch.file] += len(batch_lengths)
            if stored is not None:
                stored.result()  # one batch in flight, so memory holds two batches at most
            stored = worker.submit(store, batch, batch_lengths)
            done_files.add(batch.file)
            progress.update(task, completed=len(done_files) - 1, description=f"read {batch.file.name}")
        if stored is not None:
            stored.result()
    progress.update(task, completed=len(corpus.files), description="read")
    return _StoredCorpus(
        lengths=compact_lengths(np.concatenate(lengths) if lengths else np.empty(0, np.int64)),
        untrained=np.concatenate(untrained) if untrained else np.empty(0, bool),
        rows_per_file=[rows_per_file[path] for path in corpus.files],
        fingerprint=fingerprint.hexdigest(),
        has_labels=has_labels,
    )


def _index_documents(store: Store, progress: Progress) -> _StoredCorpus:
    """An index build's first pass: what `_store_documents` keeps, from the store's offsets and labels
    alone (`Store.shard_lengths`: no token copied, no shard hashed), and the fingerprint the store
    manifest records (the same `Fingerprint` of the same documents, computed when the store was
    written; the loader and `verify` check the shards' sha256 where the tokens are used)."""
    m = store.manifest
    lengths, untrained = [], []
    task = progress.add_task("read", total=len(m.shards), unit="shards")
    for shard in m.shards:
        shard_lengths, shard_untrained = store.shard_lengths(shard)
        lengths.append(compact_lengths(shard_lengths))
        untrained.append(shard_untrained)
        progress.advance(task)
    return _StoredCorpus(
        lengths=compact_lengths(np.concatenate(lengths)),
        untrained=np.concatenate(untrained),
        rows_per_file=[f.rows for f in m.inputs],
        fingerprint=m.fingerprint,
        has_labels=m.has_labels,
    )


def _locate_row(corpus: Corpus, rows_per_file: list[int], row: int) -> tuple[Path, int]:
    """Global row number → (file, row within the file)."""
    ends = np.cumsum(rows_per_file)
    index = int(np.searchsorted(ends, row, "right"))
    return corpus.files[index], row - int(ends[index] - rows_per_file[index])


# Shards written at once; each writer holds one shard's columns in memory. The gathering, hashing and
# writing of a shard all release the GIL: on the benchmark machine (2 cores), before shards were
# synced as they are written, the shard pass took 1.7-2.2 s with two writers, 2.7-3.3 s with one.
_SHARD_WRITERS = 2


def pack_shard_bounds(plan: PackingPlan, has_labels: bool, shard_size: int, index_only: bool) -> tuple[np.ndarray, int]:
    """The first written pack of every shard, plus the end (`shard_bounds`), and the most tokens a
    shard holds: what every engine cuts a plan's packs into shards by."""
    docs_per_pack, token_counts = plan.pack_sizes()
    # Estimated bytes per pack: token columns, per-document columns, per-pack offsets and max_seqlen.
    token_bytes = 0 if index_only else 4 + segment_id_type(plan.max_len).byte_width + (4 if has_labels else 0)
    pack_bytes = token_counts * token_bytes + docs_per_pack * 20 + 36
    bounds = shard_bounds(pack_bytes, shard_size)
    return bounds, int(np.add.reduceat(token_counts, bounds[:-1]).max())


def _write_shards(
    plan: PackingPlan,
    staging: Path,
    scratch: Path,
    has_labels: bool,
    shard_size: int,
    progress: Progress,
    store: IndexOf | None = None,
) -> list[ShardInfo]:
    index_only = store is not None
    bounds, largest_shard = pack_shard_bounds(plan, has_labels, shard_size, index_only)
    idle_buffers: queue.SimpleQueue[ShardBuffers] = queue.SimpleQueue()
    for _ in range(_SHARD_WRITERS):
        idle_buffers.put(ShardBuffers(largest_shard))
    tokens = None if index_only else TokenFiles.single(scratch / "ids.bin")
    labels = TokenFiles.single(scratch / "labels.bin") if has_labels and not index_only else None

    def write(index: int, first: int, end: int) -> ShardInfo:
        buffers = idle_buffers.get()  # never waits: no more tasks than buffers run at once
        try:
            return write_shard(staging, index, plan.slice(first, end), tokens, labels, buffers, store)
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


def _store_path(store: str | os.PathLike, out: str | os.PathLike) -> str:
    """How an index build at `out` names its store: relative to `out`, so that moving both together
    keeps the build readable. Refused (InputError), before anything is read or written, unless readers
    accept it (`StoreReference.path`): the store must lie in the build's parent directory (prefix)."""
    if is_uri(store) or is_uri(out):
        relative = relative_location(str(store), str(out))
    else:
        relative = Path(os.path.relpath(os.path.realpath(store), os.path.realpath(out))).as_posix()
    if (problem := store_path_problem(relative)) is not None:
        raise InputError(
            f"{out}: an index build must lie beside its store, in the directory (or prefix) that holds "
            f"{store}, as readers refuse a store elsewhere; its path from the build would be {relative!r}, which "
            f"{problem}. Choose --out in that directory (a store that moves later is named at load time: "
            "PackedDataset(build, store=...), prepack verify --store)."
        )
    return relative


ENGINES = ("local", "ray")


def check_engine(engine: str, ray_address: str | None, reading: Reading) -> None:
    """Refuse an engine prepack does not have, options that the engine would ignore, and the ray
    engine without ray installed; before anything is read."""
    if engine not in ENGINES:
        raise InputError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}.")
    if engine == "local":
        if ray_address is not None:
            raise InputError("--ray-address joins a Ray cluster: use it with --engine ray.")
        return
    if reading.num_proc is not None:
        raise InputError(
            "--num-proc sets the local engine's tokenizer threads or processes; with --engine ray every task "
            "tokenizes on one core, and the cluster's CPUs set how many run at once."
        )
    engine_ray = require("prepack.engine_ray", "--engine ray")  # ray is imported only for this engine
    engine_ray.check_ray_address(ray_address)  # before anything is read or written


@contextmanager
def engine_session(engine: str, ray_address: str | None, staging: Staging) -> Iterator:
    """None for the local engine; for "ray", a `prepack.engine_ray.RayEngine` connected for the build
    written into `staging`."""
    if engine == "local":
        yield None
        return
    from prepack.engine_ray import ray_engine

    with ray_engine(ray_address, staging) as session:
        yield session


def progress_bars(enabled: bool, console: Console | None) -> Progress:
    """The progress bars of a command that reads a corpus (`build`, `build_store`)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(SpinnerColumn(), *columns, console=console, disable=not enabled)


def build(
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_len: int,
    column: str = "input_ids",
    labels_column: str = "labels",
    tokenizer: str | os.PathLike | None = None,
    chat: bool = False,
    text_column: str = "text",
    messages_column: str = "messages",
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
    train_on: str = "assistant",
    num_proc: int | None = None,
    algorithm: str = "ffd",
    overflow: str = "split",
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    drop_untrained: bool = False,
    index_only: bool = False,
    overwrite: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
    progress: bool = False,
    console: Console | None = None,
) -> Manifest:
    """Pack a corpus, or a document store (`build_store`), into shards under `out` and return the
    manifest written there. A store's documents are not tokenized again: its build is byte for byte
    the build of its corpus with the options the store was tokenized with, which it records.

    >>> manifest = build("corpus.parquet", "packed/", max_len=8192)   # doctest: +SKIP
    >>> manifest.totals.packs, manifest.totals.padding_tokens           # doctest: +SKIP
    >>> build("chats.jsonl", "sft/", max_len=8192, tokenizer="./tok", chat=True)  # doctest: +SKIP

    With `index_only` (a store only) the shards are index shards: which documents each pack holds,
    no token; the manifest names the store by its path relative to `out` and its fingerprint, and
    `PackedDataset` gathers the packs' tokens from the store.

    Documents with no trained token (every label after the first -100) are counted in the
    manifest's totals (`untrained`) and, with `drop_untrained`, left out of the packs.

    Without `tokenizer` the corpus holds token ids in `column`, and `labels_column` is carried into
    the shards when every corpus file has it. With `tokenizer` (a local directory or tokenizer.json)
    the corpus holds text in `text_column`, or with `chat` conversations in `messages_column`,
    tokenized as `prepack.tokenize.tokenize_corpus` describes (`eos`, `chat_template`, `train_on`,
    `num_proc`).

    `engine="ray"` reads, tokenizes and writes shards as Ray tasks (`prepack.engine_ray`; needs
    `prepack-llm[ray]`), on the cluster at `ray_address` ("auto", "ray://…"), or on the Ray instance this
    process is connected to, or at `RAY_ADDRESS`, or on a new local one; the output is byte for byte
    the local engine's.
    Raises `InputError` for bad input, and `OutputError` when `out` cannot be written as
    asked (see `prepack.output.staged_directory`: it exists without `overwrite`, it is not a prepack
    build, another build to it runs, a disk is full); in every case nothing is published.
    """
    reading = Reading(
        column=column,
        labels_column=labels_column,
        tokenizer=tokenizer,
        chat=chat,
        text_column=text_column,
        messages_column=messages_column,
        eos=eos,
        chat_template=chat_template,
        train_on=train_on,
        num_proc=num_proc,
    )
    try:
        options = BuildOptions(
            max_len=max_len,
            algorithm=algorithm,
            overflow=overflow,
            seed=seed,
            shard_size=shard_size,
            column=reading.read_column,
            labels_column=labels_column,
            drop_untrained=drop_untrained,
        )
    except ValueError as exc:
        raise InputError(f"invalid build options:\n{exc}") from None
    check_engine(engine, ray_address, reading)
    with progress_bars(progress, console) as bar, local_input(corpus) as source:
        if index_only and not is_store(source.spec):
            raise InputError(
                f"{corpus}: --index-only packs a document store, and this is a corpus: make one with "
                f"`prepack tokenize {corpus} --out STORE`, then `prepack build STORE --index-only`."
            )
        store_path = _store_path(corpus, out) if index_only else None  # refuses a store the build cannot name
        documents = open_documents(source.spec, reading, out, bar, source.location)
        found, has_labels, batches, read_column = (
            documents.corpus, documents.has_labels, documents.batches, documents.column
        )
        staged = staged_prefix if is_uri(out) else staged_directory
        # An index build reads no token and writes small shards: it is planning only, done here.
        on = "local" if index_only else engine
        with staged(out, overwrite) as staging, engine_session(on, ray_address, staging) as session:
            if session is not None:
                read = session.read(documents, reading, bar)
                stored = read.stored
            elif index_only:
                stored = _index_documents(documents.store, bar)
            else:
                stored = _store_documents(found, has_labels, batches, staging.scratch, bar)
            if len(stored.lengths) == 0:
                raise InputError(f"{corpus}: the corpus has no documents.")
            if not stored.lengths.any():
                raise InputError(f"{corpus}: all {len(stored.lengths)} documents are empty.")
            if overflow == "error" and (stored.lengths > max_len).any():
                row = int(np.flatnonzero(stored.lengths > max_len)[0])
                path, file_row = _locate_row(found, stored.rows_per_file, row)
                raise InputError(
                    f"{path}, row {file_row}, column {read_column!r}: {stored.lengths[row]} tokens, "
                    f"longer than --max-len {max_len} (choose --overflow split, truncate or drop)."
                )
            planning = bar.add_task("plan", total=None)
            plan = plan_packs(
                stored.lengths,
                max_len,
                algorithm=algorithm,
                overflow=overflow,
                seed=seed,
                untrained=stored.untrained,
                drop_untrained=drop_untrained,
            )
            bar.update(planning, total=1, completed=1)
            if plan.packs == 0:  # every non-empty document was left out
                raise InputError(
                    f"{corpus}: no document is left to pack: of the non-empty documents, "
                    f"{plan.counts['dropped']:,} are longer than --max-len {max_len} (--overflow drop) and "
                    f"{plan.counts['untrained']:,} have no trained token (--drop-untrained)."
                )
            if session is None:
                index_of = IndexOf(len(stored.lengths), stored.fingerprint) if index_only else None
                shards = _write_shards(plan, staging.build, staging.scratch, has_labels, shard_size, bar, index_of)
            else:
                shards = session.write_pack_shards(plan, read, shard_size, bar)
            manifest = Manifest(
                prepack_version=version(DISTRIBUTION),
                # How the documents were read: as asked, or as the store was written.
                options=options.model_copy(
                    update={"column": read_column, "labels_column": documents.labels_column, "tokenize": documents.tokenize}
                ),
                has_labels=has_labels,
                fingerprint=stored.fingerprint,
                inputs=[
                    InputFile(path=found.name(path), rows=rows)
                    for path, rows in zip(found.files, stored.rows_per_file)
                ],
                totals=Totals(**plan.totals(), documents=len(stored.lengths)),
                shards=shards,
                store=StoreReference(path=store_path, fingerprint=stored.fingerprint) if index_only else None,
            )
            with output_errors(staging.build / MANIFEST_NAME):
                write_manifest(staging.build, manifest)
    return manifest
