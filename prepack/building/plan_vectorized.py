"""The planner's kernels for first-fit-decreasing in numpy, for corpora small enough that loading numba
would cost more than planning: the same arrays as `prepack.building.plan`'s numba kernels, to the byte.

Loading numba and its cached kernels takes 0.5-0.7 CPU s; planning 200,000 documents takes tens of
milliseconds either way, so an index build of such a store was mostly numba's start-up
(`python benchmarks/bench_index_planner.py`, `python benchmarks/bench_startup.py`). `prepack.building.plan` runs these functions where `suits` says so and its
kernels elsewhere; tests/building/test_plan_vectorized.py holds each to its kernel.

first-fit-decreasing by runs of equal length: a run of k segments of length x fills the open packs in
pack order, each taking as many as fit (its remaining capacity // x: after each one it is still the
lowest-numbered pack with room), until the run is placed, then opens new packs of max_len // x each.
That is one vectorized step per distinct length, over the packs open so far: O(distinct lengths x packs),
which `suits` bounds, against the kernel's O(segments x log packs).
"""

from __future__ import annotations

import numpy as np

from prepack.building import kernels
from prepack.formats.shards import IGNORE_INDEX

__all__ = [
    "assign_ffd", "assign_suits", "count_ffd", "counts_in_numpy", "pack_cap", "pack_contents", "pieces_of", "resolve", "scans",
    "scatter", "segment_histogram", "slots_of", "suits", "tally", "untrained",
]

# Documents up to which the per-document steps run here (each a few numpy passes over the documents,
# against one pass of a kernel), and the (distinct segment lengths x packs) up to which `assign_ffd` does
# (about 1 ns each): at these sizes numpy costs at most a few tenths of a second more than the kernels,
# and saves numba's start-up, 0.5-0.7 CPU s (`python benchmarks/bench_index_planner.py`).
_DOCUMENTS = 1_000_000
_ASSIGN_WORK = 200_000_000
# Tokens up to which `untrained` reads a store's labels (all of them, about 1 ns a token, where the kernel
# stops at each document's first trained one), and how many it holds at once (16 MiB of flags).
_LABELS = 200_000_000
_WINDOW = 2**24
# `prepack.building.plan`'s overflow codes and bookmark spacing (a test keeps them equal).
_TRUNCATE, _DROP = 1, 2
_BLOCK = 32
# Runs of equal length after which `count_ffd` drops the groups no later run fits; the segments a distinct
# length above which it counts faster than the kernel places them once numba has started (the kernel 6-43 ns a
# segment, `count_ffd` 12-16 us a distinct length, more the more lengths there are); and the distinct lengths up
# to which it counts faster than numba starts (0.5-0.7 CPU s; all 32,768 lengths of max-len 32768 took 0.52 s, so
# half of them about 0.25 s): `python benchmarks/bench_append.py` prints the kernel's and count_ffd's costs,
# `python benchmarks/bench_startup.py` numba's.
_TIDY = 64
_KERNEL_SEGMENTS = 1000
_COUNT_LENGTHS = 16_384


def suits(documents: int, algorithm: str) -> bool:
    """Whether a plan of `documents` documents by `algorithm` is made here (as far as `assign_ffd`
    goes: `assign_suits` decides that once the segment lengths are known)."""
    return algorithm == "ffd" and documents <= _DOCUMENTS


def scans(tokens: int) -> bool:
    """Whether `untrained` reads `tokens` labels faster than numba would start."""
    return tokens <= _LABELS


def labels_in_numpy(tokens: int) -> bool:
    """Whether `tokens` labels are read in numpy, no numba kernel (`without_numba`): when numpy scans them faster
    than numba would start, and no kernel ran in this process before (then numba's start-up is paid anyway)."""
    return scans(tokens) and not kernels.started()


def plans_in_numpy(tokens: int, has_labels: bool) -> bool:
    """Whether an index build whose documents hold `tokens` tokens (an append's: the new documents') reads
    their labels and plans in numpy, no numba kernel: `labels_in_numpy(tokens)` where it has labels, else where
    no kernel ran in this process yet. Its first pass and its planning ask this alike."""
    return labels_in_numpy(tokens) if has_labels else not kernels.started()


def counts_in_numpy(histogram: np.ndarray, segments: int) -> bool:
    """Whether `count_ffd` counts the packs of `histogram`'s `segments` segments faster than the kernel would
    place them (the kernel's cost follows the segments, `count_ffd`'s the distinct lengths): before numba has
    started, where they are at most `_COUNT_LENGTHS` distinct lengths, and after, where the segments are more
    than `_KERNEL_SEGMENTS` for each distinct length."""
    lengths = np.count_nonzero(histogram)
    return lengths <= _COUNT_LENGTHS if not kernels.started() else segments > _KERNEL_SEGMENTS * lengths


def pack_cap(segments: int, max_documents: int | None) -> int:
    """The most segments a pack of a plan of `segments` segments holds: `max_documents` when given, else as
    many as there are (an int32 at most, as the kernels take it)."""
    return min(segments, max_documents or segments, 2**31 - 1)


def assign_suits(histogram: np.ndarray, max_len: int, max_documents: int | None = None) -> bool:
    """Whether `assign_ffd` places the segments of `histogram` (at most `max_documents` a pack) faster
    than numba would start."""
    tokens = int(np.dot(histogram, np.arange(len(histogram), dtype=np.int64)))
    packs = max(-(-tokens // max_len), -(-int(histogram.sum()) // (max_documents or 1 << 62)))
    return np.count_nonzero(histogram) * packs <= _ASSIGN_WORK


def pieces_of(lengths: np.ndarray, left_out: np.ndarray, max_len: int, overflow: int) -> np.ndarray:
    """`prepack.building.plan._pieces_of` of every document (int64)."""
    pieces = np.where(lengths <= max_len, 1, 0 if overflow == _DROP else 1 if overflow == _TRUNCATE else -(-lengths // max_len))
    pieces[lengths == 0] = 0
    if len(left_out):
        pieces[left_out] = 0
    return pieces


def tally(lengths: np.ndarray, untrained: np.ndarray, drop_untrained: bool, max_len: int, overflow: int) -> tuple[np.ndarray, np.ndarray]:
    """`prepack.building.plan._tally`: the histogram of segment lengths and the counts."""
    lengths = lengths.astype(np.int64)
    flagged = untrained if len(untrained) else np.zeros(len(lengths), bool)
    pieces = pieces_of(lengths, flagged if drop_untrained else untrained[:0], max_len, overflow)
    over = (lengths > max_len) & ~(flagged & drop_untrained)
    split = over & (pieces > 1)
    counts = np.zeros(10, np.int64)
    counts[:4] = lengths.sum(), np.count_nonzero(lengths == 0), np.count_nonzero(split), pieces[split].sum()
    if overflow == _TRUNCATE:
        counts[4:6] = np.count_nonzero(over), (lengths[over] - max_len).sum()
    elif overflow == _DROP:
        counts[6:8] = np.count_nonzero(over), lengths[over].sum()
    counts[8:] = np.count_nonzero(flagged), lengths[flagged].sum()
    return segment_histogram(lengths, flagged if drop_untrained else untrained[:0], max_len, overflow), counts


def segment_histogram(lengths: np.ndarray, left_out: np.ndarray, max_len: int, overflow: int) -> np.ndarray:
    """`prepack.building.plan._tally`'s histogram (int64): `histogram[x]` segments of x tokens, x in 1..min(longest,
    max_len), of the documents of `lengths` not `left_out` (empty: none), by two bincounts, no pass per piece:
    what an append counts a rebuild's packs from, one store shard at a time (their histograms add up)."""
    longest = int(lengths.max()) if len(lengths) else 0
    kept = lengths[~left_out] if len(left_out) else lengths
    over = kept > max_len
    histogram = np.bincount(kept[~over], minlength=min(longest, max_len) + 1)
    if overflow != _DROP and over.any():
        longer = kept[over].astype(np.int64)
        if overflow == _TRUNCATE:
            histogram[max_len] += len(longer)
        else:  # split: whole pieces of max_len, then what is left (an exact multiple leaves none)
            histogram[max_len] += (longer // max_len).sum()
            rest = np.bincount(longer % max_len)  # as long as the longest rest, not max_len
            histogram[: len(rest)] += rest
    histogram[0] = 0  # empty documents (and exact multiples' nothing left) make no segment
    return histogram.astype(np.int64, copy=False)


def assign_ffd(histogram: np.ndarray, max_len: int, cap: int, bound: int) -> tuple[np.ndarray, int]:
    """`prepack.building.plan._ffd`: the pack (int32) of every segment in the planner's order, and the pack
    count, at most `cap` segments a pack, in at most `bound` packs (`prepack.building.plan._pack_bound`)."""
    segments = int(histogram.sum())
    left = np.empty(bound, np.int32)  # room in every pack
    held = np.empty(bound, np.int64)  # segments in every pack
    out = np.empty(segments, np.int32)
    at, packs = 0, 0
    for need in np.flatnonzero(histogram[1:])[::-1] + 1:
        run = int(histogram[need])
        roomy = np.flatnonzero((left[:packs] >= need) & (held[:packs] < cap))  # in pack order
        if len(roomy):
            fits = np.minimum(left[roomy] // need, cap - held[roomy])
            placed = np.cumsum(fits)
            if placed[-1] >= run:  # the run ends in roomy[last]
                last = int(np.searchsorted(placed, run))
                roomy, fits = roomy[: last + 1], fits[: last + 1]
                fits[last] -= placed[last] - run
            taken = int(fits.sum())
            out[at : at + taken] = np.repeat(roomy, fits)
            left[roomy] -= (fits * need).astype(np.int32)
            held[roomy] += fits
            at, run = at + taken, run - taken
        if run:
            per_pack = min(max_len // need, cap)
            opened = -(-run // per_pack)
            out[at : at + run] = packs + np.arange(run, dtype=np.int32) // per_pack
            left[packs : packs + opened] = max_len - per_pack * need
            held[packs : packs + opened] = per_pack
            last = run - (opened - 1) * per_pack
            left[packs + opened - 1] = max_len - last * need
            held[packs + opened - 1] = last
            at, packs = at + run, packs + opened
    return out, packs


def count_ffd(histogram: np.ndarray, max_len: int, max_documents: int | None = None) -> int:
    """The pack count of `assign_ffd` (at most `max_documents` segments a pack when given), placing no segment:
    O(distinct lengths x groups), whatever the number of segments. Packs that are alike (room left, segments
    held) and next to each other in pack order take alike from every run, so they are kept as one group of
    several: a run fills the groups with room in order, each of its packs taking as many as fit, and splits the
    group where it ends into the packs that took as many, the one that took the rest, and the packs that took
    none; the packs it opens are two groups more. A run longer than any pack's room searches nothing (the longest
    half of the lengths, at least, only open packs). A group whose packs no later run fits (room below the
    shortest segment, or `max_documents` held) is dropped now and then, as it only lengthens the search."""
    needs = np.flatnonzero(histogram[1:])[::-1] + 1
    if not len(needs):
        return 0
    segments = int(histogram[1:].sum())
    cap = pack_cap(segments, max_documents)
    shortest, capped = int(needs[-1]), cap < segments
    groups = np.empty((3, 0), np.int64)  # rows: room left in each pack, segments each holds, packs in the group
    opened_since = []  # the groups opened after `groups`, each (room, held, packs): joined to it before a search
    packs = 0
    most = 0  # at least the most room of any group that may take a segment: a longer run skips the search
    for step, need in enumerate(needs.tolist()):
        run = int(histogram[need])
        if most >= need and opened_since:
            groups = np.concatenate([groups, np.array(opened_since, np.int64).T], axis=1)
            opened_since = []
        roomy = np.flatnonzero(groups[0] >= need) if most >= need else groups[0, :0]
        ended_in = -1  # the group where the run ended, split there; -1: every group with room took all it fits
        if len(roomy):
            fits = groups[0, roomy] // need
            if capped:
                fits = np.minimum(fits, cap - groups[1, roomy])
            placed = np.cumsum(fits * groups[2, roomy])
            if placed[-1] >= run:
                last = int(np.searchsorted(placed, run))
                ended_in, took = int(roomy[last]), int(fits[last])
                full, rest = divmod(run - (int(placed[last - 1]) if last else 0), took)
                roomy, fits, run = roomy[:last], fits[:last], 0
            else:
                run -= int(placed[-1])
            groups[0, roomy] -= fits * need
            groups[1, roomy] += fits
        if ended_in >= 0:
            room, held, size = groups[:, ended_in].tolist()
            split = [(room - took * need, held + took, full), (room - rest * need, held + rest, int(rest > 0)),
                     (room, held, size - full - int(rest > 0))]
            split = np.array([group for group in split if group[2]], np.int64).T
            groups = np.concatenate([groups[:, :ended_in], split, groups[:, ended_in + 1 :]], axis=1)
        else:
            most = min(most, need - 1)
        if run:
            per_pack = min(max_len // need, cap)
            opened = -(-run // per_pack)
            last_holds = run - (opened - 1) * per_pack
            if opened > 1:
                opened_since.append((max_len - per_pack * need, per_pack, opened - 1))
            opened_since.append((max_len - last_holds * need, last_holds, 1))
            packs += opened
            most = max(most, max_len - last_holds * need)
        if step % _TIDY == _TIDY - 1 and not opened_since:
            live = groups[0] >= shortest
            if capped:
                live &= groups[1] < cap
            groups = groups[:, live]
    return packs


def pack_contents(histogram: np.ndarray, pack_of_sorted: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """`prepack.building.plan._pack_contents`: segments and tokens (int32 each) of every pack."""
    lengths = np.arange(len(histogram) - 1, 0, -1)
    sorted_lengths = np.repeat(lengths, histogram[:0:-1])  # the planner's order, longest first
    segments = np.bincount(pack_of_sorted, minlength=packs).astype(np.int32)
    # float64 weights sum exactly: a pack holds at most 2**31 tokens.
    tokens = np.bincount(pack_of_sorted, weights=sorted_lengths, minlength=packs).astype(np.int32)
    return segments, tokens


def _segments(lengths: np.ndarray, left_out: np.ndarray, max_len: int, overflow: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pieces of every document, its first segment's number, its first token) as int64."""
    lengths = lengths.astype(np.int64)
    pieces = pieces_of(lengths, left_out, max_len, overflow)
    first_segment = np.cumsum(pieces) - pieces
    first_token = np.cumsum(lengths) - lengths
    return pieces, first_segment, first_token


def scatter(
    lengths: np.ndarray,
    left_out: np.ndarray,
    max_len: int,
    overflow: int,
    histogram: np.ndarray,
    pack_of_sorted: np.ndarray,
    slot_offsets: np.ndarray,
    order: np.ndarray,
    bookmarks: np.ndarray,
) -> None:
    """`prepack.building.plan._scatter`: fill `order` (the segment in every pack slot) and `bookmarks`."""
    pieces, first_segment, first_token = _segments(lengths, left_out, max_len, overflow)
    rows = np.repeat(np.arange(len(lengths)), pieces)
    piece = np.arange(len(rows)) - first_segment[rows]
    segment_lengths = np.minimum(lengths[rows] - piece * max_len, max_len)
    # The planner's order is longest first, ties in segment order: a stable sort of max_len - length.
    pack_of_segment = np.empty(len(rows), np.int32)
    pack_of_segment[_stable_argsort(len(histogram) - 1 - segment_lengths, len(histogram))] = pack_of_sorted
    order[:] = _stable_argsort(pack_of_segment, len(slot_offsets) - 1)  # packs in turn, each its segments in order
    marked = rows[::_BLOCK]
    bookmarks[:, 0], bookmarks[:, 1], bookmarks[:, 2] = marked, piece[::_BLOCK], first_token[marked]


def _stable_argsort(keys: np.ndarray, bound: int) -> np.ndarray:
    """`np.argsort(keys, kind="stable")` of keys in [0, bound): by 16-bit digits, least significant first,
    as numpy radix-sorts 16-bit keys in linear time (and others in O(n log n))."""
    order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    for shift in range(16, max(bound - 1, 1).bit_length(), 16):
        order = order[np.argsort(((keys[order] >> shift) & 0xFFFF).astype(np.uint16), kind="stable")]
    return order


def slots_of(order: np.ndarray, slot_offsets: np.ndarray, packs: np.ndarray) -> np.ndarray:
    """`prepack.building.plan._slots_of`: the segment numbers of `packs`, one pack after the other."""
    sizes = slot_offsets[packs + 1] - slot_offsets[packs]
    starts = np.repeat(slot_offsets[packs] - (np.cumsum(sizes) - sizes), sizes)
    return order[starts + np.arange(len(starts))]


def resolve(
    segments: np.ndarray, lengths: np.ndarray, left_out: np.ndarray, max_len: int, overflow: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`prepack.building.plan._resolve`: row, piece (int32), token start and length of the numbered segments,
    looked up in the segments of all documents (O(documents) per call, no bookmarks)."""
    pieces, first_segment, first_token = _segments(lengths, left_out, max_len, overflow)
    rows = np.repeat(np.arange(len(lengths)), pieces)[segments]
    piece = segments - first_segment[rows]
    return rows, piece.astype(np.int32), first_token[rows] + piece * max_len, np.minimum(lengths[rows] - piece * max_len, max_len)


def untrained(offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """`prepack.building.plan._untrained`: which documents have tokens but no trained label after their first,
    reading the labels `_WINDOW` at a time."""
    out = np.zeros(len(offsets) - 1, bool)
    first = 0
    while first < len(out):
        end = max(int(np.searchsorted(offsets, offsets[first] + _WINDOW, "right")) - 1, first + 1)
        base = offsets[first]
        starts, ends = offsets[first:end] - base, offsets[first + 1 : end + 1] - base
        trained = np.zeros(ends[-1] + 1, bool)  # one more, so that every bound below indexes it
        np.not_equal(labels[base : base + ends[-1]], IGNORE_INDEX, out=trained[:-1])
        # Each document's labels after its first, [start + 1, end), as one reduceat pair (empty if end <= start + 1).
        bounds = np.empty(2 * len(starts), np.int64)
        bounds[0::2], bounds[1::2] = np.minimum(starts + 1, ends), ends
        any_trained = np.logical_or.reduceat(trained, bounds)[0::2] & (bounds[0::2] < bounds[1::2])
        out[first:end] = (ends > starts) & ~any_trained
        first = end
    return out


def first_trained(offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """`prepack.building.plan._first_trained`: each document's tokens before its first trained label (its
    length when none), from every label's place."""
    trained = np.flatnonzero(labels[offsets[0] : offsets[-1]] != IGNORE_INDEX) + offsets[0]
    # Each document's first trained token; a document with none finds the next one's, or the end: its own end at most.
    first = np.append(trained, offsets[-1])[np.searchsorted(trained, offsets[:-1])]
    return np.minimum(first, offsets[1:]) - offsets[:-1]
