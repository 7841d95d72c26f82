"""Write shards: gather each pack's tokens, lay out the columns of schemas/shard-format.md, and publish
the output directory atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa

from prepack.errors import OutputError
from prepack.format import MANIFEST_NAME, ShardInfo, shard_name, shard_schema
from prepack.plan import PackingPlan

__all__ = ["shard_bounds", "staged_directory", "write_shard"]


@contextmanager
def staged_directory(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out` in one rename.

    A build that fails or is killed leaves `out` as it was (and at most a hidden `.NAME.tmp-…`
    sibling), never a directory that looks complete.
    """
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise OutputError(f"{out} already exists; pass --overwrite to replace it.")
        if not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_NAME).is_file()):
            raise OutputError(
                f"{out} is not a prepack build (no {MANIFEST_NAME}); refusing to replace it."
            )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as exc:
        raise OutputError(f"cannot create the output beside {out}: {exc}") from None
    try:
        yield staging
        if out.exists():
            retired = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, retired)
            os.rename(staging, out)
            shutil.rmtree(retired)
        else:
            os.rename(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def shard_bounds(pack_bytes: np.ndarray, shard_size: int) -> np.ndarray:
    """First pack of every shard, plus the end: a shard starts wherever a pack's first byte crosses
    into the next multiple of `shard_size` (vectorized, and independent of anything but sizes)."""
    start = np.cumsum(pack_bytes) - pack_bytes
    shard_of_pack = start // shard_size
    firsts = np.flatnonzero(np.diff(shard_of_pack, prepend=-1))
    return np.append(firsts, len(pack_bytes))


@numba.njit(cache=True, nogil=True)
def _gather(source: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    at = 0
    for i in range(len(starts)):
        out[at : at + lengths[i]] = source[starts[i] : starts[i] + lengths[i]]
        at += lengths[i]


def _list(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def write_shard(
    directory: Path,
    index: int,
    layout: PackingPlan,
    tokens: np.ndarray,
    labels: np.ndarray | None,
) -> ShardInfo:
    """Write the packs of `layout` as one shard, their tokens (and labels) gathered from the stores;
    return the shard's manifest entry."""
    lengths = layout.lengths.astype(np.int64)
    docs_per_pack = np.diff(layout.pack_offsets)
    packs = len(docs_per_pack)
    token_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_offsets[1:])
    pack_token_offsets = token_offsets[layout.pack_offsets]

    ids = np.empty(token_offsets[-1], dtype=np.int32)
    _gather(tokens, layout.starts, lengths, ids)
    # 1-based document number inside its pack, repeated over the document's tokens.
    first_doc = np.repeat(layout.pack_offsets[:-1], docs_per_pack)
    doc_number = (np.arange(len(lengths)) - first_doc + 1).astype(np.int32)
    segment_ids = np.repeat(doc_number, lengths)
    # cu_seqlens: every pack gets a leading 0, then the running token count inside the pack.
    cu_offsets = layout.pack_offsets + np.arange(packs + 1)
    cu = np.zeros(len(lengths) + packs, dtype=np.int32)
    ends_within_pack = token_offsets[1:] - np.repeat(pack_token_offsets[:-1], docs_per_pack)
    cu[np.arange(len(lengths)) + np.repeat(np.arange(packs), docs_per_pack) + 1] = ends_within_pack
    max_seqlen = np.maximum.reduceat(lengths, layout.pack_offsets[:-1]).astype(np.int32)

    columns = [
        _list(pack_token_offsets, ids),
        _list(pack_token_offsets, segment_ids),
        _list(cu_offsets, cu),
        pa.array(max_seqlen),
        _list(layout.pack_offsets, layout.rows.astype(np.int64)),
        _list(layout.pack_offsets, layout.pieces.astype(np.int32)),
    ]
    if labels is not None:
        pack_labels = np.empty(token_offsets[-1], dtype=np.int32)
        _gather(labels, layout.starts, lengths, pack_labels)
        columns.append(_list(pack_token_offsets, pack_labels))
    schema = shard_schema(labels is not None)
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    data = sink.getvalue()
    name = shard_name(index)
    with open(directory / name, "wb") as f:
        f.write(data)
    return ShardInfo(
        name=name,
        rows=packs,
        tokens=int(token_offsets[-1]),
        bytes=data.size,
        sha256=hashlib.sha256(data).hexdigest(),
    )
