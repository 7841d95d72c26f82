"""Read a tokenized corpus: find its files, stream their documents as token arrays, refuse bad input.

A corpus is a file, a directory or a glob of Parquet, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst),
Arrow IPC (file or stream format) files, or a Hugging Face `save_to_disk` directory. Files are read in
sorted path order and rows are numbered 0, 1, … across them: that global row number is what the shards'
`source_rows` column records.

Every file is untrusted: each record batch is validated in full (offsets against their buffers,
UTF-8) before a value is used, so memory stays bounded by the file's real size; JSON Lines records
may be up to MAX_RECORD_BYTES (256 MiB) long. Every check here is vectorized over a record batch, and
every error names the file, the row and the column, because a user with a billion documents cannot
bisect by hand.
"""

from __future__ import annotations

import glob
import io
import json
import os
import stat
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from prepack.errors import InputError
from prepack.formats.common import INT32_MAX, MANIFEST_MAX_BYTES, numpy_view
from prepack.formats.shards import IGNORE_INDEX, MANIFEST_NAME, SHARD_VERSION_KEY, STORE_MANIFEST_NAME
from prepack.storage.output import is_staging
from prepack.formats.store import STORE_VERSION_KEY

__all__ = ["Corpus", "DocumentBatch", "LocalCopy", "find_corpus", "read_documents"]

# Rows per Parquet batch: 8k SFT documents are tens of MB, so a build's memory does not grow with a
# file's row groups (a 64k-row batch of long documents is over a GB once decoded).
_BATCH_ROWS = 8_192
_READ_BUFFER = 2**20  # Parquet pages are streamed through this buffer, not whole column chunks
_SUFFIXES = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".jsonl.zst": "jsonl",
}


def file_kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, kind in _SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return None


@dataclass(frozen=True)
class LocalCopy(os.PathLike):
    """A corpus file read through a local copy of it (`prepack.storage.remote` fetches object storage so):
    opened at `copy` (it is path-like), and named by `location`, its URI, wherever it is printed."""

    location: str
    copy: Path

    def __fspath__(self) -> str:
        return os.fspath(self.copy)

    def __str__(self) -> str:
        return self.location

    @property
    def name(self) -> str:
        return self.copy.name


@dataclass(frozen=True)
class Corpus:
    """The files of a corpus, in reading order, and the root their names are reported against."""

    root: Path
    files: tuple[Path | LocalCopy, ...]

    def name(self, path: Path | LocalCopy) -> str:
        """A file's name relative to the root, '/'-separated, so manifests do not depend on where the
        corpus lies."""
        path = Path(path)
        return path.relative_to(self.root).as_posix() if path != self.root else path.name

    def located(self, location: str) -> Corpus:
        """This corpus, a local copy of the one at URI `location`: its files are named by their URIs."""
        return Corpus(self.root, tuple(LocalCopy(f"{location.rstrip('/')}/{self.name(f)}", Path(f)) for f in self.files))


def _hf_saved_dataset(directory: Path) -> tuple[Path, ...] | None:
    """The Arrow files of a `Dataset.save_to_disk` directory, in their saved order.

    `state.json` is input like any other: a file name in it that leaves the directory (`../x`, an
    absolute path, a symlink pointing out) or names something that is not a regular file is refused.
    """
    state = directory / "state.json"
    if not state.is_file():
        if (directory / "dataset_dict.json").is_file():
            raise InputError(
                f"{directory} is a saved DatasetDict; pass one split's directory, e.g. {directory}/train."
            )
        return None
    try:
        names = [entry["filename"] for entry in parse_json(state.read_text())["_data_files"]]
        inside = Path(os.path.realpath(directory))
        files = tuple(directory / name for name in names if isinstance(name, str) and name)
        if len(files) != len(names):
            raise ValueError("every '_data_files' entry needs a non-empty 'filename' string")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{state}: not a readable Hugging Face dataset state ({exc}).") from None
    for name, path in zip(names, files):
        try:  # realpath, not resolve(): on Python 3.11 resolve() raises RuntimeError for a symlink loop
            real = Path(os.path.realpath(path))
        except ValueError as exc:  # a NUL or a lone surrogate in the name
            raise InputError(f"{state}: data file {name!r} is not a usable file name ({exc}).") from None
        if Path(name).is_absolute() or not real.is_relative_to(inside):
            raise InputError(f"{state}: data file {name!r} lies outside the dataset directory {directory}.")
        _check_regular(path)
    return files


def _check_regular(path: Path) -> None:
    """Refuse a corpus file that cannot be read as a file: a FIFO would block the build for ever, a
    dangling symlink or a directory would be skipped, and either way documents would go missing. A path
    that is not UTF-8 is refused by that name: pyarrow opens paths as UTF-8 text, and the manifest records
    them so."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            f"{path}: its path is not valid UTF-8, which prepack needs to open and record it; rename it."
        ) from None
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        what = "a symbolic link to nothing" if path.is_symlink() else "missing"
        raise InputError(f"{path}: cannot be read as a corpus file: {what}.") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot be read as a corpus file ({exc}).") from None
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise InputError(f"{path}: cannot be read as a corpus file: it is {what}.")


def _refuse_build_output(directory: Path, files: list[Path]) -> None:
    """Refuse the corpus `files` of `directory` when it is a prepack build (its manifest.json has a
    `format_version`): read as a corpus, its shards would add every document it packed once more."""
    manifest = directory / MANIFEST_NAME
    try:
        if not files or not manifest.is_file() or manifest.stat().st_size > MANIFEST_MAX_BYTES:
            return
        is_build = "format_version" in parse_json(manifest.read_bytes())
    except (OSError, ValueError, TypeError):  # not JSON, or not an object: not a prepack manifest
        return
    if is_build:
        raise InputError(
            f"{min(files)}: a shard of the prepack build {directory}, not a corpus file. "
            "Leave the build out of the corpus (pass the corpus files, or a glob)."
        )


def _directory_files(root: Path) -> tuple[Path, ...]:
    """The corpus files under `root`, following symlinks, sorted; every directory is listed or the
    build fails (a subdirectory that cannot be read must not quietly leave its documents out)."""

    def refuse(exc: OSError) -> None:
        raise InputError(f"{exc.filename}: cannot list this corpus directory ({exc.strerror}).")

    files, seen = [], set()
    for top, directories, names in os.walk(root, onerror=refuse, followlinks=True):
        here = Path(top)
        real = Path(os.path.realpath(here))
        if real in seen:  # a symlink back up the tree, or a second way to the same files
            raise InputError(f"{here}: the same directory as {real}, reached twice; its files would be read twice.")
        seen.add(real)
        directories[:] = [d for d in directories if not is_staging(here / d)]
        found = [here / name for name in names if file_kind(Path(name)) is not None]
        _refuse_build_output(here, found)
        for path in found:
            _check_regular(path)
        files.extend(found)
    return tuple(sorted(files))


def find_corpus(spec: str | Path) -> Corpus:
    """Resolve a file, directory or glob into the corpus files, sorted.

    Refused with `InputError`: a corpus file that is not a regular file (FIFO, dangling symlink), a
    directory that cannot be listed, a prepack build inside the corpus, a document store (which
    `prepack.sources.documents.open_documents` reads instead). Hidden staging directories
    of builds (`.NAME.tmp-…`) are not read.
    """
    path = Path(spec)
    if path.is_dir() and os.path.lexists(path / STORE_MANIFEST_NAME):
        raise InputError(
            f"{path}: a prepack document store, not a corpus. `prepack build` packs it as it is; where a "
            "corpus is asked for, pass the corpus the store was made from."
        )
    if path.is_dir():
        saved = _hf_saved_dataset(path)
        files = saved if saved is not None else _directory_files(path)
        if not files:
            raise InputError(f"{path}: no corpus files in it ({', '.join(_SUFFIXES)}).")
        return Corpus(root=path, files=files)
    if os.path.lexists(path):
        if file_kind(path) is None:
            raise InputError(f"{path}: unsupported file type; expected one of {', '.join(_SUFFIXES)}.")
        _check_regular(path)
        return Corpus(root=path.parent, files=(path,))
    matches = sorted(Path(p) for p in glob.glob(str(spec), recursive=True))
    files = tuple(p for p in matches if file_kind(p) is not None and not p.is_dir())
    for file in files:
        _check_regular(file)
    if not files:
        raise InputError(f"{spec}: no such file or directory, and no corpus files match it as a glob.")
    root = Path(glob.escape(str(spec))).parent
    while glob.has_magic(str(root)) or not all(f.is_relative_to(root) for f in files):
        root = root.parent
    return Corpus(root=root, files=files)


@dataclass(frozen=True)
class DocumentBatch:
    """Consecutive documents of one file: document i is `ids[offsets[i]:offsets[i+1]]`."""

    file: Path | LocalCopy
    first_row: int  # row of the first document within its file
    offsets: np.ndarray  # int64 [m + 1], starting at 0
    ids: np.ndarray  # int32 [offsets[-1]]
    labels: np.ndarray | None  # int32 [offsets[-1]], or None when the corpus has no labels


# Longest JSON Lines record, newline included. pyarrow parses a file in blocks that must each hold a
# whole record; a file with longer records is read with blocks twice its longest (so up to 512 MiB).
MAX_RECORD_BYTES = 2**28
_JSON_BLOCK = 2**20  # pyarrow's default block: the fastest here, and enough for almost every corpus


def record_batches(
    path: Path, kind: str, columns: list[str], batch_rows: int = _BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """The `columns` of a file, batch by batch: Parquet in batches of `batch_rows` rows, Arrow files in
    their stored batches, JSON Lines in pyarrow's blocks.

    Every batch is validated in full before it is yielded (offsets monotonic and inside their buffers,
    lengths inside the file, UTF-8): an Arrow file's offsets are untrusted bytes, and one past its
    buffer would otherwise reach numpy as an out-of-bounds read or an allocation of any size. A file
    that cannot be read raises `InputError`.
    """
    row0 = 0
    batches = _json_batches(path, columns) if kind == "jsonl" else _binary_batches(path, kind, columns, batch_rows)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as exc:
            if kind == "jsonl" and not isinstance(exc, OSError):
                raise _json_error(path, columns, exc) from None
            raise InputError(f"{path}: cannot be read ({exc}); is it truncated?") from None
        try:
            # benchmarks/bench_validate.py: 5 µs for 8k rows of token ids (38 MB), 0.9 ms for 24 MB of
            # text (UTF-8), beside 33 ms and 8 ms to decode them from Parquet: cheap enough for every batch.
            batch.validate(full=True)
        except pa.ArrowInvalid as exc:
            raise InputError(f"{path}, {_invalid_at(batch, row0)}: corrupt data ({exc}).") from None
        yield batch
        row0 += batch.num_rows


def _binary_batches(path: Path, kind: str, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    if kind == "parquet":
        import pyarrow.parquet as pq  # here: a build of a document store reads no Parquet (0.03 CPU s to import both)

        # pre_buffer (pyarrow's default) fetches whole row groups ahead: no faster from a local disk,
        # and it holds a row group's compressed bytes on top of the decoded batch.
        with pq.ParquetFile(path, pre_buffer=False, buffer_size=_READ_BUFFER) as source:
            yield from source.iter_batches(batch_size=batch_rows, columns=columns)
        return
    with pa.memory_map(os.fspath(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(columns)
            return
        for batch in reader:
            yield batch.select(columns)


def _json_batches(path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """JSON Lines in pyarrow's blocks. A record longer than a block makes pyarrow fail; the file is
    then measured and read again with a block that holds its longest record, from the row it was at."""
    import pyarrow.json as pa_json

    schema = pa.schema([(c, pa.list_(pa.int64())) for c in columns])
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    block, rows = _JSON_BLOCK, 0
    while True:
        try:
            with pa.input_stream(os.fspath(path), compression="detect") as stream:
                skip = rows
                for batch in pa_json.open_json(stream, pa_json.ReadOptions(block_size=block), options):
                    if skip:  # rows already yielded before the block grew
                        dropped = min(skip, batch.num_rows)
                        batch, skip = batch.slice(dropped), skip - dropped
                    if batch.num_rows:
                        rows += batch.num_rows
                        yield batch
            return
        except pa.ArrowInvalid:
            longest = _longest_record(path)
            if longest < block:
                raise
            block = min(2 * longest, 2**31 - 1)


def _longest_record(path: Path) -> int:
    with pa.input_stream(os.fspath(path), compression="detect") as stream:
        return max(map(len, json_records(path, stream)), default=0)


def parse_json(text: str | bytes) -> object:
    """`json.loads`, with nesting too deep for Python's parser refused as the ValueError it is."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def json_records(path: Path, stream: pa.NativeFile) -> Iterator[bytes]:
    """The records of a JSON Lines stream: its non-blank lines, whole, row after row. A line over
    MAX_RECORD_BYTES is refused, so a file without newlines cannot fill memory."""
    lines = io.BufferedReader(stream)  # pyarrow streams decompress but do not split lines
    row = 0
    while line := lines.readline(MAX_RECORD_BYTES + 1):
        if len(line) > MAX_RECORD_BYTES:
            raise InputError(
                f"{path}, row {row}: a record longer than {MAX_RECORD_BYTES} bytes, the most prepack reads "
                "as one JSON Lines record (is a newline missing?)."
            )
        if not line.isspace():
            yield line
            row += 1


def json_object_blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, list[dict], int]]:
    """(first row, records, bytes) per block of about `block_bytes` of the JSON Lines file `path`, every
    record a JSON object (else InputError naming its row). Python's json, not pyarrow's reader, for
    readers whose values become Python strings and dicts anyway (text, chat, pairs): every error names
    its row."""
    records, size, row0 = [], 0, 0
    try:
        with pa.input_stream(os.fspath(path), compression="detect") as stream:
            for raw in json_records(path, stream):
                row = row0 + len(records)
                try:
                    record = parse_json(raw)
                except ValueError as exc:
                    raise InputError(f"{path}, row {row}: not valid JSON ({exc}).") from None
                if not isinstance(record, dict):
                    raise InputError(f"{path}, row {row}: a JSON Lines record must be an object.")
                records.append(record)
                size += len(raw)
                if size >= block_bytes:
                    yield row0, records, size
                    records, size, row0 = [], 0, row0 + len(records)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot be read ({exc}); is it truncated?") from None
    if records:
        yield row0, records, size


def _invalid_at(batch: pa.RecordBatch, row0: int) -> str:
    """'row R, column C' of the first invalid value of a batch that failed validation, as far as its
    offsets tell; 'rows A-B, column C' when the offsets are sound and something below them is not."""
    rows = f"rows {row0}-{row0 + batch.num_rows - 1}"
    for name, array in zip(batch.schema.names, batch.columns):
        try:
            array.validate(full=True)
        except pa.ArrowInvalid:
            pass
        else:
            continue
        offsets = _offsets(array)
        if offsets is None:
            return f"{rows}, column {name!r}"
        ends = offsets[1:]
        bad = (ends < offsets[:-1]) | (ends > len(array.values)) | (offsets[:-1] < 0)
        where = f"row {row0 + int(np.flatnonzero(bad)[0])}" if bad.any() else rows
        return f"{where}, column {name!r}"
    return rows


def _offsets(array: pa.Array) -> np.ndarray | None:
    """The offsets of a list array, read from its buffer when that holds them all, else None."""
    if pa.types.is_list(array.type):
        width = np.int32
    elif pa.types.is_large_list(array.type):
        width = np.int64
    else:
        return None
    buffer = array.buffers()[1]
    count = array.offset + len(array) + 1
    if buffer is None or buffer.size < count * np.dtype(width).itemsize:
        return None
    return np.frombuffer(buffer, width, count)[array.offset :].astype(np.int64)


def file_columns(path: Path, kind: str) -> dict[str, pa.DataType]:
    """Column names and types, read from the file's header (for JSONL, its first record).

    A shard of a prepack build (its schema says so) is refused: its packs are not documents."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            schema = pq.read_schema(path)
        elif kind == "arrow":
            with pa.memory_map(os.fspath(path)) as source:
                try:
                    schema = pa.ipc.open_stream(source).schema
                except pa.ArrowInvalid:
                    source.seek(0)
                    schema = pa.ipc.open_file(source).schema
        else:
            for _, (record, *_), _ in json_object_blocks(path, block_bytes=1):  # the first record only
                return {name: pa.list_(pa.int64()) for name in record}
            return {}
        if SHARD_VERSION_KEY.encode() in (schema.metadata or {}):
            raise InputError(
                f"{path}: a shard of a prepack build (its schema says so), not a corpus file. "
                "Leave the build out of the corpus (pass the corpus files, or a glob)."
            )
        if STORE_VERSION_KEY.encode() in (schema.metadata or {}):
            raise InputError(
                f"{path}: a shard of a prepack document store (its schema says so), not a corpus file. "
                "Pass the store's directory itself, or leave the store out of the corpus."
            )
        return {f.name: f.type for f in schema}  # a name that is not UTF-8 raises UnicodeDecodeError
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise InputError(f"{path}: cannot be read ({exc}); is it truncated?") from None


def _check_column_type(path: Path, column: str, dtype: pa.DataType) -> None:
    if not (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)):
        raise InputError(
            f"{path}, column {column!r}: expected a list of token ids per row, found {dtype}."
        )
    item = dtype.value_type
    if pa.types.is_list(item) or pa.types.is_large_list(item):
        raise InputError(
            f"{path}, column {column!r}: nested lists ({dtype}); each row must be a flat list of ids."
        )
    if not pa.types.is_integer(item) and not pa.types.is_null(item):
        raise InputError(f"{path}, column {column!r}: token ids must be integers, found {item}.")


def _json_error(path: Path, columns: list[str], exc: pa.ArrowException) -> InputError:
    """The first JSON Lines record pyarrow refused, found with Python's json to name its row."""
    with pa.input_stream(os.fspath(path), compression="detect") as stream:
        for row, raw in enumerate(json_records(path, stream)):
            try:
                record = parse_json(raw)
            except ValueError as error:
                return InputError(f"{path}, row {row}: not valid JSON ({error}).")
            if not isinstance(record, dict):
                return InputError(f"{path}, row {row}: a JSON Lines record must be an object.")
            for column in columns:
                value = record.get(column)
                if value is not None and not isinstance(value, list):  # null is pyarrow's, refused later
                    return InputError(
                        f"{path}, row {row}, column {column!r}: expected a list of token ids, "
                        f"found {type(value).__name__}."
                    )
                for v in value or ():
                    if isinstance(v, list):
                        return InputError(f"{path}, row {row}, column {column!r}: nested lists.")
                    if v is not None and type(v) is not int:  # bool is not an id either
                        return InputError(f"{path}, row {row}, column {column!r}: a non-integer id {v!r}.")
                    if v is not None and not -(2**63) <= v < 2**63:
                        return InputError(
                            f"{path}, row {row}, column {column!r}: token id {v} is out of range; "
                            f"ids must lie in [0, {INT32_MAX}]."
                        )
    return InputError(f"{path}: cannot be parsed as JSON Lines ({exc}).")


def _token_array(path: Path, row0: int, column: str, array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 from 0, ids) of one validated list column, after checking for nulls."""
    where = f"{path}, column {column!r}"
    if array.null_count:
        row = row0 + int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{where}, row {row}: missing (null) instead of a list of token ids.")
    offsets = numpy_view(array.offsets).astype(np.int64)
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets -= offsets[0]
    if values.null_count:
        token = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = row0 + int(np.searchsorted(offsets, token, "right")) - 1
        raise InputError(f"{where}, row {row}: a null token id.")
    # Nulls were refused above, so the integer values convert without a copy.
    ids = numpy_view(values) if len(values) else np.empty(0, np.int64)
    return offsets, ids


def _row_of_token(offsets: np.ndarray, token: int) -> int:
    return int(np.searchsorted(offsets, token, "right")) - 1


def _check_ids(path: Path, row0: int, column: str, offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
    # No mask on the fast path, and no reduction for a bound the dtype already keeps (int32: one).
    limits = np.iinfo(ids.dtype)
    negative = limits.min < 0 and len(ids) and ids.min() < 0
    too_large = limits.max > INT32_MAX and len(ids) and ids.max() > INT32_MAX
    if negative or too_large:
        bad = (ids < 0) | (ids > INT32_MAX)
        token = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"{path}, row {row0 + _row_of_token(offsets, token)}, column {column!r}: token id "
            f"{ids[token]} is out of range; ids must lie in [0, {INT32_MAX}]."
        )
    return ids.astype(np.int32, copy=False)


def _check_labels(path: Path, row0: int, column: str, offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels > INT32_MAX)
    if bad.any():
        token = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"{path}, row {row0 + _row_of_token(offsets, token)}, column {column!r}: label "
            f"{labels[token]} is neither a token id nor {IGNORE_INDEX}."
        )
    return labels.astype(np.int32, copy=False)


def _file_batches(
    path: Path, kind: str, column: str, labels_column: str | None
) -> Iterator[DocumentBatch]:
    columns = [column] if labels_column is None else [column, labels_column]
    row0 = 0
    for batch in record_batches(path, kind, columns):
        offsets, ids = _token_array(path, row0, column, batch.column(column))
        ids = _check_ids(path, row0, column, offsets, ids)
        labels = None
        if labels_column is not None:
            label_offsets, labels = _token_array(path, row0, labels_column, batch.column(labels_column))
            if not np.array_equal(label_offsets, offsets):
                row = row0 + int(np.flatnonzero(label_offsets != offsets)[0]) - 1
                raise InputError(
                    f"{path}, row {row}, column {labels_column!r}: {labels_column} and {column} "
                    "have different lengths."
                )
            labels = _check_labels(path, row0, labels_column, offsets, labels)
        yield DocumentBatch(file=path, first_row=row0, offsets=offsets, ids=ids, labels=labels)
        row0 += batch.num_rows


# Where text and conversations usually live: a corpus holding them needs --tokenizer, and for
# conversations --chat, whatever column the user asked for.
_TEXT_COLUMN = "text"
_CHAT_COLUMNS = ("messages", "conversations")


def missing_column_fix(present: Container[str], mode: str) -> str:
    """What to change when the column of `mode` ("tokens", "text" or "chat") is missing, judged by
    the columns (or JSON fields) `present`: the clause that ends the error message, the likely fix
    first, then the option that names the column."""
    chat_column = next((name for name in _CHAT_COLUMNS if name in present), None)
    chat = "--chat" if chat_column in (None, "messages") else f"--chat --messages-column {chat_column}"
    option = {"tokens": "choose the token column with --column", "text": "choose it with --text-column",
              "chat": "choose it with --messages-column"}[mode]
    if mode == "tokens" and chat_column is not None:
        return f"it holds conversations: tokenize them with --tokenizer DIR {chat} (a local tokenizer), or {option}"
    if mode == "tokens" and _TEXT_COLUMN in present:
        return f"it holds text: tokenize it with --tokenizer DIR (a local tokenizer), or {option}"
    if mode == "text" and chat_column is not None:
        return f"it holds conversations: add {chat}, or {option}"
    if mode == "chat" and _TEXT_COLUMN in present:
        return f"it holds text: leave out --chat, or {option}"
    return option


def read_documents(
    corpus: Corpus, column: str = "input_ids", labels_column: str | None = "labels"
) -> tuple[str | None, Iterator[DocumentBatch]]:
    """Check the corpus schema, then stream its documents in row order.

    `labels_column` is carried through when every file has it (a corpus with labels in some files
    only is refused). Returns the labels column actually used (or None) and the batches.
    """
    schemas = [file_columns(path, file_kind(path) or "arrow") for path in corpus.files]
    for path, schema in zip(corpus.files, schemas):
        if column not in schema:
            raise InputError(
                f"{path}: there is no column {column!r} (columns: {', '.join(schema) or 'none'}); "
                f"{missing_column_fix(schema, 'tokens')}."
            )
        _check_column_type(path, column, schema[column])
    has_labels = [labels_column is not None and labels_column in s for s in schemas]
    if any(has_labels) and not all(has_labels):
        with_, without = (corpus.files[has_labels.index(v)] for v in (True, False))
        raise InputError(
            f"mixed schemas: {with_} has a {labels_column!r} column and {without} has none."
        )
    used_labels = labels_column if all(has_labels) and has_labels else None
    for path, schema in zip(corpus.files, schemas):
        if used_labels:
            _check_column_type(path, used_labels, schema[used_labels])
        for name in filter(None, (column, used_labels)):
            if schema[name] != schemas[0][name]:
                raise InputError(
                    f"mixed schemas: column {name!r} is {schema[name]} in {path} but "
                    f"{schemas[0][name]} in {corpus.files[0]}; all files of a corpus share one schema."
                )

    def batches() -> Iterator[DocumentBatch]:
        for path in corpus.files:
            yield from _file_batches(path, file_kind(path) or "arrow", column, used_labels)

    return used_labels, batches()
