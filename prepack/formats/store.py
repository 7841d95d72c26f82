"""The document store's format: one description that its writer (`prepack.building.write_store`) and reader
(`prepack.sources.store`) are built against.

A store holds a corpus's documents once, tokenized, in corpus row order, so that any number of builds
(other max-lens, seeds, algorithms) read them without tokenizing again. The normative text is
`schemas/store-format.md`; `schemas/store.schema.json` is generated from `StoreManifest` below, and
`tests/formats/test_store.py` fails when either drifts from this module.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, ValidationError, model_validator

from prepack.errors import FormatError
from prepack.formats.common import (
    INT32_MAX, Fingerprint, StrictModel, field_path, format_error, length_count_sums, load_manifest_json, numpy_view,
)
from prepack.formats.shards import (
    IGNORE_INDEX,
    MANIFEST_NAME,
    STORE_MANIFEST_NAME,
    TOKEN_TYPE,
    InputFile,
    PairOptions,
    TokenizeOptions,
    shard_file_problems,
)

__all__ = [
    "GROWN_STORE_VERSION",
    "PAIR_STORE_VERSION",
    "STORE_MANIFEST_NAME",
    "STORE_VERSION",
    "STORE_VERSION_KEY",
    "LengthSummary",
    "StoreFingerprint",
    "StoreGeneration",
    "StoreManifest",
    "StoreShard",
    "chained_fingerprint",
    "check_store_files",
    "check_store_offsets",
    "check_store_shard",
    "read_store_manifest",
    "store_error",
    "store_schema",
    "store_shard_name",
    "store_version_of",
    "write_store_manifest",
]

STORE_VERSION = 1
STORE_VERSION_KEY = "prepack.store_version"  # schema metadata of every store shard: marks it as a store's
# `store_version` of the manifest of a store grown by appends (`generations`); its shards are those of
# version 1, metadata included, so that an append leaves every shard written before byte for byte as it was.
GROWN_STORE_VERSION = 2
# `store_version` of the manifest of a store of preference pairs or groups (`pairs`), grown by appends or not: a
# reader that knows only versions 1 and 2 refuses it by its version, instead of reading its groups as documents.
# Its shards are those of version 1 too, cut at group boundaries.
PAIR_STORE_VERSION = 3


def store_version_of(pairs: bool, grown: bool) -> int:
    """The `store_version` of a store's manifest: of pairs or groups (`pairs`), grown by appends (`grown`)."""
    return PAIR_STORE_VERSION if pairs else GROWN_STORE_VERSION if grown else STORE_VERSION


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


class StoreGeneration(StrictModel):
    """The store as it stood after its tokenizing (generation 0) or after an append: each count up to
    and including this generation, so generation g's documents are those after generation g - 1's."""

    documents: int = Field(ge=1, description="Documents of the store up to this generation.")
    inputs: int = Field(ge=1, description="Corpus files (inputs[]) up to this generation.")
    shards: int = Field(ge=1, description="Shards up to this generation.")
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="The store's fingerprint as of this generation: generation 0's the documents' fingerprint, "
        "each later one chained (`chained_fingerprint`) with the fingerprint of the documents it added.",
    )


def chained_fingerprint(previous: str, added: str) -> str:
    """The fingerprint of a store grown by documents of fingerprint `added` (`Fingerprint`, of those
    documents alone) from one of fingerprint `previous`: hex sha256 of the two 32-byte digests. An
    append so hashes only what it adds, and each generation's fingerprint stays checkable."""
    return hashlib.sha256(bytes.fromhex(previous) + bytes.fromhex(added)).hexdigest()


class StoreManifest(StrictModel):
    """`store.json`: written last; a directory without one is not a finished store."""

    store_version: Literal[1, 2, 3] = STORE_VERSION
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
    generations: list[StoreGeneration] | None = Field(
        default=None,
        min_length=2,
        description="Only in a store grown by appends (store_version 2, or 3 of pairs): the store after its tokenizing and "
        "after each append, in order. Absent from a store never appended to.",
    )
    length_counts: list[list[int]] | None = Field(
        default=None,
        description="Only in a store grown by appends: how many documents have each length, as [length, count] "
        "pairs by rising length, from which the next append summarises `lengths` without reading the shards.",
    )
    pairs: PairOptions | None = Field(
        default=None,
        description="Only in a store of preference pairs or groups (store_version 3, `--pairs`, `--groups`): how "
        "they were read. Group r is documents Gr … Gr + G - 1 (G = 2 a pair: chosen, rejected), each prompt + "
        "completion, labelled -100 on the prompt (the group's prompt length: the same in each of its documents) and "
        "with its ids on the completion; every shard and input holds whole groups. Absent from a store of documents.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> StoreManifest:
        """What the manifest says agrees with itself: shard names the format's (so none leaves the
        store), counts that add up, generations that cut the shards and inputs where their documents end."""
        if self.store_version != store_version_of(self.pairs is not None, self.generations is not None):
            with_pairs = "" if self.pairs is None else " of pairs or groups"
            raise ValueError(f"store_version {self.store_version}{with_pairs} with{'out' if self.generations is None else ''} generations")
        if self.pairs is not None and (not self.has_labels or self.tokenize is None):
            raise ValueError("a store of pairs or groups is tokenized and has labels")
        if self.pairs is not None and (self.pairs.scores_column, self.pairs.ranks_column) != (None, None):
            raise ValueError("a store of groups holds no scores or ranks (scores_column, ranks_column)")
        size = 1 if self.pairs is None else self.pairs.size
        for what, counts in (("shard", [s.documents for s in self.shards]), ("input", [f.rows for f in self.inputs])):
            if (split := next((i for i, count in enumerate(counts) if count % size), None)) is not None:
                raise ValueError(f"{what} {split} holds {counts[split]} documents, not whole groups of {size}")
        before = (0, 0, 0)  # documents, inputs and shards up to the generation before
        for number, g in enumerate(self.generations or []):
            if not all(now > then for now, then in zip((g.documents, g.inputs, g.shards), before)):
                raise ValueError(f"generation {number} adds no document, input or shard to the one before")
            in_shards = sum(s.documents for s in self.shards[: g.shards])
            in_inputs = sum(f.rows for f in self.inputs[: g.inputs])
            if g.shards > len(self.shards) or g.inputs > len(self.inputs) or not in_shards == in_inputs == g.documents:
                raise ValueError(
                    f"generation {number}'s {g.documents} documents are not those of its first {g.shards} shards and {g.inputs} inputs"
                )
            before = (g.documents, g.inputs, g.shards)
        if self.length_counts is not None:
            if self.generations is None or not self.length_counts:
                raise ValueError("length_counts are recorded in a grown store only, and never empty")
            try:
                sums = length_count_sums(self.length_counts, 0)
            except ValueError as exc:
                raise ValueError(f"length_counts {exc}") from None
            if sums != (self.documents, self.tokens):
                raise ValueError("its length_counts are not its documents and tokens")
        if self.generations is not None and len({f.path for f in self.inputs}) < len(self.inputs):
            raise ValueError("two inputs of a grown store have one name: a document's file would be ambiguous")
        last = self.generations[-1] if self.generations is not None else None
        if last is not None and (last.documents, last.inputs, last.shards, last.fingerprint) != (
            self.documents, len(self.inputs), len(self.shards), self.fingerprint
        ):
            raise ValueError("its last generation is not the whole store (documents, inputs, shards and fingerprint)")
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


    def generation_of(self, fingerprint: str) -> int | None:
        """The generation whose fingerprint is `fingerprint` (0 for a store never appended to whose
        fingerprint it is), or None when the store never had it."""
        found = [g.fingerprint for g in self.generations] if self.generations is not None else [self.fingerprint]
        return found.index(fingerprint) if fingerprint in found else None

    def at_generation(self, number: int) -> StoreManifest:
        """The manifest of the store as it stood at generation `number` (its first shards and inputs,
        the fingerprint it had then); `lengths` stays the whole store's, being only a summary."""
        if self.generations is None or number == len(self.generations) - 1:
            return self
        g = self.generations[number]
        return self.model_copy(update={
            "store_version": store_version_of(self.pairs is not None, number > 0),
            "fingerprint": g.fingerprint,
            "inputs": self.inputs[: g.inputs],
            "documents": g.documents,
            "tokens": sum(s.tokens for s in self.shards[: g.shards]),
            "shards": self.shards[: g.shards],
            "generations": self.generations[: number + 1] if number else None,
            "length_counts": None,  # the whole store's
        })

    def since_generation(self, number: int) -> StoreManifest:
        """The documents added after generation `number`: a manifest of the later shards and inputs
        alone (what an append to a build reads), not a store's on its own."""
        g = self.generations[number]
        return self.model_copy(update={
            "inputs": self.inputs[g.inputs :],
            "documents": self.documents - g.documents,
            "tokens": self.tokens - sum(s.tokens for s in self.shards[: g.shards]),
            "shards": self.shards[g.shards :],
            "length_counts": None,  # the whole store's
        })


class StoreFingerprint:
    """A store's fingerprint recomputed from its documents, fed in row order in batches that no
    generation's end falls inside (shards, or parts of them: `update`): of a store never appended to,
    the documents' `Fingerprint`; of a grown one, each generation's documents hashed alone and chained
    (`chained_fingerprint`). `found` holds each generation's. Of the manifest of the documents added
    after a generation (`StoreManifest.since_generation`), the generations up to it are taken as
    recorded, and the chain goes on from there."""

    def __init__(self, manifest: StoreManifest) -> None:
        generations = manifest.generations or []
        before = generations[-1].documents - manifest.documents if generations else 0
        self.found: list[str] = [g.fingerprint for g in generations if g.documents <= before]
        self._ends = [g.documents - before for g in generations if g.documents > before] or [manifest.documents]
        self._fed, self._ended, self._documents = 0, 0, Fingerprint()

    def update(self, lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray | None) -> None:
        """Add the next documents."""
        self._documents.update(lengths, ids, labels)
        self._count(len(lengths))

    def update_ids(self, ids: np.ndarray) -> None:
        """`Fingerprint.update_ids` of the next documents, whose lengths `update` (with no ids) adds last."""
        self._documents.update_ids(ids)

    def update_labels(self, labels: np.ndarray) -> None:
        self._documents.update_labels(labels)

    def _count(self, documents: int) -> None:
        self._fed += documents
        if self._fed == self._ends[self._ended]:
            added = self._documents.hexdigest()
            self.found.append(chained_fingerprint(self.found[-1], added) if self.found else added)
            self._documents, self._ended = Fingerprint(), self._ended + 1

    def hexdigest(self) -> str:
        """The fingerprint of every shard fed (all of them: `update` ends a generation at its last)."""
        return self.found[-1]


def write_store_manifest(directory: Path, manifest: StoreManifest) -> None:
    """Write `store.json` atomically (temporary file + rename), keys sorted. A store never appended to
    has no `generations` key, so its bytes are those of before appends."""
    optional = ("generations", "length_counts", "pairs")
    fields = manifest.model_dump(mode="json", exclude={name for name in optional if getattr(manifest, name) is None})
    text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
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
    if type(version) is not int or version not in (STORE_VERSION, GROWN_STORE_VERSION, PAIR_STORE_VERSION):
        raise format_error(
            path, f"has store_version {version!r}; this prepack reads versions {STORE_VERSION} to {PAIR_STORE_VERSION}. "
            "Tokenize the corpus again or use the prepack version that wrote the store.", column="store_version",
        )
    try:
        manifest = StoreManifest.model_validate(raw, strict=True)
    except ValidationError as exc:
        field = field_path(exc.errors()[0]["loc"])  # "(top level)": the manifest as a whole (`StoreManifest._consistent`)
        raise format_error(path, f"is not a valid prepack store manifest:\n{exc}", column=None if field == "(top level)" else field) from None
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
