"""What every format is handed (`pack_batches`): the build's packs in order, whole, in batches of bounded size
whose list offsets start at 0, full and index builds alike."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prepack.exports import common
from prepack.exports.common import open_export_build, pack_batches
from prepack.formats.shards import shard_schema

pytestmark = pytest.mark.slow  # the session's builds take seconds


@pytest.mark.parametrize("name", ["chat", "chat-index", "mixture", "mixture-index"])
def test_batches_are_bounded_and_hold_every_pack_in_order(builds, name, monkeypatch):
    build = open_export_build(builds[name])
    max_len, has_labels = build.manifest.options.max_len, build.manifest.has_labels
    monkeypatch.setattr(common, "BATCH_BYTES", 5 * max_len * (8 + 4 * has_labels))  # five packs a batch
    batches = list(pack_batches(build))
    assert len(batches) >= build.manifest.totals.packs // 5 > len(build.manifest.shards)
    expected = shard_schema(has_labels, max_len, sources=build.manifest.mixture is not None)
    for batch in batches:
        assert 1 <= batch.num_rows <= 5
        assert batch.schema.remove_metadata().equals(expected.remove_metadata())
        for column in batch.columns:
            if isinstance(column, pa.ListArray):
                assert column.offsets[0].as_py() == 0
    rows = pa.Table.from_batches(batches).to_pylist()
    monkeypatch.setattr(common, "BATCH_BYTES", 1 << 40)  # one batch a shard (a full build) or 64 MiB (an index build)
    whole = pa.Table.from_batches(list(pack_batches(build))).to_pylist()
    assert len(rows) == build.manifest.totals.packs and rows == whole
    assert all(np.diff(row["cu_seqlens"]).min() > 0 for row in rows)
