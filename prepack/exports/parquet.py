"""The Parquet export: packed rows that `datasets.load_dataset("parquet", data_files=...)` loads, with a
dataset card (`README.md`) that the Hugging Face Hub renders, so that the directory uploads as it is
(`hf upload USER/NAME DIR --repo-type dataset`).

Layout (version 1):

    data/train-00000-of-0000N.parquet   the packs, in pack order: `training_rows`'s columns (input_ids,
                                        labels, position_ids, cu_seqlens; a mixture's source_ids, a
                                        preference-pair build's pair_roles), zstd, row groups of
                                        `training_rows_per_group` packs, `_GROUPS_PER_FILE` groups a file
    README.md                           the card: the Hub's YAML header, and what `prepack inspect` says
    pack_statistics.png                 `prepack inspect --plot`'s figure of the build

Every figure in the card is `prepack inspect --json`'s (`ExportBuild.report`). The files depend on the
build alone: a rerun writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from prepack.check.report import InspectReport, plot
from prepack.errors import require
from prepack.exports.common import ExportBuild, training_rows, training_rows_per_group, training_schema
from prepack.storage.output import output_errors

__all__ = ["write"]

_GROUPS_PER_FILE = 16
IMAGE_NAME = "pack_statistics.png"
_SPLIT = "train"


def _file_name(index: int, files: int) -> str:
    return f"data/{_SPLIT}-{index:05d}-of-{files:05d}.parquet"


def write(batches: Iterable[pa.RecordBatch], directory: Path, build: ExportBuild, scratch: Path) -> None:
    """Write the packs `batches` as Parquet files under `directory / "data"`, then the card and its figure."""
    require("matplotlib", "prepack export --to parquet (its card's figure)")  # before any pack is read
    schema = training_schema(build)
    packs = build.manifest.totals.packs
    rows_per_group = training_rows_per_group(build)
    rows_per_file = rows_per_group * _GROUPS_PER_FILE
    files = max(1, -(-packs // rows_per_file))
    (directory / "data").mkdir()
    writer, written, pending, arrow_bytes = None, 0, [], 0

    def flush(rows: pa.Table) -> None:
        nonlocal writer, written
        if writer is None:
            path = directory / _file_name(written // rows_per_file, files)
            with output_errors(path):
                writer = pq.ParquetWriter(path, schema, compression="zstd", write_statistics=False)  # list min/max: read by no one
        writer.write_table(rows, row_group_size=rows_per_group)
        written += rows.num_rows
        if written % rows_per_file == 0:
            writer.close()
            writer = None

    try:
        for batch in batches:
            rows = training_rows(batch, schema)
            arrow_bytes += rows.nbytes
            pending.append(rows)
            table = pa.Table.from_batches(pending, schema)
            while table.num_rows >= rows_per_group:
                flush(table.slice(0, rows_per_group).combine_chunks())
                table = table.slice(rows_per_group)
            pending = table.combine_chunks().to_batches() if table.num_rows else []
        if pending:
            flush(pa.Table.from_batches(pending, schema).combine_chunks())
    finally:
        if writer is not None:
            writer.close()
    report = build.report
    plot(report.model_copy(update={"path": build.name}), directory / IMAGE_NAME)
    card = dataset_card(build, report, files, arrow_bytes, schema)
    with output_errors(directory / "README.md"):
        (directory / "README.md").write_text(card, encoding="utf-8")


def _size_category(rows: int) -> str:
    """The Hub's `size_categories` value for `rows` rows."""
    bounds = [(10**3, "n<1K"), (10**4, "1K<n<10K"), (10**5, "10K<n<100K"), (10**6, "100K<n<1M"), (10**7, "1M<n<10M"),
              (10**8, "10M<n<100M"), (10**9, "100M<n<1B"), (10**10, "1B<n<10B"), (10**11, "10B<n<100B"),
              (10**12, "100B<n<1T")]
    return next((name for bound, name in bounds if rows < bound), "n>1T")


def _feature(field: pa.Field) -> dict:
    return {"name": field.name, "sequence": str(field.type.value_type)}


def dataset_card(build: ExportBuild, report: InspectReport, files: int, arrow_bytes: int, schema: pa.Schema) -> str:
    """The card: the Hub's YAML header (config and data files, features, split size, size category) and a
    body of what `prepack inspect --json` reports of the build."""
    m, r = build.manifest, report
    header = {
        "configs": [{"config_name": "default", "data_files": [{"split": _SPLIT, "path": f"data/{_SPLIT}-*.parquet"}]}],
        "dataset_info": {
            "features": [_feature(field) for field in schema],
            "splits": [{"name": _SPLIT, "num_bytes": arrow_bytes, "num_examples": r.packs}],
            "dataset_size": arrow_bytes,
        },
        "size_categories": [_size_category(r.packs)],
        "tags": ["prepack", "packed", "tokenized"],
    }
    kind = {"full": "a build", "index": "an index build", "mixture full": "a mixture build", "mixture index": "a mixture's index build"}[build.kind]
    lines = [
        "---",
        yaml.safe_dump(header, sort_keys=False, default_flow_style=False).rstrip("\n"),
        "---",
        "",
        f"# {build.name}",
        "",
        f"Pre-packed, tokenized training rows exported by [prepack](https://pypi.org/project/prepack-llm/) from {kind} "
        f"(`prepack export --to parquet`). Each row is one pack of up to {r.max_len:,} tokens holding whole documents "
        "(or pieces of longer ones) back to back; nothing in a row is padding.",
        "",
        "## Columns",
        "",
        "| column | per | what |",
        "|---|---|---|",
        "| `input_ids` | token | the token ids |",
        "| `labels` | token | what each token is trained to be: "
        + ("the build's labels" if m.has_labels else "the token ids (the build has no labels)")
        + ", -100 at each document's first token and wherever the build trains nothing, so no document learns from the one before it; a model that shifts labels (transformers) takes them as they are |",
        "| `position_ids` | token | 0, 1, ... restarting at each document: transformers' flash-attention path keeps documents apart from these |",
        "| `cu_seqlens` | document + 1 | the documents' bounds in the row, `[0, ..., tokens]` (varlen attention's `cu_seqlens`) |",
    ]
    if m.mixture is not None:
        names = ", ".join(f"{number} `{source.name}`" for number, source in enumerate(m.mixture.sources))
        lines.append(f"| `source_ids` | document | each document's source: {names} |")
    if m.pairs is not None:
        lines.append("| `pair_roles` | document | 0 chosen, 1 rejected: each pair's chosen document, then its rejected one |")
    if m.options.pairs is not None and m.options.pairs.kind == "unpaired":
        lines.append("| `desirable` | example (2 documents) | KTO: each example's label, true = desirable; role 0 its completion, role 1 its KL completion |")
    lines += [
        "",
        "```python",
        "from datasets import load_dataset",
        f'packs = load_dataset("parquet", data_files="data/{_SPLIT}-*.parquet", split="{_SPLIT}")',
        "```",
        "",
        "## The build",
        "",
        "| | |",
        "|---|---|",
        f"| max_len | {r.max_len:,} |",
        f"| packs | {r.packs:,} |",
        f"| tokens | {r.tokens:,} |",
        f"| fill | {r.fill:.4%} ({r.padding_tokens:,} padding positions if rows are padded to max_len) |",
        f"| documents read | {r.documents:,} |",
        f"| documents packed (segments) | {r.segments:,} |",
        f"| documents per pack | mean {r.documents_per_pack.mean:.2f}, p50 {r.documents_per_pack.p50:g}, max {r.documents_per_pack.max:g} |",
        f"| document length (tokens) | mean {r.document_length.mean:.1f}, p50 {r.document_length.p50:g}, p99 {r.document_length.p99:g}, max {r.document_length.max:g} |",
        f"| packs over the lower bound | {r.over_lower_bound:,} ({r.over_lower_bound_percent:.3f}% over {r.lower_bound:,}) |",
        f"| overflow | {r.overflow}: {r.split:,} split, {r.truncated:,} truncated, {r.dropped:,} dropped, {r.empty:,} empty |",
        f"| labels | {'in the build' if r.has_labels else 'none in the build'} |",
        f"| fingerprint | `{m.fingerprint}` |",
        f"| manifest sha256 | `{build.manifest_sha256}` |",
        "",
    ]
    if r.sources is not None:
        lines += ["## Sources", "", "| # | source | tokens | weight | asked | documents |", "|---|---|---|---|---|---|"]
        lines += [f"| {number} | {s.name} | {s.tokens:,} | {s.weight:.4%} | {s.requested_weight:.4%} | {s.documents:,} |"
                  for number, s in enumerate(r.sources)]
        lines.append("")
    options = m.options.model_dump(mode="json", exclude_none=True)
    lines += [
        "## Options",
        "",
        "```yaml",
        yaml.safe_dump(options, sort_keys=True, default_flow_style=False).rstrip("\n"),
        "```",
        "",
        "## Pack statistics",
        "",
        f"![documents per pack, document length, pack fill and the compute without packing]({IMAGE_NAME})",
        "",
        f"The figures are `prepack inspect --json`'s ({len(r.per_shard)} shard(s) read). In {files} Parquet file(s).",
        "",
    ]
    return "\n".join(lines)
