"""The plan as prepack made it before it planned from the length histogram: cut the documents into
segments with numpy, place them with the textbook packer of `tests.corpus`, number the packs in a
shuffled order and stable-argsort the segments by it. Plain and slow, kept as the oracle."""

from __future__ import annotations

import numpy as np

from tests.corpus import reference_placement


def reference_segments(lengths, max_len, overflow, untrained=None, drop_untrained=False):
    """Segments (rows, pieces, starts, lengths) in (row, piece) order, and the overflow counts."""
    lengths = np.asarray(lengths, dtype=np.int64)
    untrained = np.zeros(len(lengths), dtype=bool) if untrained is None else np.asarray(untrained, dtype=bool)
    left_out = untrained if drop_untrained else np.zeros(len(lengths), dtype=bool)
    long = (lengths > max_len) & ~left_out
    if overflow in ("split", "error"):
        pieces_per_doc = -(-lengths // max_len)
    elif overflow == "truncate":
        pieces_per_doc = (lengths > 0).astype(np.int64)
    else:  # drop
        pieces_per_doc = ((lengths > 0) & ~long).astype(np.int64)
    pieces_per_doc[left_out] = 0
    rows = np.repeat(np.arange(len(lengths)), pieces_per_doc)
    pieces = np.arange(len(rows)) - np.repeat(np.cumsum(pieces_per_doc) - pieces_per_doc, pieces_per_doc)
    starts = (np.cumsum(lengths) - lengths)[rows] + pieces * max_len
    segment_lengths = np.minimum(lengths[rows] - pieces * max_len, max_len)
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
        "untrained": int(untrained.sum()),
        "untrained_tokens": int(lengths[untrained].sum()),
    }
    return rows, pieces, starts, segment_lengths, counts


def reference_plan(lengths, max_len, *, algorithm, overflow, seed, untrained=None, drop_untrained=False, max_documents=None):
    """pack_offsets, starts, lengths, rows, pieces of every pack in written order, and the counts."""
    rows, pieces, starts, segment_lengths, counts = reference_segments(
        lengths, max_len, overflow, untrained, drop_untrained
    )
    placement = reference_placement(segment_lengths.tolist(), max_len, algorithm, max_documents)
    pack_of = np.array(placement, dtype=np.int64)
    packs = int(pack_of.max()) + 1 if len(pack_of) else 0
    position = np.empty(packs, dtype=np.int64)
    position[np.random.default_rng(seed).permutation(packs)] = np.arange(packs)
    written = position[pack_of]
    order = np.argsort(written, kind="stable")
    pack_offsets = np.zeros(packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(written, minlength=packs), out=pack_offsets[1:])
    return pack_offsets, starts[order], segment_lengths[order], rows[order], pieces[order], counts
