"""`prepack export --to parquet`: what `datasets` loads is every pack of the build, its card parses and says
what `prepack inspect --json` says, and the export is written as a build is (atomically, exclusively,
byte-identical on a rerun) and checked later by `verify_export`."""

from __future__ import annotations

import json
import sys
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from prepack import OutputError, InputError, inspect_build
from prepack.exports import FORMATS, ExportFormat, export_build, verify_export
from tests.cli import invoke_prepack, run_prepack
from tests.exports.rows import first_difference

pytestmark = pytest.mark.slow  # every test here exports a build (and the session's builds take seconds)


def _load(export: Path, cache: Path):
    from datasets import load_dataset

    files = sorted(str(path) for path in (export / "data").glob("*.parquet"))
    return load_dataset("parquet", data_files=files, split="train", cache_dir=str(cache))


@pytest.mark.parametrize("name", ["chat", "chat-index", "mixture", "mixture-index", "pairs"])
def test_datasets_loads_every_pack_of_the_build(builds, tmp_path, name):
    export_build(builds[name], "parquet", tmp_path / "export")
    dataset = _load(tmp_path / "export", tmp_path / "cache").with_format("numpy")
    assert first_difference(iter(dataset), builds[name]) is None


def test_an_index_build_exports_the_bytes_of_its_full_build(builds, tmp_path):
    export_build(builds["chat"], "parquet", tmp_path / "full")
    export_build(builds["chat-index"], "parquet", tmp_path / "index")
    data = lambda root: {p.name: p.read_bytes() for p in (root / "data").iterdir()}  # noqa: E731
    assert data(tmp_path / "full") == data(tmp_path / "index")


def _retokened(export: Path) -> None:
    """Change one token id of the export's first Parquet file, written back as it was otherwise."""
    file = sorted((export / "data").glob("*.parquet"))[0]
    table = pq.read_table(file)
    offsets = table.column("input_ids").chunk(0).offsets.to_numpy()
    ids = table.column("input_ids").combine_chunks().values.to_numpy().copy()
    ids[offsets[3] + 2] += 1
    changed = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int32()))
    pq.write_table(table.set_column(0, table.schema.field(0), changed), file, compression="zstd")


def test_tampering_with_one_token_fails_the_comparison_and_the_verify(builds, tmp_path):
    export = tmp_path / "export"
    export_build(builds["chat"], "parquet", export)
    assert verify_export(export, builds["chat"]) == []
    _retokened(export)
    assert first_difference(iter(_load(export, tmp_path / "cache").with_format("numpy")), builds["chat"]) == "pack 3, column input_ids"
    problems = verify_export(export, builds["chat"])
    assert len(problems) == 1 and "data/train-00000-of-00001.parquet" in problems[0] and "the file changed" in problems[0]


def test_a_rerun_writes_the_same_bytes(builds, tmp_path):
    for name in ("a", "b"):
        export_build(builds["mixture"], "parquet", tmp_path / name)
    files = lambda root: {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}  # noqa: E731
    first = files(tmp_path / "a")
    assert set(map(str, first)) == {"README.md", "export.json", "pack_statistics.png", "data/train-00000-of-00001.parquet"}
    assert first == files(tmp_path / "b")


def _card(export: Path) -> tuple[dict, str]:
    text = (export / "README.md").read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def test_the_card_parses_as_the_hubs_header_and_says_what_inspect_says(builds, tmp_path):
    from datasets import Features

    export_build(builds["mixture"], "parquet", tmp_path / "export")
    header, body = _card(tmp_path / "export")
    report = json.loads(inspect_build(builds["mixture"]).to_json())
    dataset = _load(tmp_path / "export", tmp_path / "cache")
    assert header["configs"] == [{"config_name": "default", "data_files": [{"split": "train", "path": "data/train-*.parquet"}]}]
    assert Features._from_yaml_list(header["dataset_info"]["features"]) == dataset.features
    assert header["dataset_info"]["splits"][0]["num_examples"] == report["packs"] == len(dataset)
    assert header["size_categories"] == ["n<1K"]
    for row in (f"| max_len | {report['max_len']:,} |", f"| packs | {report['packs']:,} |", f"| tokens | {report['tokens']:,} |",
                f"| fill | {report['fill']:.4%} ", f"| documents read | {report['documents']:,} |",
                f"| documents packed (segments) | {report['segments']:,} |"):
        assert row in body, row
    for number, source in enumerate(report["sources"]):
        assert f"| {number} | {source['name']} | {source['tokens']:,} | {source['weight']:.4%} |" in body
    manifest = json.loads((builds["mixture"] / "manifest.json").read_text())
    assert f"| fingerprint | `{manifest['fingerprint']}` |" in body
    assert "![" in body and "(pack_statistics.png)" in body
    assert (tmp_path / "export" / "pack_statistics.png").read_bytes().startswith(b"\x89PNG")


def test_an_existing_out_is_refused_and_left_as_it_is(builds, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists"):
        export_build(builds["chat"], "parquet", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    export_build(builds["chat"], "parquet", tmp_path / "export")
    with pytest.raises(OutputError, match="already exists"):
        export_build(builds["chat"], "parquet", tmp_path / "export")
    assert verify_export(tmp_path / "export", builds["chat"]) == []


def test_a_format_that_fails_midway_publishes_nothing(builds, tmp_path, monkeypatch):
    module = tmp_path / "failing_format.py"
    module.write_text(
        "def write(batches, directory, build, scratch):\n"
        "    next(iter(batches))\n"
        "    (directory / 'part').write_text('half')\n"
        "    raise OSError('disk full')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(FORMATS, "failing", ExportFormat("failing_format", 1))
    with pytest.raises(OSError, match="disk full"):
        export_build(builds["chat"], "failing", tmp_path / "out" / "export")
    assert list((tmp_path / "out").iterdir()) == []  # no export, no staging directory, no lock


def test_an_unknown_format_and_a_uri_are_refused_by_name(builds, tmp_path):
    with pytest.raises(InputError, match="prepack exports to .*parquet"):
        export_build(builds["chat"], "mds", tmp_path / "out")
    with pytest.raises(InputError, match="local build"):
        export_build("s3://bucket/packed", "parquet", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="inside the build"):
        export_build(builds["chat"], "parquet", builds["chat"] / "parquet")
    assert sorted(p.name for p in builds["chat"].iterdir() if not p.name.startswith("shard-")) == ["manifest.json"]


def test_verify_reports_a_changed_build_a_missing_file_and_a_stray_one(builds, tmp_path):
    import shutil

    import prepack

    build = tmp_path / "build"
    shutil.copytree(builds["mixture"], build)
    export_build(build, "parquet", tmp_path / "export")
    (tmp_path / "export" / "pack_statistics.png").unlink()
    (tmp_path / "export" / "data" / "extra.parquet").write_bytes(b"x")
    prepack.build(builds["mixture"].parent / "mix.yaml", build, max_len=128, seed=1, overwrite=True)
    problems = verify_export(tmp_path / "export", build)
    assert len(problems) == 3
    assert "the build changed" in problems[0]
    assert "pack_statistics.png: missing" in problems[1]
    assert "extra.parquet: not listed" in problems[2]


def test_the_command_line_exports_and_verifies(builds, tmp_path):
    out = tmp_path / "export"
    result = run_prepack("export", str(builds["chat"]), "--to", "parquet", "--out", str(out))  # the console script
    assert result.returncode == 0, result.stderr
    assert f"into {out}" in result.stdout
    again = invoke_prepack("export", str(builds["chat"]), "--to", "parquet", "--out", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr
    checked = invoke_prepack("verify", str(builds["chat"]), "--export", str(out))
    assert checked.returncode == 0 and "the export's files and build checked" in checked.stdout
    _retokened(out)
    tampered = invoke_prepack("verify", str(builds["chat"]), "--export", str(out))
    assert tampered.returncode == 1 and tampered.stdout.startswith("problem: ") and "the file changed" in tampered.stdout


def test_the_exports_import_no_torch():
    modules = ", ".join(FORMATS[name].module for name in FORMATS)
    code = f"import sys, prepack.exports, {modules}; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
