"""What the engines of `build` and `build_store` share: the `Engine` protocol, the results its steps
hand back, and where a plan's packs are cut into shards.

An engine runs the steps that touch tokens; the commands (`prepack.build`) do everything else
(checking input, planning, the manifest) the same for every engine:

1. `first_pass`: read (and tokenize) every document once, keep the tokens where the second pass finds
   them, and hand back what planning needs (`FirstPass`: lengths, fingerprint, rows per file).
2. `write_packs`: write the plan's packs as shards.
3. `write_store`: read every document once and write it into a document store's shards (`WrittenStore`).

A mixture (`prepack.building.mixture_build`) reads each source twice instead of `first_pass`, with an
engine of the source's own (`for_source`): `read_lengths` (what planning needs, no token kept), then,
once the selection is known, `write_selected` (the selected documents' tokens alone).

`prepack.building.engines.local.LocalEngine` runs them in this process, `prepack.building.engines.ray.RayEngine` as Ray
tasks across a cluster; both write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from prepack.sources.documents import Documents, Reading
from prepack.formats.shards import Manifest, ShardInfo, segment_id_type
from prepack.building.plan import PackingPlan, ShardPacks
from prepack.sources.corpus import Corpus
from prepack.formats.store import StoreManifest, StoreShard
from prepack.building.write_shards import TokenFiles, shard_bounds

if TYPE_CHECKING:  # rich for annotations only: a build without progress bars does not import it
    from rich.progress import Progress

__all__ = ["ENGINES", "Engine", "FirstPass", "WrittenStore", "kept_rows", "locate_row", "numbered_on", "pack_shard_bounds", "rows_from"]

ENGINES = ("local", "ray")


@dataclass(frozen=True)
class FirstPass:
    """What the first pass keeps: document lengths, per-file row counts and the fingerprint, and where
    the documents' tokens (and labels) lie for the second pass (none for an index build)."""

    lengths: np.ndarray  # one per corpus row, `compact_lengths`
    untrained: np.ndarray  # bool, one per corpus row: tokens but no trained token (`untrained_documents`)
    rows_per_file: list[int]
    fingerprint: str
    has_labels: bool
    tokens: TokenFiles | None
    labels: TokenFiles | None
    # Of a store's documents hashed (a full build's): its fingerprint at each generation, as hashed or, for
    # the generations before the documents read (an append's), as recorded (`StoreFingerprint.found`).
    generations: tuple[str, ...] = ()


@dataclass(frozen=True)
class WrittenStore:
    """What writing a document store's shards leaves for its manifest (`prepack.building.write_store.finish_store`)."""

    shards: list[StoreShard]
    rows_per_file: list[int]
    lengths: np.ndarray  # one per document
    untrained: int  # documents with no trained token
    fingerprint: str


class Engine(Protocol):
    """How a build's or a store's tokens are read and written; one instance per output (`staging`)."""

    def first_pass(self, documents: Documents, reading: Reading, progress: Progress) -> FirstPass:
        """Read the documents found as `documents` (a corpus, or a store), keeping their tokens for `write_packs`."""
        ...

    def write_packs(self, plan: PackingPlan, first: FirstPass, shard_size: int, progress: Progress) -> list[ShardInfo]:
        """Write the plan's packs of the documents of `first` as shards (`pack_shard_bounds`); their manifest entries."""
        ...

    def write_store(self, documents: Documents, reading: Reading, shard_size: int, progress: Progress) -> WrittenStore:
        """Read the documents found as `documents` and write them as a document store's shards."""
        ...

    def for_source(self, number: int) -> Engine:
        """This engine for a mixture's source `number`, its scratch files apart from the other sources'."""
        ...

    def read_lengths(self, documents: Documents, reading: Reading, progress: Progress, observe=None) -> tuple[FirstPass, list]:
        """`first_pass` keeping no token (`tokens` None), and the results of `observe` (a picklable function of a
        batch's offsets and labels) batch by batch in row order."""
        ...

    def write_selected(self, documents: Documents, reading: Reading, first: FirstPass, keep: np.ndarray, progress: Progress) -> FirstPass:
        """`first` with the tokens of the rows `keep` keeps (bool per row) written to scratch, read again from
        `documents`, the very `Documents` that `read_lengths` read (its files, its store's manifest), and refused
        unless they are what `read_lengths` read."""
        ...


def kept_rows(keep: np.ndarray, row: int, count: int) -> np.ndarray:
    """Which of `count` rows from `row` on a second read keeps (`keep`: bool, one per row of the first
    read). Rows past the first read's (a corpus that grew meanwhile) are kept by none: the comparison of
    the two reads then refuses the corpus by name."""
    kept = np.zeros(count, dtype=bool)
    within = keep[row : row + count]
    kept[: len(within)] = within
    return kept


def locate_row(corpus: Corpus, rows_per_file: list[int], row: int) -> tuple[Path, int]:
    """Global row number → (file, row within the file)."""
    ends = np.cumsum(rows_per_file)
    index = int(np.searchsorted(ends, row, "right"))
    return corpus.files[index], row - int(ends[index] - rows_per_file[index])


def numbered_on(appending: Manifest | StoreManifest | None) -> tuple[int, int]:
    """(the number of the first shard an engine writes, the row of the first document it packs): after the
    shards and documents of the output an append grows (`Staging.appending`), else 0 and 0."""
    if appending is None:
        return 0, 0
    return len(appending.shards), appending.documents if isinstance(appending, StoreManifest) else appending.totals.documents


def rows_from(layout: ShardPacks, first_row: int) -> ShardPacks:
    """A shard's packs (`PackingPlan.slice`) with their documents' rows counted from `first_row` (an append's)."""
    return replace(layout, rows=layout.rows + first_row) if first_row else layout


def pack_shard_bounds(plan: PackingPlan, has_labels: bool, shard_size: int, index_only: bool) -> tuple[np.ndarray, int]:
    """The first written pack of every shard, plus the end (`shard_bounds`), and the most tokens a
    shard holds: what every engine cuts a plan's packs into shards by."""
    docs_per_pack, token_counts = plan.pack_sizes()
    # Estimated bytes per pack: token columns, per-document columns, per-pack offsets and max_seqlen.
    token_bytes = 0 if index_only else 4 + segment_id_type(plan.max_len).byte_width + (4 if has_labels else 0)
    pack_bytes = token_counts * token_bytes + docs_per_pack * 20 + 36
    bounds = shard_bounds(pack_bytes, shard_size)
    return bounds, int(np.add.reduceat(token_counts, bounds[:-1]).max())
