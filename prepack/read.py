"""Read a tokenized corpus: find its files, stream their documents as token arrays, refuse bad input.

A corpus is a file, a directory or a glob of Parquet, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst),
Arrow IPC (file or stream format) files, or a Hugging Face `save_to_disk` directory. Files are read in
sorted path order and rows are numbered 0, 1, … across them: that global row number is what the shards'
`source_rows` column records.

Every check here is vectorized over a record batch, and every error names the file, the row and the
column, because a user with a billion documents cannot bisect by hand.
"""

from __future__ import annotations

import glob
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from prepack.errors import InputError
from prepack.format import IGNORE_INDEX

__all__ = ["Corpus", "DocumentBatch", "find_corpus", "read_documents"]

# Rows per Parquet batch: 8k SFT documents are tens of MB, so a build's memory does not grow with a
# file's row groups (a 64k-row batch of long documents is over a GB once decoded).
_BATCH_ROWS = 8_192
_READ_BUFFER = 2**20  # Parquet pages are streamed through this buffer, not whole column chunks
_INT32_MAX = np.iinfo(np.int32).max
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
class Corpus:
    """The files of a corpus, in reading order, and the root their names are reported against."""

    root: Path
    files: tuple[Path, ...]

    def name(self, path: Path) -> str:
        """A file's name relative to the root, '/'-separated, so manifests do not depend on where the
        corpus lies."""
        return path.relative_to(self.root).as_posix() if path != self.root else path.name


def _hf_saved_dataset(directory: Path) -> tuple[Path, ...] | None:
    """The Arrow files of a `Dataset.save_to_disk` directory, in their saved order."""
    state = directory / "state.json"
    if not state.is_file():
        if (directory / "dataset_dict.json").is_file():
            raise InputError(
                f"{directory} is a saved DatasetDict; pass one split's directory, e.g. {directory}/train."
            )
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{state}: not a readable Hugging Face dataset state ({exc}).") from None
    return tuple(directory / name for name in names)


def find_corpus(spec: str | Path) -> Corpus:
    """Resolve a file, directory or glob into the corpus files, sorted."""
    path = Path(spec)
    if path.is_file():
        if file_kind(path) is None:
            raise InputError(f"{path}: unsupported file type; expected one of {', '.join(_SUFFIXES)}.")
        return Corpus(root=path.parent, files=(path,))
    if path.is_dir():
        saved = _hf_saved_dataset(path)
        files = saved if saved is not None else tuple(
            sorted(p for p in path.rglob("*") if p.is_file() and file_kind(p) is not None)
        )
        if not files:
            raise InputError(f"{path}: no corpus files in it ({', '.join(_SUFFIXES)}).")
        return Corpus(root=path, files=files)
    matches = sorted(Path(p) for p in glob.glob(str(spec), recursive=True))
    files = tuple(p for p in matches if p.is_file() and file_kind(p) is not None)
    if not files:
        raise InputError(f"{spec}: no such file or directory, and no corpus files match it as a glob.")
    root = Path(glob.escape(str(spec))).parent
    while glob.has_magic(str(root)) or not all(f.is_relative_to(root) for f in files):
        root = root.parent
    return Corpus(root=root, files=files)


@dataclass(frozen=True)
class DocumentBatch:
    """Consecutive documents of one file: document i is `ids[offsets[i]:offsets[i+1]]`."""

    file: Path
    first_row: int  # row of the first document within its file
    offsets: np.ndarray  # int64 [m + 1], starting at 0
    ids: np.ndarray  # int32 [offsets[-1]]
    labels: np.ndarray | None  # int32 [offsets[-1]], or None when the corpus has no labels


def record_batches(
    path: Path, kind: str, columns: list[str], batch_rows: int = _BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """The `columns` of a file, batch by batch: Parquet in batches of `batch_rows` rows, Arrow files in
    their stored batches, JSON Lines in pyarrow's blocks."""
    if kind == "parquet":
        # pre_buffer (pyarrow's default) fetches whole row groups ahead: no faster from a local disk,
        # and it holds a row group's compressed bytes on top of the decoded batch.
        with pq.ParquetFile(path, pre_buffer=False, buffer_size=_READ_BUFFER) as source:
            yield from source.iter_batches(batch_size=batch_rows, columns=columns)
    elif kind == "arrow":
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
                return
            yield from reader
    else:
        schema = pa.schema([(c, pa.list_(pa.int64())) for c in columns])
        options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        with pa.input_stream(str(path), compression="detect") as stream:
            yield from pa_json.open_json(stream, parse_options=options)


def file_columns(path: Path, kind: str) -> dict[str, pa.DataType]:
    """Column names and types, read from the file's header (for JSONL, its first record)."""
    if kind == "parquet":
        return {f.name: f.type for f in pq.read_schema(path)}
    if kind == "arrow":
        with pa.memory_map(str(path)) as source:
            try:
                schema = pa.ipc.open_stream(source).schema
            except pa.ArrowInvalid:
                source.seek(0)
                schema = pa.ipc.open_file(source).schema
        return {f.name: f.type for f in schema}
    with pa.input_stream(str(path), compression="detect") as stream:
        for raw in lines(stream):
            if raw.strip():
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise InputError(f"{path}, row 0: a JSON Lines record must be an object.")
                return {name: pa.list_(pa.int64()) for name in record}
    return {}


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


def _json_error_row(path: Path, columns: list[str]) -> tuple[int, str, str]:
    """Find the first JSON Lines record pyarrow refused, with Python's json, to name its row."""
    row = 0
    with pa.input_stream(str(path), compression="detect") as stream:
        for raw in lines(stream):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as exc:
                return row, "", f"not valid JSON ({exc})"
            for column in columns:
                value = record.get(column) if isinstance(record, dict) else None
                if not isinstance(value, list):
                    return row, column, f"expected a list of token ids, found {type(value).__name__}"
                bad = next((v for v in value if type(v) is not int), None)  # bool is not an id either
                if bad is not None:
                    what = "nested lists" if isinstance(bad, list) else f"a non-integer id {bad!r}"
                    return row, column, what
            row += 1
    return row, "", "the file ends in the middle of a record"


def lines(stream: pa.NativeFile) -> Iterator[bytes]:
    yield from io.BufferedReader(stream)  # pyarrow streams decompress but do not split lines


def _token_array(path: Path, row0: int, column: str, array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 from 0, ids int32) of one list column, after checking every value."""
    where = f"{path}, column {column!r}"
    if array.null_count:
        row = row0 + int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{where}, row {row}: missing (null) instead of a list of token ids.")
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets -= offsets[0]
    if values.null_count:
        token = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = row0 + int(np.searchsorted(offsets, token, "right")) - 1
        raise InputError(f"{where}, row {row}: a null token id.")
    # Nulls were refused above, so the integer values convert without a copy.
    ids = values.to_numpy() if len(values) else np.empty(0, np.int64)
    return offsets, ids


def _row_of_token(offsets: np.ndarray, token: int) -> int:
    return int(np.searchsorted(offsets, token, "right")) - 1


def _check_ids(path: Path, row0: int, column: str, offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
    # No mask on the fast path, and no reduction for a bound the dtype already keeps (int32: one).
    limits = np.iinfo(ids.dtype)
    negative = limits.min < 0 and len(ids) and ids.min() < 0
    too_large = limits.max > _INT32_MAX and len(ids) and ids.max() > _INT32_MAX
    if negative or too_large:
        bad = (ids < 0) | (ids > _INT32_MAX)
        token = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"{path}, row {row0 + _row_of_token(offsets, token)}, column {column!r}: token id "
            f"{ids[token]} is out of range; ids must lie in [0, {_INT32_MAX}]."
        )
    return ids.astype(np.int32, copy=False)


def _check_labels(path: Path, row0: int, column: str, offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels > _INT32_MAX)
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
    batches = record_batches(path, kind, columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except pa.ArrowInvalid as exc:
            if kind != "jsonl":
                raise InputError(f"{path}: cannot be read ({exc}); is it truncated?") from None
            row, col, what = _json_error_row(path, columns)
            at_column = f", column {col!r}" if col else ""
            raise InputError(f"{path}, row {row}{at_column}: {what}.") from None
        except OSError as exc:
            raise InputError(f"{path}: cannot be read ({exc}); is it truncated?") from None
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


def read_documents(
    corpus: Corpus, column: str = "input_ids", labels_column: str | None = "labels"
) -> tuple[str | None, Iterator[DocumentBatch]]:
    """Check the corpus schema, then stream its documents in row order.

    `labels_column` is carried through when every file has it (a corpus with labels in some files
    only is refused). Returns the labels column actually used (or None) and the batches.
    """
    schemas = []
    for path in corpus.files:
        try:
            schemas.append(file_columns(path, file_kind(path) or "arrow"))
        except (OSError, pa.ArrowException, ValueError) as exc:
            raise InputError(f"{path}: cannot be read ({exc}); is it truncated?") from None
    for path, schema in zip(corpus.files, schemas):
        if column not in schema:
            raise InputError(
                f"{path}: there is no column {column!r} (columns: {', '.join(schema) or 'none'}); "
                "choose the token column with --column."
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
