"""Writing an output's files: streamed to disk and synced as they go, and an Arrow record batch written as
one IPC stream with its size and sha256 taken on the way (a pack shard, a store shard, a loader's cached
full shard)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from prepack.storage.output import output_errors, output_file

__all__ = ["SyncedFile", "record_batch_sha256", "write_in_pieces", "write_record_batch"]

# Bytes per write() call of `write_in_pieces`. On the benchmark machine (a VM whose fresh memory is
# slow to touch), 1 MiB writes into the page cache ran 2.5 times as fast as 16 to 128 MiB ones, and
# storing the build's scratch file in 1 MiB pieces cut the first pass by a fifth. (Shards are written
# through `SyncedFile`, whose syncs matter more than the size of its writes.)
_WRITE_PIECE = 2**20


def write_in_pieces(file: BinaryIO, data: bytes | memoryview) -> None:
    """`file.write(data)`, `_WRITE_PIECE` bytes at a time."""
    view = memoryview(data).cast("B")
    file.writelines(view[start : start + _WRITE_PIECE] for start in range(0, len(view), _WRITE_PIECE))


# Bytes written between two syncs of a `SyncedFile`.
_SYNC_EVERY = 64 * 2**20


class SyncedFile:
    """A file for `pa.PythonFile` (or direct writes) that streams what it is given to disk: every
    `_SYNC_EVERY` bytes the written part is synced and dropped from the page cache.

    For output written once and not read back soon, such as shards. Left in the page cache it made
    every write claim a new page, which on the benchmark machine (a VM) ran at 0.4-0.5 GB/s, against
    1.5 GB/s synced and dropped (`benchmarks/bench_writes.py`). It also means a shard's bytes are on
    disk before the manifest names it. Call `sync` once more after the last write.
    """

    closed = False  # read by pa.PythonFile before every write; the file outlives the IPC writer

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.size = 0
        self.synced = 0

    def write(self, data: bytes | memoryview | pa.Buffer) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _SYNC_EVERY):
            piece = view[start : start + _SYNC_EVERY]
            self.file.write(piece)  # releases the GIL: shards are written in parallel
            self.size += len(piece)
            if self.size - self.synced >= _SYNC_EVERY:
                self.sync()
        return len(view)

    def sync(self) -> None:
        self.file.flush()
        getattr(os, "fdatasync", os.fsync)(self.file.fileno())  # macOS has no fdatasync
        if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the pages stay cached
            os.posix_fadvise(self.file.fileno(), self.synced, self.size - self.synced, os.POSIX_FADV_DONTNEED)
        self.synced = self.size


class _HashingSink:
    """A `SyncedFile` that also hashes what it writes. The IPC writer hands it the columns' own
    buffers, so the shard is never copied whole to be hashed."""

    closed = False  # as in SyncedFile

    def __init__(self, file: BinaryIO) -> None:
        self.out = SyncedFile(file)
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes | pa.Buffer) -> int:
        self.sha256.update(data)  # releases the GIL, as the write does
        return self.out.write(data)


def write_record_batch(path: Path, batch: pa.RecordBatch, mode: str = "wb") -> tuple[int, str]:
    """Write `batch` as an uncompressed Arrow IPC stream of that one batch, synced as it goes, and
    return the file's size and hex sha256; `mode` "xb": into a new file only (OutputError if one is there)."""
    with output_file(path, mode) as f, output_errors(path):
        sink = _HashingSink(f)
        _write_stream(pa.PythonFile(sink, mode="w"), batch)
        sink.out.sync()
    return sink.out.size, sink.sha256.hexdigest()


def record_batch_sha256(batch: pa.RecordBatch) -> str:
    """The hex sha256 of the file `write_record_batch` writes for `batch`, serialized in memory: nothing
    is written (a loader's cached full shard checked against the packs it should hold)."""
    stream = pa.BufferOutputStream()
    _write_stream(stream, batch)
    return hashlib.sha256(stream.getvalue()).hexdigest()


def _write_stream(sink: pa.NativeFile, batch: pa.RecordBatch) -> None:
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
