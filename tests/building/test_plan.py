"""prepack.building.plan.assign_packs against a plain-Python FFD/BFD, plus the invariants of any plan."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack.building.plan import assign_packs, document_pieces
from tests.corpus import reference_placement

ALGORITHMS = ["ffd", "bfd"]


@st.composite
def corpora(draw):
    max_len = draw(st.sampled_from([1, 2, 3, 7, 16, 100, 4096]) | st.integers(1, 300))
    # A few distinct values make many ties; max_len itself is always a candidate.
    values = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=6)) + [max_len]
    lengths = draw(st.lists(st.sampled_from(values) | st.integers(1, max_len), max_size=300))
    return np.array(lengths, dtype=np.int64), max_len


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=300, deadline=None)
@given(corpora())
def test_matches_reference(algorithm, corpus):
    lengths, max_len = corpus
    got = assign_packs(lengths, max_len, algorithm)
    assert got.dtype == np.int32 and got.shape == lengths.shape
    assert got.tolist() == reference_placement(lengths.tolist(), max_len, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=300, deadline=None)
@given(corpora(), st.integers(1, 12))
def test_a_cap_on_documents_matches_the_capped_reference(algorithm, corpus, cap):
    lengths, max_len = corpus
    got = assign_packs(lengths, max_len, algorithm, max_documents=cap)
    assert got.tolist() == reference_placement(lengths.tolist(), max_len, algorithm, max_documents=cap)
    if len(lengths):
        assert np.bincount(got).max() <= cap  # every document once (one pack each), no pack over the cap ...
        assert np.bincount(got, weights=lengths).max() <= max_len  # ... or over max_len


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_cap_at_or_above_the_largest_pack_changes_nothing(algorithm):
    lengths = np.random.default_rng(0).integers(1, 40, 2000)
    plain = assign_packs(lengths, 256, algorithm)
    largest = int(np.bincount(plain).max())
    assert np.array_equal(assign_packs(lengths, 256, algorithm, max_documents=largest), plain)
    capped = assign_packs(lengths, 256, algorithm, max_documents=largest - 1)
    assert not np.array_equal(capped, plain) and np.bincount(capped).max() == largest - 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 512).flatmap(lambda m: st.tuples(st.just(m), st.lists(st.integers(1, m), max_size=3000))))
def test_invariants(algorithm, case):
    max_len, values = case
    lengths = np.array(values, dtype=np.int64)
    packs = assign_packs(lengths, max_len, algorithm)
    if len(lengths) == 0:
        assert packs.shape == (0,)
        return
    loads = np.bincount(packs, weights=lengths).astype(np.int64)
    assert loads.max() <= max_len
    assert (loads > 0).all()  # ids are 0..P-1 with no gaps
    # Opening order: along the processing order, each pack id first appears right after the last.
    order = np.argsort(-lengths, kind="stable")
    _, first_seen = np.unique(packs[order], return_index=True)
    assert np.array_equal(np.sort(first_seen), first_seen)
    # Any-fit: no two packs fit together in one, so at most one is at most half full ...
    assert np.count_nonzero(2 * loads <= max_len) <= 1
    # ... which bounds the count from above; the total bounds it from below.
    lower = math.ceil(lengths.sum() / max_len)
    assert lower <= len(loads) <= 2 * lower - 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_matches_reference_on_realistic_lengths(algorithm):
    # Long-tailed lengths with many ties: deeper trees and heaps than hypothesis reaches.
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1.2, 3000).astype(np.int64), 1, 4096)
    assert assign_packs(lengths, 4096, algorithm).tolist() == reference_placement(lengths.tolist(), 4096, algorithm)


def test_where_ffd_and_bfd_differ():
    # Processing order 8, 6, 3, 1 -> packs 0, 1, 1 leave 2 and 1 tokens; the 1 then goes to the
    # first pack with room (FFD: pack 0) or the tightest (BFD: pack 1).
    lengths = np.array([1, 3, 6, 8])
    assert assign_packs(lengths, 10, "ffd").tolist() == [0, 1, 1, 0]
    assert assign_packs(lengths, 10, "bfd").tolist() == [1, 1, 1, 0]


def test_identical_lengths_keep_input_order():
    assert assign_packs(np.full(1000, 2048), 2048, "ffd").tolist() == list(range(1000))
    assert assign_packs(np.full(1000, 1024), 2048, "bfd").tolist() == [i // 2 for i in range(1000)]


def test_empty_and_dtypes():
    assert assign_packs(np.array([], dtype=np.int64), 8).shape == (0,)
    for dtype in (np.int8, np.uint16, np.int32, np.uint64):
        assert assign_packs(np.array([4, 4, 1], dtype=dtype), 8).tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    "lengths, max_len, algorithm",
    [
        (np.array([3, 0, 2]), 8, "ffd"),
        (np.array([3, -1]), 8, "bfd"),
        (np.array([3, 9, 2]), 8, "ffd"),
        (np.array([3, 9, 2]), 8, "bfd"),
        (np.array([[1, 2], [3, 4]]), 8, "ffd"),
        (np.array(3), 8, "ffd"),
        (np.array([1.0, 2.0]), 8, "ffd"),
        (np.array([True, True]), 8, "ffd"),
        (np.array([1]), 0, "ffd"),
        (np.array([1]), -5, "bfd"),
        (np.array([1]), 2**31, "ffd"),
        (np.array([1, 2]), 8, "wfd"),
        (np.array([1, 2]), 8, "FFD"),
    ],
)
def test_bad_input(lengths, max_len, algorithm):
    with pytest.raises(ValueError):
        assign_packs(lengths, max_len, algorithm)


@pytest.mark.parametrize("cap", [0, -1, 2**31, 1.5])
def test_a_cap_below_one_or_past_int32_is_refused(cap):
    with pytest.raises((ValueError, TypeError)):
        assign_packs(np.array([1, 2]), 8, "ffd", max_documents=cap)


# Documents of 0, 3, 10 and 25 tokens with max_len 10: one empty, one short, one exactly max_len, one long.
@pytest.mark.parametrize(
    "overflow, segments, counts",
    [
        (
            "split",
            [(1, 0, 0, 3), (2, 0, 3, 10), (3, 0, 13, 10), (3, 1, 23, 10), (3, 2, 33, 5)],
            {"split": 1, "split_pieces": 3},
        ),
        ("truncate", [(1, 0, 0, 3), (2, 0, 3, 10), (3, 0, 13, 10)], {"truncated": 1, "truncated_tokens": 15}),
        ("drop", [(1, 0, 0, 3), (2, 0, 3, 10)], {"dropped": 1, "dropped_tokens": 25}),
    ],
)
def test_document_pieces_is_the_overflow_policy(overflow, segments, counts):
    got = document_pieces(np.array([0, 3, 10, 25]), 10, overflow)
    assert list(zip(got.rows, got.pieces, got.starts, got.lengths)) == segments
    zero = dict.fromkeys(
        ["split", "split_pieces", "truncated", "truncated_tokens", "dropped", "dropped_tokens", "untrained", "untrained_tokens"],
        0,
    )
    assert got.counts == {"input_tokens": 38, "empty": 1, **zero, **counts}
    with pytest.raises(ValueError, match="overflow"):
        document_pieces(np.array([1]), 10, "wrap")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("max_len", [2**31 - 1, 10**6 + 3])
def test_a_huge_max_len_places_as_the_reference(algorithm, max_len):
    """Capacities far above the documents: bfd's buckets start at max_len - tokens, not at 0."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 400_000, 40)
    assert assign_packs(lengths, max_len, algorithm).tolist() == reference_placement(lengths.tolist(), max_len, algorithm)
    # Several packs, capacities left far above 0 (bfd's buckets then cover all of 0..max_len: keep it small).
    lengths = rng.integers(max_len // 3 + 1, max_len, 12) if max_len < 2**24 else rng.integers(2**20, 2**21, 12)
    assert assign_packs(lengths, max_len, algorithm).tolist() == reference_placement(lengths.tolist(), max_len, algorithm)


_MEMORY_LIMIT = 3 * 2**30  # address space: the interpreter with numba and pyarrow takes about 1.5 GiB


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_memory_follows_the_documents_not_max_len(tmp_path, algorithm):
    """A build of 300 short documents with --max-len 2147483647 in 3 GiB of address space: a histogram
    or a bucket per token of max_len would take 16 GiB (and be killed)."""
    import resource
    import subprocess
    import sys

    from tests.corpus import corpus_table, write_corpus

    rng = np.random.default_rng(3)
    write_corpus(tmp_path / "c.parquet", corpus_table([rng.integers(0, 100, int(n)).tolist() for n in rng.integers(1, 200, 300)]))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_LIMIT, _MEMORY_LIMIT))

    result = subprocess.run(
        [sys.executable, "-c", "from prepack.cli import app; app()", "build", str(tmp_path / "c.parquet"), "--max-len", str(2**31 - 1),
         "--algorithm", algorithm, "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, preexec_fn=limit,
    )
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["totals"]["packs"] == 1 and manifest["totals"]["segments"] == 300
