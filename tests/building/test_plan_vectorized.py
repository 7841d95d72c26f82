"""`prepack.building.plan_vectorized` (first-fit-decreasing in numpy, for index builds that load no numba) against
the planner's numba kernels, array for array, and the index build that runs it without numba."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack import build_store
from prepack.building import kernels, plan_vectorized
from prepack.formats.shards import read_manifest
from prepack.building.plan import pack_count, plan_packs, segment_histogram, untrained_documents
from tests.building.test_plan_compact import plans
from tests.corpus import corpus_table, write_corpus

PLAN_ARRAYS = ("shuffle", "slot_offsets", "tokens_per_pack", "order")
DOCUMENT_ARRAYS = ("lengths", "left_out", "bookmarks")
LAYOUT_ARRAYS = ("pack_offsets", "starts", "lengths", "rows", "pieces")


def _same_arrays(got, want, names):
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), name


@settings(max_examples=250, deadline=None)
@given(plans(), st.data())
def test_the_numpy_plan_is_the_kernels_plan(case, data):
    lengths, max_len, options = case
    options = {**options, "algorithm": "ffd"}
    want = plan_packs(lengths, max_len, **options)
    got = plan_packs(lengths, max_len, **options, without_numba=True)
    assert got.documents.vectorized and not want.documents.vectorized
    _same_arrays(got, want, PLAN_ARRAYS)
    _same_arrays(got.documents, want.documents, DOCUMENT_ARRAYS)
    assert got.documents.overflow == want.documents.overflow and got.counts == want.counts
    first = data.draw(st.integers(0, want.packs))
    end = data.draw(st.integers(first, want.packs))
    _same_arrays(got.slice(first, end), want.slice(first, end), LAYOUT_ARRAYS)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.data())
def test_runs_of_many_lengths_fill_many_open_packs_as_the_kernel_does(max_len, data):
    # Thousands of documents over many distinct lengths: each run meets packs opened by the runs before it.
    lengths = np.array(data.draw(st.lists(st.integers(1, max_len), min_size=1, max_size=3000)))
    want, got = plan_packs(lengths, max_len), plan_packs(lengths, max_len, without_numba=True)
    assert got.documents.vectorized
    _same_arrays(got, want, PLAN_ARRAYS)
    _same_arrays(got.slice(0, got.packs), want.slice(0, want.packs), LAYOUT_ARRAYS)


def _histogram(parts, max_len, options):
    """The sum of the parts' `segment_histogram`s, as an append adds up a rebuild's."""
    histogram = np.zeros(max_len + 1, np.int64)
    for lengths, untrained in parts:
        part = segment_histogram(lengths, max_len, overflow=options["overflow"], untrained=untrained,
                                 drop_untrained=options["drop_untrained"])
        histogram[: len(part)] += part
    return histogram


def _assert_counted(histogram, max_len, options, packs):
    """`pack_count` (kernel or numpy, as it chooses; and as it counts before numba has started) and, for
    first-fit, `count_ffd` itself count `packs`."""
    def count():
        return pack_count(histogram, max_len, algorithm=options["algorithm"], max_documents=options["max_documents"])

    assert count() == packs
    with mock.patch.object(kernels, "started", lambda: False):
        assert count() == packs
    if options["algorithm"] == "ffd":
        assert plan_vectorized.count_ffd(histogram, max_len, options["max_documents"]) == packs


@settings(max_examples=100, deadline=None)
@given(plans(), st.data())
@pytest.mark.slow
def test_a_pack_count_from_the_histograms_of_parts_is_the_plans(case, data):
    # Every overflow, untrained flags left out or not, a cap or none, both algorithms; the documents cut anywhere.
    lengths, max_len, options = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lengths)), max_size=3)))
    untrained = options["untrained"]
    parts = [(lengths[a:b], None if untrained is None else untrained[a:b]) for a, b in zip([0, *cuts], [*cuts, len(lengths)])]
    options = {name: options[name] for name in ("algorithm", "overflow", "drop_untrained", "max_documents")}
    packs = plan_packs(lengths, max_len, untrained=untrained, **options).packs
    _assert_counted(_histogram(parts, max_len, options), max_len, options, packs)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 600), st.none() | st.integers(1, 12), st.data())
def test_first_fit_counted_by_runs_of_equal_packs_is_the_kernels(max_len, cap, data):
    # Thousands of documents over many distinct lengths: runs split groups of equal packs and fill many of them.
    lengths = np.array(data.draw(st.lists(st.integers(1, max_len), min_size=1, max_size=3000)))
    options = {"algorithm": "ffd", "overflow": "split", "drop_untrained": False, "max_documents": cap}
    packs = plan_packs(lengths, max_len, max_documents=cap).packs
    _assert_counted(_histogram([(lengths, None)], max_len, options), max_len, options, packs)


def test_a_pack_count_runs_no_kernel_before_numba_started_and_the_kernel_where_it_is_faster(monkeypatch):
    lengths = np.repeat([3, 40], [1000, 500])  # 1,500 segments of 2 lengths: fewer than the kernel places faster
    histogram = segment_histogram(lengths, 64)
    assert 1500 <= 2 * plan_vectorized._KERNEL_SEGMENTS
    packs = plan_packs(lengths, 64).packs
    monkeypatch.setattr(plan_vectorized, "count_ffd", lambda *args: -1)
    for started, counted in ((True, packs), (False, -1)):
        monkeypatch.setattr(kernels, "started", lambda: started)
        assert plan_vectorized.counts_in_numpy(histogram, 1500) == (not started)
        assert pack_count(histogram, 64) == counted and pack_count(histogram, 64, algorithm="bfd") > 0


def test_a_pack_count_of_many_distinct_lengths_runs_the_kernel_even_before_numba_started(monkeypatch):
    # count_ffd's cost follows the distinct lengths (and the groups of packs they leave): past
    # _COUNT_LENGTHS of them, numba's start-up costs less.
    bound = plan_vectorized._COUNT_LENGTHS
    lengths = np.arange(1, bound + 2)
    histogram = segment_histogram(lengths, bound + 1)
    monkeypatch.setattr(kernels, "started", lambda: False)
    assert plan_vectorized.counts_in_numpy(histogram[:-1], bound) and not plan_vectorized.counts_in_numpy(histogram, bound + 1)
    monkeypatch.setattr(plan_vectorized, "count_ffd", lambda *args: -1)
    assert pack_count(histogram, bound + 1) == plan_packs(lengths, bound + 1).packs


def test_packs_past_65536_sort_by_every_digit():
    # 70,000 documents of max_len // 2 + 1 open a pack each: pack numbers take two 16-bit digits.
    lengths = np.array([51] * 70_000 + [1] * 5_000, dtype=np.uint16)
    want, got = plan_packs(lengths, 100, seed=5), plan_packs(lengths, 100, seed=5, without_numba=True)
    assert got.packs == 70_000 and got.documents.vectorized
    _same_arrays(got, want, PLAN_ARRAYS)
    _same_arrays(got.documents, want.documents, DOCUMENT_ARRAYS)


def test_numba_plans_what_is_not_small_or_not_ffd():
    lengths = np.arange(1, 101)
    assert not plan_packs(lengths, 64, algorithm="bfd", without_numba=True).documents.vectorized
    assert not plan_packs(lengths, 64).documents.vectorized  # a caller that runs kernels anyway
    assert not plan_vectorized.suits(plan_vectorized._DOCUMENTS + 1, "ffd")
    histogram = np.zeros(4097, np.int64)
    histogram[1:] = 200  # 4,096 distinct lengths in about 400,000 packs
    assert not plan_vectorized.assign_suits(histogram, 4096)


@pytest.mark.parametrize("labelled", [False, True])
def test_builds_of_a_small_store_load_only_what_they_run(tmp_path, labelled):
    rng = np.random.default_rng(3)
    documents = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(0, 90, 300)]
    labels = [[-100 if rng.random() < 0.8 else t for t in doc] for doc in documents] if labelled else None
    build_store(write_corpus(tmp_path / "c.parquet", corpus_table(documents, labels)), tmp_path / "store")
    code = f"""
import sys
import prepack
loaded = lambda: [name in sys.modules for name in ("numba", "rich", "pyarrow.parquet")]
prepack.build({str(tmp_path / 'store')!r}, {str(tmp_path / 'index')!r}, max_len=64, index_only=True, drop_untrained=True)
print(*loaded())
prepack.build({str(tmp_path / 'store')!r}, {str(tmp_path / 'full')!r}, max_len=64, drop_untrained=True)
print(*loaded())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Only the full build runs kernels (it gathers tokens); neither shows progress bars or reads Parquet.
    assert result.stdout.split() == ["False", "False", "False", "True", "False", "False"]
    index, full = read_manifest(tmp_path / "index"), read_manifest(tmp_path / "full")
    assert index.totals == full.totals and (index.totals.untrained > 0) == labelled


@pytest.mark.slow  # a process of its own
def test_an_index_build_in_a_process_that_ran_a_kernel_plans_with_the_kernels(tmp_path, monkeypatch):
    """numba's start-up is what numpy saves; once a kernel has run here, the kernels are the faster."""
    from prepack import build

    rng = np.random.default_rng(4)
    documents = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(1, 90, 200)]
    labels = [[-100, *doc[1:]] for doc in documents]
    build_store(write_corpus(tmp_path / "c.parquet", corpus_table(documents, labels)), tmp_path / "store")
    plan_packs(np.array([3, 5]), 8)  # a kernel runs: numba started

    def numpy_step(*args, **kwargs):
        raise AssertionError("planned in numpy with numba started")

    for name in ("assign_ffd", "untrained", "tally"):
        monkeypatch.setattr(plan_vectorized, name, numpy_step)
    index = build(tmp_path / "store", tmp_path / "index", max_len=64, index_only=True, drop_untrained=True)
    monkeypatch.undo()
    # The same build in a process of its own plans in numpy (numba never loaded) and writes the same bytes. That
    # numpy and the kernels plan alike in general rests on the plan-level hypothesis tests (test_the_numpy_plan_is_the_kernels_plan, test_untrained_documents_in_numpy_are_the_kernels)
    # and the subprocess tests above; a second build here would plan with the kernels again.
    code = f"""
import sys
import prepack
prepack.build({str(tmp_path / 'store')!r}, {str(tmp_path / 'numpy')!r}, max_len=64, index_only=True, drop_untrained=True)
print("numba" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]
    assert [(tmp_path / "index" / s.name).read_bytes() for s in index.shards] == [
        (tmp_path / "numpy" / s.name).read_bytes() for s in read_manifest(tmp_path / "numpy").shards
    ]


def test_the_numpy_steps_read_the_planners_codes():
    from prepack.building import plan

    assert (plan_vectorized._TRUNCATE, plan_vectorized._DROP) == (plan._OVERFLOWS["truncate"], plan._OVERFLOWS["drop"])
    assert plan_vectorized._BLOCK == plan._BLOCK


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=60), st.data())
def test_untrained_documents_in_numpy_are_the_kernels(lengths, data):
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    labels = np.array(data.draw(st.lists(st.sampled_from([-100, -100, 0, 7]), min_size=int(offsets[-1]), max_size=int(offsets[-1]))), np.int32)
    want = untrained_documents(offsets, labels)
    assert untrained_documents(offsets, labels, without_numba=True).tolist() == want.tolist()


def test_untrained_documents_are_found_across_windows(monkeypatch):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 2000)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    labels = np.where(rng.random(int(offsets[-1])) < 0.97, -100, 1).astype(np.int32)
    want = untrained_documents(offsets, labels)
    assert 0 < want.sum() < len(want)
    monkeypatch.setattr(plan_vectorized, "_WINDOW", 64)  # documents longer than a window, and many windows
    assert plan_vectorized.untrained(offsets, labels).tolist() == want.tolist()
