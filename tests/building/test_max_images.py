"""The image cap (`--max-images-per-pack M`, issue 34 item 5): a second cap of the first-fit-decreasing
planner beside max_len and the document cap, held to a plain-Python FFD with the same caps."""

from __future__ import annotations

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
    return lengths, max_len, np.array(images, dtype=np.int64), draw(st.integers(4, 9))


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
