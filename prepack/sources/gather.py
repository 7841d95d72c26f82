"""An index build's packs, gathered from its document store(s): the one gather that the loader
(`prepack.training.dataset.PackedDataset`, `open_hf_dataset`) and the exports (`prepack.exports`) share.

An index shard holds no token: each pack's documents are (store row, piece) references, copied out of
the store (`prepack.sources.store.Store`, or a mixture's `StoreChain`) by one numba kernel call per pack
(`_gather_pack`) that checks every reference it follows. Building wing: no torch.
"""

from __future__ import annotations

from typing import NoReturn

import numba
import numpy as np
import pyarrow as pa
from numba.typed import List as TypedList

from prepack.errors import FormatError
from prepack.formats.common import list_array
from prepack.formats.shards import PAIR_ROLES, shard_schema
from prepack.sources.mixture_stores import StoreChain
from prepack.sources.store import Store

__all__ = ["INDEX_COLUMNS", "IndexGather", "index_columns"]

# What an index shard's rows are gathered from.
INDEX_COLUMNS = ("cu_seqlens", "source_rows", "source_pieces")

ListColumn = tuple[np.ndarray, np.ndarray]  # (offsets, values): row r is values[offsets[r]:offsets[r + 1]]


def index_columns(batch: pa.RecordBatch) -> list[str]:
    """The list columns an index shard's rows are gathered from (and a mixture's `source_ids` and a pair
    build's `pair_roles`, served)."""
    return [*INDEX_COLUMNS, *(name for name in ("source_ids", PAIR_ROLES) if name in batch.schema.names)]


class IndexGather:
    """The packs of an index build whose store is `store` and whose max_len is `max_len`, gathered.
    `index_shards`: what a refusal calls each of the build's index shards (its path or URI), by number.

    Store shards are checked in full (sha256, contents: `Store.shard_columns`) and mapped when a pack
    first needs them, in each process separately: pickling carries the store, never a memory map."""

    def __init__(self, store: Store | StoreChain, max_len: int, index_shards: list[str]) -> None:
        self.store, self.max_len, self.index_shards = store, max_len, index_shards
        self.store_ends = np.cumsum([s.documents for s in store.manifest.shards], dtype=np.int64)
        self.tokens: _StoreTokens | None = None  # made on the first gather, in each worker

    def __getstate__(self) -> dict:
        return {**self.__dict__, "tokens": None}

    def pack(self, columns: dict[str, ListColumn], row: int, shard: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Row `row` of index shard number `shard`, whose list columns are `columns` (at least `INDEX_COLUMNS`):
        (input_ids, labels or None, segment_ids), new int32 arrays. A reference that does not hold raises
        FormatError naming the index shard (`index_shards`), the row and the column."""
        tokens = self.tokens or self._open_tokens()
        has_labels = self.store.manifest.has_labels
        while True:
            problem, at, ids, labels, segment_ids = _gather_pack(
                row, *columns["cu_seqlens"], *columns["source_rows"], *columns["source_pieces"], self.max_len,
                self.store_ends, tokens.offsets, tokens.ids, tokens.labels, has_labels,
            )
            if problem != _STORE_SHARD_CLOSED:
                break
            tokens.open(at)
        if problem != _GATHERED:
            self._refuse(columns, row, self.index_shards[shard], problem, at)
        return ids, labels if has_labels else None, segment_ids

    def batch(self, columns: dict[str, ListColumn], first: int, stop: int, shard: int) -> pa.RecordBatch:
        """Packs `first` to `stop` of index shard number `shard`, whose list columns are `columns`, gathered, as one
        record batch of the full shard format (`shard_schema`; with labels when the store has them, and
        `source_ids` when `columns` has them, a mixture's), so that they are the rows the full build of the
        same documents holds."""
        has_labels = self.store.manifest.has_labels
        rows = [self.pack(columns, row, shard) for row in range(first, stop)]
        lengths = np.array([len(ids) for ids, _, _ in rows], np.int64)
        token_offsets = np.concatenate([[0], np.cumsum(lengths)])
        cu_off, cu_values = columns["cu_seqlens"]
        cu = [cu_values[cu_off[row] : cu_off[row + 1]] for row in range(first, stop)]
        cu_offsets = np.concatenate([[0], np.cumsum([len(bounds) for bounds in cu])])
        sources = "source_ids" in columns
        schema = shard_schema(has_labels, self.max_len, sources=sources)
        segment_type = schema.field("segment_ids").type.value_type.to_pandas_dtype()

        def per_document(name: str, dtype: type) -> pa.Array:
            offsets, values = columns[name]
            return list_array(offsets[first : stop + 1] - offsets[first], values[offsets[first] : offsets[stop]].astype(dtype))

        arrays = [
            list_array(token_offsets, np.concatenate([ids for ids, _, _ in rows])),
            list_array(token_offsets, np.concatenate([segments for _, _, segments in rows]).astype(segment_type)),
            list_array(cu_offsets, np.concatenate(cu)),
            pa.array(np.array([np.diff(bounds).max() for bounds in cu], np.int32)),
            per_document("source_rows", np.int64),
            per_document("source_pieces", np.int32),
            *([per_document("source_ids", np.uint16)] if sources else []),
        ]
        if has_labels:
            arrays.append(list_array(token_offsets, np.concatenate([labels for _, labels, _ in rows])))
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def _open_tokens(self) -> _StoreTokens:
        self.tokens = _StoreTokens(self.store)
        return self.tokens

    def _refuse(self, columns: dict[str, ListColumn], row: int, where: str, problem: int, number: int) -> NoReturn:
        """Raise the FormatError for what `_gather_pack` found wrong with document `number` of a pack."""
        (cu_off, cu), (row_off, rows), (piece_off, pieces) = (columns[name] for name in INDEX_COLUMNS)

        def refuse(column: str, message: str) -> NoReturn:
            raise FormatError(f"{where}: row {row}, column {column!r}: {message}")

        if problem == _BAD_LAYOUT:  # only without validation: check_index_shard refuses these first
            documents = row_off[row + 1] - row_off[row]
            refuse("cu_seqlens", f"{cu[cu_off[row] : cu_off[row + 1]].tolist()} are not the bounds "
                   f"of {documents} documents within max_len {self.max_len}.")
        document, piece = int(rows[row_off[row] + number]), int(pieces[piece_off[row] + number])
        if problem == _NO_SUCH_DOCUMENT:
            refuse("source_rows", f"document {number + 1} is store document {document}; "
                   f"the store has {int(self.store_ends[-1])}.")
        length = int(cu[cu_off[row] + number + 1] - cu[cu_off[row] + number])
        store_shard = int(np.searchsorted(self.store_ends, document, "right"))
        offsets = self.tokens.offsets[store_shard]
        local = document - int(self.store_ends[store_shard]) + self.store.manifest.shards[store_shard].documents
        side = "starts before" if piece < 0 else "runs past"  # a negative piece only without validation
        refuse("source_pieces", f"document {number + 1} (store document {document}, piece {piece}, "
               f"{length} tokens) {side} that document's {offsets[local + 1] - offsets[local]} tokens.")


class _StoreTokens:
    """The store's shards as `_gather_pack` reads them: three typed lists indexed by store shard (token
    offsets as int64, token ids, labels), each shard's entries empty until `open` checks and maps it.
    Numba lists, so that one kernel call reaches every shard a pack needs; never pickled."""

    def __init__(self, store: Store | StoreChain):
        self.store = store
        count = len(store.manifest.shards)
        self.offsets = _typed_list(count, _read_only(np.zeros(0, np.int64)))
        self.ids = _typed_list(count, _read_only(np.zeros(0, np.int32)))
        self.labels = _typed_list(count, _read_only(np.zeros(0, np.int32))) if store.manifest.has_labels else self.ids

    def open(self, index: int) -> None:
        offsets, ids, labels = self.store.shard_columns(self.store.manifest.shards[index])
        # One type per list (C-contiguous, read-only) whatever the arrays came as.
        _put(self.offsets, index, _read_only(np.ascontiguousarray(offsets, np.int64)))
        _put(self.ids, index, _read_only(np.ascontiguousarray(ids, np.int32)))
        if labels is not None:
            _put(self.labels, index, _read_only(np.ascontiguousarray(labels, np.int32)))


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@numba.njit(cache=True)
def _typed_list(count, fill):
    # Built in a cached function: a typed list made from Python compiles its methods in every process.
    out = TypedList()
    for _ in range(count):
        out.append(fill)
    return out


@numba.njit(cache=True)
def _put(items, index, value):
    items[index] = value


# What `_gather_pack` found: the pack gathered, a store shard to open first, or what is wrong with it.
_GATHERED, _STORE_SHARD_CLOSED, _BAD_LAYOUT, _NO_SUCH_DOCUMENT, _OUTSIDE_DOCUMENT = range(5)


@numba.njit(cache=True, nogil=True)
def _gather_pack(row, cu_offsets, cu_values, row_offsets, row_values, piece_offsets, piece_values, max_len,
                 store_ends, store_offsets, store_ids, store_labels, has_labels):
    """Row `row` of an index shard, gathered: (problem, at, input_ids, labels, segment_ids).

    `problem` is `_GATHERED`, or `_STORE_SHARD_CLOSED` with `at` the store shard to open before calling
    again, or a reference that does not hold with `at` the pack's document (0-based). Every value read
    from the index shard is checked before it sizes, indexes or bounds a copy, validated or not (the
    index shard's list offsets are, by `open_shard`); `store_ends` is the store's cumulative document
    counts."""
    cu = cu_values[cu_offsets[row] : cu_offsets[row + 1]]
    documents = len(cu) - 1
    rows = row_values[row_offsets[row] : row_offsets[row + 1]]
    pieces = piece_values[piece_offsets[row] : piece_offsets[row + 1]]
    none = np.empty(0, np.int32)
    if documents < 1 or len(rows) != documents or len(pieces) != documents or cu[0] != 0:
        return _BAD_LAYOUT, 0, none, none, none
    tokens = np.int64(cu[documents])
    if not 0 <= tokens <= max_len:
        return _BAD_LAYOUT, 0, none, none, none
    ids = np.empty(tokens, np.int32)
    labels = np.empty(tokens if has_labels else 0, np.int32)
    segment_ids = np.empty(tokens, np.int32)
    for number in range(documents):
        start, end = np.int64(cu[number]), np.int64(cu[number + 1])
        if not start <= end <= tokens:
            return _BAD_LAYOUT, number, none, none, none
        document = np.int64(rows[number])
        if not 0 <= document < store_ends[-1]:
            return _NO_SUCH_DOCUMENT, number, none, none, none
        store_shard = np.searchsorted(store_ends, document, side="right")
        offsets = store_offsets[store_shard]
        if len(offsets) == 0:
            return _STORE_SHARD_CLOSED, store_shard, none, none, none
        local = document - (store_ends[store_shard - 1] if store_shard > 0 else 0)
        first = offsets[local] + np.int64(pieces[number]) * max_len
        if pieces[number] < 0 or first + (end - start) > offsets[local + 1]:
            return _OUTSIDE_DOCUMENT, number, none, none, none
        ids[start:end] = store_ids[store_shard][first : first + end - start]
        if has_labels:
            labels[start:end] = store_labels[store_shard][first : first + end - start]
        segment_ids[start:end] = number + 1
    return _GATHERED, 0, ids, labels, segment_ids
