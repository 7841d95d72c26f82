from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prepack.plan import assign_packs


@dataclass(frozen=True)
class PackingPlan:
    """Which tokens go where: pack p holds the segments `pack_offsets[p]:pack_offsets[p+1]`, in
    (row, piece) order; a segment is `lengths[i]` tokens from `starts[i]` of the token store."""

    max_len: int
    pack_offsets: np.ndarray  # int64 [packs + 1]
    starts: np.ndarray  # int64 [segments]: first token in the store of all documents, back to back
    lengths: np.ndarray  # int64 [segments]
    rows: np.ndarray  # int64 [segments]: corpus row
    pieces: np.ndarray  # int32 [segments]: piece number of a split document
    counts: dict[str, int] = field(default_factory=dict)  # what overflow did; see `Totals`

    @property
    def packs(self) -> int:
        return len(self.pack_offsets) - 1

    def slice(self, first: int, end: int) -> PackingPlan:
        """Packs first..end-1 as a plan of their own (what one shard holds)."""
        a, b = self.pack_offsets[first], self.pack_offsets[end]
        return PackingPlan(
            max_len=self.max_len,
            pack_offsets=self.pack_offsets[first : end + 1] - a,
            starts=self.starts[a:b],
            lengths=self.lengths[a:b],
            rows=self.rows[a:b],
            pieces=self.pieces[a:b],
        )

    def totals(self) -> dict[str, int]:
        tokens = int(self.lengths.sum())
        return {
            **self.counts,
            "tokens": tokens,
            "segments": len(self.lengths),
            "packs": self.packs,
            "padding_tokens": self.packs * self.max_len - tokens,
            "lower_bound": -(-tokens // self.max_len),
        }


def plan_packs(
    lengths: np.ndarray, max_len: int, *, algorithm: str = "ffd", overflow: str = "split", seed: int = 0
) -> PackingPlan:
    """Plan the whole corpus: cut overlong documents as `overflow` says, assign segments to packs
    with `assign_packs`, then shuffle the pack order with `seed`.

    `lengths` are the token counts of the corpus rows, whose tokens lie back to back in the token
    store. `overflow="error"` is the caller's to enforce (it can name the file); here it packs as split.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    doc_starts = np.cumsum(lengths) - lengths
    long = lengths > max_len
    if overflow in ("split", "error"):
        pieces_per_doc = -(-lengths // max_len)  # 0 for an empty document
    elif overflow == "truncate":
        pieces_per_doc = (lengths > 0).astype(np.int64)
    elif overflow == "drop":
        pieces_per_doc = ((lengths > 0) & ~long).astype(np.int64)
    else:
        raise ValueError(f"unknown overflow {overflow!r}")
    rows = np.repeat(np.arange(len(lengths)), pieces_per_doc)
    pieces = np.arange(len(rows)) - np.repeat(np.cumsum(pieces_per_doc) - pieces_per_doc, pieces_per_doc)
    starts = doc_starts[rows] + pieces * max_len
    segment_lengths = np.minimum(lengths[rows] - pieces * max_len, max_len)

    pack_of = assign_packs(segment_lengths, max_len, algorithm)
    packs = int(pack_of.max()) + 1 if len(pack_of) else 0
    # Shuffle whole packs, so training never sees the decreasing-length order of the planner.
    position = np.empty(packs, dtype=np.int64)
    position[np.random.default_rng(seed).permutation(packs)] = np.arange(packs)
    final_pack = position[pack_of]
    order = np.argsort(final_pack, kind="stable")  # stable: segments stay in (row, piece) order
    pack_offsets = np.zeros(packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(final_pack, minlength=packs), out=pack_offsets[1:])

    split = long & (pieces_per_doc > 1)
    counts = {
        "input_tokens": int(lengths.sum()),
        "empty": int((lengths == 0).sum()),
        "split": int(split.sum()),
        "split_pieces": int(pieces_per_doc[split].sum()),
        "truncated": int(long.sum()) if overflow == "truncate" else 0,
        "truncated_tokens": int((lengths[long] - max_len).sum()) if overflow == "truncate" else 0,
        "dropped": int(long.sum()) if overflow == "drop" else 0,
        "dropped_tokens": int(lengths[long].sum()) if overflow == "drop" else 0,
    }
    return PackingPlan(
        max_len=max_len,
        pack_offsets=pack_offsets,
        starts=starts[order],
        lengths=segment_lengths[order],
        rows=rows[order],
        pieces=pieces[order].astype(np.int32),
        counts=counts,
    )
