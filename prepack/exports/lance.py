"""The Lance export (`pylance`): the packs as one Lance dataset, `packs.lance`, which `lance.dataset(path)`
opens (and `lance.torch.data.LanceDataset` streams from local disk or object storage), with
`training_rows`'s columns: input_ids, labels, position_ids, cu_seqlens, and a mixture's source_ids and a
preference-pair build's pair_roles. Rows in pack order, written as one stream (bounded memory).

Lance was chosen over mosaic's MDS: `mosaicml-streaming` 0.13, its newest, pins transformers < 5 and
numpy < 2.2 and cannot share prepack's environment, while `pylance` installs beside it; Lance also serves
random access by row and object storage, which a streaming reader of MDS shards does not need prepack for.

Not byte-identical on a rerun: Lance names its data files by random ids and stamps its manifest and
transaction files with the time, so two exports of one build hold the same rows in different bytes
(`tests/exports/test_lance.py` compares them row by row). `export.json` records this export's own files,
so `verify_export` still finds any change to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from prepack.errors import optional_imports
from prepack.exports.common import ExportBuild, training_rows, training_rows_per_group, training_schema

__all__ = ["DATASET_NAME", "write"]

DATASET_NAME = "packs.lance"
_STORAGE_VERSION = "2.1"  # Lance's file format version, pinned: what the export's readers need to read


def write(batches: Iterable[pa.RecordBatch], directory: Path, build: ExportBuild, scratch: Path) -> None:
    """Write the packs `batches` as the Lance dataset `directory / DATASET_NAME`."""
    with optional_imports("prepack export --to lance"):
        import lance
    schema = training_schema(build)
    rows = pa.RecordBatchReader.from_batches(schema, (training_rows(batch, schema) for batch in batches))
    # Lance buffers a row group: 1,024 rows by default, 100 MiB of tokens at max_len 8192.
    lance.write_dataset(rows, directory / DATASET_NAME, schema, mode="create", data_storage_version=_STORAGE_VERSION,
                        max_rows_per_group=training_rows_per_group(build))
