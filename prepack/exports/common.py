"""What every export format is written from: the source build (`ExportBuild`), its packs as record batches of
prepack's own shard format (`pack_batches`), and the columns a generic table reader trains on
(`training_rows`, which the Parquet and Lance exports hold), and which tokens are trained (`training_tokens`,
the one definition every format writes: labels, or a loss mask).

A format is a module `prepack.exports.<name>` with one function,

    write(batches: Iterable[pyarrow.RecordBatch], directory: pathlib.Path, build: ExportBuild, scratch: pathlib.Path) -> None

that writes its files into `directory` (a private staging directory, published whole by `export_build`);
`scratch` is an empty directory beside it for what the format needs only while it writes (never published,
deleted with the staging).
`batches` are the build's packs in pack order, whole packs, in the shard schema
(`prepack.formats.shards.shard_schema`, `schemas/shard-format.md` "Shards"): `input_ids`, `segment_ids`,
`cu_seqlens`, `max_seqlen`, `source_rows`, `source_pieces`, then `source_ids` (a mixture's), `labels` (a build
with labels), `pair_roles` (a preference-pair build's). Each batch is checked (`check_shard`) before it is
handed on, and its list offsets start at 0. A format that cannot hold what a build carries raises
InputError naming it; nothing is published then.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from prepack.check.report import InspectReport, inspect_build
from prepack.errors import FormatError, InputError
from prepack.formats.common import format_error, list_array, list_column
from prepack.formats.shards import (
    DESIRABLE_FIELD, GROUP_RANKS_FIELD, GROUP_SCORES_FIELD, IGNORE_INDEX, MANIFEST_NAME, PAIR_ROLES_FIELD, Manifest, PackLayout,
    check_index_shard, check_shard, check_shard_sha256, pack_layout, read_manifest, shard_path, shard_sha256,
)
from prepack.sources.gather import IndexGather, index_columns
from prepack.sources.mixture_stores import open_mixture_stores
from prepack.sources.store import open_build_store
from prepack.storage.remote import is_uri

__all__ = [
    "ExportBuild", "TrainingTokens", "open_export_build", "pack_batches", "training_rows", "training_rows_per_group",
    "training_schema", "training_tokens",
]

# The most bytes of token columns (ids, segment ids, labels) one batch holds: what a format's writer holds at once.
BATCH_BYTES = 64 << 20


@dataclass
class ExportBuild:
    """The build an export is written from: its directory, manifest, and the sha256 of its manifest.json
    (`manifest_sha256`: the build's fingerprint as an export records it; the manifest lists every shard's
    sha256, and an index build's its store's fingerprint, so the same value means the same packs)."""

    path: Path
    manifest: Manifest
    manifest_sha256: str

    @property
    def name(self) -> str:
        """The build directory's name (what a card calls it: never the path, which is the writer's machine's)."""
        return self.path.resolve().name

    @property
    def kind(self) -> str:
        """"full", "index", "mixture full" or "mixture index": what `export.json` records and a format may refuse by name."""
        m = self.manifest
        return ("mixture " if m.mixture is not None else "") + ("index" if m.index_of is not None else "full")

    @cached_property
    def report(self) -> InspectReport:
        """`prepack inspect --json`'s report of the build (default options), computed once."""
        return inspect_build(self.path)


def open_export_build(path: str | os.PathLike) -> ExportBuild:
    """The local build at `path`, its manifest read and checked (`read_manifest`). InputError for a URI:
    an export reads a local build (download it first, or export where it was built)."""
    if is_uri(path):
        raise InputError(f"{path}: prepack export reads a local build directory; copy the build here first.")
    path = Path(path)
    manifest = read_manifest(path)
    return ExportBuild(path, manifest, shard_sha256(path / MANIFEST_NAME))


def pack_batches(build: ExportBuild) -> Iterator[pa.RecordBatch]:
    """The build's packs in pack order as record batches of the full shard format, each checked
    (`check_shard`; each shard's sha256 against the manifest's first, FormatError naming it), each of at
    most `BATCH_BYTES` of tokens (or one pack), so that memory stays bounded by the batch whatever the
    build's size and shard size: a full build's shards memory-mapped and cut into batches that share their
    memory, each batch checked on its own; an index build's (a mixture's too) gathered from its store(s)
    by the loader's gather (`IndexGather`). Every list column's offsets start at 0."""
    m, max_len = build.manifest, build.manifest.options.max_len
    files = [shard_path(build.path, index, info) for index, info in enumerate(m.shards)]
    store = None
    if m.mixture is not None and m.mixture.index_only:
        store = open_mixture_stores(build.path, m)
    elif m.store is not None:
        store = open_build_store(build.path, m)
    gather = None if store is None else IndexGather(store, max_len, [str(file) for file in files])
    bytes_per_pack = max_len * (8 + (4 if m.has_labels else 0))
    per_batch = max(1, BATCH_BYTES // bytes_per_pack)
    for index, (info, file) in enumerate(zip(m.shards, files)):
        where = str(file)
        check_shard_sha256(file, info)  # the packs the manifest (and so export.json) vouches for
        batch = m.open_shard(file, where)
        if batch.num_rows != info.rows:
            raise FormatError(f"{where}: {batch.num_rows} packs, but the manifest says {info.rows}.")
        if gather is None:
            for first in range(0, batch.num_rows, per_batch):
                packs = _rebased(batch.slice(first, per_batch))
                _check_packs(packs, first, max_len, where)
                yield packs
            continue
        check_index_shard(batch, max_len, where)
        columns = {name: list_column(batch, name, where) for name in index_columns(batch)}
        for first in range(0, batch.num_rows, per_batch):
            gathered = gather.batch(columns, first, min(first + per_batch, batch.num_rows), index)
            _check_packs(gathered, first, max_len, where)
            yield gathered


def _check_packs(packs: pa.RecordBatch, first: int, max_len: int, where: str) -> None:
    """`check_shard` of the packs `first` onwards of the shard `where` (a batch at a time, so that the check's
    arrays are a batch's size, not a shard's): a FormatError names the shard's row."""
    try:
        check_shard(packs, max_len, where)
    except FormatError as exc:
        found = exc.problem
        if found is None or found.row is None:
            raise
        raise format_error(found.file, found.message, found.row + first, found.column) from None


def _rebased(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch`, a slice of a shard, with every list column's offsets starting at 0: new offsets (one per
    pack), the values shared with the shard, not copied."""
    arrays = []
    for name, column in zip(batch.schema.names, batch.columns):
        if isinstance(column, pa.ListArray):
            offsets, values = list_column(batch, name)
            column = list_array(offsets - offsets[0], values[offsets[0] : offsets[-1]])
        arrays.append(column)
    return pa.RecordBatch.from_arrays(arrays, schema=batch.schema)


def training_schema(build: ExportBuild) -> pa.Schema:
    """The columns of `training_rows`: input_ids, labels, position_ids, cu_seqlens, and a mixture's
    source_ids, a preference-pair build's pair_roles (and a group build's group_scores, group_ranks) and an unpaired
    build's desirable."""
    m = build.manifest
    fields = [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("labels", pa.list_(pa.int32()), nullable=False),
        pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
    ]
    if m.mixture is not None:
        fields.append(pa.field("source_ids", pa.list_(pa.uint16()), nullable=False))
    p = m.options.pairs  # a group build's values or an unpaired build's labels, as its shards carry them
    fields += [f for f, present in ((PAIR_ROLES_FIELD, m.pairs is not None), (GROUP_SCORES_FIELD, p is not None and p.scores_column
               is not None), (GROUP_RANKS_FIELD, p is not None and p.ranks_column is not None),
               (DESIRABLE_FIELD, m.options.unpaired)) if present]
    return pa.schema(fields)


def training_rows_per_group(build: ExportBuild) -> int:
    """Packs per row group of a table of `training_rows`: 32 MiB of its int32 token columns (input_ids, labels,
    position_ids) at max_len, the unit a reader reads and a writer buffers."""
    return max(1, (32 << 20) // (12 * build.manifest.options.max_len))


class TrainingTokens(NamedTuple):
    """A batch of packs' tokens as prepack trains on them (`training_tokens`), flat: pack p is
    `[pack_offsets[p], pack_offsets[p + 1])` of each per-token array."""

    tokens: np.ndarray  # the packs' token ids back to back (a view of the batch's values)
    pack_offsets: np.ndarray  # int64 [packs + 1]
    layout: PackLayout  # per document: its pack, its start inside the pack, its length
    labels: np.ndarray  # int32 per token: the training label, IGNORE_INDEX where no loss is taken
    position_ids: np.ndarray  # int64 per token: 0, 1, ... restarting at each document

    @property
    def trained(self) -> np.ndarray:
        """bool per token: a target of the loss (what a loss mask holds)."""
        return self.labels != IGNORE_INDEX


def training_tokens(batch: pa.RecordBatch) -> TrainingTokens:
    """The one definition of which tokens prepack trains on, for every export format: a token's label is the
    build's label (a build without labels: the token id), and IGNORE_INDEX at each document's first token,
    which would be predicted from the document before it. It is `PackedCollator`'s rule (there in torch,
    tested equal on real builds in tests/exports/test_trained_tokens.py), ready for a model that shifts
    labels itself. `batch`: packs in the shard schema, checked (`check_shard`)."""
    offsets, values = list_column(batch, "input_ids")
    tokens = values[offsets[0] : offsets[-1]]
    pack_offsets = offsets.astype(np.int64) - offsets[0]
    layout = pack_layout(*list_column(batch, "cu_seqlens"))
    document_starts = pack_offsets[layout.pack] + layout.starts
    position_ids = np.arange(len(tokens), dtype=np.int64) - np.repeat(document_starts, layout.lengths)
    if "labels" in batch.schema.names:
        label_offsets, label_values = list_column(batch, "labels")
        labels = np.array(label_values[label_offsets[0] : label_offsets[-1]], np.int32)
    else:
        labels = np.array(tokens, np.int32)
    labels[document_starts] = IGNORE_INDEX
    return TrainingTokens(tokens, pack_offsets, layout, labels, position_ids)


def training_rows(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """Packs of the shard format as a generic trainer reads them (`training_schema`), one row a pack:

    - `input_ids` as stored;
    - `labels` and `position_ids`: `training_tokens`'s (-100 at each document's first token; positions
      restarting at each document, from which transformers' flash-attention path finds the documents'
      bounds, as with `DataCollatorWithFlattening`);
    - `cu_seqlens`: the documents' bounds, [0, ..., tokens];
    - `source_ids` (a mixture's: each document's source, numbered as the card and manifest list them) and
      `pair_roles` (0 chosen, 1 rejected), a group build's `group_scores` and `group_ranks` and an unpaired build's
      `desirable` (one label an example) as stored."""
    packs = training_tokens(batch)
    cu_off, cu = list_column(batch, "cu_seqlens")
    arrays = [
        list_array(packs.pack_offsets, np.ascontiguousarray(packs.tokens, np.int32)),
        list_array(packs.pack_offsets, packs.labels),
        list_array(packs.pack_offsets, packs.position_ids.astype(np.int32)),
        list_array(cu_off - cu_off[0], np.ascontiguousarray(cu[cu_off[0] : cu_off[-1]], np.int32)),
    ]
    for name in schema.names[4:]:
        column_offsets, values = list_column(batch, name)
        arrays.append(list_array(column_offsets - column_offsets[0], values[column_offsets[0] : column_offsets[-1]]))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
