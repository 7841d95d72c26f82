"""A mixture's packing plan: its parts (`prepack.building.mixture.mixture_parts`: one per round of copies, and
per source with `pack_within_source`) each planned by `prepack.building.plan.plan_packs`, their packs shuffled
together with the build's seed.

`MixturePlan` answers what the engines ask of a `PackingPlan` (`packs`, `pack_sizes`, `slice`,
`totals`), so shards are cut and written as for any build. Its `slice` gives each segment its row
among the build's rows (a source's `first_row` plus the source's own row), its token start in the
sources' token files laid back to back, and its source; documents inside a pack in (row, piece)
order, as the format asks.

Memory: besides the parts' plans, 4 bytes a packed document (its row in its part, uint32 while the
rows fit) and the parts' lengths (2 or 4 bytes a packed document); writing needs every source row's
first token (8 bytes a row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from prepack.building.plan import PackingPlan, ShardPacks, compact_lengths, plan_packs

__all__ = ["MixturePlan", "plan_mixture"]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated [start, start + length) index ranges."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


@dataclass(frozen=True)
class MixturePlan:
    """Packs of several plans (`parts`), written in the order `shuffle` (over the parts' packs numbered
    part after part). Part i's document j is the build's row `rows[i][j]`, whose tokens start at
    `row_starts[row]` in the token files; `first_rows` are the sources' first rows."""

    max_len: int
    parts: list[PackingPlan]
    rows: list[np.ndarray]  # per part, the build row of each of its documents (uint32 while they fit)
    shuffle: np.ndarray  # int64 [packs]
    pack_ends: np.ndarray  # int64 [parts]: cumulative packs
    first_rows: np.ndarray  # int64 [sources]
    row_starts: np.ndarray | None  # int64 [rows]: first token of every row (None: an index build's plan)

    @property
    def packs(self) -> int:
        return len(self.shuffle)

    def pack_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Segments and tokens of every pack, in written order (int64 each)."""
        segments = np.concatenate([np.diff(p.slot_offsets) for p in self.parts])
        tokens = np.concatenate([p.tokens_per_pack.astype(np.int64) for p in self.parts])
        return segments[self.shuffle], tokens[self.shuffle]

    def slice(self, first: int, end: int) -> ShardPacks:
        """Written packs first..end-1 as concrete arrays, rows and token starts the build's."""
        packs = self.shuffle[first:end]
        part_of = np.searchsorted(self.pack_ends, packs, "right")
        pieces, where = [], np.empty(len(packs), np.int64)  # where: each written pack among the concatenated ones
        done = 0
        for part in np.unique(part_of):
            chosen = np.flatnonzero(part_of == part)
            local = packs[chosen] - (self.pack_ends[part] - self.parts[part].packs)
            layout = replace(self.parts[part], shuffle=local).slice(0, len(local))
            pieces.append(replace(layout, rows=self.rows[part][layout.rows].astype(np.int64)))
            where[chosen] = done + np.arange(len(local))
            done += len(local)
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(p.pack_offsets) for p in pieces]))])
        sizes = np.diff(offsets)[where]
        take = _ranges(offsets[:-1][where], sizes)
        rows = np.concatenate([p.rows for p in pieces])[take]
        piece = np.concatenate([p.pieces for p in pieces])[take]
        lengths = np.concatenate([p.lengths for p in pieces])[take]
        pack_offsets = np.concatenate([[0], np.cumsum(sizes)])
        # Inside a pack, documents in (row, piece) order; no pack holds a (row, piece) twice.
        order = np.lexsort((piece, rows, np.repeat(np.arange(len(sizes)), sizes)))
        rows, piece, lengths = rows[order], piece[order], lengths[order]
        starts = piece.astype(np.int64) * self.max_len
        if self.row_starts is not None:
            starts += self.row_starts[rows]
        source_ids = (np.searchsorted(self.first_rows, rows, "right") - 1).astype(np.uint16)
        return ShardPacks(self.max_len, pack_offsets, starts, lengths, rows, piece, source_ids)

    def totals(self) -> dict[str, int]:
        each = [p.totals() for p in self.parts]
        summed = {key: sum(t[key] for t in each) for key in each[0]}
        tokens, packs = summed["tokens"], self.packs
        return {**summed, "padding_tokens": packs * self.max_len - tokens, "lower_bound": -(-tokens // self.max_len)}

    @property
    def counts(self) -> dict[str, int]:
        return {key: sum(p.counts[key] for p in self.parts) for key in self.parts[0].counts}


def plan_mixture(
    parts: list[np.ndarray],
    cuts: list[dict[int, int]],
    lengths: np.ndarray,
    untrained: np.ndarray,
    first_rows: np.ndarray,
    row_starts: np.ndarray | None,
    max_len: int,
    *,
    algorithm: str,
    overflow: str,
    seed: int,
    drop_untrained: bool,
    max_documents: int | None = None,
) -> MixturePlan:
    """Plan each part (the build rows of its documents, `lengths` and `untrained` indexed by build row)
    on its own, at most `max_documents` segments a pack when given, and shuffle all their packs with `seed`.
    A document cut in a part (`cuts`: its build row → pieces kept, `mixture_parts`) is planned as its
    first pieces, of max_len tokens each."""
    plans, rows = [], []
    for part, cut in zip(parts, cuts):
        part_lengths = lengths[part]
        for row, kept in cut.items():
            part_lengths[np.flatnonzero(part == row)] = kept * max_len
        plans.append(
            plan_packs(
                compact_lengths(part_lengths),
                max_len,
                algorithm=algorithm,
                overflow=overflow,
                untrained=untrained[part],
                drop_untrained=drop_untrained,
                max_documents=max_documents,
            )
        )
        rows.append(part)
    pack_ends = np.cumsum([p.packs for p in plans])
    return MixturePlan(
        max_len=max_len,
        parts=plans,
        rows=rows,
        shuffle=np.random.default_rng(seed).permutation(int(pack_ends[-1])),
        pack_ends=pack_ends,
        first_rows=np.asarray(first_rows, dtype=np.int64),
        row_starts=row_starts,
    )
