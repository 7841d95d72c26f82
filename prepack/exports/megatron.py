"""The Megatron export: a build as megatron-core's indexed dataset and as Megatron-Bridge's packed SFT Parquet.

Written into the export directory (checked against megatron-core 0.16.1 and Megatron-Bridge 0.7.0's source):

- `tokens.bin` / `tokens.idx`: megatron-core's `IndexedDataset` (int32 tokens). Each prepack document is one
  Megatron *sequence* and each pack one Megatron *document* (its `document_indices` mark where each pack's
  sequences end): GPTDataset samples sequences, the unit Megatron's own preprocessing writes for one
  document, and `dataset[document_indices[p]:document_indices[p + 1]]` gives pack p's documents in order.
- `loss_mask.bin` / `loss_mask.idx`: a second indexed dataset (uint8) of the same sequences and documents,
  in Megatron's terms: `loss_mask[t]` is 1 when the prediction made at position t (of token t + 1 of the
  same document) is trained, so a document's last position is always 0. A GPT-style reader of one
  sequence takes tokens `seq[:-1]`, labels `seq[1:]` and loss mask `mask[:-1]`.
- `packed.idx.parquet` and `packed_metadata.json`: Megatron-Bridge's packed sequences
  (`GPTSFTPackedParquetDataset`): one row per pack, `input_ids` list<int32>, `loss_mask` list<int8> (as above),
  `seq_start_id` list<int32> (each document's first token: `cu_seqlens` without its end), in row groups
  of at most 500 packs as Bridge's own writer makes them; a mixture's rows also carry `source_ids` (each
  document's source, numbered as the manifest's `mixture.sources`), a column Bridge does not read. The
  metadata is the list of one dict Bridge's packing writes (`max_samples_per_bin`, `dataset_max_seqlen`,
  `min_packed_seqlen` are what its `pad_cu_seqlens` reads).

megatron-core's own `IndexedDatasetBuilder` imports torch, which the building wing never does, so the
`.idx` layout (its `_IndexWriter`) is written here with numpy; the tests read it back with megatron-core's
`IndexedDataset` and find the `.bin` and `.idx` files byte for byte those its builder writes. Sequence lengths and document ends are spooled to files while the `.bin` files stream,
then copied into the `.idx` files in bounded chunks.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prepack.exports.common import ExportBuild
from prepack.exports.trained_packs import TrainedPacks, refuse_pair_build, trained_packs
from prepack.formats.common import list_array
from prepack.formats.mixture import SOURCE_ID_TYPE

__all__ = ["write", "TOKENS", "LOSS_MASK", "PACKED", "PACKED_METADATA"]

TOKENS = "tokens"  # tokens.bin, tokens.idx
LOSS_MASK = "loss_mask"  # loss_mask.bin, loss_mask.idx
PACKED = "packed.idx.parquet"
PACKED_METADATA = "packed_metadata.json"

# megatron.core.datasets.indexed_dataset: _INDEX_HEADER, the index version 1, and DType's codes.
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_DTYPE_CODES = {np.dtype(np.int32): 4, np.dtype(np.uint8): 1}
_BRIDGE_ROW_GROUP = 500  # megatron.bridge.data.packing.parquet.write_packed_parquet's default
_SPOOL_CHUNK = 1 << 20  # values copied from a spool into an .idx file at a time
_EXPORT = "Megatron"


def write(batches: Iterable[pa.RecordBatch], directory: Path, build: ExportBuild, scratch: Path) -> None:
    """Write the build's packs (`batches`, whole packs in pack order) into `directory` (the .idx files'
    arrays spooled in `scratch` meanwhile).

    Raises `InputError` for a preference-pair build (before writing anything) and for labels other than
    the token ids where trained.
    """
    m = build.manifest
    refuse_pair_build(m.options.pairs is not None, _EXPORT)
    # The .idx files' per-sequence and per-document arrays, spooled while the .bin files stream: into `scratch`,
    # which is never published (and deleted with the staging directory).
    lengths_spool, ends_spool = scratch / "sequence-lengths.spool", scratch / "document-ends.spool"
    sources = m.mixture is not None
    stats = _PackStats()
    with (
        open(directory / f"{TOKENS}.bin", "wb") as tokens_bin,
        open(directory / f"{LOSS_MASK}.bin", "wb") as mask_bin,
        open(lengths_spool, "wb") as lengths,
        open(ends_spool, "wb") as ends,
        pq.ParquetWriter(directory / PACKED, _bridge_schema(sources)) as bridge,
    ):
        sequences = 0
        for packs in trained_packs(batches, m.has_labels, sources, _EXPORT):
            loss_mask = _next_token_mask(packs.training.trained)
            tokens_bin.write(packs.training.tokens.astype("<i4", copy=False).tobytes())
            mask_bin.write(loss_mask.tobytes())
            lengths.write(packs.training.layout.lengths.astype("<i4").tobytes())
            ends.write((sequences + np.cumsum(packs.training.layout.documents)).astype("<i8").tobytes())
            sequences += len(packs.training.layout.lengths)
            bridge.write_batch(_bridge_batch(packs, loss_mask, sources), row_group_size=_BRIDGE_ROW_GROUP)
            stats.add(packs)
    for name, dtype in ((TOKENS, np.int32), (LOSS_MASK, np.uint8)):
        _write_index(directory / f"{name}.idx", np.dtype(dtype), lengths_spool, ends_spool)
    metadata = [stats.bridge_metadata(m.options.max_len)]
    (directory / PACKED_METADATA).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")


def _next_token_mask(trained: np.ndarray) -> np.ndarray:
    """Megatron's loss mask (uint8): position t is trained when token t + 1 is a trained target. A document's
    last position predicts the next document's first token, never a target, so it is 0."""
    mask = np.zeros(len(trained), np.uint8)
    mask[:-1] = trained[1:]
    return mask


def _bridge_schema(sources: bool) -> pa.Schema:
    fields = [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("seq_start_id", pa.list_(pa.int32())),
    ]
    if sources:
        fields.append(pa.field("source_ids", pa.list_(SOURCE_ID_TYPE)))
    return pa.schema(fields)


def _bridge_batch(packs: TrainedPacks, loss_mask: np.ndarray, sources: bool) -> pa.RecordBatch:
    document_offsets = packs.document_offsets
    arrays = [
        list_array(packs.training.pack_offsets, packs.training.tokens.astype(np.int32, copy=False)),
        list_array(packs.training.pack_offsets, loss_mask.view(np.int8)),
        list_array(document_offsets, packs.training.layout.starts.astype(np.int32)),
    ]
    if sources:
        arrays.append(list_array(document_offsets, packs.source_ids))
    return pa.RecordBatch.from_arrays(arrays, schema=_bridge_schema(sources))


class _PackStats:
    """What Megatron-Bridge's packing metadata says of the packs, gathered batch by batch."""

    def __init__(self):
        self.packs = self.documents = self.tokens = 0
        self.longest_document = self.most_documents = 0
        self.fewest_tokens: int | None = None

    def add(self, packs: TrainedPacks) -> None:
        pack_tokens = np.diff(packs.training.pack_offsets)
        if not len(pack_tokens):
            return
        self.packs += len(pack_tokens)
        layout = packs.training.layout
        self.documents += len(layout.lengths)
        self.tokens += int(pack_tokens.sum())
        self.longest_document = max(self.longest_document, int(layout.lengths.max()))
        self.most_documents = max(self.most_documents, int(layout.documents.max()))
        fewest = int(pack_tokens.min())
        self.fewest_tokens = fewest if self.fewest_tokens is None else min(self.fewest_tokens, fewest)

    def bridge_metadata(self, max_len: int) -> dict:
        """The dict `megatron.bridge.data.packing.algorithms.create_packing_strategy` records, for these packs."""
        return {
            "dataset_max_seqlen": self.longest_document,
            "max_samples_per_bin": self.most_documents,
            "min_packed_seqlen": self.fewest_tokens or 0,
            "pack_size": max_len,
            "packing_factor": round(self.documents / self.packs, 2) if self.packs else 0.0,
            "packing_efficiency": round(self.tokens / self.packs / max_len * 100, 2) if self.packs else 0.0,
        }


def _write_index(path: Path, dtype: np.dtype, lengths_spool: Path, ends_spool: Path) -> None:
    """An `.idx` file as megatron-core's `_IndexWriter` lays it out: header, version, dtype code, the
    sequence and document counts, then every sequence's length (int32), its byte offset in the `.bin`
    (int64), and the document indices (int64: 0, then the sequence count at each document's end)."""
    sequences = lengths_spool.stat().st_size // 4
    documents = ends_spool.stat().st_size // 8
    with open(path, "wb") as index:
        index.write(_INDEX_HEADER)
        index.write(struct.pack("<Q", _INDEX_VERSION))
        index.write(struct.pack("<B", _DTYPE_CODES[dtype]))
        index.write(struct.pack("<Q", sequences))
        index.write(struct.pack("<Q", documents + 1))
        for chunk in _spooled(lengths_spool, "<i4", sequences):
            index.write(chunk.tobytes())
        pointer = 0
        for chunk in _spooled(lengths_spool, "<i4", sequences):
            ends = pointer + np.cumsum(chunk, dtype=np.int64) * dtype.itemsize
            index.write(np.concatenate([[pointer], ends[:-1]]).astype("<i8").tobytes())
            pointer = int(ends[-1])
        index.write(np.zeros(1, "<i8").tobytes())
        for chunk in _spooled(ends_spool, "<i8", documents):
            index.write(chunk.tobytes())


def _spooled(path: Path, dtype: str, count: int) -> Iterable[np.ndarray]:
    """The `count` values of a spool file, in chunks."""
    if count:
        values = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        for start in range(0, count, _SPOOL_CHUNK):
            yield np.asarray(values[start : start + _SPOOL_CHUNK])
