"""The one definition of which tokens the exports train (`training_tokens`, written by every format as labels
or a loss mask) is the training wing's: on real builds, every pack's labels and position ids equal what
`PackedCollator` gives for that pack of `PackedDataset`."""

from __future__ import annotations

import numpy as np
import pytest

from prepack.exports.common import open_export_build, pack_batches, training_tokens
from tests.exports.rows import Expected

pytestmark = pytest.mark.slow  # the session's builds take seconds


@pytest.mark.parametrize("name", ["chat", "chat-index", "mixture", "mixture-index"])
def test_the_exports_train_the_tokens_the_collator_trains(builds, name):
    build, expected = open_export_build(builds[name]), Expected(builds[name])
    pack, first_tokens_masked = 0, 0
    for batch in pack_batches(build):
        packs = training_tokens(batch)
        for p in range(batch.num_rows):
            start, stop = packs.pack_offsets[p], packs.pack_offsets[p + 1]
            row = expected.row(pack)
            assert np.array_equal(packs.tokens[start:stop], row["input_ids"]), pack
            assert np.array_equal(packs.labels[start:stop], row["labels"]), pack
            assert np.array_equal(packs.position_ids[start:stop], row["position_ids"]), pack
            stored = np.asarray(expected.rows[pack].get("labels", row["input_ids"]))
            first_tokens_masked += int((stored[row["cu_seqlens"][:-1]] != -100).sum())
            pack += 1
    assert pack == len(expected)
    if name.startswith("mixture"):  # a source without labels: its documents' first tokens are masked here alone
        assert first_tokens_masked > 0
