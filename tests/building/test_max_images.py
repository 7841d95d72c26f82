"""The image cap (`--max-images-per-pack M`, issue 34 item 5): a second cap of the first-fit-decreasing
planner beside max_len and the document cap, held to a plain-Python FFD with the same caps."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack.building.plan import assign_packs, plan_packs
from tests.building.test_plan import corpora
from tests.corpus import reference_placement


@st.composite
def pictured(draw):
    """A corpus of `corpora` with 0-4 images a document (mostly none, as in an SFT mix), and a cap."""
    lengths, max_len = draw(corpora())
    images = draw(st.lists(st.sampled_from([0, 0, 0, 1, 1, 2, 3, 4]), min_size=len(lengths), max_size=len(lengths)))
    cap = draw(st.integers(1, 9))
    return lengths, max_len, np.minimum(np.array(images, dtype=np.int64), cap), cap


@settings(max_examples=60, deadline=None)
@given(pictured(), st.none() | st.integers(1, 12))
def test_the_image_cap_matches_the_reference(corpus, max_documents):
    lengths, max_len, images, cap = corpus
    got = assign_packs(lengths, max_len, "ffd", max_documents=max_documents, images=images, max_images=cap)
    assert got.tolist() == reference_placement(lengths.tolist(), max_len, "ffd", max_documents, images.tolist(), cap)
    if len(lengths):
        assert np.bincount(got, weights=images).max() <= cap  # no pack over M images ...
        assert np.bincount(got, weights=lengths).max() <= max_len  # ... nor over max_len


def test_a_cap_no_pack_reaches_changes_nothing_and_a_lower_one_binds():
    rng = np.random.default_rng(0)
    lengths, images = rng.integers(1, 40, 3000), rng.choice([0, 0, 1, 2], 3000)
    plain = assign_packs(lengths, 256, "ffd")
    most = int(np.bincount(plain, weights=images).max())
    assert np.array_equal(assign_packs(lengths, 256, "ffd", images=images, max_images=most), plain)
    capped = assign_packs(lengths, 256, "ffd", images=images, max_images=most - 2)
    assert np.bincount(capped, weights=images).max() == most - 2 and not np.array_equal(capped, plain)


def test_the_whole_plan_holds_each_segment_once_under_the_cap():
    rng = np.random.default_rng(1)
    lengths, images = rng.integers(0, 90, 500), rng.choice([0, 1, 3], 500)
    plan = plan_packs(lengths, 64, overflow="split", images=images, max_images=4)
    packs = plan.slice(0, plan.packs)
    per_pack = np.add.reduceat(images[packs.rows], packs.pack_offsets[:-1])
    assert per_pack.max() <= 4
    # Every document's segments once: a split document's pieces each count its images (conservative).
    assert sorted(zip(packs.rows.tolist(), packs.pieces.tolist())) == sorted(
        (row, piece) for row, length in enumerate(lengths.tolist()) for piece in range(-(-length // 64)))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"images": np.array([0, 5]), "max_images": 4}, "document 1 has 5 images, more than max_images 4"),
        ({"images": np.array([0, 1]), "max_images": None}, "images and max_images go together"),
        ({"images": np.array([1]), "max_images": 4}, "one image count per document"),
        ({"images": np.array([0, -1]), "max_images": 4}, "must not be negative"),
        ({"images": np.array([0, 1]), "max_images": 0}, "max_images must be in"),
    ],
)
def test_bad_image_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        assign_packs(np.array([3, 4]), 8, "ffd", **options)


def test_best_fit_with_an_image_cap_is_refused_by_name():
    with pytest.raises(ValueError, match="first-fit-decreasing"):
        assign_packs(np.array([3, 4]), 8, "bfd", images=np.array([1, 1]), max_images=1)


@pytest.mark.slow  # a fresh interpreter compiling the planner's kernels: ~5-10 s
def test_an_uncapped_plan_compiles_nothing_of_the_image_cap(tmp_path):
    # Kernels compile on first use (numba's cache empty: seconds each): a plan without the cap must not pay for it.
    # (A kernel loaded from numba's cache resolves none of the kernels it calls: hence an empty cache.)
    code = ("import numpy as np; from prepack.building import plan; plan.assign_packs(np.array([3, 4, 5]), 8, 'ffd'); "
            "print([k.__name__ for k in (plan._ffd, plan._ffd_pictured, plan._images_in_order) if 'dispatcher' in vars(k)])")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.stdout.split() == ["['_ffd']"], result.stderr


# Builds of a real-shaped image-chat corpus ------------------------------------------------------------------

MAX_LEN = 512


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from prepack.sources.images import prepare_image_chat
    from tests.vision_corpora import real_shaped_corpus
    from tests.vision_inputs import processor_directory

    root = tmp_path_factory.mktemp("imagecap")
    processor = processor_directory(root / "processor")
    corpus, _ = real_shaped_corpus(root / "corpus", rows=40)
    return processor, prepare_image_chat(corpus, processor, root / "prepared")


def images_per_pack(build_dir, image_set_dir) -> list[int]:
    from prepack.formats.images import read_image_set
    from prepack.training.dataset import PackedDataset

    per_row, dataset = read_image_set(image_set_dir).row_images(), PackedDataset(build_dir)
    return [int(per_row[dataset.source_rows(i)].sum()) for i in range(len(dataset))]


def build_of(prepared, out, **options):
    from prepack import build

    processor, summary = prepared
    return build(summary.corpus, out, max_len=MAX_LEN, tokenizer=processor, chat=True, overflow="error", **options)


@pytest.mark.slow
def test_no_pack_holds_more_than_m_images_and_every_sample_is_in_one_pack(prepared, tmp_path):
    from prepack.check.images import verify_images
    from prepack.check.verify import verify_build
    from tests.corpus import files

    processor, summary = prepared
    plain = build_of(prepared, tmp_path / "plain")
    assert max(images_per_pack(tmp_path / "plain", summary.image_set)) > 3  # the cap below binds
    capped = build_of(prepared, tmp_path / "capped", max_images_per_pack=3, images=summary.image_set)
    counts = images_per_pack(tmp_path / "capped", summary.image_set)
    assert max(counts) == 3 and sum(counts) == summary.references  # every image once
    assert capped.options.max_images_per_pack == 3 and len(capped.options.image_set) == 64
    assert plain.options.max_images_per_pack is None and "max_images_per_pack" not in (tmp_path / "plain" / "manifest.json").read_text()
    assert capped.totals.documents == plain.totals.documents and capped.totals.tokens == plain.totals.tokens
    assert verify_build(tmp_path / "capped", summary.corpus, tokenizer=processor) == []  # every sample in exactly one pack
    assert verify_images(tmp_path / "capped", summary.image_set) == []
    build_of(prepared, tmp_path / "again", max_images_per_pack=3, images=summary.image_set)
    assert files(tmp_path / "again") == files(tmp_path / "capped")  # byte-identical


@pytest.mark.slow
def test_a_cap_no_pack_reaches_writes_the_uncapped_shards(prepared, tmp_path):
    processor, summary = prepared
    build_of(prepared, tmp_path / "plain")
    build_of(prepared, tmp_path / "capped", max_images_per_pack=64, images=summary.image_set)
    for shard in sorted((tmp_path / "plain").glob("*.arrow")):
        assert (tmp_path / "capped" / shard.name).read_bytes() == shard.read_bytes()


@pytest.mark.slow
def test_verify_and_inspect_report_images_per_pack(prepared, tmp_path):
    import json

    from tests.cli import run_prepack

    processor, summary = prepared
    build_of(prepared, tmp_path / "capped", max_images_per_pack=3, images=summary.image_set)
    counts = images_per_pack(tmp_path / "capped", summary.image_set)
    report = run_prepack("inspect", tmp_path / "capped", "--images", summary.image_set, "--json")
    assert report.returncode == 0, report.stderr
    images = json.loads(report.stdout)["images"]
    assert images["images_per_pack_max"] == 3 and images["images_per_pack_mean"] == pytest.approx(np.mean(counts))
    # A manifest whose cap is below what its packs hold: each such pack is a finding (exit 1).
    manifest = tmp_path / "capped" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"max_images_per_pack": 3', '"max_images_per_pack": 2'))
    found = run_prepack("verify", tmp_path / "capped", "--images", summary.image_set)
    assert found.returncode == 1
    assert found.stdout.count("3 images, more than the manifest's max_images_per_pack = 2") == counts.count(3)


@pytest.mark.slow
def test_verify_refuses_another_image_set_than_the_one_the_cap_counted(prepared, tmp_path):
    import shutil

    from prepack.check.images import verify_images
    from tests.cli import failure, run_prepack

    processor, summary = prepared
    build_of(prepared, tmp_path / "capped", max_images_per_pack=3, images=summary.image_set)
    other = tmp_path / "other"
    shutil.copytree(summary.image_set, other)
    (other / "images.json").write_text((other / "images.json").read_text() + " ")
    problems = verify_images(tmp_path / "capped", other)
    assert [p.column for p in problems] == ["image_set"] and "not the image set this build was planned with" in problems[0].message
    inspected = run_prepack("inspect", tmp_path / "capped", "--images", other)
    assert inspected.returncode == 2 and "not the image set this build was planned with" in failure(inspected)


@pytest.mark.slow
def test_a_row_with_more_images_than_the_cap_is_refused_by_file_and_row(prepared, tmp_path):
    from prepack.formats.images import read_image_set
    from tests.cli import failure, run_prepack, WIDE

    processor, summary = prepared
    row = int(np.argmax(read_image_set(summary.image_set).row_images() == 3))
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--max-images-per-pack", 2, "--images", summary.image_set, "--out", tmp_path / "out", env=WIDE)
    assert f"{summary.corpus}, row {row}: 3 images" in failure(result) and "more than --max-images-per-pack 2" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-images-per-pack", "2"], "give it with --images DIR"),
        (["--images", "IMAGES"], "--images names the image set whose image counts --max-images-per-pack caps"),
        (["--max-images-per-pack", "0", "--images", "IMAGES"], "--max-images-per-pack 0: give an integer in [1, 2**31)"),
        (["--max-images-per-pack", "2", "--images", "IMAGES", "--algorithm", "bfd"], "leave out --algorithm bfd"),
        (["--max-images-per-pack", "2", "--images", "IMAGES", "--unpaired"], "leave out --unpaired"),
        (["--max-images-per-pack", "2", "--images", "IMAGES", "--pairs"], "leave out --pairs"),
        (["--max-images-per-pack", "2", "--images", "IMAGES", "--groups"], "leave out --groups"),
        (["--max-images-per-pack", "2", "--images", "IMAGES", "--append"], "leave out --append"),
    ],
)
def test_the_cli_refuses_an_image_cap_it_cannot_plan(tmp_path, flags, message):
    from tests.cli import failure, run_prepack, WIDE
    from tests.corpus import corpus_table, write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    flags = [str(tmp_path / "images") if flag == "IMAGES" else flag for flag in flags]
    result = run_prepack("build", corpus, "--max-len", "8", *flags, "--out", tmp_path / "out", env=WIDE)
    assert message in failure(result) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_index_build_holds_the_capped_full_builds_packs(prepared, tmp_path):
    """`--index-only` from the corpus's store plans as the full build does (the cap counts the same rows): the same
    documents in the same packs, each pack's tokens read from the store equal to the full build's."""
    from prepack import build, build_store
    from prepack.check.images import verify_images
    from prepack.training.dataset import PackedDataset

    processor, summary = prepared
    full = build_of(prepared, tmp_path / "full", max_images_per_pack=3, images=summary.image_set)
    build_store(summary.corpus, tmp_path / "store", tokenizer=processor, chat=True, num_proc=1)
    index = build(tmp_path / "store", tmp_path / "index", max_len=MAX_LEN, overflow="error", index_only=True,
                  max_images_per_pack=3, images=summary.image_set)
    assert index.store is not None and (index.options.max_images_per_pack, index.options.image_set) == (
        full.options.max_images_per_pack, full.options.image_set)
    assert max(images_per_pack(tmp_path / "index", summary.image_set)) == 3  # the cap binds (the plain build's > 3)
    full_packs, index_packs = PackedDataset(tmp_path / "full"), PackedDataset(tmp_path / "index")
    assert len(index_packs) == len(full_packs)
    for number in range(len(full_packs)):
        assert index_packs.source_rows(number).tolist() == full_packs.source_rows(number).tolist()
        expected, got = full_packs[number], index_packs[number]
        assert sorted(got) == sorted(expected) and all(np.array_equal(got[key], expected[key]) for key in expected)
    assert verify_images(tmp_path / "index", summary.image_set) == []


def test_the_cli_refuses_an_image_cap_on_a_mixture(tmp_path):
    from tests.cli import failure, run_prepack, WIDE
    from tests.corpus import corpus_table, write_corpus

    write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    (tmp_path / "mixture.yaml").write_text("tokens: 3\nseed: 0\nsources:\n  - {name: c, path: c.parquet, weight: 1}\n")
    result = run_prepack("build", tmp_path / "mixture.yaml", "--max-len", "8", "--max-images-per-pack", "2",
                         "--images", tmp_path / "images", "--out", tmp_path / "out", env=WIDE)
    assert "leave out a mixture" in failure(result) and not (tmp_path / "out").exists()
