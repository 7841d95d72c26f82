"""What both formats (pack shards, `prepack.formats.shards`; the document store, `prepack.formats.store`)
are read and checked with: strict JSON models and manifests, regular files only, one Arrow IPC reader of
one record batch, the documents' fingerprint, and every finding as a `FormatProblem`."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from prepack.errors import FormatError

# Readers refuse a bigger manifest before parsing it. A shard entry takes ~200 bytes of indented JSON
# and an input ~80, so 64 MiB lists some 300,000 of them: a 64 MiB-shard build of 20 TB.
MANIFEST_MAX_BYTES = 64 * 2**20


COUNT_MAX = 2**63 - 1  # counts are int64 in every reader


# The largest int32: the largest token id or label (`TOKEN_TYPE`), and the most values one list column of a
# shard or store shard holds (its offsets are int32).
INT32_MAX = 2**31 - 1


class StrictModel(BaseModel):
    """The base of prepack's JSON models (manifests, `inspect`'s report, `verify`'s problems): unknown keys
    refused, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Fingerprint:
    """`Manifest.fingerprint` (and a store's): the hex sha256 of the three sha256 digests, in this order,
    of the documents' lengths as little-endian int64, their token ids as little-endian int32 and their
    labels as little-endian int32 (nothing without labels), each stream fed in row order. A hash per
    stream makes it independent of how the rows are cut into batches."""

    def __init__(self) -> None:
        self._streams = (hashlib.sha256(), hashlib.sha256(), hashlib.sha256())

    def update(self, lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray | None) -> None:
        """Add consecutive documents: their lengths, and their tokens (and labels) back to back."""
        self._streams[0].update(lengths.astype("<i8", copy=False).data)
        self.update_ids(ids)
        if labels is not None:
            self.update_labels(labels)

    def update_ids(self, ids: np.ndarray) -> None:
        """Add token ids alone. Each stream is a hash of its own, so one thread may feed the ids while
        another feeds the labels (sha256 releases the GIL)."""
        self._streams[1].update(ids.astype("<i4", copy=False).data)

    def update_labels(self, labels: np.ndarray) -> None:
        """Add labels alone (see `update_ids`)."""
        self._streams[2].update(labels.astype("<i4", copy=False).data)

    def hexdigest(self) -> str:
        return hashlib.sha256(b"".join(stream.digest() for stream in self._streams)).hexdigest()


class FormatProblem(NamedTuple):
    """One way a build breaks the format, and where: what `FormatError.problem` carries, so that a
    caller (`verify`) takes the row and column from fields, never from the message."""

    file: str  # the file, as the reader was given it (a path, or a shard's name)
    message: str  # what is wrong, without the place
    row: int | None = None  # the pack's row inside the shard
    column: str | None = None  # the shard column, or the manifest field

    def __str__(self) -> str:
        where = [f"row {self.row}"] if self.row is not None else []
        where += [f"column {self.column!r}"] if self.column is not None else []
        return f"{self.file}: {', '.join(where)}: {self.message}" if where else f"{self.file}: {self.message}"


def format_error(
    file: str | os.PathLike, message: str, row: int | None = None, column: str | None = None
) -> FormatError:
    """The FormatError for `message` about `file` (its row and column): the message names them, and its
    `problem` carries them as fields."""
    problem = FormatProblem(str(file), message, row, column)
    return FormatError(str(problem), problem)


def field_path(location: tuple) -> str:
    """A pydantic error location as a field path, as messages and `verify` name a field (`sources[1].weight`,
    `shards[1].sha256`); "(top level)" for the model as a whole (its own checks)."""
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "literal[", "constrained-")) and part not in ("int", "str"):
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def refuse(file: str | os.PathLike, message: str, row: int | None = None, column: str | None = None) -> NoReturn:
    raise format_error(file, message, row, column)


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, refused unless it is a regular file: a symbolic link is not
    followed, and a FIFO or device is opened without blocking and then refused, so that a file planted
    in a build or a store (`/dev/zero`, a pipe) can neither hang a reader nor feed it. Every file of a
    build or store is opened through here. FileNotFoundError passes."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse(path, "is a symbolic link; a build holds regular files only.")
        refuse(path, f"cannot be opened ({exc.strerror}).")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        refuse(path, f"is not a regular file ({file_type_name(mode)}); a build holds regular files only.")
    return fd


def file_type_name(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISLNK: "a symbolic link",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    return next((kind for test, kind in kinds.items() if test(mode)), "not a file")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


_MAX_DIGITS = 100  # of an integer in the manifest: counts are int64 (19 digits); a seed may be longer


_TOO_MANY_DIGITS = re.compile(rb"[0-9]{%d}" % (_MAX_DIGITS + 1))


def _integers_fit(data: bytes) -> bool:
    """Whether no integer in the JSON text `data` can have more than _MAX_DIGITS digits: it is ASCII
    (so every digit is one of 0-9) with no longer run of them; checked without a copy of `data`. Only
    where one might is every integer parsed through `_integer`, a Python call each: most of the parse
    of a grown store's length_counts."""
    return data.isascii() and _TOO_MANY_DIGITS.search(data) is None


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits; manifest integers have at most {_MAX_DIGITS}")
    return int(text)


def length_count_sums(pairs: list[list[int]], least: int, most: int | None = None) -> tuple[int, int]:
    """(the count, the tokens) of `pairs`, [length, count] pairs by rising length as a grown store's
    `length_counts` and a build's `segment_lengths` record them, after refusing (ValueError) any other
    shape: a pair that is not two numbers, lengths that do not rise or lie outside `least`..`most`, a count
    below 1. The sums are Python's integers: a forged count cannot overflow them."""
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("are not [length, count] pairs")
    lengths = [length for length, _ in pairs]
    outside = bool(lengths) and (lengths[0] < least or (most is not None and lengths[-1] > most))
    if outside or any(b <= a for a, b in zip(lengths, lengths[1:])) or any(count < 1 for _, count in pairs):
        within = f"{least}..{most}" if most is not None else f"{least} and up"
        raise ValueError(f"are not [length, count] pairs by rising length in {within}, each count at least 1")
    return sum(count for _, count in pairs), sum(length * count for length, count in pairs)


def check_manifest_size(size: int, where: str | os.PathLike) -> None:
    """Refuse (FormatError naming `where`) a manifest of more than MANIFEST_MAX_BYTES bytes: every
    reader, local or of object storage, before it parses one."""
    if size > MANIFEST_MAX_BYTES:
        refuse(where, f"is larger than {MANIFEST_MAX_BYTES} bytes, the most a prepack manifest may hold.")


def read_manifest_bytes(where: Path) -> bytes:
    """The bytes of the manifest file `where`, read as `load_manifest_json` reads one: a regular file
    (`open_regular`), no more than one byte over MANIFEST_MAX_BYTES read (FormatError, after reading, when
    over). Raises FileNotFoundError when the file is missing, else FormatError."""
    fd = open_regular(where)
    try:
        with os.fdopen(fd, "rb") as file:
            data = file.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        refuse(where, f"cannot be read ({exc.strerror}).")
    check_manifest_size(len(data), where)
    return data


def load_manifest_json(
    directory: str | os.PathLike | bytes, kind: str, name: str
) -> tuple[str | os.PathLike, object]:
    """(what problems name it by, its JSON value) of the manifest `kind` (MANIFEST_NAME or
    STORE_MANIFEST_NAME) of the output `directory`, or of the bytes `directory` of one, which problems
    then name `name`. Read strictly: a regular file (`open_regular`) of at most MANIFEST_MAX_BYTES (no
    more than one byte over is read), UTF-8, no NaN or Infinity, no repeated key, no integer of more
    than _MAX_DIGITS digits, nesting bounded by the parser's recursion. Raises FileNotFoundError when
    the file is missing, else FormatError."""
    if isinstance(directory, bytes):
        where, data = name, directory
        check_manifest_size(len(data), where)
    else:
        where = Path(directory) / kind
        data = read_manifest_bytes(where)
    try:
        parse_int = None if _integers_fit(data) else _integer
        return where, json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_int=parse_int)
    except RecursionError:
        refuse(where, "cannot be read as JSON: it nests too deeply to be a prepack manifest.")
    except ValueError as exc:  # also UnicodeDecodeError
        refuse(where, f"cannot be read as JSON: {exc}")


def map_regular(path: Path, what: str, where: str | None = None) -> pa.Buffer:
    """The bytes of the file `path`, a `what` ("shard", "store shard") that its manifest lists,
    memory-mapped. Opened by `open_regular`: a file found regular before may since have been swapped for
    a FIFO, a directory or a device, which must not hang or feed a reader. Problems name `path` when it
    is missing, else `where` (default: `path`)."""
    where = str(path) if where is None else where
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        refuse(path, f"the {what} is missing; its manifest lists it.")
    try:
        if os.fstat(fd).st_size == 0:
            refuse(where, f"is empty; a {what} is an Arrow IPC stream.")
        return pa.py_buffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    except OSError as exc:
        refuse(where, f"cannot be read ({exc.strerror}).")
    finally:
        os.close(fd)  # the map holds the file open


def read_one_batch(
    data: pa.Buffer, what: str, where: str, check_schema: Callable[[pa.Schema], None] | None = None
) -> pa.RecordBatch:
    """The one record batch of `data`, the bytes of a `what` ("shard", "store shard"), zero-copy: an
    Arrow IPC stream of a schema message, one uncompressed record batch (its compression flag read
    before the body is decoded, `ipc_body_compressed`) and nothing after it. `check_schema`, when given,
    is called on the schema before the batch is read. The batch is not validated. Raises FormatError
    naming `where`."""
    try:
        messages = pa.ipc.MessageReader.open_stream(pa.BufferReader(data))
        schema = pa.ipc.read_schema(_next_message(messages, where, "schema"))
        if check_schema is not None:
            check_schema(schema)
        message = _next_message(messages, where, "record batch")
        if ipc_body_compressed(message.metadata):
            refuse(where, f"the record batch is compressed; a {what} is uncompressed, to be memory-mapped.")
        batch = pa.ipc.read_record_batch(message, schema)
        try:
            extra = messages.read_next_message()
        except StopIteration:  # the stream ends after its record batch, as it should
            extra = None
    except (OSError, pa.ArrowException, struct.error) as exc:
        refuse(where, f"not a readable Arrow IPC stream ({exc}).")
    if extra is not None:
        refuse(where, f"a {extra.type} message follows the record batch; a {what} holds exactly one.")
    return batch


def _next_message(messages: pa.ipc.MessageReader, where: str, kind: str) -> pa.ipc.Message:
    try:
        message = messages.read_next_message()
    except StopIteration:
        refuse(where, f"the stream ends before its {kind}.")
    if message.type != kind:
        refuse(where, f"a {message.type} message where the stream's {kind} should be.")
    return message


def ipc_body_compressed(metadata: pa.Buffer) -> bool:
    """Whether an IPC record batch message sets `compression`, read from its flatbuffer before the body
    is decoded (pyarrow would decompress it into memory). In Arrow's Message.fbs, field 2 of the Message
    table, `header`, is the RecordBatch table, whose field 3 is `compression`."""
    data = metadata.to_pybytes()

    def read(fmt: str, at: int) -> int:
        if not 0 <= at <= len(data) - struct.calcsize(fmt):
            raise struct.error(f"flatbuffer offset {at} out of range")
        return struct.unpack_from(fmt, data, at)[0]

    def field(table: int, index: int) -> int:  # where a table's field is, 0 when absent
        vtable = table - read("<i", table)
        entry = 4 + 2 * index
        offset = read("<H", vtable + entry) if entry + 2 <= read("<H", vtable) else 0
        return table + offset if offset else 0

    header = field(read("<I", 0), 2)
    return bool(header) and field(header + read("<I", header), 3) != 0


def first_index(mask: np.ndarray) -> int:
    """The index of the first True of `mask` (which has one): the row a problem names."""
    return int(np.flatnonzero(mask)[0])


def list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """An Arrow list column: row i holds values[offsets[i]:offsets[i + 1]]."""
    return pa.ListArray.from_arrays(arrow_array(offsets.astype(np.int32)), arrow_array(values))


def list_column(batch: pa.RecordBatch, column: str, where: str = "shard") -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column as zero-copy numpy views: row r is values[offsets[r]:offsets[r+1]].

    `values` is the whole child array, so the offsets index it directly even in a sliced batch. Nulls
    are refused here, which is also what lets `to_numpy` share the Arrow buffers instead of copying.
    The offsets are not checked here: `check_shard` does that.
    """
    array = batch.column(column)
    if array.null_count:
        refuse(where, "has null rows", first_index(array.is_null().to_numpy(zero_copy_only=False)), column)
    if array.values.null_count:
        refuse(where, "has null values", column=column)
    offsets = numpy_view(array.offsets) if len(array.offsets) else np.zeros(1, np.int32)  # 0 rows may have none
    return offsets, numpy_view(array.values)


def numpy_view(array: pa.Array) -> np.ndarray:
    """A numeric Arrow array without nulls as a zero-copy numpy view of its data buffer: what
    `array.to_numpy()` returns, without importing pandas, which `to_numpy` does on its first call
    (pyarrow converts through its pandas layer): a second of an index build's start-up."""
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)) or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())
    if not len(array):
        return np.empty(0, dtype)
    return np.frombuffer(array.buffers()[1], dtype, count=len(array), offset=array.offset * dtype.itemsize)


def arrow_array(values: np.ndarray) -> pa.Array:
    """A numeric numpy array as an Arrow array without nulls, sharing its memory when contiguous: what
    `pa.array(values)` returns, without the import of pandas that it too makes on its first call."""
    if values.dtype.kind not in "iuf":
        return pa.array(values)
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])
