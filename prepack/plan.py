"""The packing planner: which pack every document goes into.

`plan_packs` plans a whole corpus from its document lengths alone: it cuts documents longer than
max_len as the overflow policy says (`document_pieces`, which `verify` also holds builds to), assigns
the resulting segments to packs with `assign_packs`, and shuffles the order of the packs with a seed.
The rest of this docstring is about `assign_packs`.

Both algorithms see the documents in the same order: a stable sort by length, longest first, so
equal lengths keep their input order. That makes the plan a pure function of the length column,
reproducible across runs and machines.

first-fit-decreasing ("ffd")
    Each document goes into the lowest-numbered pack with room for it (remaining capacity >=
    length), else into a new pack. A max segment tree over pack slots finds that pack in
    O(log packs); slots not opened yet hold a full capacity, so "the next pack to open" is simply
    the leftmost such slot and needs no special case. A run of equal lengths resumes the search
    from the previous document's pack, which makes the common case O(1).

best-fit-decreasing ("bfd")
    Each document goes into the pack with the least remaining capacity that still fits it, ties
    to the lowest-numbered pack, else into a new pack. Open packs are bucketed by remaining
    capacity: a min segment tree over capacities 0..max_len finds the smallest non-empty bucket
    >= length, and each bucket is a pairing heap of pack numbers whose root is the lowest one.

Packs are numbered 0, 1, ... in the order they are opened. The whole plan is O(n log n) time
(O(n + max_len) for the sort) and O(n + max_len) memory; max_len is a context length, so small.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import numba
import numpy as np

from prepack.format import IGNORE_INDEX

__all__ = ["DocumentPieces", "PackingPlan", "assign_packs", "document_pieces", "plan_packs", "untrained_documents"]

_ALGORITHMS = ("ffd", "bfd")


def assign_packs(lengths: np.ndarray, max_len: int, algorithm: str = "ffd") -> np.ndarray:
    """Pack number (int32, 0-based, in the order packs are opened) of every document.

    `lengths` is a 1-D integer array with every value in [1, max_len]; the caller has already
    split, truncated or dropped the documents that do not fit, so anything else is a bug and
    raises ValueError.
    """
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; expected one of {_ALGORITHMS}")
    max_len = operator.index(max_len)
    if not 1 <= max_len < 2**31:  # capacities are kept in int32
        raise ValueError(f"max_len must be in [1, 2**31), got {max_len}")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D integer array, got {lengths.ndim}-D {lengths.dtype}")
    if len(lengths) == 0:
        return np.empty(0, np.int32)
    if lengths.min() < 1 or lengths.max() > max_len:
        raise ValueError(f"every length must be in [1, {max_len}], got [{lengths.min()}, {lengths.max()}]")
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)  # one compiled specialisation
    # Any-fit algorithms leave no two packs that together fit in one (the later one's first
    # document did not fit in the earlier), so at most 2*ceil(total/max_len) - 1 packs open.
    max_packs = min(len(lengths), 2 * -(-int(lengths.sum()) // max_len) + 1)
    kernel = _ffd if algorithm == "ffd" else _bfd
    return kernel(lengths, max_len, max_packs)


@numba.njit(cache=True)
def _order_longest_first(lengths, max_len):
    """Stable counting sort: document indices by length descending, ties by index ascending."""
    # Slot max_len - x holds length x, so slots ascend as lengths descend.
    start = np.zeros(max_len + 1, np.int64)
    for x in lengths:
        start[max_len - x + 1] += 1
    for slot in range(1, max_len + 1):  # prefix sum: start[slot] = documents in earlier slots
        start[slot] += start[slot - 1]
    order = np.empty(len(lengths), np.int64)
    for i in range(len(lengths)):
        slot = max_len - lengths[i]
        order[start[slot]] = i
        start[slot] += 1
    return order


@numba.njit(cache=True)
def _ffd(lengths, max_len, max_packs):
    size = 1
    while size < max_packs:
        size *= 2
    # Implicit binary tree: leaves size..2*size-1 are pack slots holding remaining capacity,
    # each inner node the max of its children. The bound on max_packs guarantees a free slot.
    tree = np.full(2 * size, max_len, np.int32)
    out = np.empty(len(lengths), np.int32)
    prev_need, node = 0, 1
    for i in _order_longest_first(lengths, max_len):
        need = lengths[i]
        if need == prev_need:
            # Packs left of the previous equal-length document's pack had no room for it and only
            # fill up, so search rightwards from there: O(log distance), usually the same pack.
            while tree[node] < need:
                while node & 1:  # climb until there is a right sibling ...
                    node //= 2
                node += 1  # ... and move onto it
            # (the climb cannot pass the root: a fitting slot exists right of the previous one)
        else:
            prev_need, node = need, 1
        while node < size:  # descend towards the leftmost leaf with room
            node *= 2
            if tree[node] < need:
                node += 1
        out[i] = node - size
        tree[node] -= need
        up = node // 2
        while up >= 1:  # stop as soon as an ancestor's max is unaffected
            m = max(tree[2 * up], tree[2 * up + 1])
            if tree[up] == m:
                break
            tree[up] = m
            up //= 2
    return out


@numba.njit(cache=True)
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


@numba.njit(cache=True)
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


@numba.njit(cache=True)
def _link(a, b, child, sibling):
    """Merge two pairing-heap roots; the lower pack number stays on top."""
    if b < a:
        a, b = b, a
    sibling[b] = child[a]
    child[a] = b
    return a


@numba.njit(cache=True)
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


@numba.njit(cache=True)
def _bfd(lengths, max_len, max_packs):
    size = 1
    while size <= max_len:
        size *= 2
    none = max_len + 1
    # Leaf c of the min tree is c while some open pack has exactly c tokens left, else `none`.
    tree = np.full(2 * size, none, np.int32)
    heap = np.full(max_len + 1, -1, np.int32)  # root (lowest pack number) of bucket c's heap
    child = np.full(max_packs, -1, np.int32)
    sibling = np.full(max_packs, -1, np.int32)
    stack = np.empty(max_packs, np.int32)
    out = np.empty(len(lengths), np.int32)
    packs = 0
    for i in _order_longest_first(lengths, max_len):
        need = lengths[i]
        left = _min_from(tree, size, need)
        if left == none:
            pack = packs
            packs += 1
            left = max_len
        else:
            pack = heap[left]
            heap[left] = _pop(pack, child, sibling, stack)
            if heap[left] < 0:
                _set_leaf(tree, size, left, none)
        out[i] = pack
        left -= need
        if left > 0:  # a full pack can never be chosen again, so it leaves the structure
            child[pack] = -1
            if heap[left] < 0:
                heap[left] = pack
                _set_leaf(tree, size, left, left)
            else:
                heap[left] = _link(heap[left], pack, child, sibling)
    return out


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


class DocumentPieces(NamedTuple):
    """The segments that documents become under an overflow policy, in (row, piece) order."""

    rows: np.ndarray  # int64 [segments]: the document's index
    pieces: np.ndarray  # int64 [segments]: 0, 1, … within a split document
    starts: np.ndarray  # int64 [segments]: first token, with the documents' tokens back to back
    lengths: np.ndarray  # int64 [segments]
    counts: dict[str, int]  # what overflow did: input_tokens, empty, split, … as in `Totals`


def untrained_documents(offsets: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """Which documents (`labels[offsets[i]:offsets[i+1]]`) have tokens but no trained token: every label
    after the first is -100 (a document's first token is never trained, see `prepack.collate`).

    Without labels every token is trained, so no document is untrained.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    if labels is None:
        return np.zeros(len(lengths), dtype=bool)
    trained = np.asarray(labels) != IGNORE_INDEX
    trained[offsets[:-1][lengths > 0]] = False
    trained_per_document = np.diff(np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])[offsets])
    return (lengths > 0) & (trained_per_document == 0)


def document_pieces(
    lengths: np.ndarray, max_len: int, overflow: str, untrained: np.ndarray | None = None, drop_untrained: bool = False
) -> DocumentPieces:
    """What documents of `lengths` tokens become in packs of `max_len`: the definition of `overflow`.

    "split" (and "error", which the caller enforces) cuts a longer document into max_len pieces and a
    shorter last one; "truncate" keeps its first max_len tokens; "drop" leaves it out. Empty documents
    become nothing. `untrained` (see `untrained_documents`) marks the documents with no trained token:
    counted, and with `drop_untrained` left out before overflow applies to the rest.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    untrained = np.zeros(len(lengths), dtype=bool) if untrained is None else np.asarray(untrained, dtype=bool)
    left_out = untrained if drop_untrained else np.zeros(len(lengths), dtype=bool)
    long = (lengths > max_len) & ~left_out
    if overflow in ("split", "error"):
        pieces_per_doc = -(-lengths // max_len)  # 0 for an empty document
    elif overflow == "truncate":
        pieces_per_doc = (lengths > 0).astype(np.int64)
    elif overflow == "drop":
        pieces_per_doc = ((lengths > 0) & ~long).astype(np.int64)
    else:
        raise ValueError(f"unknown overflow {overflow!r}")
    pieces_per_doc[left_out] = 0
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces_per_doc)
    pieces = np.arange(len(rows), dtype=np.int64) - np.repeat(
        np.cumsum(pieces_per_doc) - pieces_per_doc, pieces_per_doc
    )
    doc_starts = np.cumsum(lengths) - lengths
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
    return DocumentPieces(
        rows=rows,
        pieces=pieces,
        starts=doc_starts[rows] + pieces * max_len,
        lengths=np.minimum(lengths[rows] - pieces * max_len, max_len),
        counts=counts,
    )


def plan_packs(
    lengths: np.ndarray,
    max_len: int,
    *,
    algorithm: str = "ffd",
    overflow: str = "split",
    seed: int = 0,
    untrained: np.ndarray | None = None,
    drop_untrained: bool = False,
) -> PackingPlan:
    """Plan the whole corpus: cut overlong documents as `overflow` says and leave out untrained ones
    as `drop_untrained` says (`document_pieces`), assign the segments to packs with `assign_packs`,
    then shuffle the pack order with `seed`.

    `lengths` are the token counts of the corpus rows, whose tokens lie back to back in the token
    store. `overflow="error"` is the caller's to enforce (it can name the file); here it packs as split.
    """
    segments = document_pieces(lengths, max_len, overflow, untrained, drop_untrained)
    pack_of = assign_packs(segments.lengths, max_len, algorithm)
    packs = int(pack_of.max()) + 1 if len(pack_of) else 0
    # Shuffle whole packs, so training never sees the decreasing-length order of the planner.
    position = np.empty(packs, dtype=np.int64)
    position[np.random.default_rng(seed).permutation(packs)] = np.arange(packs)
    final_pack = position[pack_of]
    order = np.argsort(final_pack, kind="stable")  # stable: segments stay in (row, piece) order
    pack_offsets = np.zeros(packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(final_pack, minlength=packs), out=pack_offsets[1:])
    return PackingPlan(
        max_len=max_len,
        pack_offsets=pack_offsets,
        starts=segments.starts[order],
        lengths=segments.lengths[order],
        rows=segments.rows[order],
        pieces=segments.pieces[order].astype(np.int32),
        counts=segments.counts,
    )
