"""Index builds from elsewhere: a manifest that names another store, a store outside the build's parent
directory or reached through a symbolic link, path fields no file system holds, store files swapped for FIFOs or directories. Each is
refused by name (FormatError, a verify finding, CLI exit 2) before the store is opened, never served,
never a traceback or a hang."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prepack import build, build_store
from prepack.errors import FormatError, InputError
from prepack.formats.shards import store_location_problem
from prepack.training.dataset import PackedDataset, open_hf_dataset
from prepack.check.verify import verify_build
from tests.cli import invoke_prepack, run_prepack
from tests.corpus import corpus_table, edit_json, write_corpus


def _store(root: Path, name: str, seed: int) -> Path:
    """60 documents whose lengths do not depend on `seed`, their tokens do."""
    lengths = np.random.default_rng(0).integers(1, 30, 60)
    rng = np.random.default_rng(seed)
    (root / f"corpus-{name}").mkdir(parents=True)
    write_corpus(root / f"corpus-{name}" / "a.parquet", corpus_table([rng.integers(0, 500, int(n)).tolist() for n in lengths]))
    build_store(root / f"corpus-{name}", root / name, shard_size=256)
    return root / name


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    """(an index build of `store`, `other`: a store of the same lengths and other tokens), side by side."""
    store, other = _store(tmp_path, "store", 1), _store(tmp_path, "other", 2)
    build(store, tmp_path / "index", max_len=32, index_only=True)
    return tmp_path / "index", other


def test_an_index_build_retargeted_at_another_store_is_refused(pair):
    index, other = pair
    fingerprint = json.loads((other / "store.json").read_text())["fingerprint"]
    edit_json(index / "manifest.json", lambda raw: raw["store"].update(path="../other", fingerprint=fingerprint))
    with pytest.raises(FormatError, match="planned from the store with fingerprint"):
        PackedDataset(index)[0]
    problems = verify_build(index, all_problems=True)
    assert ("manifest.json", "store.fingerprint") in {(p.file, p.column) for p in problems}
    assert any("planned from the store with fingerprint" in p.message for p in problems)
    # The manifest's own fingerprint rewritten too: the shards still say which store they were planned from.
    edit_json(index / "manifest.json", lambda raw: raw.update(fingerprint=fingerprint))
    with pytest.raises(FormatError, match="planned from the store with fingerprint"):
        PackedDataset(index)[0]
    assert verify_build(index)


@pytest.mark.parametrize(
    "path", ["/abs/store", "../../store", "../x/../../store", "store", "..", "../", "../../other-bucket/store"]
)
@pytest.mark.slow
def test_a_store_path_outside_the_builds_parent_is_refused_before_any_open(pair, path, tmp_path):
    index, _ = pair
    edit_json(index / "manifest.json", lambda raw: raw["store"].update(path=path))
    with pytest.raises(FormatError, match=r"store.path"):
        PackedDataset(index)
    assert [p.column for p in verify_build(index)] == [None] and "store.path" in verify_build(index)[0].message
    if path not in ("/abs/store", "../../store"):  # the CLI's exit codes once, for the fast lane's time
        return
    result = run_prepack("verify", str(index))
    assert result.returncode == 1 and "store.path" in result.stdout and "Traceback" not in result.stderr
    result = invoke_prepack("inspect", str(index))
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_a_build_refuses_to_write_a_store_path_readers_refuse(tmp_path):
    store = _store(tmp_path / "data", "store", 1)
    (tmp_path / "builds").mkdir()
    with pytest.raises(InputError, match="must lie beside its store"):
        build(store, tmp_path / "builds" / "index", max_len=32, index_only=True)
    assert not (tmp_path / "builds" / "index").exists()


@pytest.mark.slow
def test_a_moved_store_is_named_at_load_time(pair, tmp_path):
    index, _ = pair
    rows = [PackedDataset(index)[i]["input_ids"].tolist() for i in range(3)]
    moved = tmp_path / "elsewhere" / "deep" / "store"
    shutil.move(tmp_path / "store", moved)
    with pytest.raises(FormatError, match="is not there"):
        PackedDataset(index)
    assert [PackedDataset(index, store=moved)[i]["input_ids"].tolist() for i in range(3)] == rows
    assert verify_build(index, store=moved) == []
    assert invoke_prepack("verify", str(index), "--store", str(moved)).returncode == 0
    with pytest.raises(FormatError, match="planned from"):  # the named store must still be the build's own
        PackedDataset(index, store=tmp_path / "other")
    with pytest.raises(InputError, match="not a prepack document store"):
        PackedDataset(index, store=tmp_path / "elsewhere")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store.path", "../st\0re"),
        ("store.path", ""),
        ("store.path", "../" + "x" * 300),
        ("store.path", "../" + "/".join(["x"] * 3000)),
        ("store.path", "../a//b"),
        ("store.path", "../."),
        ("inputs.0.path", "a\0.parquet"),
        ("inputs.0.path", "x" * 256),
        ("inputs.0.path", "."),
    ],
)
def test_path_fields_no_file_system_holds_are_named_errors(pair, field, value):
    index, _ = pair
    key, *rest = field.split(".")

    def edit(raw):
        target = raw[key]
        for part in rest[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        target[rest[-1]] = value

    edit_json(index / "manifest.json", edit)
    with pytest.raises(FormatError, match="is not a valid prepack manifest"):
        PackedDataset(index)
    assert verify_build(index)[0].file == "manifest.json"
    if "\0" not in value:  # the CLI's exit code for the NUL cases only, for the fast lane's time
        return
    result = invoke_prepack("inspect", str(index))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "manifest.json" in result.stderr.replace("\n", "")


def test_store_manifest_path_fields_are_named_errors(pair):
    index, _ = pair
    store = index.parent / "store"
    edit_json(store / "store.json", lambda raw: raw["inputs"][0].update(path="a\0b"))
    with pytest.raises(FormatError, match="not a valid prepack store manifest"):
        PackedDataset(index)
    assert "store" in verify_build(index)[0].column


@pytest.mark.parametrize("swap", ["fifo", "directory", "symlink-to-fifo"])
def test_a_store_shard_swapped_after_open_is_refused_not_hung(pair, swap):
    index, _ = pair
    dataset = PackedDataset(index)  # store opened: its files checked with lstat
    shard = index.parent / "store" / "documents-00000.arrow"
    shard.unlink()
    if swap == "fifo":
        os.mkfifo(shard)
    elif swap == "directory":
        shard.mkdir()
    else:
        os.mkfifo(index.parent / "pipe")
        shard.symlink_to(index.parent / "pipe")
    with pytest.raises(FormatError, match="documents-00000.arrow"):
        for i in range(len(dataset)):
            dataset[i]


def test_an_index_build_at_a_buckets_root_names_no_store_in_another_bucket(pair):
    from prepack.formats.shards import read_manifest
    from prepack.sources.store import store_location

    index, _ = pair
    edit_json(index / "manifest.json", lambda raw: raw["store"].update(path="../other-bucket/store"))
    manifest = read_manifest(index)  # a valid path: beside a build that has a parent prefix
    assert store_location("s3://bucket/builds/index", manifest) == "s3://bucket/builds/other-bucket/store"
    with pytest.raises(FormatError, match="bucket's root"):
        store_location("s3://bucket", manifest)


# A store reached through a symbolic link: `store.path` (or a mixture source's `store`) is held to the
# build's parent directory where it resolves, not only as text; the writer and every reader share the rule.


def _link_to_a_store_elsewhere(store: Path, link: Path, elsewhere: Path) -> None:
    """Move `store` out of the build's parent directory, into `elsewhere`, and make `link` point at it: a
    manifest whose text says "beside the build" then names a store anywhere on the machine."""
    moved = elsewhere / store.name
    shutil.move(store, moved)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(moved, target_is_directory=True)


@pytest.mark.parametrize(
    ("link", "path"),
    [
        ("index/s", "../index/s"),  # shipped inside the build itself
        ("shelf", "../shelf/store"),  # a linked directory on the way
        ("alias", "../alias"),  # beside the build, but a link
    ],
)
def test_a_store_path_through_a_symbolic_link_is_refused(pair, tmp_path_factory, link, path):
    index, _ = pair
    parent = index.parent
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    if link == "shelf":  # the store moved into a directory elsewhere, reached through the link `shelf`
        shutil.move(parent / "store", elsewhere / "store")
        (parent / "shelf").symlink_to(elsewhere, target_is_directory=True)
    else:
        _link_to_a_store_elsewhere(parent / "store", parent / link, elsewhere)
    edit_json(index / "manifest.json", lambda raw: raw["store"].update(path=path))
    with pytest.raises(FormatError, match=r"manifest.json: store.path .* passes through the symbolic link"):
        PackedDataset(index)
    with pytest.raises(FormatError, match=r"manifest.json: store.path .* passes through the symbolic link"):
        open_hf_dataset(index, cache_dir=tmp_path_factory.mktemp("rows"))
    [problem] = verify_build(index, all_problems=True)[:1]
    assert (problem.file, problem.column) == ("manifest.json", "store") and "symbolic link" in problem.message
    if link != "index/s":  # the CLI once, for the fast lane's time
        return
    result = run_prepack("verify", str(index))
    assert result.returncode == 1 and "symbolic link" in result.stdout and "no problems" not in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_mixtures_source_store_through_a_symbolic_link_is_refused(pair, tmp_path_factory):
    index, _ = pair
    parent = index.parent
    (parent / "mix.yaml").write_text(
        "tokens: 600\nseed: 3\nsources:\n  - {name: a, path: store, weight: 0.5}\n  - {name: b, path: other, weight: 0.5}\n"
    )
    build(parent / "mix.yaml", parent / "mix", max_len=32, index_only=True)
    assert verify_build(parent / "mix") == []
    _link_to_a_store_elsewhere(parent / "other", parent / "mix" / "o", tmp_path_factory.mktemp("elsewhere"))
    edit_json(parent / "mix" / "manifest.json", lambda raw: raw["mixture"]["sources"][1].update(store="../mix/o"))
    with pytest.raises(FormatError, match=r"mixture.sources\[1\].store .* passes through the symbolic link"):
        PackedDataset(parent / "mix")
    problem = verify_build(parent / "mix")[0]
    assert (problem.file, problem.column) == ("manifest.json", "mixture.sources") and "symbolic link" in problem.message


def test_a_build_records_where_its_store_really_lies(tmp_path):
    """The writer holds itself to the readers' rule: a store named through a link is recorded where it
    really is, so refused when that is not beside the build, and read back when it is."""
    store = _store(tmp_path / "data", "store", 1)
    (tmp_path / "builds").mkdir()
    (tmp_path / "builds" / "store").symlink_to(store, target_is_directory=True)
    with pytest.raises(InputError, match="must lie beside its store"):
        build(tmp_path / "builds" / "store", tmp_path / "builds" / "index", max_len=32, index_only=True)
    assert not (tmp_path / "builds" / "index").exists()
    (tmp_path / "data" / "alias").symlink_to(store, target_is_directory=True)
    manifest = build(tmp_path / "data" / "alias", tmp_path / "data" / "index", max_len=32, index_only=True)
    assert manifest.store.path == "../store"
    assert verify_build(tmp_path / "data" / "index") == [] and len(PackedDataset(tmp_path / "data" / "index")) > 0


@given(
    parts=st.lists(st.sampled_from(["a", "b", "store"]), min_size=1, max_size=4),
    link=st.none() | st.integers(0, 3),
    outside=st.booleans(),
    build_through_a_link=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_a_store_location_is_refused_exactly_when_a_part_of_it_is_a_link(parts, link, outside, build_through_a_link):
    """`store_location_problem`: None when every part below the build's parent is a directory (the
    location then resolves inside that parent), a problem naming the link otherwise, wherever it
    points. A link to the build's parent itself is the user's own path, not a part of `store.path`."""
    assume(link is None or link < len(parts))
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        parent, target = root / "parent", root / ("elsewhere" if outside else "parent/real")
        (parent / "index").mkdir(parents=True)
        target.mkdir(parents=True)
        place = parent
        for number, part in enumerate(parts):
            place = place / part
            if number == link:
                place.symlink_to(target, target_is_directory=True)
            else:
                place.mkdir()
        build_path = parent / "index"
        if build_through_a_link:
            (root / "alias").symlink_to(parent, target_is_directory=True)
            build_path = root / "alias" / "index"
        path = "../" + "/".join(parts)
        problem = store_location_problem(build_path, path)
        if link is None:
            assert problem is None
            assert Path(os.path.realpath(build_path / path)).is_relative_to(os.path.realpath(parent))
        else:
            assert problem is not None and f"symbolic link {parent / '/'.join(parts[: link + 1])}" in problem
