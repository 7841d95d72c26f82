"""The shard format: one description that the writer and every reader are built against.

The normative text is `schemas/shard-format.md`; `schemas/manifest.schema.json` is generated from
`Manifest` below. `tests/test_format.py` fails when either drifts from this module.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prepack.errors import FormatError

__all__ = [
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "MANIFEST_NAME",
    "SHARD_VERSION_KEY",
    "STORE_MANIFEST_NAME",
    "BuildOptions",
    "Fingerprint",
    "InputFile",
    "Manifest",
    "ShardFileProblem",
    "ShardInfo",
    "TokenizeOptions",
    "TokenizerInfo",
    "Totals",
    "check_shard",
    "list_column",
    "open_shard",
    "read_manifest",
    "segment_id_type",
    "shard_file_problems",
    "shard_name",
    "shard_schema",
    "shard_sha256",
    "write_manifest",
]

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
# What marks a document store (prepack/store_format.py), named here so that a reader of builds can say
# so when it is handed a store.
STORE_MANIFEST_NAME = "store.json"
SHARD_VERSION_KEY = "prepack.format_version"  # schema metadata of every shard: marks it as prepack's
IGNORE_INDEX = -100  # label value that is not trained on (the PyTorch / HF convention)

_TOKEN = pa.int32()  # token ids and labels: vocabularies fit in 31 bits, and torch has no uint32 kernels


def segment_id_type(max_len: int) -> pa.DataType:
    """The type of `segment_ids` values. A pack holds at most max_len documents, so with max_len up to
    65,535 every segment id fits 16 bits, and the column costs half the bytes of `input_ids`."""
    return pa.uint16() if max_len <= np.iinfo(np.uint16).max else pa.int32()


def shard_schema(has_labels: bool, max_len: int) -> pa.Schema:
    """The Arrow schema of every shard of a build; `labels` only when the corpus had them."""
    fields = [
        pa.field("input_ids", pa.list_(_TOKEN), nullable=False),
        pa.field("segment_ids", pa.list_(segment_id_type(max_len)), nullable=False),
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
        pa.field("max_seqlen", pa.int32(), nullable=False),
        pa.field("source_rows", pa.list_(pa.int64()), nullable=False),
        pa.field("source_pieces", pa.list_(pa.int32()), nullable=False),
    ]
    if has_labels:
        fields.append(pa.field("labels", pa.list_(_TOKEN), nullable=False))
    return pa.schema(fields, metadata={SHARD_VERSION_KEY: str(FORMAT_VERSION)})


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenizerInfo(_Model):
    name: str = Field(description="The tokenizer directory's or file's name.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 over its files, by sorted name.")


class TokenizeOptions(_Model):
    """How text or chat documents became tokens, when `prepack build` tokenized them."""

    tokenizer: TokenizerInfo
    mode: Literal["text", "chat"]
    column: str = Field(description="The text column, or the messages column in chat mode.")
    chat_template_sha256: str | None = Field(description="sha256 of the chat template used (chat mode).")
    train_on: Literal["assistant", "all"] = Field(description="Chat mode: which tokens keep their labels.")
    eos: bool = Field(description="Whether EOS was appended to every text document.")


class BuildOptions(_Model):
    """Every option that changes the bytes of the output."""

    max_len: int = Field(ge=1, le=2**31 - 1, description="Longest pack, in tokens.")
    algorithm: Literal["ffd", "bfd"] = Field(description="First-fit or best-fit decreasing.")
    overflow: Literal["split", "truncate", "drop", "error"] = Field(
        description="What happens to documents longer than max_len."
    )
    seed: int = Field(ge=0, description="Seed of the pack-order shuffle.")
    shard_size: int = Field(ge=1, description="Target shard size in bytes.")
    column: str = Field(description="Token column read from the corpus.")
    labels_column: str | None = Field(description="Labels column carried through, if the corpus had one.")
    drop_untrained: bool = Field(
        default=False, description="Whether documents with no trained token were left out of the packs."
    )
    tokenize: TokenizeOptions | None = Field(
        default=None, description="Set when the corpus was text or chat, tokenized by the build."
    )


class InputFile(_Model):
    path: str = Field(description="Path relative to the corpus root, '/'-separated.")
    rows: int = Field(ge=0)


class Totals(_Model):
    documents: int = Field(ge=0, description="Rows read from the corpus.")
    input_tokens: int = Field(ge=0, description="Tokens read from the corpus.")
    tokens: int = Field(ge=0, description="Tokens written into packs.")
    segments: int = Field(ge=0, description="Documents and document pieces written into packs.")
    packs: int = Field(ge=0)
    padding_tokens: int = Field(ge=0, description="packs * max_len - tokens.")
    lower_bound: int = Field(ge=0, description="ceil(tokens / max_len): no packing can use fewer packs.")
    empty: int = Field(ge=0, description="Documents with no tokens (never packed).")
    split: int = Field(ge=0, description="Documents longer than max_len split into pieces.")
    split_pieces: int = Field(ge=0, description="Pieces those documents became.")
    truncated: int = Field(ge=0, description="Documents cut to max_len.")
    truncated_tokens: int = Field(ge=0, description="Tokens cut off by truncation.")
    dropped: int = Field(ge=0, description="Documents longer than max_len left out.")
    dropped_tokens: int = Field(ge=0)
    untrained: int = Field(
        default=0,
        ge=0,
        description="Documents with tokens but no trained token (every label after the first is -100); "
        "left out of the packs when options.drop_untrained.",
    )
    untrained_tokens: int = Field(default=0, ge=0, description="Tokens of those documents.")


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
        self._streams[1].update(ids.astype("<i4", copy=False).data)
        if labels is not None:
            self._streams[2].update(labels.astype("<i4", copy=False).data)

    def hexdigest(self) -> str:
        return hashlib.sha256(b"".join(stream.digest() for stream in self._streams)).hexdigest()


class ShardInfo(_Model):
    name: str
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(_Model):
    """`manifest.json`: written last; a directory without one is not a finished build."""

    format_version: Literal[2] = FORMAT_VERSION
    prepack_version: str
    options: BuildOptions
    has_labels: bool
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 over the documents as read: lengths, token ids and labels, in row order.",
    )
    inputs: list[InputFile]
    totals: Totals
    shards: list[ShardInfo]


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write `manifest.json` atomically (temporary file + rename), keys sorted."""
    text = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, directory / MANIFEST_NAME)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and strictly validate `manifest.json`; unknown format versions are refused."""
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if (Path(directory) / STORE_MANIFEST_NAME).exists():
            raise FormatError(
                f"{directory} is a prepack document store ({STORE_MANIFEST_NAME}), not a build: pack it with "
                f"`prepack build {directory} --max-len N --out DIR`."
            ) from None
        raise FormatError(
            f"{path} does not exist: {directory} is not a finished prepack build "
            "(the manifest is written last)."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path} cannot be read as JSON: {exc}") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{path} has format_version {version!r}; this prepack reads version {FORMAT_VERSION}. "
            "Rebuild the shards or use the prepack version that wrote them."
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise FormatError(f"{path} is not a valid prepack manifest:\n{exc}") from None


class ShardFileProblem(NamedTuple):
    """A way the shard files differ from the manifest, as `shard_file_problems` finds it."""

    index: int  # the shard's position in manifest.shards
    kind: Literal["name", "missing", "size"]  # "name" and "missing": there is no file to read
    file: str  # where the problem is: MANIFEST_NAME for a wrong name, else the shard's file name
    message: str  # what is wrong, without the file


def shard_file_problems(directory: Path, manifest: Manifest) -> Iterator[ShardFileProblem]:
    """What the manifest promises about its shard files, checked with `stat` only (no shard is read),
    in manifest order: each shard named `shard_name(index)`, present, and of the manifest's size.

    A shard with another name is not looked at: that also keeps a hand-edited name like "../x.arrow"
    from reaching outside the build.
    """
    for index, info in enumerate(manifest.shards):
        if info.name != shard_name(index):
            message = f"shard {index} is named {info.name!r}, not {shard_name(index)!r}."
            yield ShardFileProblem(index, "name", MANIFEST_NAME, message)
            continue
        try:
            size = (directory / info.name).stat().st_size
        except FileNotFoundError:
            message = f"missing; the manifest lists it with {info.rows} packs, {info.bytes} bytes."
            yield ShardFileProblem(index, "missing", info.name, message)
            continue
        if size != info.bytes:
            message = f"{size} bytes, but the manifest says {info.bytes} (truncated or replaced?)."
            yield ShardFileProblem(index, "size", info.name, message)


def shard_sha256(path: Path) -> str:
    """The hex sha256 of a shard file (what `ShardInfo.sha256` records), read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def open_shard(path: Path, has_labels: bool, max_len: int) -> pa.RecordBatch:
    """Memory-map one shard (zero-copy) and check its schema; the row contents are checked by
    `check_shard`."""
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            batches = list(reader)
    except FileNotFoundError:
        raise FormatError(f"{path}: the shard is missing.") from None
    except (OSError, pa.ArrowException) as exc:
        raise FormatError(f"{path}: not a readable Arrow IPC stream ({exc}).") from None
    expected = shard_schema(has_labels, max_len)
    if not reader.schema.equals(expected, check_metadata=True):
        raise FormatError(
            f"{path}: the schema is\n{reader.schema}\nbut format version {FORMAT_VERSION} "
            f"{'with' if has_labels else 'without'} labels and max_len {max_len} expects\n{expected}"
        )
    if len(batches) != 1:
        raise FormatError(f"{path}: a shard holds exactly one record batch, this one {len(batches)}.")
    return batches[0]


def list_column(batch: pa.RecordBatch, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column as zero-copy numpy views: row r is values[offsets[r]:offsets[r+1]].

    `values` is the whole child array, so the offsets index it directly even in a sliced batch. Nulls
    are refused here, which is also what lets `to_numpy` share the Arrow buffers instead of copying.
    """
    array = batch.column(column)
    if array.null_count:
        raise FormatError(f"column {column!r} has null rows")
    if array.values.null_count:
        raise FormatError(f"column {column!r} has null values")
    return array.offsets.to_numpy(), array.values.to_numpy()


def check_shard(batch: pa.RecordBatch, max_len: int, where: str) -> None:
    """Check every row of a shard against the format, vectorized over the whole batch.

    Raises FormatError naming `where`, the row and the column of the first violation. This is what
    stands between a file from elsewhere and a GPU kernel: `cu_seqlens` out of range is an
    out-of-bounds read there.
    """

    def fail(row: int, column: str, what: str) -> None:
        raise FormatError(f"{where}: row {row}, column {column!r}: {what}")

    try:
        ids_off, ids = list_column(batch, "input_ids")
        seg_off, seg = list_column(batch, "segment_ids")
        cu_off, cu = list_column(batch, "cu_seqlens")
        src_off, _ = list_column(batch, "source_rows")
        piece_off, pieces = list_column(batch, "source_pieces")
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    if batch.column("max_seqlen").null_count:
        raise FormatError(f"{where}: column 'max_seqlen' has null rows")
    max_seqlen = batch.column("max_seqlen").to_numpy()
    rows = batch.num_rows
    if rows == 0:
        return
    # Rebase offsets so a sliced batch works like a fresh one.
    seg = seg[seg_off[0] : seg_off[-1]]
    cu = cu[cu_off[0] : cu_off[-1]]
    pieces = pieces[piece_off[0] : piece_off[-1]]
    n = np.diff(ids_off).astype(np.int64)  # tokens per pack
    docs = np.diff(cu_off).astype(np.int64) - 1  # documents per pack

    def first(mask: np.ndarray) -> int:
        return int(np.flatnonzero(mask)[0])

    if (bad := n > max_len).any():
        r = first(bad)
        fail(r, "input_ids", f"{n[r]} tokens, more than max_len {max_len}")
    if (bad := n == 0).any():
        fail(first(bad), "input_ids", "a pack has no tokens")
    if (bad := np.diff(seg_off) != n).any():
        r = first(bad)
        fail(r, "segment_ids", f"length {np.diff(seg_off)[r]}, but input_ids has {n[r]}")
    if (bad := docs < 1).any():
        fail(first(bad), "cu_seqlens", "needs at least two values [0, ..., tokens]")
    for column, off in (("source_rows", src_off), ("source_pieces", piece_off)):
        if (bad := np.diff(off) != docs).any():
            r = first(bad)
            fail(r, column, f"{np.diff(off)[r]} values for {docs[r]} documents")
    ids = ids[ids_off[0] : ids_off[-1]]
    if len(ids) and ids.min() < 0:  # an embedding lookup with a negative id reads out of bounds
        token = first(ids < 0)
        fail(int(np.searchsorted(ids_off[1:] - ids_off[0], token, "right")), "input_ids", "negative token id")
    if "labels" in batch.schema.names:
        lab_off, labels = list_column(batch, "labels")
        if (bad := np.diff(lab_off) != n).any():
            r = first(bad)
            fail(r, "labels", f"length {np.diff(lab_off)[r]}, but input_ids has {n[r]}")
        labels = labels[lab_off[0] : lab_off[-1]]
        if (bad := (labels < 0) & (labels != IGNORE_INDEX)).any():
            token = first(bad)
            row = int(np.searchsorted(lab_off[1:] - lab_off[0], token, "right"))
            fail(row, "labels", f"{labels[token]} is neither a token id nor {IGNORE_INDEX}")
    if (pieces < 0).any():
        fail(int(np.searchsorted(piece_off[1:] - piece_off[0], first(pieces < 0), "right")),
             "source_pieces", "negative piece number")

    # cu_seqlens: starts at 0, strictly increasing, ends at the row's token count.
    starts = cu_off[:-1] - cu_off[0]
    ends = cu_off[1:] - cu_off[0] - 1
    if (bad := cu[starts] != 0).any():
        fail(first(bad), "cu_seqlens", f"starts at {cu[starts][first(bad)]}, not 0")
    if (bad := cu[ends] != n).any():
        r = first(bad)
        fail(r, "cu_seqlens", f"ends at {cu[ends][r]}, but the pack has {n[r]} tokens")
    step = np.diff(cu)
    inner = np.ones(len(step), dtype=bool)
    inner[ends[:-1]] = False  # the step from one row's last value to the next row's 0
    if (bad := inner & (step <= 0)).any():
        r = int(np.searchsorted(ends, first(bad), "left"))
        fail(r, "cu_seqlens", "values must be strictly increasing (no empty documents)")
    lengths = np.where(inner, step, 0)
    row_of_step = np.repeat(np.arange(rows), docs)
    longest = np.zeros(rows, dtype=np.int64)
    np.maximum.at(longest, row_of_step, lengths[inner])
    if (bad := longest != max_seqlen).any():
        r = first(bad)
        fail(r, "max_seqlen", f"is {max_seqlen[r]}, the longest document is {longest[r]}")

    # segment_ids: document k's tokens carry k, as cu_seqlens says.
    expected = np.repeat(_document_numbers(docs), lengths[inner])
    if (bad := seg != expected).any():
        token = first(bad)
        r = int(np.searchsorted(ids_off[1:] - ids_off[0], token, "right"))
        fail(r, "segment_ids", f"token {token - (ids_off[r] - ids_off[0])} has {seg[token]}, "
             f"cu_seqlens says {expected[token]}")


def _document_numbers(docs_per_pack: np.ndarray) -> np.ndarray:
    """[2, 3] -> [1, 2, 1, 2, 3]: the 1-based number of every document inside its pack."""
    total = int(docs_per_pack.sum())
    first_of_pack = np.repeat(np.cumsum(docs_per_pack) - docs_per_pack, docs_per_pack)
    return (np.arange(total, dtype=np.int64) - first_of_pack + 1).astype(np.int32)
