"""A mixture whose sources (a corpus and a document store) lie in object storage, built into object
storage, is the mixture of the same sources built locally: the same shards, the same counts."""

from __future__ import annotations

from pathlib import Path

import pytest

import prepack
from tests.corpus import MIXTURE, mixture_sources

s3fs = pytest.importorskip("s3fs")


def test_a_mixture_of_sources_in_s3_equals_the_local_one(tmp_path, s3_server, s3_bucket):
    fs = s3fs.S3FileSystem()
    mixture_sources(tmp_path)
    for local in [tmp_path / "web.parquet", tmp_path / "code.jsonl", *sorted((tmp_path / "math-store").iterdir())]:
        fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/{local.relative_to(tmp_path).as_posix()}", local.read_bytes())
    text = MIXTURE.format(tokens=20000, within="false")
    (tmp_path / "local.yaml").write_text(text)
    remote = tmp_path / "remote.yaml"
    remote.write_text(text.replace("path: ", f"path: {s3_bucket}/"))
    here = prepack.build(tmp_path / "local.yaml", tmp_path / "packed", max_len=256)
    there = prepack.build(remote, f"{s3_bucket}/packed", max_len=256)
    assert [s.path for s in there.mixture.sources] == [f"{s3_bucket}/{s.path}" for s in here.mixture.sources]
    assert [s.model_dump(exclude={"path"}) for s in there.mixture.sources] == [s.model_dump(exclude={"path"}) for s in here.mixture.sources]
    assert there.inputs == here.inputs and there.shards == here.shards
    for shard in here.shards:
        assert fs.cat_file(f"{s3_bucket.removeprefix('s3://')}/packed/{shard.name}") == (Path(tmp_path / "packed") / shard.name).read_bytes()
    assert prepack.verify_build(f"{s3_bucket}/packed") == []
