"""Index-only builds against full builds of one document store: bytes per document, build time, and
loader throughput.

    python benchmarks/bench_index.py --docs 200000

The corpus is synthetic token ids with labels (lengths uniform in 1..--longest, seed 0), written as
Parquet and made a store once (`prepack.build_store`, not timed). Then, for each max-len (2048, 4096,
8192), in one process: a full build and an index build of the store (`prepack.build`, `index_only`),
their rows checked identical on the first and last 200 packs, and every pack of each read once through
`PackedDataset` (full rows are views, index rows are gathered from the store). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import prepack
from prepack.load import PackedDataset

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


def _read_all(path: Path) -> float:
    dataset = PackedDataset(path)
    start = time.perf_counter()
    for index in range(len(dataset)):
        dataset[index]
    return (time.perf_counter() - start) / len(dataset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=200_000)
    parser.add_argument("--longest", type=int, default=600)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _corpus(root / "corpus.parquet", args.docs, args.longest)
        store = prepack.build_store(root / "corpus.parquet", root / "store")
        for max_len in MAX_LENS:
            timings = {}
            for kind, index_only in (("full", False), ("index", True)):
                out = root / f"{kind}-{max_len}"
                start = time.perf_counter()
                prepack.build(root / "store", out, max_len=max_len, index_only=index_only)
                timings[kind] = (time.perf_counter() - start, _bytes(out), _read_all(out))
            full, index = PackedDataset(root / f"full-{max_len}"), PackedDataset(root / f"index-{max_len}")
            for i in [*range(200), *range(len(full) - 200, len(full))]:
                assert all(np.array_equal(full[i][k], index[i][k]) for k in full[i]), f"pack {i} differs"
            rows.append((max_len, timings))
    print(f"{args.docs:,} documents, {store.tokens:,} tokens, with labels; {platform.machine()}, "
          f"Python {sys.version.split()[0]}\n")
    print("| max-len | build | wall s | bytes | bytes/doc | µs/pack read |\n|---:|---|---:|---:|---:|---:|")
    for max_len, timings in rows:
        for kind, (seconds, size, per_pack) in timings.items():
            print(f"| {max_len} | {kind} | {seconds:.2f} | {size:,} | {size / args.docs:.1f} | {per_pack * 1e6:.1f} |")
        ratio = timings["index"][0] / timings["full"][0]
        print(f"| {max_len} | index / full | {ratio:.0%} | | | {timings['index'][2] / timings['full'][2]:.1f}x |")


if __name__ == "__main__":
    main()
