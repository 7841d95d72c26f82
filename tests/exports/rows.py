"""The one comparison every export test makes: an export's rows, as the consumer's own reader gives them,
against `PackedDataset`'s rows of the build, pack by pack."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from prepack import PackedDataset

IGNORE_INDEX = -100


def expected_row(pack: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a generic trainer's row of `pack` (a PackedDataset row) holds, worked out here from the pack alone:
    labels as PackedCollator trains on them (the build's, or the ids; -100 at each document's first token),
    positions restarting at each document."""
    cu = np.asarray(pack["cu_seqlens"], np.int64)
    positions = np.concatenate([np.arange(end - start) for start, end in zip(cu[:-1], cu[1:])])
    labels = np.array(pack.get("labels", pack["input_ids"]), np.int64)
    labels[cu[:-1]] = IGNORE_INDEX
    row = {"input_ids": pack["input_ids"], "labels": labels, "position_ids": positions, "cu_seqlens": cu}
    for name in ("source_ids", "pair_roles"):  # a mixture's, a preference-pair build's
        if name in pack:
            row[name] = pack[name]
    return row


def first_difference(rows: Iterable[Mapping[str, object]], build: Path) -> str | None:
    """Where `rows` (the export's, in order) first differ from the build's packs: "pack N, column C", "N rows
    for M packs", or None when every pack's tokens, labels and boundaries are equal."""
    packs = PackedDataset(build)
    count = 0
    for number, row in enumerate(rows):
        count += 1
        if number >= len(packs):
            continue
        expected = expected_row(packs[number])
        if sorted(row) != sorted(expected):
            return f"pack {number}: columns {sorted(row)}, expected {sorted(expected)}"
        for column, values in expected.items():
            if not np.array_equal(np.asarray(row[column], np.int64), np.asarray(values, np.int64)):
                return f"pack {number}, column {column}"
    return None if count == len(packs) else f"{count} rows for {len(packs)} packs"
