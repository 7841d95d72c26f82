"""The shard format: one description that the writer and every reader are built against.

The normative text is `schemas/shard-format.md`; `schemas/manifest.schema.json` is generated from
`Manifest` below. `tests/formats/test_format.py` fails when either drifts from this module.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from collections.abc import Callable
from typing import Annotated, Literal, NamedTuple, Protocol

import numpy as np
import pyarrow as pa
from pydantic import AfterValidator, Field, ValidationError, model_validator

from prepack.errors import ArgumentTypeError, OutputError
from prepack.formats.common import (
    COUNT_MAX,
    INT32_MAX,
    MANIFEST_MAX_BYTES,
    StrictModel,
    file_type_name,
    first_index,
    length_count_sums,
    list_column,
    load_manifest_json,
    map_regular,
    numpy_view,
    open_regular,
    read_one_batch,
    refuse,
)
from prepack.formats.mixture import SOURCE_ID_TYPE, MixtureInfo

__all__ = [
    "DESIRABLE_FIELD",
    "FORMAT_VERSION",
    "GROUP_RANKS_FIELD",
    "GROUP_SCORES_FIELD",
    "PAIR_ROLES_FIELD",
    "GROUP_RANKS",
    "GROUP_SCORES",
    "IGNORE_INDEX",
    "MANIFEST_NAME",
    "OUTPUT_KINDS",
    "SHARD_STORE_KEY",
    "SHARD_VERSION_KEY",
    "STORE_MANIFEST_NAME",
    "TOKEN_TYPE",
    "BuildGeneration",
    "BuildOptions",
    "IndexOf",
    "InputFile",
    "Manifest",
    "PackLayout",
    "PairOptions",
    "PairTotals",
    "ShardFileProblem",
    "ShardInfo",
    "StoreReference",
    "TokenizeOptions",
    "TokenizerInfo",
    "Totals",
    "check_layout",
    "check_shard_names",
    "check_index_shard",
    "check_shard",
    "check_shard_sha256",
    "group_ranking_problems",
    "open_shard",
    "pack_layout",
    "read_manifest",
    "segment_id_type",
    "shard_file_problems",
    "shard_name",
    "shard_path",
    "shard_schema",
    "shard_sha256",
    "store_location_problem",
    "store_path_problem",
    "write_manifest",
]

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
# What marks a document store (prepack/formats/store.py), named here so that a reader of builds can say
# so when it is handed a store.
STORE_MANIFEST_NAME = "store.json"
OUTPUT_KINDS = {MANIFEST_NAME: "build", STORE_MANIFEST_NAME: "document store"}  # what each manifest marks
SHARD_VERSION_KEY = "prepack.format_version"  # schema metadata of every shard: marks it as prepack's
SHARD_KIND_KEY = "prepack.shard_kind"  # schema metadata of an index shard only: its value is "index"
# Schema metadata of an index shard only: the fingerprint of the store it was planned from, so that the
# shards (and their sha256) bind the build to that store, whatever its manifest's `store` says.
SHARD_STORE_KEY = "prepack.store_fingerprint"
IGNORE_INDEX = -100  # label value that is not trained on (the PyTorch / HF convention)

TOKEN_TYPE = pa.int32()  # token ids and labels: vocabularies fit in 31 bits, and torch has no uint32 kernels


def segment_id_type(max_len: int) -> pa.DataType:
    """The type of `segment_ids` values. A pack holds at most max_len documents, so with max_len up to
    65,535 every segment id fits 16 bits, and the column costs half the bytes of `input_ids`."""
    return pa.uint16() if max_len <= np.iinfo(np.uint16).max else pa.int32()


# A preference-pair build's shards (`Manifest.pairs`) carry one more per-pack column: each document's
# role in its pair, 0 chosen and 1 rejected (`check_shard` checks the pairing).
PAIR_ROLES = "pair_roles"
# A group build read with scores or ranks (`PairOptions.scores_column`, `ranks_column`) carries, after `pair_roles`,
# each completion document's value from the corpus: `group_scores` float64, finite (reward-model scores, say), and
# `group_ranks` uint8, 1 the best, each group's ranks a standard competition ranking ("1224": ties share a rank, and
# a rank r says that r - 1 of its group rank better; what scipy's `rankdata(method="min")` gives).
GROUP_SCORES = "group_scores"
GROUP_RANKS = "group_ranks"
# An unpaired (KTO) build's shards (`PairOptions.label_column`) carry one more: each example's label, 1 for a
# desirable completion and 0 for an undesirable one, one value per example (2 documents) of the pack. uint8, not
# bool: Arrow packs bools as bits, which no numpy view shares (`list_column` would copy them through pandas).
DESIRABLE = "desirable"
# Their fields, as shards and `prepack.exports.common.training_schema` carry them.
PAIR_ROLES_FIELD = pa.field(PAIR_ROLES, pa.list_(pa.uint8()), nullable=False)
GROUP_SCORES_FIELD = pa.field(GROUP_SCORES, pa.list_(pa.float64()), nullable=False)
GROUP_RANKS_FIELD = pa.field(GROUP_RANKS, pa.list_(pa.uint8()), nullable=False)
DESIRABLE_FIELD = pa.field(DESIRABLE, pa.list_(pa.uint8()), nullable=False)


def _pack_fields(source_row: pa.DataType, sources: bool) -> list[pa.Field]:
    """The per-pack columns: what an index shard holds, and a full shard too; `source_ids` only in a
    mixture's shards (`prepack.formats.mixture`)."""
    return [
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
        pa.field("max_seqlen", pa.int32(), nullable=False),
        pa.field("source_rows", pa.list_(source_row), nullable=False),
        pa.field("source_pieces", pa.list_(pa.int32()), nullable=False),
        *([pa.field("source_ids", pa.list_(SOURCE_ID_TYPE), nullable=False)] if sources else []),
    ]


class IndexOf(NamedTuple):
    """The store an index shard points into: its document count and fingerprint (`Manifest.index_of`).
    `earlier`: of a build grown by appends, the (documents, fingerprint) of the store its earlier
    generations were planned from, whose shards carry those."""

    documents: int
    fingerprint: str
    earlier: tuple[tuple[int, str], ...] = ()

    def planned_from(self, fingerprint: bytes) -> IndexOf | None:
        """The store a shard whose metadata names `fingerprint` points into: this one or an earlier
        generation's; None when it is neither."""
        for documents, known in ((self.documents, self.fingerprint), *self.earlier):
            if fingerprint == known.encode():
                return IndexOf(documents, known)
        return None


def shard_schema(
    has_labels: bool, max_len: int, store: IndexOf | None = None, *, sources: bool = False, pairs: bool = False,
    scores: bool = False, ranks: bool = False, unpaired: bool = False,
) -> pa.Schema:
    """The Arrow schema of every shard of a build; `labels` only when the corpus had them, `source_ids`
    only in a mixture's (`sources`), `pair_roles` only in a preference-pair build's (`pairs`), then
    `group_scores` and `group_ranks` only in a group build's read with them (`scores`, `ranks`), `desirable`
    only in an unpaired build's (`unpaired`).

    With `store`, an index shard's: the per-pack columns alone (and `pair_roles`, last, in a build of a pair
    store), its tokens staying in that store, whose fingerprint its metadata carries. Its `source_rows` are uint32 while the store's document
    numbers fit, which keeps an index build near 12 bytes a document (int64 above)."""
    if store is not None:
        source_row = pa.uint32() if store.documents <= np.iinfo(np.uint32).max + 1 else pa.int64()
        metadata = {SHARD_VERSION_KEY: str(FORMAT_VERSION), SHARD_KIND_KEY: "index", SHARD_STORE_KEY: store.fingerprint}
        roles = [PAIR_ROLES_FIELD] if pairs else []
        return pa.schema([*_pack_fields(source_row, sources), *roles], metadata=metadata)
    fields = [
        pa.field("input_ids", pa.list_(TOKEN_TYPE), nullable=False),
        pa.field("segment_ids", pa.list_(segment_id_type(max_len)), nullable=False),
        *_pack_fields(pa.int64(), sources),
    ]
    if has_labels:
        fields.append(pa.field("labels", pa.list_(TOKEN_TYPE), nullable=False))
    fields += [f for f, present in ((PAIR_ROLES_FIELD, pairs), (GROUP_SCORES_FIELD, scores), (GROUP_RANKS_FIELD, ranks),
                                     (DESIRABLE_FIELD, unpaired)) if present]
    return pa.schema(fields, metadata={SHARD_VERSION_KEY: str(FORMAT_VERSION)})


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


class TokenizerInfo(StrictModel):
    name: str = Field(description="The tokenizer directory's or file's name.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 over its files, by sorted name.")


class TokenizeOptions(StrictModel):
    """How text or chat documents became tokens, when `prepack build` tokenized them."""

    tokenizer: TokenizerInfo
    mode: Literal["text", "chat"]
    column: str = Field(description="The text column, or the messages column in chat mode.")
    chat_template_sha256: str | None = Field(description="sha256 of the chat template used (chat mode).")
    train_on: Literal["assistant", "all"] = Field(description="Chat mode: which tokens keep their labels.")
    eos: bool = Field(description="Whether EOS was appended to every text document.")


GROUP_SIZE_MAX = 255  # a group's documents: its roles 0 … G - 1 are `pair_roles`' uint8 values


def unit_name(size: int, plural: bool = False) -> str:
    """What every message calls one prompt's `size` documents: a "pair" (2, from --pairs or --groups alike) or a
    "group"; `plural`: "pairs" or "groups of G"."""
    if size == 2:
        return "pairs" if plural else "pair"
    return f"groups of {size}" if plural else "group"


class PairOptions(StrictModel):
    """How a preference-pair build (`--pairs`) read its pairs: pair r of the corpus is documents 2r
    (prompt + chosen) and 2r + 1 (prompt + rejected). A group build (`--groups`) is the same with G
    completions a row: group r is documents Gr … Gr + G - 1 (prompt + each completion). An unpaired build
    (`--unpaired`, KTO) has one completion and a label a row: example r is documents 2r (prompt + its completion)
    and 2r + 1 (prompt + its KL completion, the completion of example `kl_partners(N, seed=kl_seed)[r]`)."""

    prompt_column: str = Field(description="The prompt column; a row without one (or null) takes the common prefix of chosen and rejected.")
    chosen_column: str | None = Field(default=None, description="A pair build's chosen column; absent from a group build's.")
    rejected_column: str | None = Field(default=None, description="A pair build's rejected column; absent from a group build's.")
    completions_column: str | None = Field(
        default=None, description="A group build's column of completions (a list a row); absent from a pair build's."
    )
    group_size: int | None = Field(
        default=None, ge=2, le=GROUP_SIZE_MAX, description="A group build's completions a row (G); absent from a pair build's (2)."
    )
    scores_column: str | None = Field(
        default=None, description="A group build's column of G scores a row, stored as `group_scores`; absent without one."
    )
    ranks_column: str | None = Field(
        default=None, description="A group build's column of G ranks a row (1 the best), stored as `group_ranks`; absent without one."
    )
    completion_column: str | None = Field(default=None, description="An unpaired build's completion column; absent otherwise.")
    label_column: str | None = Field(
        default=None, description="An unpaired build's label column (true: desirable); absent otherwise."
    )
    kl_seed: int | None = Field(
        default=None, ge=0, le=COUNT_MAX, description="An unpaired build's seed of its KL completions' plan; absent otherwise."
    )

    @model_validator(mode="after")
    def _pairs_or_groups(self) -> PairOptions:
        kinds = {
            "pairs": (self.chosen_column, self.rejected_column),
            "groups": (self.completions_column, self.group_size),
            "unpaired": (self.completion_column, self.label_column, self.kl_seed),
        }
        given = [kind for kind, values in kinds.items() if any(value is not None for value in values)]
        if len(given) != 1 or any(value is None for value in kinds[given[0]]):
            raise ValueError("pairs name chosen_column and rejected_column; groups completions_column and group_size; "
                             "unpaired examples completion_column, label_column and kl_seed")
        if given[0] != "groups" and (self.scores_column, self.ranks_column) != (None, None):
            raise ValueError("scores_column and ranks_column belong to a group build (completions_column)")
        return self

    @property
    def kind(self) -> Literal["pairs", "groups", "unpaired"]:
        """Which corpus the build read: preference pairs, groups of completions or unpaired (KTO) examples."""
        if self.label_column is not None:
            return "unpaired"
        return "pairs" if self.group_size is None else "groups"

    @property
    def size(self) -> int:
        """Documents a unit: 2 a pair, G a group."""
        return self.group_size or 2

    @property
    def unit(self) -> str:
        """What messages call a unit (`unit_name`; an unpaired build's: an example)."""
        return "example" if self.kind == "unpaired" else unit_name(self.size)


class PairTotals(StrictModel):
    """What a preference-pair build did with its pairs (the documents' counts are in `Totals`); in a group
    build, with its groups (every field counting groups where it says pairs)."""

    pairs: int = Field(ge=0, le=COUNT_MAX, description="Pairs (groups) read: totals.documents / 2 (/ G).")
    truncated: int = Field(ge=0, le=COUNT_MAX, description="Pairs whose completions were cut to fit max_len.")
    dropped: int = Field(ge=0, le=COUNT_MAX, description="Pairs longer than max_len left out.")
    prompt_tokens: int = Field(ge=0, le=COUNT_MAX, description="Prompt tokens in the packs (each pair's twice).")
    completion_tokens: int = Field(ge=0, le=COUNT_MAX, description="Completion tokens in the packs.")
    desirable: int | None = Field(
        default=None, ge=0, le=COUNT_MAX, description="An unpaired build's examples in the packs labelled desirable; absent otherwise."
    )
    undesirable: int | None = Field(
        default=None, ge=0, le=COUNT_MAX, description="An unpaired build's examples in the packs labelled undesirable; absent otherwise."
    )


class BuildOptions(StrictModel):
    """Every option that changes the bytes of the output."""

    max_len: int = Field(ge=1, le=INT32_MAX, description="Longest pack, in tokens.")
    algorithm: Literal["ffd", "bfd"] = Field(description="First-fit or best-fit decreasing.")
    overflow: Literal["split", "truncate", "drop", "error"] = Field(
        description="What happens to documents longer than max_len."
    )
    seed: int = Field(ge=0, le=COUNT_MAX, description="Seed of the pack-order shuffle.")
    shard_size: int = Field(ge=1, le=COUNT_MAX, description="Target shard size in bytes.")
    column: str = Field(description="Token column read from the corpus.")
    labels_column: str | None = Field(description="Labels column carried through, if the corpus had one.")
    drop_untrained: bool = Field(
        default=False, description="Whether documents with no trained token were left out of the packs."
    )
    tokenize: TokenizeOptions | None = Field(
        default=None, description="Set when the corpus was text or chat, tokenized by the build."
    )
    pairs: PairOptions | None = Field(
        default=None, description="Set for a preference-pair build; absent from every other build's manifest."
    )
    max_docs_per_pack: int | None = Field(
        default=None,
        ge=1,
        le=INT32_MAX,
        description="Most documents (segments) a pack holds, beside max_len; absent from a build without a cap.",
    )
    max_images_per_pack: int | None = Field(
        default=None,
        ge=1,
        le=INT32_MAX,
        description="Most images a pack holds (`--max-images-per-pack`), each document counting its image set's "
        "images (every piece of a split one); absent from a build without an image cap.",
    )
    image_set: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="With max_images_per_pack: the sha256 of the images.json of the image set whose image counts were "
        "planned with (it records its files' sha256); `verify --images` and `inspect --images` refuse another.",
    )

    @model_validator(mode="after")
    def _image_cap_and_its_set(self) -> BuildOptions:
        if (self.max_images_per_pack is None) != (self.image_set is None):
            raise ValueError("max_images_per_pack and image_set go together: the image cap and the image set it counted")
        return self

    @property
    def unpaired(self) -> bool:
        """Whether the build read unpaired (KTO) examples (`prepack build --unpaired`)."""
        return self.pairs is not None and self.pairs.kind == "unpaired"


_PATH_MAX, _NAME_MAX = 4096, 255  # bytes of a path and of each of its parts (Linux's PATH_MAX, NAME_MAX)


def _relative_path_problem(path: str) -> str | None:
    """What keeps `path` from being a relative '/'-separated path that every file system holds: None
    when it is one. Checked by the manifests' models, so that a reader refuses it by name before
    `open` or `stat` raise on it (an embedded NUL, a name too long)."""
    encoded = path.encode("utf-8", "surrogatepass")
    if not path or path.startswith("/") or len(encoded) > _PATH_MAX:
        return f"is not a relative path of 1 to {_PATH_MAX} bytes"
    if "\0" in path:
        return "holds a NUL character"
    for part in path.split("/"):
        if part in ("", ".", "..") or len(part.encode("utf-8", "surrogatepass")) > _NAME_MAX:
            return f"has a part that is empty, '.', '..' or longer than {_NAME_MAX} bytes"
    return None


def store_path_problem(path: str) -> str | None:
    """What keeps `path` from naming an index build's store, relative to the build: None when it is
    `../` and then one or more parts, none '..' (`_relative_path_problem` for the rest): a store inside
    the build's parent directory (prefix), so that a manifest never takes a reader elsewhere on the
    machine or into another bucket."""
    if not path.startswith("../"):
        return "does not start with '../': the store must lie in the build's parent directory"
    if ".." in path[3:].split("/"):
        return "climbs out of the build's parent directory: the store must lie in it"
    return _relative_path_problem(path[3:])


def store_location_problem(build: str | os.PathLike, path: str) -> str | None:
    """What keeps `path` from naming the store of the local build at `build`: `store_path_problem`'s
    text rule, then the path resolved. None when each of its parts below the build's parent directory is
    no symbolic link, so that it lies in that directory (that of the build's real path, from which the
    system resolves `build/../`); else the first link. A link shipped with a build (`build/s`, or a
    directory beside it) could take a reader to a store anywhere on the machine. The writer (`build`)
    and every reader of a local build hold its stores to this rule; object storage has no links."""
    if (problem := store_path_problem(path)) is not None:
        return problem
    parent = place = Path(os.path.realpath(build)).parent
    for part in path[3:].split("/"):
        place = place / part
        if os.path.islink(place):
            return f"passes through the symbolic link {place}: the store must lie in the build's parent directory {parent}"
    return None


def _valid(problem: Callable[[str], str | None]) -> AfterValidator:
    """A field validator refusing the values for which `problem` says what is wrong."""

    def check(value: str) -> str:
        if (found := problem(value)) is not None:
            raise ValueError(f"{reprlib.repr(value)} {found}")
        return value

    return AfterValidator(check)


class InputFile(StrictModel):
    path: Annotated[str, _valid(_relative_path_problem)] = Field(
        description="Path relative to the corpus root, '/'-separated, no empty, '.' or '..' part."
    )
    rows: int = Field(ge=0, le=COUNT_MAX)


class Totals(StrictModel):
    documents: int = Field(ge=0, le=COUNT_MAX, description="Rows read from the corpus.")
    input_tokens: int = Field(ge=0, le=COUNT_MAX, description="Tokens read from the corpus.")
    tokens: int = Field(ge=0, le=COUNT_MAX, description="Tokens written into packs.")
    segments: int = Field(ge=0, le=COUNT_MAX, description="Documents and document pieces written into packs.")
    packs: int = Field(ge=0, le=COUNT_MAX)
    padding_tokens: int = Field(ge=0, le=COUNT_MAX, description="packs * max_len - tokens.")
    lower_bound: int = Field(ge=0, le=COUNT_MAX, description="ceil(tokens / max_len): no packing can use fewer packs.")
    empty: int = Field(ge=0, le=COUNT_MAX, description="Documents with no tokens (never packed).")
    split: int = Field(ge=0, le=COUNT_MAX, description="Documents longer than max_len split into pieces.")
    split_pieces: int = Field(ge=0, le=COUNT_MAX, description="Pieces those documents became.")
    truncated: int = Field(ge=0, le=COUNT_MAX, description="Documents cut to max_len.")
    truncated_tokens: int = Field(ge=0, le=COUNT_MAX, description="Tokens cut off by truncation.")
    dropped: int = Field(ge=0, le=COUNT_MAX, description="Documents longer than max_len left out.")
    dropped_tokens: int = Field(ge=0, le=COUNT_MAX)
    untrained: int = Field(
        default=0,
        ge=0,
        le=COUNT_MAX,
        description="Documents with tokens but no trained token (every label after the first is -100); "
        "left out of the packs when options.drop_untrained.",
    )
    untrained_tokens: int = Field(default=0, ge=0, le=COUNT_MAX, description="Tokens of those documents.")


class ShardInfo(StrictModel):
    name: str
    rows: int = Field(ge=0, le=COUNT_MAX)
    tokens: int = Field(ge=0, le=COUNT_MAX)
    bytes: int = Field(ge=0, le=COUNT_MAX)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class StoreReference(StrictModel):
    """The document store an index build takes its tokens from."""

    path: Annotated[str, _valid(store_path_problem)] = Field(
        description="The store's directory, relative to the build's ('/'-separated): '../' and a path "
        "without '..', inside the build's parent directory."
    )
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$", description="The store's fingerprint: readers refuse another.")


class BuildGeneration(StrictModel):
    """A build as it stood after its first build (generation 0) or after an append (`prepack build
    STORE --out DIR --append`): each count up to and including this generation, whose packs are its
    shards after the generation before's."""

    documents: int = Field(ge=1, le=COUNT_MAX, description="Store documents planned from up to this generation.")
    inputs: int = Field(ge=1, le=COUNT_MAX, description="inputs[] up to this generation.")
    shards: int = Field(ge=1, le=COUNT_MAX, description="Shards up to this generation.")
    packs: int = Field(ge=1, le=COUNT_MAX, description="Packs up to this generation.")
    tokens: int = Field(ge=1, le=COUNT_MAX, description="Tokens in those packs.")
    rebuild_packs: int = Field(
        ge=1, le=COUNT_MAX, description="Packs a build of the same documents at once, with the same options, takes."
    )
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="The store's fingerprint at the generation this one was planned from."
    )


class Manifest(StrictModel):
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
    store: StoreReference | None = Field(
        default=None,
        description="Set for an index build: its shards are index shards, its tokens in this store. "
        "Absent from a full build's manifest.",
    )
    mixture: MixtureInfo | None = Field(
        default=None,
        description="Set for a mixture build (several sources, `prepack build MIX.yaml`): the request and each "
        "source's counts; its shards then carry `source_ids`. Absent from every other build's manifest.",
    )
    pairs: PairTotals | None = Field(
        default=None,
        description="Set for a preference-pair build (options.pairs): its shards carry pair_roles. Absent otherwise.",
    )
    generations: list[BuildGeneration] | None = Field(
        default=None,
        min_length=2,
        description="Only in a build grown by appends: the build after its first build and after each append, "
        "in order. Absent from every other build's manifest.",
    )
    segment_lengths: list[list[int]] | None = Field(
        default=None,
        description="Only in an index build of a document store and in a build grown by appends: how many segments "
        "of each length a build of all its documents at once plans, as [length, count] pairs by rising length "
        "(lengths 1..options.max_len; the counts sum to totals.segments, length x count to totals.tokens), from "
        "which an append counts a rebuild's packs without reading the store's older shards. Absent from a full "
        "build never appended to (so that a full build of a store is byte for byte the build of its corpus), "
        "from mixtures and preference-pair builds, and from builds written before it.",
    )

    @model_validator(mode="after")
    def _segment_lengths_are_the_segments(self) -> Manifest:
        """The recorded segment lengths: pairs by rising length within max_len whose counts and tokens are the
        totals', before a count of a rebuild's packs takes them. Checking them allocates nothing whatever a forged
        length or count (Python's integers); the histogram counted from them is as long as their longest length,
        which an append holds to its store's longest document before it allocates one (`_rebuild_histogram`)."""
        if self.segment_lengths is None:
            return self
        if self.mixture is not None or self.pairs is not None:
            raise ValueError("segment_lengths: a mixture or preference-pair build records none")
        try:
            sums = length_count_sums(self.segment_lengths, 1, self.options.max_len)
        except ValueError as exc:
            raise ValueError(f"segment_lengths {exc}") from None
        if sums != (self.totals.segments, self.totals.tokens):
            raise ValueError(
                f"segment_lengths hold {sums[0]} segments of {sums[1]} tokens, not totals.segments "
                f"({self.totals.segments}) and totals.tokens ({self.totals.tokens})"
            )
        return self

    @model_validator(mode="after")
    def _mixture_stores_beside_the_build(self) -> Manifest:
        """A mixture index build's stores, held to the rule of `store.path` (checked here, as
        `prepack.formats.mixture` cannot import this module)."""
        for number, source in enumerate(self.mixture.sources if self.mixture is not None else []):
            if source.store is not None and (problem := store_path_problem(source.store)) is not None:
                raise ValueError(f"mixture.sources[{number}].store {reprlib.repr(source.store)} {problem}")
        return self

    @model_validator(mode="after")
    def _generations_cut_the_build(self) -> Manifest:
        """A grown build's generations: counts that rise, cut the shards and inputs where their packs
        and documents end, the last one the whole build, planned from the store the build names."""
        if self.generations is None:
            return self
        if self.mixture is not None or self.pairs is not None:
            raise ValueError("generations: a mixture or preference-pair build is never appended to")
        before = (0, 0, 0, 0)
        for number, g in enumerate(self.generations):
            # Each adds documents (in files of their own); an append whose documents all are left out adds no pack.
            rising = g.documents > before[0] and g.inputs > before[1] and g.shards >= before[2] and g.packs >= before[3]
            if not rising:
                raise ValueError(f"generations[{number}] adds no document or input to the one before, or fewer shards or packs")
            if g.shards > len(self.shards) or g.inputs > len(self.inputs):
                raise ValueError(f"generations[{number}] names more shards or inputs than the build has")
            counted = (sum(f.rows for f in self.inputs[: g.inputs]), sum(s.rows for s in self.shards[: g.shards]),
                       sum(s.tokens for s in self.shards[: g.shards]))
            if counted != (g.documents, g.packs, g.tokens):
                raise ValueError(f"generations[{number}]'s documents, packs and tokens are not those of its first inputs and shards")
            before = (g.documents, g.inputs, g.shards, g.packs)
        last = self.generations[-1]
        if (last.inputs, last.shards, last.fingerprint) != (len(self.inputs), len(self.shards), self.fingerprint):
            raise ValueError("generations: the last one is not the whole build (inputs, shards and fingerprint)")
        return self

    def generation_of_shard(self, index: int) -> int:
        """The generation that wrote shard `index` (0 in a build never appended to)."""
        ends = [g.shards for g in self.generations or []]
        return next((number for number, end in enumerate(ends) if index < end), 0)

    @property
    def index_of(self) -> IndexOf | None:
        """What `shard_schema` and `open_shard` take to describe this build's shards: for an index
        build its store's document count (the build's `totals.documents`) and fingerprint (a mixture's:
        its stores' documents, and its own fingerprint), else None."""
        if self.mixture is not None and self.mixture.index_only:  # the sources' stores, one after the other
            return IndexOf(sum(f.rows for f in self.inputs), self.fingerprint)
        if self.store is None:
            return None
        earlier = tuple((g.documents, g.fingerprint) for g in self.generations[:-1]) if self.generations is not None else ()
        return IndexOf(self.totals.documents, self.store.fingerprint, earlier)

    def open_shard(self, path: Path, where: str | None = None) -> pa.RecordBatch:
        """`open_shard` of one of this build's shards, with the columns this manifest says its shards
        have (labels, a mixture's `source_ids`, a pair build's `pair_roles`, an index build's)."""
        pairs = self.options.pairs
        return open_shard(
            path, self.has_labels, self.options.max_len, self.index_of, where=where,
            sources=self.mixture is not None, pairs=None if pairs is None else pairs.size,
            scores=pairs is not None and pairs.scores_column is not None,
            ranks=pairs is not None and pairs.ranks_column is not None,
            unpaired=self.options.unpaired,
        )


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write `manifest.json` atomically (temporary file + rename), keys sorted."""
    # A full build's manifest has no `store` key at all, so its bytes are those of before index builds;
    # likewise no `mixture` key outside a mixture, and no `pairs` keys outside a preference-pair build.
    exclude: dict = {name: True for name in ("store", "mixture", "pairs", "generations", "segment_lengths") if getattr(manifest, name) is None}
    if manifest.mixture is not None and manifest.mixture.count is None:  # a mixture counting every token: as before
        exclude["mixture"] = {"count": True, "sources": {"__all__": {"trained_tokens": True}}}
    # Likewise no `options.max_docs_per_pack` key in a build without a cap, nor image cap keys without one.
    unset: dict = {
        name: True
        for name in ("pairs", "max_docs_per_pack", "max_images_per_pack", "image_set")
        if getattr(manifest.options, name) is None
    }
    if manifest.options.pairs is not None:  # a pair build's options name chosen and rejected, a group build's not
        unset["pairs"] = {name: True for name, value in manifest.options.pairs if value is None}  # never empty
    if unset:
        exclude["options"] = unset
    if manifest.pairs is not None and manifest.pairs.desirable is None:  # a pair or group build's: as before
        exclude["pairs"] = {"desirable": True, "undesirable": True}
    fields = manifest.model_dump(mode="json", exclude=exclude or None)
    # One [length, count] pair a line, not a line for each number and bracket: half the bytes to read again, and
    # written by json's C encoder (its indenting one is Python's, a call a number). A string holds no bare '"',
    # so the placeholder's key and value are found once.
    if pairs := fields.get("segment_lengths"):
        fields["segment_lengths"] = None
    text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    if pairs:
        lines = json.dumps(pairs)[1:-1].replace("], [", "],\n    [")
        text = text.replace('"segment_lengths": null', f'"segment_lengths": [\n    {lines}\n  ]', 1)
    if len(text.encode()) > MANIFEST_MAX_BYTES:  # readers would refuse it
        raise OutputError(
            f"the manifest would take {len(text.encode())} bytes, more than the {MANIFEST_MAX_BYTES} readers "
            "accept: use a larger --shard-size, or fewer corpus files."
        )
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, directory / MANIFEST_NAME)


def read_manifest(directory: str | os.PathLike | bytes, name: str = MANIFEST_NAME) -> Manifest:
    """Read and strictly validate `manifest.json` of the build `directory`, or the bytes of one
    (`directory` a `bytes`, read from object storage), which messages then call `name` (its URI);
    unknown format versions are refused.

    Strict: the file is a regular file of at most MANIFEST_MAX_BYTES, UTF-8 JSON without NaN, Infinity
    or repeated keys, and every value has exactly its JSON Schema type (`"rows": "102"` or
    `"has_labels": 1` are refused, not coerced).
    """
    try:
        path, raw = load_manifest_json(directory, MANIFEST_NAME, name)
    except FileNotFoundError:
        if (Path(directory) / STORE_MANIFEST_NAME).exists():
            refuse(
                directory,
                f"is a prepack document store ({STORE_MANIFEST_NAME}), not a build: pack it with "
                f"`prepack build {directory} --max-len N --out DIR`.",
            )
        refuse(
            Path(directory) / MANIFEST_NAME,
            f"does not exist: {directory} is not a finished prepack build (the manifest is written last).",
        )
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if type(version) is not int or version != FORMAT_VERSION:
        refuse(
            path,
            f"has format_version {reprlib.repr(version)}; this prepack reads version {FORMAT_VERSION}. "
            "Rebuild the shards or use the prepack version that wrote them.",
        )
    try:
        return Manifest.model_validate(raw, strict=True)
    except ValidationError as exc:
        refuse(path, f"is not a valid prepack manifest:\n{exc}")


class ShardFileProblem(NamedTuple):
    """A way the shard files differ from the manifest, as `shard_file_problems` finds it."""

    index: int  # the shard's position in manifest.shards
    kind: Literal["name", "missing", "type", "size"]  # all but "size": there is no file to read
    file: str  # where the problem is: MANIFEST_NAME for a wrong name, else the shard's file name
    message: str  # what is wrong, without the file


def _misnamed(index: int, info: ShardInfo, name_of: Callable[[int], str] = shard_name) -> str | None:
    if info.name != name_of(index):
        return f"shard {index} is named {info.name!r}, not {name_of(index)!r}."
    return None


def _check_name(manifest_file: str | os.PathLike, index: int, info: ShardInfo) -> None:
    if (message := _misnamed(index, info)) is not None:
        refuse(manifest_file, message, column=f"shards[{index}].name")


def shard_path(directory: str | os.PathLike, index: int, info: ShardInfo) -> Path:
    """The file of shard `index` (`info` is its manifest entry). A manifest that names it otherwise is
    refused, which also keeps a name like "../x" or "/etc/passwd" from taking a reader out of the build."""
    _check_name(Path(directory) / MANIFEST_NAME, index, info)
    return Path(directory) / info.name


def check_shard_names(manifest: Manifest, manifest_file: str | os.PathLike) -> None:
    """Refuse (FormatError naming `manifest_file` and the field) a manifest that names any shard
    otherwise than `shard_name` (`shard_path`'s rule for every shard at once): what a reader of object
    storage checks before it takes a name for a key."""
    for index, info in enumerate(manifest.shards):
        _check_name(manifest_file, index, info)


class _ShardList(Protocol):
    """A manifest's list of shard files (each entry with a `name` and `bytes`): a build's `Manifest`,
    or a store's (`prepack.formats.store.StoreManifest`)."""

    @property
    def shards(self) -> Sequence[ShardInfo]: ...


def shard_file_problems(
    directory: Path, manifest: _ShardList, name_of: Callable[[int], str] = shard_name, listed_by: str = "the manifest"
) -> Iterator[ShardFileProblem]:
    """What a manifest promises about its shard files, checked with `lstat` only (no shard is opened),
    in manifest order: each shard named `name_of(index)`, present, a regular file (not a symbolic link,
    FIFO or device), and of the manifest's size. A build's by default; a document store's with
    `store_shard_name` (`prepack.formats.store.check_store_files`). `listed_by` is what the messages
    call the manifest.

    A shard with another name is not looked at (`shard_path`'s rule): that also keeps a hand-edited name
    like "../x.arrow" from reaching outside the build.
    """
    for index, info in enumerate(manifest.shards):
        if (message := _misnamed(index, info, name_of)) is not None:
            yield ShardFileProblem(index, "name", MANIFEST_NAME, message)
            continue
        try:
            status = os.lstat(directory / info.name)
        except FileNotFoundError:
            message = f"missing; {listed_by} lists it with {info.bytes} bytes."
            yield ShardFileProblem(index, "missing", info.name, message)
            continue
        if not stat.S_ISREG(status.st_mode):
            message = f"not a regular file ({file_type_name(status.st_mode)}); prepack writes regular files only."
            yield ShardFileProblem(index, "type", info.name, message)
        elif status.st_size != info.bytes:
            message = f"{status.st_size} bytes, but {listed_by} says {info.bytes} (truncated or replaced?)."
            yield ShardFileProblem(index, "size", info.name, message)


def shard_sha256(path: Path) -> str:
    """The hex sha256 of a shard file (what `ShardInfo.sha256` records), read in 4 MiB chunks."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        refuse(path, "the shard is missing.")
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as file:
        while chunk := file.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def check_shard_sha256(path: Path, info: ShardInfo) -> None:
    """Refuse (FormatError naming `path`) a shard file whose sha256 is not its manifest entry's `info.sha256`:
    the file changed after the build."""
    if (digest := shard_sha256(path)) != info.sha256:
        refuse(path, f"sha256 {digest} does not match the manifest's {info.sha256}: the file changed after the build.")


def open_shard(
    path: Path,
    has_labels: bool,
    max_len: int,
    store: IndexOf | None = None,
    *,
    where: str | None = None,
    sources: bool = False,
    pairs: int | None = None,
    scores: bool = False,
    ranks: bool = False,
    unpaired: bool = False,
) -> pa.RecordBatch:
    """Memory-map one shard (zero-copy) and check its structure: a regular file holding an Arrow IPC
    stream of the format's schema (metadata included) and one uncompressed record batch
    (`read_one_batch`), whose buffers hold what their lengths say and whose list offsets start at 0 and
    end at their values' length. The row contents are checked by `check_shard`. Problems with the
    contents name `where` (default: `path`; the shard's URI when `path` is a cached copy, `prepack.storage.cache`).
    `sources`: a mixture's shard, with `source_ids`; `pairs`: a preference-pair or group build's group size
    (`PairOptions.size`, 2 for pairs), with `pair_roles`, whose packs' largest role must be that size - 1
    (`check_shard` holds each document's role to that stride); `scores`, `ranks`: a group build's, with
    `group_scores`, `group_ranks` (`check_shard` checks their values); `unpaired`: an unpaired build's, with
    `desirable`."""
    if pairs is not None and (type(pairs) is not int or pairs < 2):  # a bool is an int, and True == 1
        raise ArgumentTypeError(f"pairs must be a group size, an int of at least 2, not {pairs!r}.")
    where = str(path) if where is None else where
    if (scores or ranks) and pairs is None:
        raise ArgumentTypeError("scores and ranks are a group build's: give its group size (pairs).")
    if (scores or ranks) and unpaired:
        raise ArgumentTypeError("scores and ranks are a group build's, desirable an unpaired build's: not both.")
    expected = shard_schema(
        has_labels, max_len, store, sources=sources, pairs=pairs is not None, scores=scores, ranks=ranks, unpaired=unpaired
    )

    def check_schema(schema: pa.Schema) -> None:
        nonlocal expected
        planned = (schema.metadata or {}).get(SHARD_STORE_KEY.encode())
        generation = store.planned_from(planned) if store is not None and planned is not None else None
        if generation is not None and generation.fingerprint != store.fingerprint:  # an earlier generation's shard
            expected = shard_schema(
                has_labels, max_len, generation, sources=sources, pairs=pairs is not None, scores=scores, ranks=ranks,
                unpaired=unpaired,
            )
        if store is not None and planned is not None and generation is None:
            refuse(
                where,
                f"this index shard was planned from the store with fingerprint {planned.decode(errors='replace')!r}, "
                f"but the manifest names a store with fingerprint {store.fingerprint}: the build's store was "
                "changed; build the index again from the store it should read.",
            )
        if not schema.equals(expected, check_metadata=True):
            kind = f"an index shard of {store.documents} documents" if store is not None else f"{'with' if has_labels else 'without'} labels and max_len {max_len}"
            refuse(
                where,
                f"the schema is\n{schema}\n(metadata {schema.metadata}) but format version {FORMAT_VERSION} "
                f"{kind} expects\n{expected}\n"
                f"(metadata {expected.metadata})",
            )

    batch = read_one_batch(map_regular(path, "shard", where), "shard", where, check_schema)
    try:
        batch.validate()  # buffers as long as the lengths say, before numpy reads them
    except pa.ArrowException as exc:
        refuse(where, f"not valid Arrow data ({exc}).")
    for column in batch.schema.names:  # offsets are few (one per pack): every reader checks them all
        if isinstance(batch.column(column), pa.ListArray):
            offsets, values = list_column(batch, column, where)
            if (problem := _offsets_problem(offsets, len(values))) is not None:
                refuse(where, f"{problem[1]}.", problem[0], column)
            if offsets[0] != 0 or offsets[-1] != len(values):
                refuse(where, f"offsets run from {offsets[0]} to {offsets[-1]}, not from 0 to its {len(values)} "
                      "values.", column=column)
    if pairs is not None:
        _check_group_size(batch, where, pairs)
    return batch


def _check_group_size(batch: pa.RecordBatch, where: str, size: int) -> None:
    """Every pack's largest `pair_roles` value is the manifest's group size - 1: roles 0, 1, 0, 1 … in a build of
    groups of 4 are whole pairs on their own, and a reader taking G from them would lay out the wrong groups."""
    offsets, roles = list_column(batch, PAIR_ROLES, where)
    filled = np.flatnonzero(np.diff(offsets) > 0)
    largest = np.maximum.reduceat(roles, offsets[filled]) if len(filled) else roles[:0]
    if (bad := largest != size - 1).any():
        refuse(where, f"its largest role is {largest[first_index(bad)]}, but the manifest's build holds "
               f"{unit_name(size, plural=True)} (roles 0 to {size - 1})",
               int(filled[first_index(bad)]), PAIR_ROLES)


class PackLayout(NamedTuple):
    """What `cu_seqlens` says about a batch of packs, decoded once, vectorized (`pack_layout`).

    Per pack: `tokens` and `documents`. Per document (segment), in row order: its `pack` (row), its
    1-based `number` inside the pack (its segment id), its first token inside the pack (`starts`, its
    cu_seqlens value) and its `lengths`. All int64.
    """

    tokens: np.ndarray
    documents: np.ndarray
    pack: np.ndarray
    number: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def pack_layout(offsets: np.ndarray, values: np.ndarray) -> PackLayout:
    """Decode `cu_seqlens` (its offsets and values, as `list_column` gives them) for every pack at once.

    Needs sound offsets and at least two values per pack (as `check_layout` checks first); the values
    themselves are taken as they are: `check_layout` refuses a length below 1.
    """
    offsets = offsets.astype(np.int64)
    cu = values[offsets[0] : offsets[-1]].astype(np.int64)
    documents = np.diff(offsets) - 1
    last = offsets[1:] - offsets[0] - 1  # each pack's last cu_seqlens value: its token count
    is_start = np.ones(len(cu), dtype=bool)
    is_start[last] = False
    pack = np.repeat(np.arange(len(documents), dtype=np.int64), documents)
    return PackLayout(
        tokens=cu[last],
        documents=documents,
        pack=pack,
        number=np.arange(len(pack), dtype=np.int64) - np.repeat(np.cumsum(documents) - documents, documents) + 1,
        starts=cu[is_start],
        lengths=np.diff(cu)[is_start[:-1]],
    )


def _offsets_problem(offsets: np.ndarray, values: int) -> tuple[int, str] | None:
    """(row, what) of the first row whose offsets do not slice `values` values, if any: an offset below
    0, going back, or past the end would serve another row's tokens, or none."""
    if offsets[0] < 0:
        return 0, f"its first offset is {offsets[0]}"
    if (bad := np.diff(offsets) < 0).any():
        r = first_index(bad)
        return r, f"its offsets go back from {offsets[r]} to {offsets[r + 1]}"
    if offsets[-1] > values:
        r = first_index(offsets[1:] > values)
        return r, f"its offset {offsets[r + 1]} is past the end of its {values} values"
    return None


def _list_checked(batch: pa.RecordBatch, column: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """`list_column` with the offsets checked against the values, problems naming `where`."""
    offsets, values = list_column(batch, column, where)
    if (problem := _offsets_problem(offsets, len(values))) is not None:
        refuse(where, f"{problem[1]}.", problem[0], column)
    return offsets, values


def _row_of(offsets: np.ndarray, value: int) -> int:
    """The row holding value number `value` (counted from offsets[0])."""
    return int(np.searchsorted(offsets[1:] - offsets[0], value, "right"))


def check_layout(
    batch: pa.RecordBatch, max_len: int, where: str, tokens: np.ndarray | None = None
) -> PackLayout:
    """Check the columns that describe the packs' documents (`cu_seqlens`, `source_rows`,
    `source_pieces`) and return their `PackLayout`. Reads only those small columns, and `tokens`, the
    packs' token counts, when the caller has read them (`check_shard` checks the token columns).
    Raises FormatError naming `where`, the row and the column.
    """
    cu_off, cu = _list_checked(batch, "cu_seqlens", where)
    documents = np.diff(cu_off).astype(np.int64) - 1
    if (bad := documents < 1).any():
        refuse(where, "needs at least two values [0, ..., tokens]", first_index(bad), "cu_seqlens")
    layout = pack_layout(cu_off, cu)
    first_doc = np.cumsum(documents) - documents
    if (bad := layout.starts[first_doc] != 0).any():
        r = first_index(bad)
        refuse(where, f"starts at {layout.starts[first_doc][r]}, not 0", r, "cu_seqlens")
    if (bad := layout.lengths < 1).any():
        r = int(layout.pack[first_index(bad)])
        refuse(where, "values must be strictly increasing (no empty documents)", r, "cu_seqlens")
    if tokens is not None and (bad := layout.tokens != tokens).any():
        r = first_index(bad)
        refuse(where, f"ends at {layout.tokens[r]}, but the pack has {tokens[r]} tokens", r, "cu_seqlens")
    if (bad := layout.tokens > max_len).any():
        r = first_index(bad)
        refuse(where, f"ends at {layout.tokens[r]}, more than max_len {max_len}", r, "cu_seqlens")
    optional = ("source_ids", PAIR_ROLES, GROUP_SCORES, GROUP_RANKS)  # one value a document, where present
    for column in ("source_rows", "source_pieces", *(c for c in optional if c in batch.schema.names)):
        offsets, values = _list_checked(batch, column, where)
        if (bad := np.diff(offsets) != documents).any():
            r = first_index(bad)
            refuse(where, f"{np.diff(offsets)[r]} values for {documents[r]} documents", r, column)
        if column == "source_pieces" and (bad := values[offsets[0] : offsets[-1]] < 0).any():
            refuse(where, "negative piece number", _row_of(offsets, first_index(bad)), column)
    if PAIR_ROLES in batch.schema.names:
        _check_pairs(batch, where, documents)
    if DESIRABLE in batch.schema.names:
        offsets, labels = _list_checked(batch, DESIRABLE, where)
        if (bad := 2 * np.diff(offsets) != documents).any():
            r = first_index(bad)
            refuse(where, f"{np.diff(offsets)[r]} labels for {documents[r]} documents: an unpaired build's pack holds one "
                   "label an example, 2 documents each", r, DESIRABLE)
        if (bad := labels[offsets[0] : offsets[-1]] > 1).any():
            at = first_index(bad)
            refuse(where, f"label {labels[offsets[0] + at]}: 1 is desirable, 0 undesirable", _row_of(offsets, at), DESIRABLE)
    return layout


def _check_pairs(batch: pa.RecordBatch, where: str, documents: np.ndarray) -> None:
    """A preference-pair shard's pairing: every pack holds whole pairs, each its chosen document (role 0,
    corpus row 2r) and right after it its rejected one (role 1, row 2r + 1). A group build's shard likewise
    holds whole groups of G documents (roles 0 … G - 1, rows Gr … Gr + G - 1), G the largest role + 1 (the
    manifest's `pairs.group_size`, which `verify` holds the shards' counts to)."""
    offsets, roles = list_column(batch, PAIR_ROLES, where)  # one a document (check_layout)
    roles = roles[offsets[0] : offsets[-1]]
    size = max(int(roles.max(initial=1)) + 1, 2)
    unit, units = unit_name(size), unit_name(size, plural=True)
    if (bad := documents % size != 0).any():
        r = first_index(bad)
        refuse(where, f"{documents[r]} documents: a pack of a preference-pair build holds whole {units}", r, "cu_seqlens")
    row_off, rows = list_column(batch, "source_rows", where)
    rows = rows[row_off[0] : row_off[-1]].astype(np.int64)
    # Within a pack, documents follow their roles: position j of the pack has role j % size.
    position = np.arange(len(roles)) - np.repeat(offsets[:-1] - offsets[0], documents)
    expected_role = position % size
    if (bad := roles != expected_role).any():
        token = first_index(bad)
        order = "chosen (0) then rejected (1)" if size == 2 else f"its completions 0 to {size - 1} in order"
        refuse(where, f"document {position[token] + 1} has role {roles[token]}, but a pack holds whole {units}, each "
              f"{order}", _row_of(offsets, token), PAIR_ROLES)
    first = rows - expected_role  # each document's group's first row
    leader = np.repeat(first[expected_role == 0], size) if len(rows) else rows
    if (bad := (first % size != 0) | (first != leader)).any():
        index = first_index(bad)
        index -= int(expected_role[index])
        if size == 2:
            why = (f"document {position[index] + 1} (chosen, corpus document {rows[index]}) is not followed by its "
                   f"rejected document {rows[index] + 1}: a pair is documents 2r and 2r + 1")
        else:
            why = (f"document {position[index] + 1} (corpus document {rows[index]}) does not start its group of {size} "
                   f"consecutive documents: a {unit} is documents {size}r to {size}r + {size - 1}")
        refuse(where, why, _row_of(row_off, index), "source_rows")
    _check_group_values(batch, where, size)


def _check_group_values(batch: pa.RecordBatch, where: str, size: int) -> None:
    """A group shard's `group_scores` and `group_ranks`, where it has them (one value a document: `check_layout`):
    scores finite, and each group's ranks (its `size` documents, in order: `_check_pairs` checked them whole) a
    competition ranking of 1 to `size` (`group_ranking_problems`)."""
    for column in (c for c in (GROUP_SCORES, GROUP_RANKS) if c in batch.schema.names):
        offsets, values = list_column(batch, column, where)
        values = values[offsets[0] : offsets[-1]]
        if column == GROUP_SCORES and (bad := ~np.isfinite(values)).any():
            token = first_index(bad)
            refuse(where, f"score {values[token]} is not a finite number", _row_of(offsets, token), column)
        if column == GROUP_RANKS and (bad := group_ranking_problems(values.reshape(-1, size))).any():
            group = first_index(bad)
            refuse(where, f"ranks {values.reshape(-1, size)[group].tolist()} are not a competition ranking of 1 to "
                   f"{size} (1 the best, ties sharing a rank, as 1, 2, 2, 4)", _row_of(offsets, group * size), column)


def group_ranking_problems(ranks: np.ndarray) -> np.ndarray:
    """bool [N]: which rows of `ranks` [N, G] are not a standard competition ranking of 1 to G, the ranking
    scipy's `rankdata(method="min")` gives: sorted, it starts at 1, and each value is the one before it (a tie)
    or its own 1-based place (r - 1 members rank better)."""
    ordered = np.sort(np.asarray(ranks, np.int64), axis=1)
    place = np.arange(1, ordered.shape[1] + 1)
    ties_or_places = (ordered[:, 1:] == ordered[:, :-1]) | (ordered[:, 1:] == place[1:])
    return (ordered[:, 0] != 1) | ~ties_or_places.all(axis=1)


def check_shard(batch: pa.RecordBatch, max_len: int, where: str) -> PackLayout:
    """Check every row of a shard against the format, vectorized over the whole batch, and return its
    layout. Every list column's offsets are checked against its values first.

    Raises FormatError naming `where`, the row and the column of the first violation (its `problem`
    holds them as fields). This is what stands between a file from elsewhere and a GPU kernel:
    `cu_seqlens` out of range is an out-of-bounds read there.
    """
    ids_off, ids = _list_checked(batch, "input_ids", where)
    n = np.diff(ids_off).astype(np.int64)  # tokens per pack
    layout = check_layout(batch, max_len, where, n)
    ids = ids[ids_off[0] : ids_off[-1]]
    if len(ids) and ids.min() < 0:  # an embedding lookup with a negative id reads out of bounds
        refuse(where, "negative token id", _row_of(ids_off, first_index(ids < 0)), "input_ids")
    token_columns = ["segment_ids", *(["labels"] if "labels" in batch.schema.names else [])]
    for column in token_columns:
        offsets, values = _list_checked(batch, column, where)
        if (bad := np.diff(offsets) != n).any():
            r = first_index(bad)
            refuse(where, f"length {np.diff(offsets)[r]}, but input_ids has {n[r]}", r, column)
    if "labels" in token_columns:
        lab_off, labels = list_column(batch, "labels", where)
        labels = labels[lab_off[0] : lab_off[-1]]
        if (bad := (labels < 0) & (labels != IGNORE_INDEX)).any():
            token = first_index(bad)
            refuse(where, f"{labels[token]} is neither a token id nor {IGNORE_INDEX}", _row_of(lab_off, token), "labels")
    _check_max_seqlen(batch, layout, where)
    # segment_ids: document k's tokens carry k, as cu_seqlens says.
    seg_off, seg = list_column(batch, "segment_ids", where)
    expected = np.repeat(layout.number.astype(seg.dtype), layout.lengths)
    if (bad := seg[seg_off[0] : seg_off[-1]] != expected).any():
        token = first_index(bad)
        r = _row_of(seg_off, token)
        refuse(where, f"token {token - (seg_off[r] - seg_off[0])} has {seg[seg_off[0] + token]}, "
              f"cu_seqlens says {expected[token]}", r, "segment_ids")
    return layout


def _check_max_seqlen(batch: pa.RecordBatch, layout: PackLayout, where: str) -> None:
    if batch.column("max_seqlen").null_count:
        refuse(where, "has null rows", column="max_seqlen")
    max_seqlen = numpy_view(batch.column("max_seqlen"))
    if len(layout.lengths):
        longest = np.maximum.reduceat(layout.lengths, np.cumsum(layout.documents) - layout.documents)
        if (bad := longest != max_seqlen).any():
            r = first_index(bad)
            refuse(where, f"is {max_seqlen[r]}, the longest document is {longest[r]}", r, "max_seqlen")


def check_index_shard(batch: pa.RecordBatch, max_len: int, where: str) -> PackLayout:
    """`check_shard` for an index shard: its per-pack columns only. Whether each (row, piece) lies
    inside the store is the loader's check (`prepack.training.dataset`), which has the store."""
    layout = check_layout(batch, max_len, where)
    _check_max_seqlen(batch, layout, where)
    return layout
