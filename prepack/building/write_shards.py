"""Write shards: gather each pack's tokens and lay out the columns of schemas/shard-format.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from prepack.formats.common import arrow_array, list_array

from prepack.formats.shards import IndexOf, ShardInfo, segment_id_type, shard_name, shard_schema
from prepack.storage.files import write_record_batch
from prepack.building.kernels import kernel
from prepack.building.plan import ShardPacks

__all__ = ["ShardBuffers", "TokenFiles", "gather_tokens", "shard_bounds", "write_shard"]


def shard_bounds(pack_bytes: np.ndarray, shard_size: int) -> np.ndarray:
    """First pack of every shard, plus the end: a shard starts wherever a pack's first byte crosses
    into the next multiple of `shard_size` (vectorized, and independent of anything but sizes)."""
    start = np.cumsum(pack_bytes) - pack_bytes
    shard_of_pack = start // shard_size
    firsts = np.flatnonzero(np.diff(shard_of_pack, prepend=-1))
    return np.append(firsts, len(pack_bytes))


# Tokens of the token files mapped at once while gathering (64 MiB): resident memory is a shard plus one
# window, however large the files.
_WINDOW_TOKENS = 2**24


@kernel(cache=True, nogil=True)
def _windows(starts: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each window's segments begin in `order` (file order), and the token past the last of
    them (a segment may run past its window)."""
    firsts, highs = [0], [0]
    for i in range(len(order)):
        segment = order[i]
        window = starts[segment] // _WINDOW_TOKENS
        if i > 0 and window != starts[order[i - 1]] // _WINDOW_TOKENS:
            firsts.append(i)
            highs.append(0)
        highs[-1] = max(highs[-1], starts[segment] + lengths[segment])
    firsts.append(len(order))
    return np.array(firsts, np.int64), np.array(highs, np.int64)


@kernel(cache=True, nogil=True)
def _copy(source, low, starts, lengths, at, segments, out) -> None:
    for segment in segments:
        begin = starts[segment] - low
        out[at[segment] : at[segment] + lengths[segment]] = source[begin : begin + lengths[segment]]


@dataclass(frozen=True)
class TokenFiles:
    """int32 files that together hold every document's tokens back to back, file `i` from token
    `firsts[i]` on: the local build's one scratch file, or the per-unit files of `--engine ray`."""

    paths: tuple[Path, ...]
    firsts: np.ndarray  # int64 [files], firsts[0] == 0, non-decreasing

    @classmethod
    def single(cls, path: Path) -> TokenFiles:
        return cls((path,), np.zeros(1, np.int64))


def gather_tokens(files: TokenFiles, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    """Copy the segments (`starts`, `lengths`, in tokens) of the int32 token `files` into `out`, back
    to back.

    A shard's segments lie all over the files, so mapping them whole would leave most of their pages
    resident by the end of every shard. Instead the segments are copied in file order, window by
    window, each window mapped only while its segments are copied. 24 bytes a segment besides.
    """
    at = np.cumsum(lengths) - lengths
    order = np.argsort(starts, kind="stable")
    # A segment lies inside one file (a document is never cut across files): the last file that
    # starts at or before it. An empty file shares its first token with the next one.
    file_of = np.searchsorted(files.firsts, starts[order], "right") - 1
    ends = np.searchsorted(file_of, np.arange(1, len(files.paths) + 1))
    for index, (first, end) in enumerate(zip(np.append(0, ends[:-1]), ends)):
        if first < end:
            segments = order[first:end]
            local = starts[segments] - files.firsts[index]
            _gather_file(files.paths[index], local, lengths[segments], at[segments], out)


def _gather_file(path: Path, starts: np.ndarray, lengths: np.ndarray, at: np.ndarray, out: np.ndarray) -> None:
    """`gather_tokens` from one file, its segments sorted by start, segment i copied to out[at[i]:]."""
    order = np.arange(len(starts))
    firsts, highs = _windows(starts, lengths, order)
    for first, end, high in zip(firsts[:-1], firsts[1:], highs):
        if first == len(order):
            break
        low = int(starts[order[first]]) // _WINDOW_TOKENS * _WINDOW_TOKENS
        window = np.memmap(path, np.int32, "r", offset=low * 4, shape=(int(high) - low,))
        _copy(window, low, starts, lengths, at, order[first:end], out)
        del window  # unmapped here: its pages no longer count as this process's memory


class ShardBuffers:
    """The token-long columns of one shard being written, kept from shard to shard.

    On the benchmark machine (a VM) touching freshly allocated memory costs over a nanosecond a
    byte, more than gathering into it: with a new array per shard the shard pass took 1.04-1.27 s,
    reused 0.92-0.99 s (`benchmarks/bench_phases.py`, 250k documents). One `ShardBuffers` per writer
    thread allocates each column once, at the largest shard's size.
    """

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._columns: dict[str, np.ndarray] = {}

    def column(self, name: str, tokens: int, dtype: np.dtype = np.dtype(np.int32)) -> np.ndarray:
        if tokens > self.tokens:
            raise ValueError(f"a shard of {tokens} tokens does not fit buffers of {self.tokens}")
        if name not in self._columns:
            self._columns[name] = np.empty(self.tokens, dtype)
        return self._columns[name][:tokens]


@kernel(cache=True, nogil=True)
def _segment_ids(lengths: np.ndarray, pack_offsets: np.ndarray, out: np.ndarray) -> None:
    """1-based document number inside its pack, repeated over the document's tokens."""
    at = 0
    for pack in range(len(pack_offsets) - 1):
        for doc in range(pack_offsets[pack], pack_offsets[pack + 1]):
            out[at : at + lengths[doc]] = doc - pack_offsets[pack] + 1
            at += lengths[doc]


def _cu_seqlens(lengths: np.ndarray, pack_offsets: np.ndarray) -> np.ndarray:
    """Every pack's leading 0, then the running token count inside the pack, packs back to back (int32).
    In numpy, not a kernel: an index build writes this column alone, and runs no kernel."""
    packs = len(pack_offsets) - 1
    ends = np.cumsum(lengths)
    pack_of = np.repeat(np.arange(packs), np.diff(pack_offsets))
    before = np.concatenate(([0], ends))[pack_offsets[:-1]]  # the tokens of the packs before each
    out = np.zeros(len(lengths) + packs, dtype=np.int32)
    out[np.arange(len(lengths)) + pack_of + 1] = ends - before[pack_of]
    return out


def _pack_columns(layout: ShardPacks, lengths: np.ndarray, schema: pa.Schema) -> list[pa.Array]:
    """The per-pack columns of a shard (`cu_seqlens`, `max_seqlen`, `source_rows`, `source_pieces`, and a
    mixture's `source_ids`): all of an index shard, and part of a full one."""
    packs = len(layout.pack_offsets) - 1
    cu_offsets = layout.pack_offsets + np.arange(packs + 1)
    cu = _cu_seqlens(lengths, layout.pack_offsets)
    max_seqlen = np.maximum.reduceat(lengths, layout.pack_offsets[:-1]).astype(np.int32)
    return [
        list_array(cu_offsets, cu),
        arrow_array(max_seqlen),
        list_array(layout.pack_offsets, layout.rows.astype(schema.field("source_rows").type.value_type.to_pandas_dtype())),
        list_array(layout.pack_offsets, layout.pieces.astype(np.int32, copy=False)),
        *([] if layout.source_ids is None else [list_array(layout.pack_offsets, layout.source_ids)]),
    ]


def write_shard(
    directory: Path,
    index: int,
    layout: ShardPacks,
    tokens: TokenFiles | None,
    labels: TokenFiles | None,
    buffers: ShardBuffers | None,
    store: IndexOf | None = None,
) -> ShardInfo:
    """Write the packs of `layout` as one shard, their tokens (and labels) gathered from the int32
    token files `tokens` (and `labels`) into `buffers`, and return the shard's manifest entry.
    Threads may write shards at once, each with its own `buffers`. Without `tokens`, an index shard of
    `store`: the per-pack columns alone."""
    lengths = layout.lengths.astype(np.int64, copy=False)
    packs = len(layout.pack_offsets) - 1
    total = int(lengths.sum())
    if tokens is None:
        pairs = layout.pair_roles is not None
        schema = shard_schema(False, layout.max_len, store, sources=layout.source_ids is not None, pairs=pairs)
        roles = [list_array(layout.pack_offsets, layout.pair_roles)] if pairs else []
        batch = pa.RecordBatch.from_arrays([*_pack_columns(layout, lengths, schema), *roles], schema=schema)
    else:
        batch = _full_batch(layout, lengths, tokens, labels, buffers)
    name = shard_name(index)
    # A new file: an append's staging directory holds the published shards as hard links, never written through.
    size, sha256 = write_record_batch(directory / name, batch, mode="xb")
    return ShardInfo(name=name, rows=packs, tokens=total, bytes=size, sha256=sha256)


def _full_batch(
    layout: ShardPacks, lengths: np.ndarray, tokens: TokenFiles, labels: TokenFiles | None, buffers: ShardBuffers
) -> pa.RecordBatch:
    token_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_offsets[1:])
    pack_token_offsets = token_offsets[layout.pack_offsets]
    total = int(token_offsets[-1])
    ids = buffers.column("input_ids", total)
    gather_tokens(tokens, layout.starts, lengths, ids)
    segment_ids = buffers.column("segment_ids", total, segment_id_type(layout.max_len).to_pandas_dtype())
    _segment_ids(lengths, layout.pack_offsets, segment_ids)
    schema = shard_schema(
        labels is not None, layout.max_len, sources=layout.source_ids is not None, pairs=layout.pair_roles is not None,
        unpaired=layout.desirable is not None,
    )
    columns = [list_array(pack_token_offsets, ids), list_array(pack_token_offsets, segment_ids), *_pack_columns(layout, lengths, schema)]
    if labels is not None:
        label_values = buffers.column("labels", total)
        gather_tokens(labels, layout.starts, lengths, label_values)
        columns.append(list_array(pack_token_offsets, label_values))
    if layout.pair_roles is not None:
        columns.append(list_array(layout.pack_offsets, layout.pair_roles))
    if layout.desirable is not None:  # one label an example, each example 2 segments
        columns.append(list_array(layout.pack_offsets // 2, layout.desirable))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


