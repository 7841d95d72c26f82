"""Tokenize once, index many, against full builds: the time and bytes of one document store and three
index builds (max-len 2048, 4096, 8192) against three full builds of the same corpus.

    python benchmarks/bench_index.py                    # 100,000 documents, about a minute
    python benchmarks/bench_index.py --docs 1000000     # a bigger run
    python benchmarks/bench_index.py --store chitchat-store   # a store of your own: its builds only

The corpus is synthetic token ids with labels (lengths uniform in 1..--longest, 20 % of labels -100,
seed 0) in one Parquet file. Timed, in one process, each step the median of --repeat runs: the store
(`prepack.build_store` of the corpus) and, at each max-len, a full build of the corpus, a full build of
the store and an index build of the store (`prepack.build`, `index_only`). Bytes are those of the
output directory (the store's, or the build's). Untimed checks: the full builds of the corpus and of
the store have the same shards (sha256), and the index build's rows (input_ids, labels, cu_seqlens,
segment_ids, gathered from the store by `PackedDataset`) are the full build's on the first and last
200 packs. A small corpus is built once first, untimed, so that no step pays for loading numba's
compiled kernels. Prints two markdown tables.

With --store (an existing document store, e.g. the README walk-through's `chitchat-store`, the demo's
conversations tokenized) only that store's full and index builds are timed, at each max-len: the
first table alone.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import prepack
from prepack.formats.shards import read_manifest
from prepack.training.dataset import PackedDataset
from prepack.formats.store import read_store_manifest

MAX_LENS = (2048, 4096, 8192)


def _bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def _corpus(path: Path, docs: int, longest: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, longest + 1, docs)
    offsets = np.zeros(docs + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(ids)) < 0.2, -100, ids).astype(np.int32)
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
    })
    pq.write_table(table, path)


def _timed(make: Callable[[Path], object], out: Path, repeat: int) -> tuple[float, int]:
    """Median wall seconds of `make(out)` over `repeat` runs, and the bytes of the output it leaves."""
    seconds = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        make(out)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), _bytes(out)


def _check_rows(full: Path, index: Path) -> None:
    full_rows, index_rows = PackedDataset(full), PackedDataset(index)
    assert len(full_rows) == len(index_rows)
    for i in [*range(min(200, len(full_rows))), *range(max(0, len(full_rows) - 200), len(full_rows))]:
        a, b = full_rows[i], index_rows[i]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), f"pack {i} differs"


def _warm_up(root: Path) -> None:
    _corpus(root / "warm.parquet", 1000, 100)
    prepack.build_store(root / "warm.parquet", root / "warm-store")
    for index_only in (False, True):
        prepack.build(root / "warm-store", root / f"warm-{index_only}", max_len=512, index_only=index_only)
    prepack.build(root / "warm.parquet", root / "warm-corpus", max_len=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--longest", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each step; its median is reported")
    parser.add_argument("--store", type=Path, help="time the builds of this document store instead (first table only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _warm_up(root)
        if args.store is None:
            corpus = root / "corpus.parquet"
            _corpus(corpus, args.docs, args.longest)
            store = root / "store"
            store_step = _timed(lambda out: prepack.build_store(corpus, out), store, args.repeat)
        else:
            corpus, store = None, args.store
        steps = {}  # (max_len, kind) -> (seconds, bytes)
        for max_len in MAX_LENS:
            runs = {
                "full, corpus": lambda out: prepack.build(corpus, out, max_len=max_len),
                "full, store": lambda out: prepack.build(store, out, max_len=max_len),
                "index, store": lambda out: prepack.build(store, out, max_len=max_len, index_only=True),
            }
            if corpus is None:
                del runs["full, corpus"]
            outs = {kind: root / f"{kind.replace(', ', '-')}-{max_len}" for kind in runs}
            for kind, make in runs.items():
                steps[max_len, kind] = _timed(make, outs[kind], args.repeat)
            if corpus is not None:
                from_corpus, from_store = (read_manifest(outs[k]) for k in ("full, corpus", "full, store"))
                assert [s.sha256 for s in from_corpus.shards] == [s.sha256 for s in from_store.shards]
            _check_rows(outs["full, store"], outs["index, store"])
            for kind in ("full, corpus", "full, store"):  # 3 GB of shards at 1M documents: keep the disk free
                if kind in outs:
                    shutil.rmtree(outs[kind])
        described = read_store_manifest(store)
    print(f"{described.documents:,} documents, {described.tokens:,} tokens, "
          f"{'with' if described.has_labels else 'without'} labels"
          f"{f' (the store {args.store})' if args.store else ''}; median of {args.repeat} runs; "
          f"{platform.machine()}, Python {sys.version.split()[0]}\n")
    print("| max-len | build | wall s | bytes | bytes/doc | time / full build of the store |")
    print("|---:|---|---:|---:|---:|---:|")
    for (max_len, kind), (seconds, size) in steps.items():
        ratio = seconds / steps[max_len, "full, store"][0]
        print(f"| {max_len} | {kind} | {seconds:.3f} | {size:,} | {size / described.documents:.1f} | {ratio:.1%} |")
    if args.store is not None:
        return
    index_total = store_step[0] + sum(steps[m, "index, store"][0] for m in MAX_LENS)
    index_bytes = store_step[1] + sum(steps[m, "index, store"][1] for m in MAX_LENS)
    full_total = sum(steps[m, "full, corpus"][0] for m in MAX_LENS)
    full_bytes = sum(steps[m, "full, corpus"][1] for m in MAX_LENS)
    print("\n| path | wall s | bytes | vs three full builds |\n|---|---:|---:|---:|")
    print(f"| store ({store_step[0]:.3f} s, {store_step[1]:,} bytes) + 3 index builds | {index_total:.3f} | "
          f"{index_bytes:,} | {index_total / full_total:.1%} time, {index_bytes / full_bytes:.1%} bytes |")
    print(f"| 3 full builds of the corpus | {full_total:.3f} | {full_bytes:,} | 100 % |")


if __name__ == "__main__":
    main()
