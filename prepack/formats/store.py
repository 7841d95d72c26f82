"""The document store's format: one description that its writer (`prepack.building.write_store`) and reader
(`prepack.sources.store`) are built against.

A store holds a corpus's documents once, tokenized, in corpus row order, so that any number of builds
(other max-lens, seeds, algorithms) read them without tokenizing again. The normative text is
`schemas/store-format.md`; `schemas/store.schema.json` is generated from `StoreManifest` below, and
`tests/formats/test_store.py` fails when either drifts from this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, ValidationError, model_validator

from prepack.errors import FormatError
from prepack.formats.common import INT32_MAX, StrictModel, format_error, load_manifest_json, numpy_view
from prepack.formats.shards import (
    IGNORE_INDEX,
    MANIFEST_NAME,
    STORE_MANIFEST_NAME,
    TOKEN_TYPE,
    InputFile,
    TokenizeOptions,
    shard_file_problems,
)

__all__ = [
    "STORE_MANIFEST_NAME",
    "STORE_VERSION",
    "STORE_VERSION_KEY",
    "LengthSummary",
    "StoreManifest",
    "StoreShard",
    "check_store_files",
    "check_store_offsets",
    "check_store_shard",
    "read_store_manifest",
    "store_error",
    "store_schema",
    "store_shard_name",
    "write_store_manifest",
]

STORE_VERSION = 1
STORE_VERSION_KEY = "prepack.store_version"  # schema metadata of every store shard: marks it as a store's


def store_schema(has_labels: bool) -> pa.Schema:
    """The Arrow schema of every shard of a store; `labels` only when the documents have them."""
    fields = [pa.field("input_ids", pa.list_(TOKEN_TYPE), nullable=False)]
    if has_labels:
        fields.append(pa.field("labels", pa.list_(TOKEN_TYPE), nullable=False))
    return pa.schema(fields, metadata={STORE_VERSION_KEY: str(STORE_VERSION)})


def store_shard_name(index: int) -> str:
    return f"documents-{index:05d}.arrow"


class StoreShard(StrictModel):
    name: str
    documents: int = Field(ge=0, description="Rows: consecutive documents, in corpus row order.")
    tokens: int = Field(ge=0, le=INT32_MAX)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class LengthSummary(StrictModel):
    """The documents' lengths in tokens, for choosing max-lens without reading the store."""

    min: int = Field(ge=0)
    max: int = Field(ge=0)
    mean: float = Field(ge=0)
    p50: int = Field(ge=0, description="Percentiles: numpy's 'lower' method, so a length that occurs.")
    p90: int = Field(ge=0)
    p99: int = Field(ge=0)
    empty: int = Field(ge=0, description="Documents with no tokens.")
    untrained: int = Field(
        ge=0, description="Documents with tokens but no trained token (every label after the first is -100)."
    )


class StoreManifest(StrictModel):
    """`store.json`: written last; a directory without one is not a finished store."""

    store_version: Literal[1] = STORE_VERSION
    prepack_version: str
    column: str = Field(description="The corpus column read: token ids, or text / messages when tokenized.")
    labels_column: str | None = Field(description="The labels column read from the corpus, if any (never when tokenized).")
    tokenize: TokenizeOptions | None = Field(description="Set when the corpus was text or chat, tokenized into the store.")
    has_labels: bool
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 over the documents: lengths, token ids and labels, in row order; a build's definition.",
    )
    inputs: list[InputFile] = Field(min_length=1, description="The corpus files, in row order.")
    documents: int = Field(ge=1)
    tokens: int = Field(ge=0)
    lengths: LengthSummary
    shards: list[StoreShard] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> StoreManifest:
        """What the manifest says agrees with itself: shard names the format's (so none leaves the
        store), counts that add up."""
        for index, shard in enumerate(self.shards):
            if shard.name != store_shard_name(index):
                raise ValueError(f"shard {index} is named {shard.name!r}, not {store_shard_name(index)!r}")
        for field, listed, total in (
            ("documents", sum(s.documents for s in self.shards), self.documents),
            ("tokens", sum(s.tokens for s in self.shards), self.tokens),
            ("documents", sum(f.rows for f in self.inputs), self.documents),
        ):
            if listed != total:
                raise ValueError(f"its shards or inputs add up to {listed} {field}, but it says {total}")
        return self  # input names: `InputFile` checks them


def write_store_manifest(directory: Path, manifest: StoreManifest) -> None:
    """Write `store.json` atomically (temporary file + rename), keys sorted."""
    text = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    tmp = directory / f".{STORE_MANIFEST_NAME}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, directory / STORE_MANIFEST_NAME)


def read_store_manifest(directory: str | os.PathLike | bytes, name: str = STORE_MANIFEST_NAME) -> StoreManifest:
    """Read and strictly validate `store.json` of the store `directory` (`StoreManifest`, its own
    checks included), or the bytes of one (`directory` a `bytes`, read from object storage), which
    messages then call `name` (its URI). Raises FormatError."""
    try:
        path, raw = load_manifest_json(directory, STORE_MANIFEST_NAME, name)
    except FileNotFoundError:
        build = (Path(directory) / MANIFEST_NAME).exists()
        raise FormatError(
            f"{directory} is a prepack build, not a document store (it has {MANIFEST_NAME}, no {STORE_MANIFEST_NAME})."
            if build
            else f"{Path(directory) / STORE_MANIFEST_NAME} does not exist: {directory} is not a finished prepack document store."
        ) from None
    version = raw.get("store_version") if isinstance(raw, dict) else None
    if version != STORE_VERSION:
        raise FormatError(
            f"{path} has store_version {version!r}; this prepack reads version {STORE_VERSION}. "
            "Tokenize the corpus again or use the prepack version that wrote the store."
        )
    try:
        manifest = StoreManifest.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise FormatError(f"{path} is not a valid prepack store manifest:\n{exc}") from None
    return manifest


def check_store_files(directory: Path, manifest: StoreManifest) -> None:
    """Every shard the manifest names is a regular file in `directory` (no symbolic link) of the
    manifest's size, checked with `lstat` only (`shard_file_problems`). Raises FormatError naming the
    first that is not."""
    problems = shard_file_problems(directory, manifest, store_shard_name, "the store manifest")
    if (problem := next(problems, None)) is not None:
        raise store_error(directory / problem.file, problem.message)


def store_error(
    where: str | os.PathLike, message: str, row: int | None = None, column: str | None = None
) -> FormatError:
    """The error for a store shard that breaks the format: its message names `where` (the shard), the
    row and the column, which `FormatError.problem` carries as fields."""
    return format_error(where, message, row, column)


def check_store_offsets(batch: pa.RecordBatch, shard: StoreShard, has_labels: bool, where: str) -> np.ndarray:
    """Check a shard's one record batch as far as its documents' places go, reading no token: schema,
    no null (document or token, as the batch declares them), row and token counts against its manifest
    entry, `input_ids` offsets from 0 to the number of its values and never decreasing, `labels` with
    the same offsets and values. The batch's buffers must be as long as their lengths say
    (`RecordBatch.validate()`). Returns the offsets as int64. Raises FormatError naming `where`, the
    row and the column (`FormatError.problem`)."""
    expected = store_schema(has_labels)
    if not batch.schema.equals(expected, check_metadata=True):
        raise store_error(
            where, f"the schema is\n{batch.schema}\nbut store version {STORE_VERSION} expects\n{expected}"
        )
    ids = batch.column("input_ids")
    if batch.num_rows != shard.documents or len(ids.values) != shard.tokens:
        raise store_error(
            where,
            f"{batch.num_rows} documents and {len(ids.values)} tokens, "
            f"but the store manifest says {shard.documents} and {shard.tokens}.",
        )
    offsets = _offsets(ids)
    if offsets[0] != 0 or offsets[-1] != len(ids.values):
        message = f"offsets run from {offsets[0]} to {offsets[-1]}, not 0 to {len(ids.values)}."
        raise store_error(where, message, column="input_ids")
    if (shrinking := np.flatnonzero(offsets[1:] < offsets[:-1])).size:
        raise store_error(where, "its offsets decrease: a negative length.", int(shrinking[0]), "input_ids")
    for column in expected.names:
        array = batch.column(column)
        if array.null_count:
            row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
            raise store_error(where, "a null document.", row, column)
        if array.values.null_count:
            raise store_error(where, "a null token.", column=column)
        if column != "input_ids" and not np.array_equal(mine := _offsets(array), offsets):
            row = int(np.flatnonzero(mine != offsets)[0]) - 1 if len(mine) == len(offsets) else 0
            raise store_error(where, "not as long as input_ids.", max(row, 0), column)
        if len(array.values) != len(ids.values):
            raise store_error(where, f"{len(array.values)} values for {len(ids.values)} tokens.", column=column)
    return offsets


def _offsets(array: pa.ListArray) -> np.ndarray:
    """A list column's offsets as int64 (a batch of no rows may have none: then [0])."""
    return numpy_view(array.offsets).astype(np.int64) if len(array.offsets) else np.zeros(1, np.int64)


def check_store_shard(batch: pa.RecordBatch, shard: StoreShard, has_labels: bool, where: str) -> np.ndarray:
    """`check_store_offsets`, then every token: ids non-negative, labels a token id or -100. The
    batch must be validated in full (`RecordBatch.validate(full=True)`). Returns the offsets as int64.
    Raises FormatError naming `where`, the row and the column (`FormatError.problem`)."""
    offsets = check_store_offsets(batch, shard, has_labels, where)
    for column in store_schema(has_labels).names:
        array = batch.column(column)
        values = numpy_view(array.values)
        bad = values < 0 if column == "input_ids" else (values < 0) & (values != IGNORE_INDEX)
        if bad.any():
            token = int(np.flatnonzero(bad)[0])
            row = int(np.searchsorted(offsets, token, "right")) - 1
            raise store_error(where, f"{values[token]} is not a valid value.", row, column)
    return offsets
