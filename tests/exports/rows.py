"""The one oracle every export test compares with: what prepack trains on in each pack of a build
(`PackedDataset`'s rows, `PackedCollator`'s labels and position ids), and the comparison of an export's rows,
as the consumer's own reader gives them, against it pack by pack."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from prepack import PackedDataset
from prepack.training.collate import PackedCollator


class Expected:
    """Pack p of a build as prepack trains on it: `ids(p)`, `cu_seqlens(p)`, `targets(p)` (the collator's
    labels: -100 where no loss is taken, at each document's first token too), `position_ids(p)` (the
    collator's: restarting at each document) and `source_ids(p)`."""

    def __init__(self, directory: Path):
        self.rows = PackedDataset(directory)
        self.manifest = self.rows.manifest
        self.collate = PackedCollator(self.manifest.options.max_len, source_ids=self.manifest.mixture is not None)

    def __len__(self) -> int:
        return len(self.rows)

    def ids(self, p: int) -> np.ndarray:
        return self.rows[p]["input_ids"]

    def cu_seqlens(self, p: int) -> np.ndarray:
        return self.rows[p]["cu_seqlens"]

    def source_ids(self, p: int) -> np.ndarray:
        return self.rows[p]["source_ids"]

    def collated(self, p: int, name: str) -> np.ndarray:
        """Column `name` of pack p as the collator gives it, without padding."""
        row = self.rows[p]
        return self.collate([row])[name][0, : len(row["input_ids"])].numpy()

    def targets(self, p: int) -> np.ndarray:
        return self.collated(p, "labels")

    def row(self, p: int) -> dict[str, np.ndarray]:
        """What a generic trainer's row of pack p holds: the pack's tokens and boundaries, the collator's labels
        and position ids, and a mixture's source_ids and a preference-pair build's pair_roles as stored."""
        pack = self.rows[p]
        collated = self.collate([pack])
        n = len(pack["input_ids"])
        row = {
            "input_ids": pack["input_ids"], "cu_seqlens": pack["cu_seqlens"],
            "labels": collated["labels"][0, :n].numpy(), "position_ids": collated["position_ids"][0, :n].numpy(),
        }
        for name in ("source_ids", "pair_roles"):
            if name in pack:
                row[name] = pack[name]
        return row


def first_difference(rows: Iterable[Mapping[str, object]], build: Path) -> str | None:
    """Where `rows` (the export's, in order) first differ from the build's packs: "pack N, column C", "N rows
    for M packs", or None when every pack's tokens, labels and boundaries are equal."""
    expected = Expected(build)
    count = 0
    for number, row in enumerate(rows):
        count += 1
        if number >= len(expected):
            continue
        wanted = expected.row(number)
        if sorted(row) != sorted(wanted):
            return f"pack {number}: columns {sorted(row)}, expected {sorted(wanted)}"
        for column, values in wanted.items():
            if not np.array_equal(np.asarray(row[column], np.int64), np.asarray(values, np.int64)):
                return f"pack {number}, column {column}"
    return None if count == len(expected) else f"{count} rows for {len(expected)} packs"
