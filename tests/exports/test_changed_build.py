"""A build whose shard changed after it was built (same size, same manifest) is never exported as if it were
that build, and an export of it no longer verifies."""

from __future__ import annotations

import numpy as np
import pytest

from prepack.errors import FormatError
from prepack.exports import common, export_build, verify_export
from prepack.exports.common import open_export_build, pack_batches
from prepack.formats.shards import read_manifest
from tests.check.test_verify import rewrite_shard, with_column
from tests.exports.trainer_builds import labelled_corpus_build


def change_one_token(build_dir) -> str:
    """Change the first token of the first shard in place (same size, a valid shard still); its name."""
    shard = read_manifest(build_dir).shards[0].name
    (batch,) = pack_batches(open_export_build(build_dir))
    ids = np.asarray(batch.column("input_ids").values)
    data = (build_dir / shard).read_bytes()
    at = data.find(ids[:8].tobytes())  # input_ids, the first column (the labels, equal, come after)
    assert at >= 0
    changed = ids[:1].copy()
    changed[0] += 1
    (build_dir / shard).write_bytes(data[:at] + changed.tobytes() + data[at + changed.nbytes :])
    return shard


@pytest.mark.slow  # the export stages a directory and fails
def test_a_shard_changed_in_place_is_refused_by_name(tmp_path):
    build_dir = labelled_corpus_build(tmp_path, lambda doc: doc)
    shard = change_one_token(build_dir)
    with pytest.raises(FormatError, match=rf"{shard}: sha256 [0-9a-f]{{64}} does not match the manifest's"):
        list(pack_batches(open_export_build(build_dir)))
    with pytest.raises(FormatError, match=shard):
        export_build(build_dir, "parquet", tmp_path / "export")
    assert not (tmp_path / "export").exists()


@pytest.mark.slow  # an export and two verifies
def test_an_export_of_a_build_whose_shard_changed_no_longer_verifies(tmp_path):
    build_dir = labelled_corpus_build(tmp_path, lambda doc: doc)
    export_build(build_dir, "parquet", tmp_path / "export")
    assert verify_export(tmp_path / "export", build_dir) == []
    shard = change_one_token(build_dir)
    problems = verify_export(tmp_path / "export", build_dir)
    assert len(problems) == 1 and shard in problems[0] and "sha256" in problems[0]


def test_each_shard_is_checked_a_batch_at_a_time_naming_the_shards_row(tmp_path, monkeypatch):
    build_dir = labelled_corpus_build(tmp_path, lambda doc: doc)
    build = open_export_build(build_dir)
    max_len = build.manifest.options.max_len
    packs = build.manifest.shards[0].rows
    assert packs >= 4
    monkeypatch.setattr(common, "BATCH_BYTES", 2 * max_len * 12)  # two packs a batch
    checked = []
    check_shard = common.check_shard
    monkeypatch.setattr(common, "check_shard", lambda batch, *args: checked.append(batch.num_rows) or check_shard(batch, *args))
    assert sum(batch.num_rows for batch in pack_batches(build)) == build.manifest.totals.packs
    assert max(checked) == 2 and sum(checked) == build.manifest.totals.packs  # memory bounded by the batch
    row = packs - 1  # in the last batch of the shard: named as the shard's row, not the batch's
    rewrite_shard(build_dir, build.manifest.shards[0].name, lambda batch: with_column(
        batch, "segment_ids", [ids if r != row else [7] * len(ids) for r, ids in enumerate(batch.column("segment_ids").to_pylist())]
    ))
    with pytest.raises(FormatError, match=rf"row {row}, column 'segment_ids'"):
        list(pack_batches(open_export_build(build_dir)))
