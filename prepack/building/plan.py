"""The packing planner: which pack every document goes into.

`plan_packs` plans a whole corpus from its document lengths alone: it cuts documents longer than
max_len as the overflow policy says (`document_pieces`, which `verify` also holds builds to), assigns
the resulting segments to packs, and shuffles the order of the packs with a seed.

Both algorithms see the segments in the same order: a stable sort by length, longest first, so
equal lengths keep their (row, piece) order. That makes the plan a pure function of the length
column, reproducible across runs and machines. It also means the algorithms need only the
histogram of segment lengths: they place "the k-th segment of length x", and which segment that is
follows from counting, in row order, the segments of length x before it. So nothing is sorted, and
a plan holds per document only its length (`compact_lengths`: 2 bytes, or 4 from 65,536 tokens)
and, with `drop_untrained`, a flag; per segment the segment in its pack slot (4 bytes below 2**32
segments) and a bookmark every 32 segments (0.75 bytes a segment); per pack 20 bytes. Planning
needs 4 bytes a segment more while it runs (about 60 in numpy, where an index build of a small store
plans without numba: `prepack.building.plan_vectorized`, the same plan). The segments' rows, pieces
and token starts are derived again for the packs of one shard at a time (`PackingPlan.slice`).

first-fit-decreasing ("ffd")
    Each segment goes into the lowest-numbered pack with room for it (remaining capacity >=
    length), else into a new pack. A max segment tree over pack slots finds that pack in
    O(log packs); slots not opened yet hold a full capacity, so "the next pack to open" is simply
    the leftmost such slot and needs no special case. A run of equal lengths resumes the search
    from the previous segment's pack, which makes the common case O(1).

best-fit-decreasing ("bfd")
    Each segment goes into the pack with the least remaining capacity that still fits it, ties
    to the lowest-numbered pack, else into a new pack. Open packs are bucketed by remaining
    capacity: a min segment tree over the capacities a pack can have left finds the smallest non-empty bucket
    >= length, and each bucket is a pairing heap of pack numbers whose root is the lowest one.

A cap on documents per pack (`max_documents`, K) is a second limit beside max_len, for fixed-shape
batches (`prepack.training.collate`): a pack with K segments has no room left, for either algorithm.
ffd sets its slot's remaining capacity to 0, bfd takes it out of the buckets as it does a full pack.
Without a cap, K is the number of segments and the plan is the uncapped one, byte for byte.

A cap on images per pack (`max_images`, M, with every document's image count: a vision tower's memory follows
its images, not the text tokens) is a third limit, for first-fit-decreasing only: each segment counts its
document's images (a split document's every piece, which overcounts and so never breaks the cap), and it goes
into the lowest-numbered pack with room for both its tokens and its images. Equal lengths no longer make equal
segments, so the plan takes each segment's image count in the planner's order (`_images_in_order`, 4 bytes a
segment) and a second max tree over the packs' image room, searched with the first (`_ffd_pictured`): a subtree
whose largest rooms fit may hold no pack that fits both, and the search then moves right. A run of equal lengths
resumes from the previous segment's pack when this segment has at least the previous one's images (the packs left
of that pack lacked the tokens, or the room for the previous one's images and so for these), else searches from
the first pack. The search takes O(log packs) while the packs with token room for a segment are the ones with
image room for it. Where they part it walks pack by pack: packs alternately short of tokens and short of images,
then segments that fit none of them, make each search O(packs) and the plan O(n * packs) in the worst case (one
token tree per level of image room would bound a search by O(log packs) and an update by O(M log packs), at M
times the trees' memory). Without the image cap nothing of this runs.

Packs are numbered 0, 1, ... in the order they are opened. Without the image cap the whole plan is O(n log packs) time
(the counting is O(n + L)) and O(n + L) memory, with L the longest segment: the histogram and bfd's
capacity buckets follow the documents, never max_len (`--max-len 2147483647` plans in the memory of
`--max-len 8192`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from prepack.building import plan_vectorized
from prepack.building.kernels import kernel
from prepack.formats.shards import IGNORE_INDEX

__all__ = [
    "DocumentPieces",
    "ShardPacks",
    "PackingPlan",
    "assign_packs",
    "checked_cap",
    "compact_lengths",
    "document_pieces",
    "first_trained_labels",
    "pack_count",
    "plan_packs",
    "segment_histogram",
    "histogram_pairs",
    "pairs_histogram",
    "untrained_documents",
]

_ALGORITHMS = ("ffd", "bfd")
# The overflow policies as the kernels see them; "error" packs as "split" (the caller enforces it).
_SPLIT, _TRUNCATE, _DROP = 0, 1, 2
_OVERFLOWS = {"split": _SPLIT, "error": _SPLIT, "truncate": _TRUNCATE, "drop": _DROP}
# What `_tally` counts, in its order: the overflow and untrained fields of `prepack.formats.shards.Totals`.
_COUNTS = (
    "input_tokens",
    "empty",
    "split",
    "split_pieces",
    "truncated",
    "truncated_tokens",
    "dropped",
    "dropped_tokens",
    "untrained",
    "untrained_tokens",
)
_COUNT_FIELDS = len(_COUNTS)
# Segments per block of `_scatter`'s bookmarks: `PackingPlan.slice` finds a segment from the
# bookmark of its block by a walk over at most this many segments (plus any documents in between
# that make none). 24 bytes a block: under a byte a segment.
_BLOCK = 32


def compact_lengths(lengths: np.ndarray) -> np.ndarray:
    """Document lengths in the narrowest of uint16, uint32 and int64 that holds them: what a plan keeps
    per document. No copy when they already are."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D integer array, got {lengths.ndim}-D {lengths.dtype}")
    if len(lengths) == 0:
        return lengths.astype(np.uint16)
    if lengths.min() < 0:
        raise ValueError(f"lengths must not be negative, got {lengths.min()}")
    largest = int(lengths.max())
    dtype = np.uint16 if largest < 2**16 else np.uint32 if largest < 2**32 else np.int64
    return lengths.astype(dtype, copy=False)


def _check_options(max_len: int, algorithm: str) -> int:
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; expected one of {_ALGORITHMS}")
    max_len = operator.index(max_len)
    if not 1 <= max_len < 2**31:  # capacities are kept in int32
        raise ValueError(f"max_len must be in [1, 2**31), got {max_len}")
    return max_len


def checked_cap(max_documents: int | None) -> int | None:
    """`max_documents` as an int in [1, 2**31), or None; ValueError (TypeError for a non-integer) otherwise."""
    if max_documents is None:
        return None
    max_documents = operator.index(max_documents)
    if not 1 <= max_documents < 2**31:  # counts are kept in int32
        raise ValueError(f"max_documents must be in [1, 2**31), got {max_documents}")
    return max_documents


def _overflow_code(overflow: str) -> int:
    if overflow not in _OVERFLOWS:
        raise ValueError(f"unknown overflow {overflow!r}")
    return _OVERFLOWS[overflow]


def _flags(untrained: np.ndarray | None, documents: int) -> np.ndarray:
    """`untrained` as a bool array, or an empty one (none untrained) for None."""
    if untrained is None:
        return np.zeros(0, dtype=bool)
    untrained = np.asarray(untrained, dtype=bool)
    if untrained.shape != (documents,):
        raise ValueError(f"untrained must have one flag per document ({documents}), got shape {untrained.shape}")
    return untrained


def assign_packs(
    lengths: np.ndarray,
    max_len: int,
    algorithm: str = "ffd",
    max_documents: int | None = None,
    *,
    images: np.ndarray | None = None,
    max_images: int | None = None,
) -> np.ndarray:
    """Pack number (int32, 0-based, in the order packs are opened) of every document, at most
    `max_documents` documents a pack when given, and at most `max_images` of the documents' `images`.

    `lengths` is a 1-D integer array with every value in [1, max_len]; the caller has already
    split, truncated or dropped the documents that do not fit, so anything else is a bug and
    raises ValueError.
    """
    max_len = _check_options(max_len, algorithm)
    max_documents = checked_cap(max_documents)
    lengths = compact_lengths(lengths)
    images, max_images = _checked_images(images, max_images, len(lengths), algorithm)
    if len(lengths) == 0:
        return np.empty(0, np.int32)
    if lengths.min() < 1 or lengths.max() > max_len:
        raise ValueError(f"every length must be in [1, {max_len}], got [{lengths.min()}, {lengths.max()}]")
    histogram = np.bincount(lengths)  # as long as the longest document, never max_len
    in_order = _images_in_order(lengths, _NONE_LEFT_OUT, max_len, _SPLIT, histogram, images) if len(images) else images
    pack_of_sorted, _ = _assign_sorted(histogram, max_len, algorithm, max_documents, images=in_order, max_images=max_images)
    return _unsort(lengths, histogram, pack_of_sorted)


_NONE_LEFT_OUT = np.zeros(0, dtype=bool)
_NO_IMAGES = np.zeros(0, dtype=np.int32)  # no image cap


def _checked_images(images: np.ndarray | None, max_images: int | None, documents: int, algorithm: str) -> tuple[np.ndarray, int]:
    """The image counts as int32 (empty without a cap) and the cap (0 without one), after refusing
    (ValueError) what the image cap cannot plan: a document over the cap, counts that are not one per document."""
    if images is None and max_images is None:
        return _NO_IMAGES, 0
    if images is None or max_images is None:
        raise ValueError("images and max_images go together: the image counts of the documents and the cap on them")
    max_images = operator.index(max_images)
    if not 1 <= max_images < 2**31:
        raise ValueError(f"max_images must be in [1, 2**31), got {max_images}")
    if algorithm != "ffd":
        raise ValueError("an image cap is planned by first-fit-decreasing (algorithm 'ffd')")
    images = np.asarray(images)
    if images.shape != (documents,) or not np.issubdtype(images.dtype, np.integer):
        raise ValueError(f"images must hold one image count per document ({documents}), got {images.dtype} of shape {images.shape}")
    if documents and images.min() < 0:
        raise ValueError(f"image counts must not be negative, got {images.min()}")
    if documents and images.max() > max_images:
        row = int(np.argmax(images > max_images))
        raise ValueError(f"document {row} has {images[row]} images, more than max_images {max_images}")
    return images.astype(np.int32), max_images


def _assign_sorted(
    histogram: np.ndarray,
    max_len: int,
    algorithm: str,
    max_documents: int | None = None,
    vectorized: bool = False,
    *,
    images: np.ndarray = _NO_IMAGES,
    max_images: int = 0,
) -> tuple[np.ndarray, int]:
    """Pack number (int32) of every segment in the planner's order, longest first, and the pack count,
    from the histogram of segment lengths (`histogram[x]` segments of x tokens, x in 1..len(histogram) - 1,
    the longest segment, at most max_len), at most `max_documents` segments a pack when given, and with
    `images` (each segment's image count in the planner's order, `_images_in_order`; empty without) at most
    `max_images` images a pack; in numpy when `vectorized` (ffd without images only), else by the kernels."""
    segments = int(histogram.sum())
    tokens = int(np.dot(histogram, np.arange(len(histogram), dtype=np.int64)))
    cap = plan_vectorized.pack_cap(segments, max_documents)
    bound = _pack_bound(segments, tokens, max_len, cap)
    if len(images):
        # Of the packs under `cap` segments, at most one holds at most half max_len and half max_images (a
        # later one's first segment would have fitted an earlier one), and fewer than 2*tokens/max_len hold
        # more tokens, fewer than 2*images/max_images more images.
        bound = min(segments, bound + 2 * -(-int(images.sum(dtype=np.int64)) // max_images))
    if vectorized:
        return plan_vectorized.assign_ffd(histogram, max_len, cap, bound)
    if len(images):  # chosen here, so that a plan without the cap never compiles the capped kernel
        pack_of_sorted, packs = _ffd_pictured(histogram, max_len, bound, cap, images, max_images)
    else:
        assign = _ffd if algorithm == "ffd" else _bfd
        pack_of_sorted, packs = assign(histogram, max_len, bound, tokens, cap)
    return pack_of_sorted, int(packs)


def _pack_bound(segments: int, tokens: int, max_len: int, cap: int) -> int:
    """How many packs an any-fit algorithm can open for `segments` segments of `tokens` tokens in all, at
    most `cap` a pack. Packs holding fewer than `cap` at the end had fewer whenever a later pack opened,
    so the later one's first segment did not fit in the earlier by tokens: no two of them together fit
    in one, so at most 2*ceil(tokens/max_len) - 1 of them. The others hold `cap` segments each."""
    if segments == 0:
        return 0
    return min(segments, 2 * -(-tokens // max_len) + 1 + segments // cap)


@kernel(cache=True)
def _first_of_length(histogram):
    """Where each length's run begins in the planner's order (longest first)."""
    first = np.empty(len(histogram), np.int64)
    at = 0
    for need in range(len(histogram) - 1, 0, -1):
        first[need] = at
        at += histogram[need]
    first[0] = at
    return first


@kernel(cache=True)
def _unsort(lengths, histogram, pack_of_sorted):
    """Pack of every document in input order: the k-th document of length x in input order is the
    k-th of length x in the planner's order."""
    cursor = _first_of_length(histogram)
    out = np.empty(len(lengths), np.int32)
    for i in range(len(lengths)):
        k = cursor[lengths[i]]
        cursor[lengths[i]] = k + 1
        out[i] = pack_of_sorted[k]
    return out


@kernel(cache=True)
def _images_in_order(lengths, left_out, max_len, overflow, histogram, images):
    """The image count (int32) of every segment in the planner's order: each of a document's segments
    counts the document's `images`; the k-th segment of length x in (row, piece) order is the k-th of
    length x in the planner's (as in `_unsort`)."""
    cursor = _first_of_length(histogram)
    out = np.empty(histogram.sum(), np.int32)
    for i in range(len(lengths)):
        length = np.int64(lengths[i])
        for piece in range(_pieces_of(length, max_len, overflow, len(left_out) > 0 and left_out[i])):
            need = min(length - piece * max_len, max_len)
            k = cursor[need]
            cursor[need] = k + 1
            out[k] = images[i]
    return out


@kernel(cache=True)
def _fits(tree, room, node, need, pictured):
    """Whether some pack under `node` may hold `need` tokens and `pictured` images, by the subtree's maxima
    (at a leaf: whether that pack does)."""
    return tree[node] >= need and room[node] >= pictured


@kernel(cache=True)
def _ffd(histogram, max_len, max_packs, tokens, cap):
    size = 1
    while size < max_packs:
        size *= 2
    # Implicit binary tree: leaves size..2*size-1 are pack slots holding remaining capacity,
    # each inner node the max of its children. The bound on max_packs guarantees a free slot.
    # A slot holding `cap` segments has no room left: capacity 0, which no segment fits.
    tree = np.full(2 * size, max_len, np.int32)
    held = np.zeros(size, np.int32)
    out = np.empty(histogram.sum(), np.int32)
    at, packs = 0, 0
    for need in range(len(histogram) - 1, 0, -1):
        node = 1
        for repeat in range(histogram[need]):
            if repeat > 0:
                # Packs left of the previous equal-length segment's pack had no room for it and only
                # fill up, so search rightwards from there: O(log distance), usually the same pack.
                while tree[node] < need:
                    while node & 1:  # climb until there is a right sibling ...
                        node //= 2
                    node += 1  # ... and move onto it
                # (the climb cannot pass the root: a fitting slot exists right of the previous one)
            while node < size:  # descend towards the leftmost leaf with room
                node *= 2
                if tree[node] < need:
                    node += 1
            out[at] = node - size
            at += 1
            packs = max(packs, node - size + 1)
            held[node - size] += 1
            tree[node] = tree[node] - need if held[node - size] < cap else 0
            up = node // 2
            while up >= 1:  # stop as soon as an ancestor's max is unaffected
                m = max(tree[2 * up], tree[2 * up + 1])
                if tree[up] == m:
                    break
                tree[up] = m
                up //= 2
    return out, packs


@kernel(cache=True)
def _ffd_pictured(histogram, max_len, max_packs, cap, images, max_images):
    """`_ffd` under the image cap: the leftmost pack with room for a segment's tokens and its images. `room` is
    a second max tree, over the packs' image room, beside `_ffd`'s over their token room."""
    size = 1
    while size < max_packs:
        size *= 2
    tree = np.full(2 * size, max_len, np.int32)
    room = np.full(2 * size, max_images, np.int32)
    held = np.zeros(size, np.int32)
    out = np.empty(histogram.sum(), np.int32)
    at, packs = 0, 0
    for need in range(len(histogram) - 1, 0, -1):
        node = 1
        for repeat in range(histogram[need]):
            pictured = images[at]
            # A segment with at least the previous one's images resumes from the previous one's pack: the packs
            # left of it lacked the tokens (equal in a run) or the room for the previous one's images, so for these.
            if repeat == 0 or pictured < images[at - 1]:
                node = 1
            while not (node >= size and _fits(tree, room, node, need, pictured)):
                if node < size and _fits(tree, room, node, need, pictured):
                    node *= 2  # descend, leftmost first
                    continue
                while node & 1:  # no pack here: climb until there is a right sibling ...
                    node //= 2
                node += 1  # ... and move onto it (a fresh slot to the right always fits)
            out[at] = node - size
            packs = max(packs, node - size + 1)
            held[node - size] += 1
            tree[node] = tree[node] - need if held[node - size] < cap else 0
            room[node] -= pictured
            at += 1
            up = node // 2
            while up >= 1:  # stop as soon as neither ancestor max is affected
                m, r = max(tree[2 * up], tree[2 * up + 1]), max(room[2 * up], room[2 * up + 1])
                if tree[up] == m and room[up] == r:
                    break
                tree[up], room[up] = m, r
                up //= 2
    return out, packs


@kernel(cache=True)
def _set_leaf(tree, size, leaf, value):
    node = size + leaf
    tree[node] = value
    node //= 2
    while node >= 1:
        m = min(tree[2 * node], tree[2 * node + 1])
        if tree[node] == m:
            break
        tree[node] = m
        node //= 2


@kernel(cache=True)
def _min_from(tree, size, leaf):
    """Minimum over leaves leaf..size-1 (the classic bottom-up range query with an open end)."""
    best = tree[0]  # tree[0] is unused by the tree and holds the "empty" value
    lo, hi = leaf + size, 2 * size
    while lo < hi:
        if lo & 1:
            best = min(best, tree[lo])
            lo += 1
        lo //= 2
        hi //= 2
    return best


@kernel(cache=True)
def _link(a, b, child, sibling):
    """Merge two pairing-heap roots; the lower pack number stays on top."""
    if b < a:
        a, b = b, a
    sibling[b] = child[a]
    child[a] = b
    return a


@kernel(cache=True)
def _pop(root, child, sibling, stack):
    """Remove `root` from its pairing heap and return the new root (-1 if now empty)."""
    # Two-pass pairing (link neighbours left to right, then fold right to left) is what gives the
    # amortised O(log n) bound; linking the children one by one would degrade to O(n).
    count = 0
    a = child[root]
    while a >= 0:
        b = sibling[a]
        if b < 0:
            stack[count] = a
            count += 1
            break
        after = sibling[b]
        stack[count] = _link(a, b, child, sibling)
        count += 1
        a = after
    if count == 0:
        return -1
    top = stack[count - 1]
    for j in range(count - 2, -1, -1):
        top = _link(stack[j], top, child, sibling)
    return top


@kernel(cache=True)
def _bfd(histogram, max_len, max_packs, tokens, cap):
    # A pack holds at most `fill` = min(max_len, tokens) tokens, so its remaining capacity lies in
    # [max_len - fill, max_len]: the buckets are that range, numbered from `base`, so that memory follows
    # the corpus and not max_len (2**31 - 1 would take gigabytes).
    fill = min(max_len, tokens)
    base = max_len - fill
    size = 1
    while size <= fill:
        size *= 2
    none = fill + 1
    # Leaf c of the min tree is c while some open pack has exactly base + c tokens left, else `none`.
    tree = np.full(2 * size, none, np.int32)
    heap = np.full(fill + 1, -1, np.int32)  # root (lowest pack number) of bucket c's heap
    child = np.full(max_packs, -1, np.int32)
    sibling = np.full(max_packs, -1, np.int32)
    stack = np.empty(max_packs, np.int32)
    held = np.zeros(max_packs, np.int32)
    out = np.empty(histogram.sum(), np.int32)
    at, packs = 0, 0
    for need in range(len(histogram) - 1, 0, -1):
        for _ in range(histogram[need]):
            left = _min_from(tree, size, max(need - base, 0))
            if left == none:
                pack = packs
                packs += 1
                left = fill
            else:
                pack = heap[left]
                heap[left] = _pop(pack, child, sibling, stack)
                if heap[left] < 0:
                    _set_leaf(tree, size, left, none)
            out[at] = pack
            at += 1
            left -= need
            held[pack] += 1
            # A full pack, by tokens or by segments, can never be chosen again, so it leaves the structure.
            if base + left > 0 and held[pack] < cap:
                child[pack] = -1
                if heap[left] < 0:
                    heap[left] = pack
                    _set_leaf(tree, size, left, left)
                else:
                    heap[left] = _link(heap[left], pack, child, sibling)
    return out, packs


@kernel(cache=True)
def _pieces_of(length, max_len, overflow, left_out):
    """How many segments a document of `length` tokens becomes: the definition of the overflow
    policies (see `document_pieces`). Piece j is `min(length - j*max_len, max_len)` tokens long."""
    if left_out or length == 0:
        return 0
    if length <= max_len or overflow == _TRUNCATE:
        return 1
    if overflow == _DROP:
        return 0
    return (length + max_len - 1) // max_len


@kernel(cache=True)
def _tally(lengths, untrained, drop_untrained, max_len, overflow):
    """One pass over the documents: the histogram of segment lengths (as long as the longest segment,
    never max_len) and the `_COUNTS`."""
    longest = 0
    for i in range(len(lengths)):
        longest = max(longest, np.int64(lengths[i]))
    histogram = np.zeros(min(longest, max_len) + 1, np.int64)
    counts = np.zeros(_COUNT_FIELDS, np.int64)
    for i in range(len(lengths)):
        length = np.int64(lengths[i])
        is_untrained = len(untrained) > 0 and untrained[i]
        left_out = drop_untrained and is_untrained
        pieces = _pieces_of(length, max_len, overflow, left_out)
        counts[0] += length
        if length == 0:
            counts[1] += 1
        if length > max_len and not left_out:
            if pieces > 1:
                counts[2] += 1
                counts[3] += pieces
            if overflow == _TRUNCATE:
                counts[4] += 1
                counts[5] += length - max_len
            elif overflow == _DROP:
                counts[6] += 1
                counts[7] += length
        if is_untrained:
            counts[8] += 1
            counts[9] += length
        for piece in range(pieces):
            histogram[min(length - piece * max_len, max_len)] += 1
    return histogram, counts


@kernel(cache=True)
def _expand(lengths, left_out, max_len, overflow, segments):
    """Every segment of the documents, in (row, piece) order: rows, pieces, starts, lengths."""
    rows = np.empty(segments, np.int64)
    pieces = np.empty(segments, np.int64)
    starts = np.empty(segments, np.int64)
    out = np.empty(segments, np.int64)
    at, token = 0, 0
    for i in range(len(lengths)):
        length = np.int64(lengths[i])
        for piece in range(_pieces_of(length, max_len, overflow, len(left_out) > 0 and left_out[i])):
            rows[at], pieces[at] = i, piece
            starts[at] = token + piece * max_len
            out[at] = min(length - piece * max_len, max_len)
            at += 1
        token += length
    return rows, pieces, starts, out


@kernel(cache=True)
def _pack_contents(histogram, pack_of_sorted, packs):
    """Segments and tokens of every pack (int32: at most max_len of either)."""
    segments = np.zeros(packs, np.int32)
    tokens = np.zeros(packs, np.int32)
    at = 0
    for need in range(len(histogram) - 1, 0, -1):
        for _ in range(histogram[need]):
            pack = pack_of_sorted[at]
            segments[pack] += 1
            tokens[pack] += need
            at += 1
    return segments, tokens


@kernel(cache=True)
def _scatter(lengths, left_out, max_len, overflow, histogram, pack_of_sorted, slot_offsets, order, bookmarks):
    """Fill `order` with the number of the segment in each pack slot, segments numbered in (row,
    piece) order, which they keep within a pack; and `bookmarks` with the row, piece and row's first
    token of every `_BLOCK`-th segment.

    Packs in the planner's numbering, not shuffled (`PackingPlan.slice` applies the shuffle): the
    segments of one length go to ascending packs, so the writes of each length move forward through
    memory instead of landing anywhere in it."""
    cursor = _first_of_length(histogram)
    fill = slot_offsets[:-1].copy()
    segment, token = 0, 0
    for i in range(len(lengths)):
        length = np.int64(lengths[i])
        for piece in range(_pieces_of(length, max_len, overflow, len(left_out) > 0 and left_out[i])):
            if segment % _BLOCK == 0:
                mark = bookmarks[segment // _BLOCK]
                mark[0], mark[1], mark[2] = i, piece, token
            need = min(length - piece * max_len, max_len)
            k = cursor[need]
            cursor[need] = k + 1
            pack = pack_of_sorted[k]
            order[fill[pack]] = segment
            fill[pack] += 1
            segment += 1
        token += length


@kernel(cache=True, nogil=True)  # shard writers call it from their threads
def _resolve(order, visit, lengths, left_out, bookmarks, max_len, overflow):
    """Row, piece, token start and length of the segments numbered `order`, found in the order of
    `visit` (ascending segment numbers: the bookmarks and lengths are then read front to back)."""
    rows = np.empty(len(order), np.int64)
    pieces = np.empty(len(order), np.int32)
    starts = np.empty(len(order), np.int64)
    out = np.empty(len(order), np.int64)
    for j in visit:
        wanted = np.int64(order[j])
        mark = bookmarks[wanted // _BLOCK]
        row, piece, token = mark[0], mark[1], mark[2]
        skip = wanted % _BLOCK  # segments from the bookmark to the wanted one
        while True:
            length = np.int64(lengths[row])
            count = _pieces_of(length, max_len, overflow, len(left_out) > 0 and left_out[row])
            if piece + skip < count:
                piece += skip
                break
            skip -= count - piece
            token += length
            row += 1
            piece = 0
        rows[j], pieces[j] = row, piece
        starts[j] = token + piece * max_len
        out[j] = min(length - piece * max_len, max_len)
    return rows, pieces, starts, out


@dataclass(frozen=True)
class ShardPacks:
    """Packs as concrete arrays (what one shard holds): pack p holds the segments
    `pack_offsets[p]:pack_offsets[p+1]`, in (row, piece) order; a segment is `lengths[i]` tokens from
    `starts[i]` of the token store."""

    max_len: int
    pack_offsets: np.ndarray  # int64 [packs + 1]
    starts: np.ndarray  # int64 [segments]: first token in the store of all documents, back to back
    lengths: np.ndarray  # int64 [segments]
    rows: np.ndarray  # int64 [segments]: corpus row
    pieces: np.ndarray  # int32 [segments]: piece number of a split document
    source_ids: np.ndarray | None = None  # uint16 [segments]: a mixture's source of each (`prepack.building.mixture_plan`)
    pair_roles: np.ndarray | None = None  # uint8 [segments]: a preference-pair build's (`prepack.building.pair_plan`)
    group_scores: np.ndarray | None = None  # float64 [segments]: a group build's scores, read with --scores-column
    group_ranks: np.ndarray | None = None  # uint8 [segments]: a group build's ranks, read with --ranks-column
    desirable: np.ndarray | None = None  # bool [segments / 2]: an unpaired build's label of each example (2 segments)


@dataclass(frozen=True)
class _Documents:
    """What a plan keeps per document to find its segments again."""

    lengths: np.ndarray  # `compact_lengths`
    left_out: np.ndarray  # bool per document, or empty when none is left out
    bookmarks: np.ndarray  # int64 [segments / _BLOCK, 3]: row, piece and the row's first token
    overflow: int  # `_OVERFLOWS` code
    vectorized: bool = False  # planned by `prepack.building.plan_vectorized`, which finds its segments too


@kernel(cache=True, nogil=True)
def _slots_of(order, slot_offsets, packs):
    """The segment numbers of `packs`, one pack after the other."""
    total = 0
    for pack in packs:
        total += slot_offsets[pack + 1] - slot_offsets[pack]
    out = np.empty(total, order.dtype)
    at = 0
    for pack in packs:
        size = slot_offsets[pack + 1] - slot_offsets[pack]
        out[at : at + size] = order[slot_offsets[pack] : slot_offsets[pack + 1]]
        at += size
    return out


@dataclass(frozen=True)
class PackingPlan:
    """Which segments go where, compactly. Packs are numbered as the planner opened them; the p-th
    pack written is pack `shuffle[p]`. Pack q holds the slots `slot_offsets[q]:slot_offsets[q+1]`,
    and slot i the segment numbered `order[i]` (segments numbered in (row, piece) order, which they
    keep within a pack). `slice` turns written packs into a `ShardPacks`."""

    max_len: int
    shuffle: np.ndarray  # int64 [packs]
    slot_offsets: np.ndarray  # int64 [packs + 1]
    tokens_per_pack: np.ndarray  # int32 [packs]
    order: np.ndarray  # uint32 (int64 from 2**32 segments) [segments]
    documents: _Documents
    # int64: histogram[x] segments of x tokens (`segment_histogram`'s, as long as the longest segment): what an
    # index build records (`Manifest.segment_lengths`) for its appends to count a rebuild's packs from.
    histogram: np.ndarray
    counts: dict[str, int] = field(default_factory=dict)  # what overflow did; see `Totals`

    @property
    def packs(self) -> int:
        return len(self.shuffle)

    def pack_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Segments and tokens of every pack, in written order (int64 each)."""
        return np.diff(self.slot_offsets)[self.shuffle], self.tokens_per_pack[self.shuffle].astype(np.int64)

    def slice(self, first: int, end: int) -> ShardPacks:
        """Written packs first..end-1 as concrete arrays (what one shard holds)."""
        packs = self.shuffle[first:end]
        pack_offsets = np.zeros(len(packs) + 1, dtype=np.int64)
        np.cumsum(self.slot_offsets[packs + 1] - self.slot_offsets[packs], out=pack_offsets[1:])
        d = self.documents
        if d.vectorized:
            segments = plan_vectorized.slots_of(self.order, self.slot_offsets, packs)
            rows, pieces, starts, lengths = plan_vectorized.resolve(segments, d.lengths, d.left_out, self.max_len, d.overflow)
        else:
            segments = _slots_of(self.order, self.slot_offsets, packs)
            rows, pieces, starts, lengths = _resolve(
                segments, np.argsort(segments), d.lengths, d.left_out, d.bookmarks, self.max_len, d.overflow
            )
        return ShardPacks(self.max_len, pack_offsets, starts, lengths, rows, pieces)

    def totals(self) -> dict[str, int]:
        tokens = int(self.tokens_per_pack.sum(dtype=np.int64))
        return {
            **self.counts,
            "tokens": tokens,
            "segments": len(self.order),
            "packs": self.packs,
            "padding_tokens": self.packs * self.max_len - tokens,
            "lower_bound": -(-tokens // self.max_len),
        }


class DocumentPieces(NamedTuple):
    """The segments that documents become under an overflow policy, in (row, piece) order."""

    rows: np.ndarray  # int64 [segments]: the document's index
    pieces: np.ndarray  # int64 [segments]: 0, 1, … within a split document
    starts: np.ndarray  # int64 [segments]: first token, with the documents' tokens back to back
    lengths: np.ndarray  # int64 [segments]
    counts: dict[str, int]  # what overflow did: input_tokens, empty, split, … as in `Totals`


def untrained_documents(offsets: np.ndarray, labels: np.ndarray | None, without_numba: bool = False) -> np.ndarray:
    """Which documents (`labels[offsets[i]:offsets[i+1]]`) have tokens but no trained token: every label
    after the first is -100 (a document's first token is never trained, see `prepack.training.collate`).

    Without labels every token is trained, so no document is untrained. Each document's labels are
    read only up to its first trained one (an index build scans a store's memory-mapped labels with
    this, instead of reading them all); `without_numba` (an index build of a store small enough,
    `prepack.building.plan_vectorized.scans`), all of them, in numpy.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    if labels is None:
        return np.zeros(len(lengths), dtype=bool)
    labels = _slicing(offsets, labels)
    return plan_vectorized.untrained(offsets, labels) if without_numba else _untrained(offsets, labels)


def first_trained_labels(offsets: np.ndarray, labels: np.ndarray, without_numba: bool = False) -> np.ndarray:
    """Each document's (`labels[offsets[i]:offsets[i+1]]`) tokens before its first trained label (int64; its
    length when it has none): a pair document's prompt (`prepack.sources.pairs` labels the prompt -100). As
    `untrained_documents` reads them, each document's labels only up to its first trained one;
    `without_numba`, all of them, in numpy."""
    offsets = np.asarray(offsets, dtype=np.int64)
    labels = _slicing(offsets, labels)
    return plan_vectorized.first_trained(offsets, labels) if without_numba else _first_trained(offsets, labels)


def _slicing(offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """`labels` as an array, once int64 `offsets` are known to slice it in order (ValueError otherwise)."""
    labels = np.asarray(labels)
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > len(labels) or (np.diff(offsets) < 0).any()):
        raise ValueError(f"offsets {offsets[0]}..{offsets[-1]} do not slice {len(labels)} labels in order")
    return labels


@kernel(cache=True)
def _untrained(offsets, labels):
    out = np.zeros(len(offsets) - 1, np.bool_)
    for document in range(len(offsets) - 1):
        start, end = offsets[document], offsets[document + 1]
        if end > start:
            out[document] = True
            for token in range(start + 1, end):
                if labels[token] != IGNORE_INDEX:
                    out[document] = False
                    break
    return out


@kernel(cache=True)
def _first_trained(offsets, labels):
    out = np.empty(len(offsets) - 1, np.int64)
    for document in range(len(offsets) - 1):
        start, end = offsets[document], offsets[document + 1]
        token = start
        while token < end and labels[token] == IGNORE_INDEX:
            token += 1
        out[document] = token - start
    return out


def document_pieces(
    lengths: np.ndarray, max_len: int, overflow: str, untrained: np.ndarray | None = None, drop_untrained: bool = False
) -> DocumentPieces:
    """What documents of `lengths` tokens become in packs of `max_len`: the definition of `overflow`.

    "split" (and "error", which the caller enforces) cuts a longer document into max_len pieces and a
    shorter last one; "truncate" keeps its first max_len tokens; "drop" leaves it out. Empty documents
    become nothing. `untrained` (see `untrained_documents`) marks the documents with no trained token:
    counted, and with `drop_untrained` left out before overflow applies to the rest.
    """
    code = _overflow_code(overflow)
    lengths = np.asarray(lengths, dtype=np.int64)
    untrained = _flags(untrained, len(lengths))
    histogram, counts = _tally(lengths, untrained, drop_untrained, max_len, code)
    left_out = untrained if drop_untrained else np.zeros(0, dtype=bool)
    rows, pieces, starts, segment_lengths = _expand(lengths, left_out, max_len, code, int(histogram.sum()))
    return DocumentPieces(rows, pieces, starts, segment_lengths, dict(zip(_COUNTS, map(int, counts))))


def segment_histogram(
    lengths: np.ndarray, max_len: int, *, overflow: str = "split", untrained: np.ndarray | None = None, drop_untrained: bool = False
) -> np.ndarray:
    """The segments `plan_packs` makes of these documents with these options, by length (int64: `histogram[x]`
    segments of x tokens, as long as the longest, at most max_len + 1): what `pack_count` counts packs from. The
    histograms of the parts of a corpus, added up, are the whole's: an append counts a rebuild's packs from
    those of the store's shards, one shard's lengths at a time. In numpy (two bincounts), no kernel."""
    max_len = _check_options(max_len, "ffd")
    code = _overflow_code(overflow)
    lengths = compact_lengths(lengths)
    untrained = _flags(untrained, len(lengths))
    return plan_vectorized.segment_histogram(lengths, untrained if drop_untrained else _NONE_LEFT_OUT, max_len, code)


def histogram_pairs(histogram: np.ndarray) -> list[list[int]]:
    """The segments of a histogram (`segment_histogram`'s) as [length, count] pairs by rising length, its empty
    entries and length 0 left out: what a build records as `Manifest.segment_lengths`."""
    lengths = np.flatnonzero(histogram[1:]) + 1
    return np.stack([lengths, histogram[lengths]], axis=1).tolist()


def pairs_histogram(pairs: list[list[int]]) -> np.ndarray:
    """`histogram_pairs` undone: the histogram (int64, as long as the longest length) of [length, count] pairs
    by rising length, as the Manifest model holds `segment_lengths` (lengths in 1..max_len, counts int64)."""
    pairs = np.array(pairs, np.int64).reshape(-1, 2)
    histogram = np.zeros(int(pairs[-1, 0]) + 1 if len(pairs) else 1, np.int64)
    histogram[pairs[:, 0]] = pairs[:, 1]
    return histogram


def pack_count(histogram: np.ndarray, max_len: int, *, algorithm: str = "ffd", max_documents: int | None = None) -> int:
    """The packs `plan_packs` makes of documents whose segments `histogram` counts (`segment_histogram`), without
    laying them out: what a build appended to reports its packs against (a rebuild of the same documents at
    once). First-fit-decreasing counts runs of equal packs in numpy (`plan_vectorized.count_ffd`: no kernel, and
    as long whatever the number of documents) unless the kernel counts faster (`plan_vectorized.counts_in_numpy`:
    past so many distinct lengths before numba has started, and where the segments are few for their lengths
    after); best-fit runs its kernel."""
    max_len = _check_options(max_len, algorithm)
    max_documents = checked_cap(max_documents)
    histogram = np.asarray(histogram)
    if histogram.ndim != 1 or not np.issubdtype(histogram.dtype, np.integer) or len(histogram) > max_len + 1:
        raise ValueError(f"histogram must be a 1-D integer array of at most max_len + 1 ({max_len + 1}) counts")
    if len(histogram) and histogram.min() < 0:
        raise ValueError(f"segment counts must not be negative, got {histogram.min()}")
    histogram = histogram.astype(np.int64)  # a copy: its count of empty segments (none are placed) set to 0
    histogram[:1] = 0
    segments = int(histogram.sum())
    if segments == 0:
        return 0
    if algorithm == "bfd" or not plan_vectorized.counts_in_numpy(histogram, segments):
        return _assign_sorted(histogram, max_len, algorithm, max_documents)[1]
    return plan_vectorized.count_ffd(histogram, max_len, max_documents)


class _Assigned(NamedTuple):
    """The first half of `plan_packs`: its checked options and inputs, the segments' histogram and
    counts, and the pack of each sorted segment."""

    max_len: int
    max_documents: int | None
    code: int
    lengths: np.ndarray
    untrained: np.ndarray
    histogram: np.ndarray
    counts: np.ndarray
    pack_of_sorted: np.ndarray
    packs: int
    vectorized: bool


def _assigned(
    lengths, max_len, algorithm, overflow, untrained, drop_untrained, max_documents, without_numba=False, images=None, max_images=None
) -> _Assigned:
    max_len = _check_options(max_len, algorithm)
    max_documents = checked_cap(max_documents)
    code = _overflow_code(overflow)
    lengths = compact_lengths(lengths)
    untrained = _flags(untrained, len(lengths))
    images, max_images = _checked_images(images, max_images, len(lengths), algorithm)
    vectorized = without_numba and not len(images) and plan_vectorized.suits(len(lengths), algorithm)
    histogram, counts = (plan_vectorized.tally if vectorized else _tally)(lengths, untrained, drop_untrained, max_len, code)
    vectorized = vectorized and plan_vectorized.assign_suits(histogram, max_len, max_documents)
    if len(images):
        left_out = untrained if drop_untrained else _NONE_LEFT_OUT
        images = _images_in_order(lengths, left_out, max_len, code, histogram, images)
    pack_of_sorted, packs = _assign_sorted(histogram, max_len, algorithm, max_documents, vectorized, images=images, max_images=max_images)
    return _Assigned(max_len, max_documents, code, lengths, untrained, histogram, counts, pack_of_sorted, packs, vectorized)


def plan_packs(
    lengths: np.ndarray,
    max_len: int,
    *,
    algorithm: str = "ffd",
    overflow: str = "split",
    seed: int = 0,
    untrained: np.ndarray | None = None,
    drop_untrained: bool = False,
    max_documents: int | None = None,
    without_numba: bool = False,
    images: np.ndarray | None = None,
    max_images: int | None = None,
) -> PackingPlan:
    """Plan the whole corpus: cut overlong documents as `overflow` says and leave out untrained ones
    as `drop_untrained` says (`document_pieces`), assign the segments to packs (`assign_packs`'s
    algorithms, at most `max_documents` segments a pack when given, and with `images` (every document's image
    count) at most `max_images` images a pack, by ffd), then shuffle the pack order with `seed`.

    `lengths` are the token counts of the corpus rows, whose tokens lie back to back in the token
    store; the plan keeps them, so pass them through `compact_lengths` to keep no copy.
    `overflow="error"` is the caller's to enforce (it can name the file); here it packs as split.

    `without_numba`: the caller runs no other numba kernel (an index build), so a plan small enough
    to be made in numpy in less time than numba takes to start is (`prepack.building.plan_vectorized`: the
    same plan, to the byte).
    """
    max_len, max_documents, code, lengths, untrained, histogram, counts, pack_of_sorted, packs, vectorized = _assigned(
        lengths, max_len, algorithm, overflow, untrained, drop_untrained, max_documents, without_numba, images, max_images
    )
    contents = plan_vectorized.pack_contents if vectorized else _pack_contents
    segments_per_pack, tokens_per_pack = contents(histogram, pack_of_sorted, packs)
    slot_offsets = np.zeros(packs + 1, dtype=np.int64)
    np.cumsum(segments_per_pack, out=slot_offsets[1:])
    del segments_per_pack
    order = np.empty(len(pack_of_sorted), dtype=np.uint32 if len(pack_of_sorted) <= 2**32 else np.int64)
    left_out = untrained if drop_untrained else np.zeros(0, dtype=bool)
    bookmarks = np.empty((-(-len(order) // _BLOCK), 3), dtype=np.int64)
    if vectorized:
        plan_vectorized.scatter(lengths, left_out, max_len, code, histogram, pack_of_sorted, slot_offsets, order, bookmarks)
    else:
        _scatter(lengths, left_out, max_len, code, histogram, pack_of_sorted, slot_offsets, order, bookmarks)
    return PackingPlan(
        max_len=max_len,
        # Shuffle whole packs, so training never sees the decreasing-length order of the planner.
        shuffle=np.random.default_rng(seed).permutation(packs),
        slot_offsets=slot_offsets,
        tokens_per_pack=tokens_per_pack,
        order=order,
        documents=_Documents(lengths, left_out, bookmarks, code, vectorized),
        histogram=histogram,
        counts=dict(zip(_COUNTS, map(int, counts))),
    )
