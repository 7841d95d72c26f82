"""The OLMo-core export: a build as the Dolma-style token files `ai2-olmo-core`'s numpy datasets read.

Written into the export directory (checked against ai2-olmo-core 3.0.0's source):

- `tokens.npy`: the token ids as a raw little-endian uint32 array (no `.npy` header: OLMo-core memory-maps
  its token files; read it with `dtype=numpy.uint32`), every pack padded with token id 0 to
  `options.max_len` tokens, so that `NumpyFSLDataset(sequence_length=max_len)` serves instance p = pack p.
- `label_mask.npy`: a raw bool array of the same length, for `label_mask_paths`: True on the trained
  targets (OLMo-core's `get_labels` masks the token ids with it, then shifts), False on each document's
  first token (predicted across a boundary) and on padding.
- `tokens.csv.gz`: the Dolma metadata beside the token file: one line `start,end` per document, the
  token offsets of each document in `tokens.npy`, in pack order (padding lies in no document); a
  mixture's lines carry a third field, the document's source (numbered as the manifest's
  `mixture.sources`). OLMo-core reads the boundaries from it (`iter_document_indices` with
  `use_array_if_local=False`) instead of scanning for EOS, which a chat build's documents do not end with.

OLMo-core 3.0.0 has no dataset class that both serves fixed packs and reads their document boundaries
from a file: `NumpyFSLDataset` keeps the packs (its `generate_doc_lengths` finds boundaries by EOS), and
`NumpyPackedFSLDataset(use_array_if_local=False, generate_doc_lengths=True)` keeps every document, its
label mask and exact `doc_lens` from the metadata but packs the documents again by its own algorithm.
docs/exports.md says which to use when.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from prepack.exports.common import ExportBuild
from prepack.exports.trained_packs import TrainedPacks, refuse_pair_build, trained_packs

__all__ = ["write", "TOKENS", "LABEL_MASK", "DOCUMENTS", "TOKEN_DTYPE", "PAD_TOKEN_ID"]

TOKENS = "tokens.npy"
LABEL_MASK = "label_mask.npy"
DOCUMENTS = "tokens.csv.gz"  # olmo_core.data.utils.iter_document_indices: the token file's name, .npy -> .csv.gz
TOKEN_DTYPE = np.dtype("<u4")
PAD_TOKEN_ID = 0
_EXPORT = "OLMo-core"


def write(batches: Iterable[pa.RecordBatch], directory: Path, build: ExportBuild, scratch: Path) -> None:
    """Write the build's packs (`batches`, whole packs in pack order) into `directory`.

    Raises `InputError` for a preference-pair build (before writing anything) and for labels other than
    the token ids where trained.
    """
    m = build.manifest
    refuse_pair_build(m.options.pairs is not None, _EXPORT)
    max_len = m.options.max_len
    with (
        open(directory / TOKENS, "wb") as tokens,
        open(directory / LABEL_MASK, "wb") as label_mask,
        open(directory / DOCUMENTS, "wb") as raw,
        # no file name and time in the gzip header: the same packs give the same bytes
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as documents,
    ):
        for packs in trained_packs(batches, m.has_labels, m.mixture is not None, _EXPORT):
            padded_tokens, padded_mask = _padded(packs, max_len)
            tokens.write(padded_tokens.tobytes())
            label_mask.write(padded_mask.tobytes())
            documents.write(_document_lines(packs, max_len).encode())


def _padded(packs: TrainedPacks, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The packs' tokens and trained-target mask, each pack padded to `max_len`."""
    training = packs.training
    count = len(training.pack_offsets) - 1
    pack_of_token = np.repeat(np.arange(count, dtype=np.int64), np.diff(training.pack_offsets))
    slot = pack_of_token * max_len + np.arange(len(training.tokens), dtype=np.int64) - training.pack_offsets[pack_of_token]
    tokens = np.full(count * max_len, PAD_TOKEN_ID, TOKEN_DTYPE)
    tokens[slot] = training.tokens
    mask = np.zeros(count * max_len, np.bool_)
    mask[slot] = training.trained
    return tokens, mask


def _document_lines(packs: TrainedPacks, max_len: int) -> str:
    """The Dolma metadata lines of the packs' documents: `start,end` (and a mixture's source id)."""
    layout = packs.training.layout
    starts = (packs.first_pack + layout.pack) * max_len + layout.starts
    fields = [starts.tolist(), (starts + layout.lengths).tolist()]
    if packs.source_ids is not None:
        fields.append(packs.source_ids.tolist())
    return "".join(",".join(map(str, line)) + "\n" for line in zip(*fields))
