"""`plan_packs` against the plan it replaced (`tests/plan_reference.py`), and builds against the bytes
that builds made before planning moved to the length histogram and compact per-document arrays."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack import build
from prepack.building.plan import compact_lengths, document_pieces, plan_packs
from tests.corpus import corpus_table, write_corpus
from tests.plan_reference import reference_plan, reference_segments

OVERFLOWS = ["split", "error", "truncate", "drop"]


@st.composite
def plans(draw):
    max_len = draw(st.sampled_from([1, 2, 3, 7, 16, 100]) | st.integers(1, 64))
    # A few values make ties; 0 and lengths over max_len exercise empty and overflowing documents.
    values = draw(st.lists(st.integers(0, 3 * max_len + 1), min_size=1, max_size=5)) + [0, max_len, max_len + 1]
    lengths = draw(st.lists(st.sampled_from(values) | st.integers(0, 3 * max_len + 1), max_size=150))
    untrained = draw(st.none() | st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    options = {
        "algorithm": draw(st.sampled_from(["ffd", "bfd"])),
        "overflow": draw(st.sampled_from(OVERFLOWS)),
        "seed": draw(st.integers(0, 2**32)),
        "untrained": None if untrained is None else np.array(untrained),
        "drop_untrained": draw(st.booleans()),
        "max_documents": draw(st.none() | st.integers(1, 8)),
    }
    return np.array(lengths, dtype=np.int64), max_len, options


def assert_same_plan(lengths, max_len, options, first=0, end=None):
    plan = plan_packs(lengths, max_len, **options)
    offsets, starts, segment_lengths, rows, pieces, counts = reference_plan(lengths, max_len, **options)
    assert plan.packs == len(offsets) - 1
    end = plan.packs if end is None else end
    layout = plan.slice(first, end)
    a, b = offsets[first], offsets[end]
    assert layout.pack_offsets.tolist() == (offsets[first : end + 1] - a).tolist()
    assert layout.starts.tolist() == starts[a:b].tolist()
    assert layout.lengths.tolist() == segment_lengths[a:b].tolist()
    assert layout.rows.tolist() == rows[a:b].tolist()
    assert layout.pieces.tolist() == pieces[a:b].tolist() and layout.pieces.dtype == np.int32
    assert plan.counts == counts
    assert plan.totals()["tokens"] == int(segment_lengths.sum()) and plan.totals()["segments"] == len(rows)


@settings(max_examples=400, deadline=None)
@given(plans(), st.data())
@pytest.mark.slow
def test_plan_is_the_plan_it_replaced(case, data):
    lengths, max_len, options = case
    assert_same_plan(lengths, max_len, options)
    packs = len(reference_plan(lengths, max_len, **options)[0]) - 1
    first = data.draw(st.integers(0, packs))
    assert_same_plan(lengths, max_len, options, first, data.draw(st.integers(first, packs)))


@settings(max_examples=200, deadline=None)
@given(plans())
@pytest.mark.slow
def test_document_pieces_is_the_definition_it_replaced(case):
    lengths, max_len, options = case
    policy = (options["overflow"], options["untrained"], options["drop_untrained"])
    got = document_pieces(lengths, max_len, *policy)
    *expected, counts = reference_segments(lengths, max_len, *policy)
    for column, want in zip(got[:4], expected):
        assert column.tolist() == want.tolist()
    assert got.counts == counts


def test_segments_are_found_across_long_runs_without_segments():
    # A segment is found from a bookmark every 32 segments, walking over documents that make none:
    # runs of empty, left-out and dropped documents far longer than that, and documents of 2**16
    # tokens or more, which plans keep as uint32.
    lengths = np.array([5] + [0] * 100 + [7] * 40 + [30] * 70 + [3] * 50 + [70_000, 2**16, 9], dtype=np.int64)
    untrained = np.zeros(len(lengths), dtype=bool)
    untrained[141:211] = True
    for overflow in OVERFLOWS:
        for drop in (False, True):
            options = dict(algorithm="ffd", overflow=overflow, seed=1, untrained=untrained, drop_untrained=drop)
            assert_same_plan(lengths, 4096 if overflow != "drop" else 10, options)


def test_plans_keep_compact_arrays():
    assert compact_lengths(np.array([1, 2**16 - 1])).dtype == np.uint16
    assert compact_lengths(np.array([1, 2**16])).dtype == np.uint32
    assert compact_lengths(np.array([1, 2**32])).dtype == np.int64
    lengths = compact_lengths(np.arange(1, 1001) % 50 + 1)
    assert compact_lengths(lengths) is lengths  # no copy of what is compact already
    plan = plan_packs(lengths, 64)
    assert plan.documents.lengths is lengths  # the plan keeps the caller's array, not a copy
    assert plan.order.dtype == np.uint32 and plan.order.shape == (1000,)
    with pytest.raises(ValueError, match="negative"):
        compact_lengths(np.array([3, -1]))


def golden_corpus(path: Path) -> Path:
    rng = np.random.default_rng(13)
    documents, labels = [], []
    for i, n in enumerate(rng.integers(0, 200, size=400)):
        ids = rng.integers(1, 1000, size=n).tolist()
        documents.append(ids)
        labels.append([-100] * n if i % 7 == 0 or n == 0 else [-100, *ids[1:]])  # every 7th untrained
    return write_corpus(path, corpus_table(documents, labels))


# sha256 of all shards of each build, back to back, as prepack made them before it planned from the
# length histogram (main at 337c2ea).
@pytest.mark.parametrize(
    ("overflow", "algorithm", "drop_untrained", "seed", "shards", "digest"),
    [
        ("split", "ffd", False, 3, 57, "d23e4aba425004704ea675c8e724490e206033ffb192d46a37c2cb981a5fe4c5"),
        ("truncate", "bfd", True, 4, 26, "45a8761da003da46f1e8fbfabc39719e49c36412f32e9c3df5ec5ddb03402207"),
        ("drop", "ffd", True, 5, 4, "05fcb594d34e3417a25414dc31ebc5a0685ffc4c0faaac81442d105dece8ddcd"),
    ],
)
def test_builds_are_the_bytes_they_were(tmp_path, overflow, algorithm, drop_untrained, seed, shards, digest):
    out = tmp_path / "out"
    manifest = build(
        golden_corpus(tmp_path / "c.parquet"),
        out,
        max_len=64,
        overflow=overflow,
        algorithm=algorithm,
        drop_untrained=drop_untrained,
        seed=seed,
        shard_size=8192,
    )
    assert len(manifest.shards) == shards
    assert hashlib.sha256(b"".join((out / s.name).read_bytes() for s in manifest.shards)).hexdigest() == digest
