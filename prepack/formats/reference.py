"""Reference log-probabilities: a frozen model's summed completion log-probability of every document of a
preference-pair build, computed once (`prepack.training.reference.write_reference_logps`) and stored beside
the build, as `schemas/reference-logps.md` describes.

A reference directory holds `reference.json` (`ReferenceManifest`: the build's fingerprint, the model's
description, one entry per finished file) and, per build shard i, `reference-{i:05d}.arrow`: an Arrow IPC
stream of one record batch, a row per pack of shard i, one column `logps` (list<float64>), each pack's
documents' values in the pack's document order. Read here, without torch; checked against the build by
`read_reference_manifest` and `read_reference_file`, the one check of the loader, `verify --reference` and a
rerun of the writer.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, ValidationError

from prepack.formats.common import (
    COUNT_MAX,
    StrictModel,
    first_index,
    list_column,
    load_manifest_json,
    map_regular,
    read_one_batch,
    refuse,
)
from prepack.formats.shards import Manifest, ShardInfo

__all__ = [
    "REFERENCE_MANIFEST",
    "REFERENCE_SCHEMA",
    "REFERENCE_VERSION",
    "ReferenceFile",
    "ReferenceLogps",
    "ReferenceManifest",
    "ReferenceModel",
    "build_shard_documents",
    "read_reference_file",
    "read_reference_manifest",
    "reference_file_name",
    "unfinished",
]

REFERENCE_VERSION = 1
REFERENCE_MANIFEST = "reference.json"
REFERENCE_SCHEMA = pa.schema([pa.field("logps", pa.list_(pa.field("item", pa.float64(), nullable=False)), nullable=False)])


def reference_file_name(index: int) -> str:
    """The file of build shard `index`'s reference log-probabilities."""
    return f"reference-{index:05d}.arrow"


class ReferenceModel(StrictModel):
    """What computed the values: a rerun into the same directory must be this model."""

    name: str = Field(description="The model's name (its config's name_or_path, or what the caller gave); informative.")
    config_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of its config as JSON (to_dict() without _name_or_path, keys sorted), or of '' without one.",
    )
    weights_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 over its state_dict in key order: per tensor its name, dtype, shape and raw bytes.",
    )


class ReferenceFile(StrictModel):
    name: str
    shard_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The build shard's sha256 (its manifest's).")
    rows: int = Field(ge=0, le=COUNT_MAX)
    bytes: int = Field(ge=1, le=COUNT_MAX)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ReferenceManifest(StrictModel):
    """`reference.json`: rewritten (atomically) after each file is finished; `files` lists the finished
    ones, in shard order. Complete when it lists one per build shard."""

    reference_version: Literal[1] = REFERENCE_VERSION
    build_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$", description="The build's manifest fingerprint.")
    shards: int = Field(ge=0, le=COUNT_MAX, description="The build's shard count: files when complete.")
    model: ReferenceModel
    files: list[ReferenceFile]

    @property
    def complete(self) -> bool:
        return len(self.files) == self.shards


def unfinished(manifest: ReferenceManifest) -> str:
    """What a reader and a writer say of a directory whose manifest lists fewer files than the build has shards."""
    return (f"lists {len(manifest.files)} of the build's {manifest.shards} shards: not a finished reference directory "
            "(write_reference_logps publishes one only when every value is computed)")


def read_reference_manifest(directory: str | os.PathLike, build: Manifest | None = None) -> ReferenceManifest:
    """Read `reference.json` of `directory` strictly (FormatError naming it); files named otherwise
    than `reference_file_name` gives, or out of shard order, are refused, and so, given `build`, are the
    values of another build (`_check_against_build`)."""
    directory = Path(directory)
    try:
        where, value = load_manifest_json(directory, REFERENCE_MANIFEST, REFERENCE_MANIFEST)
    except FileNotFoundError:
        refuse(directory / REFERENCE_MANIFEST, "does not exist: not a directory of reference log-probabilities.")
    version = value.get("reference_version") if isinstance(value, dict) else None
    if type(version) is not int or version != REFERENCE_VERSION:
        refuse(where, f"reference_version {version!r} is not one this prepack reads ({REFERENCE_VERSION}).")
    try:
        manifest = ReferenceManifest.model_validate(value, strict=True)
    except ValidationError as exc:
        refuse(where, f"is not a valid reference manifest:\n{exc}")
    for index, file in enumerate(manifest.files):
        if file.name != reference_file_name(index):
            refuse(where, f"files[{index}] is named {file.name!r}; it must be {reference_file_name(index)!r}.", column="files")
    if len(manifest.files) > manifest.shards:
        refuse(where, f"lists {len(manifest.files)} files for {manifest.shards} shards.", column="files")
    if build is not None:
        _check_against_build(manifest, build, where)
    return manifest


def _check_against_build(manifest: ReferenceManifest, build: Manifest, where: str | os.PathLike) -> None:
    """Refuse (FormatError naming `where`) reference values of another build: fingerprint, shard count,
    and each listed file's build shard sha256 and rows against the build manifest's."""
    if manifest.build_fingerprint != build.fingerprint or manifest.shards != len(build.shards):
        refuse(where, f"holds the reference log-probabilities of the build with fingerprint {manifest.build_fingerprint} "
               f"({manifest.shards} shards), not of this one ({build.fingerprint}, {len(build.shards)} shards).",
               column="build_fingerprint")
    for file, shard in zip(manifest.files, build.shards):
        if file.shard_sha256 != shard.sha256 or file.rows != shard.rows:
            refuse(where, f"{file.name} was computed on a shard {shard.name} with sha256 {file.shard_sha256} and "
                   f"{file.rows} rows; the build's has {shard.sha256} and {shard.rows}.", column="files")


def read_reference_file(
    directory: Path, file: ReferenceFile, documents: Callable[[], np.ndarray], *, check_sha256: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of one file `reference.json` of `directory` lists, mapped and checked against its entry
    (`_open_reference_file`) and then against `documents()`, its build shard's documents per pack
    (`_check_reference_file`). FormatError names the file. `documents` is called only once the file has passed
    its own checks, so that a missing or damaged file is reported before its build shard is read."""
    batch = _open_reference_file(directory, file, check_sha256=check_sha256)
    return _check_reference_file(batch, documents(), str(directory / file.name))


def _open_reference_file(directory: Path, file: ReferenceFile, *, check_sha256: bool) -> pa.RecordBatch:
    """Memory-map one listed file and read its one record batch (schema checked; size, and with
    `check_sha256` the sha256, against its entry). FormatError names the file."""
    path = directory / file.name
    data = map_regular(path, "reference file")
    if data.size != file.bytes:
        refuse(path, f"holds {data.size} bytes; {REFERENCE_MANIFEST} says {file.bytes}.", column="bytes")
    if check_sha256 and (digest := hashlib.sha256(data).hexdigest()) != file.sha256:
        refuse(path, f"its sha256 is {digest}; {REFERENCE_MANIFEST} records {file.sha256}.", column="sha256")

    def check_schema(schema: pa.Schema) -> None:
        if not schema.equals(REFERENCE_SCHEMA, check_metadata=True):
            refuse(path, f"its schema is {schema}, not {REFERENCE_SCHEMA}.")

    batch = read_one_batch(data, "reference file", str(path), check_schema)
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        refuse(path, f"its column is not valid Arrow data ({exc}).")
    return batch


def _check_reference_file(batch: pa.RecordBatch, documents: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a reference file's `logps`, checked against `documents`, the build shard's
    documents per pack: a row per pack, a value per document, every value finite and at most 0."""
    if batch.num_rows != len(documents):
        refuse(where, f"holds {batch.num_rows} rows; the build shard holds {len(documents)} packs.", column="logps")
    offsets, values = list_column(batch, "logps", where)
    counts = np.diff(offsets)
    if len(counts) and (wrong := counts != documents).any():
        row = first_index(wrong)
        refuse(where, f"holds {int(counts[row])} values; the pack holds {int(documents[row])} documents.", row, "logps")
    if (bad := ~(np.isfinite(values) & (values <= 0))).any():
        row = int(np.searchsorted(offsets, first_index(bad), side="right")) - 1
        refuse(where, f"value {values[first_index(bad)]!r} is not a log-probability (finite, at most 0).", row, "logps")
    return offsets, values


def build_shard_documents(build: Manifest, path: Path, info: ShardInfo) -> np.ndarray:
    """Documents per pack of one build shard, from its `cu_seqlens` offsets (opened as the format says)."""
    offsets, _ = list_column(build.open_shard(path), "cu_seqlens", info.name)
    return np.diff(offsets).astype(np.int64) - 1


class ReferenceLogps:
    """A complete reference directory of a build, as a loader reads it: `shard` maps and checks one file
    (`read_reference_file`) and gives its (offsets, values)."""

    def __init__(self, directory: str | os.PathLike, build: Manifest):
        self.directory = Path(directory)
        self.manifest = read_reference_manifest(self.directory, build)
        if not self.manifest.complete:
            refuse(self.directory / REFERENCE_MANIFEST, f"{unfinished(self.manifest)}.", column="files")

    def shard(self, index: int, documents: np.ndarray, *, check_sha256: bool = False) -> tuple[np.ndarray, np.ndarray]:
        return read_reference_file(self.directory, self.manifest.files[index], lambda: documents, check_sha256=check_sha256)
