"""Growing a corpus by 10 %: an append (`prepack tokenize NEW --out STORE --append`, then `prepack build
STORE --out DIR --append`) against building the grown store again, in time and in pack efficiency.

    python benchmarks/bench_append.py                       # 100,000 + 10,000 documents, about a minute
    python benchmarks/bench_append.py --docs 1000000 --added 0.1

The corpus is synthetic token ids with labels (lognormal lengths, median ~350, at most 8192; 20 % of
labels -100; seed 0) in two Parquet files: the first --docs documents and --added times as many more.
Untimed: the store of the first file, and a full and an index build of it at max-len 4096. Timed, in
one process, each the median of --repeat runs on copies: the store append of the second file and, for
the full and the index build, the build append and a build of the grown store from nothing (the
"rebuild"). A small corpus is tokenized and built once first, untimed, so that no step pays for
loading numba's compiled kernels or a reader's first call. Checked: each append's old shards keep their bytes and its packs hold every
document piece once (`verify_build`). Prints a markdown table: seconds, the append's share of the
rebuild's time (goal <= 15 %), and the fill of each (tokens / (packs x max-len)) with their gap in
percentage points (goal <= 0.3).

The index build is also timed as `prepack build` runs it, each append and rebuild in a process of its own
("own process": the build call's time after `import prepack`, so numba's start-up counts where a step
loads it, and the interpreter's start does not).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import prepack
from prepack.check.verify import verify_build

MAX_LEN = 4096


def _corpus(path: Path, docs: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(350), 1.0, docs).astype(np.int64), 1, 8192)
    offsets = np.zeros(docs + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(ids)) < 0.2, -100, ids).astype(np.int32)
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
    }), path)


def _median_seconds(repeat: int, prepare, step) -> float:
    """The median wall time of `step()` over `repeat` runs, each after an untimed `prepare()`."""
    times = []
    for _ in range(repeat):
        prepare()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _own_process_seconds(repeat: int, prepare, call: str) -> float:
    """The median wall time of `call` (Python source, `prepack` imported) over `repeat` runs, each in a new
    process after an untimed `prepare()`: what a command pays, numba's start-up included where it runs."""
    code = f"import time\nimport prepack\nstart = time.perf_counter()\n{call}\nprint(time.perf_counter() - start)"
    times = []
    for _ in range(repeat):
        prepare()
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        times.append(float(run.stdout))
    return statistics.median(times)


def _copy(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)


def _shards(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.suffix == ".arrow"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--added", type=float, default=0.1, help="The append's documents, as a share of --docs.")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # numba's kernels and the readers' first-call costs paid, untimed, by every kind of step timed below
        _corpus(root / "warm" / "warm.parquet", 2000, 9)
        _corpus(root / "warm-more" / "warm-more.parquet", 200, 8)
        prepack.build_store(root / "warm", root / "warm-store")
        for index_only in (False, True):
            prepack.build(root / "warm-store", root / f"warm-{index_only}", max_len=MAX_LEN, index_only=index_only)
        prepack.build_store(root / "warm-more", root / "warm-store", append=True)
        for index_only in (False, True):
            prepack.build(root / "warm-store", root / f"warm-{index_only}", max_len=MAX_LEN, index_only=index_only, append=True)
        _corpus(root / "old" / "old.parquet", args.docs, 0)
        _corpus(root / "new" / "new.parquet", int(args.docs * args.added), 1)
        prepack.build_store(root / "old", root / "store-0")
        (root / "all").mkdir()  # the whole corpus, for the store tokenized at once
        for name in ("old", "new"):
            shutil.copyfile(root / name / f"{name}.parquet", root / "all" / f"{name}.parquet")
        rows = []
        seconds = _median_seconds(
            args.repeat, lambda: _copy(root / "store-0", root / "store"),
            lambda: prepack.build_store(root / "new", root / "store", append=True),
        )
        rebuild = _median_seconds(
            args.repeat, lambda: shutil.rmtree(root / "store-whole", ignore_errors=True),
            lambda: prepack.build_store(root / "all", root / "store-whole"),
        )
        old = _shards(root / "store-0")
        assert {name: data for name, data in _shards(root / "store").items() if name in old} == old, "an old store shard changed"
        rows.append(("store", seconds, rebuild, None, None))
        for kind, index_only in (("full build", False), ("index build", True)):
            # Each kind's own copy of the store, grown after its first build (an index build lies beside it).
            store, first, grown_out, rebuilt_out = (root / f"{kind} {name}" for name in ("store", "0", "grown", "rebuilt"))
            _copy(root / "store-0", store)
            prepack.build(store, first, max_len=MAX_LEN, index_only=index_only)
            _copy(root / "store", store)
            seconds = _median_seconds(
                args.repeat, lambda: _copy(first, grown_out),
                lambda: prepack.build(store, grown_out, max_len=MAX_LEN, index_only=index_only, append=True),
            )
            rebuild = _median_seconds(
                args.repeat, lambda: shutil.rmtree(rebuilt_out, ignore_errors=True),
                lambda: prepack.build(store, rebuilt_out, max_len=MAX_LEN, index_only=index_only),
            )
            grown, rebuilt = prepack.read_manifest(grown_out), prepack.read_manifest(rebuilt_out)
            old = _shards(first)
            assert {name: data for name, data in _shards(grown_out).items() if name in old} == old, "an old shard changed"
            assert verify_build(grown_out) == [], "the grown build does not verify"
            assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs
            fill = grown.totals.tokens / (grown.totals.packs * MAX_LEN)
            rebuilt_fill = rebuilt.totals.tokens / (rebuilt.totals.packs * MAX_LEN)
            rows.append((kind, seconds, rebuild, fill, rebuilt_fill))
            if index_only:
                call = f"prepack.build({str(store)!r}, {{!r}}, max_len={MAX_LEN}, index_only=True{{}})"
                seconds = _own_process_seconds(
                    args.repeat, lambda: _copy(first, grown_out), call.format(str(grown_out), ", append=True")
                )
                rebuild = _own_process_seconds(
                    args.repeat, lambda: shutil.rmtree(rebuilt_out, ignore_errors=True), call.format(str(rebuilt_out), "")
                )
                rows.append((f"{kind}, own process", seconds, rebuild, fill, rebuilt_fill))
    added = int(args.docs * args.added)
    print(f"{args.docs:,} documents + {added:,} appended ({args.added:.0%}), max-len {MAX_LEN}; {platform.machine()}, "
          f"median of {args.repeat}\n")
    print("| output | append s | rebuild s | append / rebuild | fill appended | fill rebuilt | gap (points) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, seconds, rebuild, fill, rebuilt_fill in rows:
        fills = ("", "", "") if fill is None else (f"{fill:.3%}", f"{rebuilt_fill:.3%}", f"{100 * (rebuilt_fill - fill):.3f}")
        print(f"| {kind} | {seconds:.2f} | {rebuild:.2f} | {seconds / rebuild:.1%} | {' | '.join(fills)} |")


if __name__ == "__main__":
    main()
