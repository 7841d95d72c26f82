"""Growing a corpus by 10 %: an append (`prepack tokenize NEW --out STORE --append`, then `prepack build
STORE --out DIR --append`) against building the grown store again, in time and in pack efficiency.

    python benchmarks/bench_append.py                       # 100,000 + 10,000 documents, about a minute
    python benchmarks/bench_append.py --docs 100000 1000000 --kinds index   # the index build at two sizes
    python benchmarks/bench_append.py --docs 1000000 10000000 --kinds index --median-tokens 30 --repeat 3

The corpus is synthetic token ids with labels (lognormal lengths, median ~350 or --median-tokens, at most
8192; 20 % of labels -100; seed 0) in two Parquet files: the first --docs documents and --added times as many more.
Untimed: the store of the first file, and a full and an index build of it at max-len 4096. Timed, in
one process, each the median of --repeat runs on copies: the store append of the second file and, for
the full and the index build, the build append and a build of the grown store from nothing (the
"rebuild"). A small corpus is tokenized and built once first, untimed, so that no step pays for
loading numba's compiled kernels or a reader's first call. Checked: each append's old shards keep their bytes and its packs hold every
document piece once (`verify_build`), the own-process rows' outputs too. Prints a markdown table: seconds, the append's share of the
rebuild's time (goal <= 15 %), and the fill of each (tokens / (packs x max-len)) with their gap in
percentage points (goal <= 0.3).

The index build is also timed as `prepack build` runs it, each append and rebuild in a process of its own
("own process": the build call's time after `import prepack`, so numba's start-up counts where a step
loads it, and the interpreter's start does not).

Each step's CPU seconds (all its threads', `time.process_time`) are printed beside its wall seconds: on a
machine shared with other work the wall time moves with the load, the CPU time much less. Several --docs
make one table each, in one run; --kinds picks the outputs (the store is grown for the builds either way,
untimed when "store" is not picked), as a store of 1,000,000 documents and its full builds take minutes
and gigabytes (the script prints a store copy's size: about 8 bytes a token).
"""

from __future__ import annotations

import argparse
import os
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
from prepack.building import plan, plan_vectorized
from prepack.check.verify import verify_build
from prepack.sources.store import open_store

MAX_LEN = 4096


_CHUNK_TOKENS = 1 << 24  # the corpus is drawn and written this many tokens at a time (a row group each), at most


def _corpus(path: Path, docs: int, seed: int, median: int) -> int:
    """Write the corpus (lengths lognormal around `median`); return its tokens. The lengths are drawn first, all
    at once, then the tokens and labels of a chunk of documents at a time: memory follows the chunk, not the
    corpus (10,000,000 documents of median 30 are about 500,000,000 tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, docs).astype(np.int64), 1, 8192)
    ends = np.cumsum(lengths)
    path.parent.mkdir(parents=True)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    with pq.ParquetWriter(path, schema) as writer:
        first = 0
        while first < docs:
            end = max(first + 1, int(np.searchsorted(ends, (ends[first - 1] if first else 0) + _CHUNK_TOKENS, "right")))
            offsets = np.zeros(end - first + 1, np.int32)
            np.cumsum(lengths[first:end], out=offsets[1:])
            ids = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
            labels = np.where(rng.random(len(ids)) < 0.2, np.int32(-100), ids)
            writer.write_table(pa.table({
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
            }, schema=schema))
            first = end
    return int(ends[-1])


def _median_seconds(repeat: int, prepare, step) -> tuple[float, float]:
    """The median wall and CPU time of `step()` over `repeat` runs, each after an untimed `prepare()`."""
    times = []
    for _ in range(repeat):
        prepare()
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _own_process_seconds(repeat: int, prepare, call: str) -> tuple[float, float]:
    """The median wall and CPU time of `call` (Python source, `prepack` imported) over `repeat` runs, each in a
    new process after an untimed `prepare()`: what a command pays, numba's start-up included where it runs."""
    code = (f"import time\nimport prepack\nstart, cpu = time.perf_counter(), time.process_time()\n{call}\n"
            "print(time.perf_counter() - start, time.process_time() - cpu)")
    times = []
    for _ in range(repeat):
        prepare()
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        times.append(tuple(map(float, run.stdout.split())))
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _copy(source: Path, target: Path, link: bool = False) -> None:
    """A copy of the directory `source` at `target`; with `link`, of hard links to its files (for a store that only
    appends grow: they write new files and rename store.json over its link, never into an old file)."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, copy_function=os.link if link else shutil.copy2)


def _shards(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.suffix == ".arrow"}


def _checked_fills(first: Path, grown_out: Path, rebuilt_out: Path) -> tuple[float, float]:
    """The fill of the grown build and of the rebuild, after checking that the grown one kept the first
    build's shards byte for byte, verifies, and recorded the rebuild's pack count."""
    grown, rebuilt = prepack.read_manifest(grown_out), prepack.read_manifest(rebuilt_out)
    old = _shards(first)
    assert {name: data for name, data in _shards(grown_out).items() if name in old} == old, "an old shard changed"
    assert verify_build(grown_out) == [], "the grown build does not verify"
    assert grown.generations[-1].rebuild_packs == rebuilt.totals.packs
    return grown.totals.tokens / (grown.totals.packs * MAX_LEN), rebuilt.totals.tokens / (rebuilt.totals.packs * MAX_LEN)


def _count_costs(store: Path) -> list[str]:
    """What counting a rebuild's packs costs each way (`prepack.building.plan.pack_count` chooses by these): the
    kernel's first-fit per segment, and `count_ffd`'s per distinct length and in all (CPU, best of 5), on the grown
    store's segments at max-len 4096, and at max-len 32768 on its documents whole with one more segment of every
    length 1..32768 (every length present: `count_ffd`'s cost grows with the distinct lengths)."""
    opened = open_store(store)
    lengths = [opened.shard_document_lengths(shard) for shard in opened.manifest.shards]
    every_length = np.zeros(32768 + 1, np.int64)
    every_length[1:] = 1
    lines = []
    for max_len, extra in ((MAX_LEN, None), (32768, every_length)):
        histogram = np.zeros(max_len + 1, np.int64)
        for part in lengths:
            part = plan.segment_histogram(part, max_len)
            histogram[: len(part)] += part
        if extra is not None:
            histogram += extra
        segments, distinct = int(histogram.sum()), int(np.count_nonzero(histogram))

        def best(step) -> float:
            times = []
            for _ in range(5):
                start = time.process_time()
                step()
                times.append(time.process_time() - start)
            return min(times)

        kernel = best(lambda: plan._assign_sorted(histogram, max_len, "ffd"))  # the kernel's placement (warm)
        runs = best(lambda: plan_vectorized.count_ffd(histogram, max_len))
        lines.append(f"rebuild pack count, max-len {max_len}: the kernel {kernel / segments * 1e9:.0f} ns a segment "
                     f"({segments:,}), runs of equal packs in numpy {runs / distinct * 1e6:.1f} us a distinct length "
                     f"({distinct:,}), {runs:.3f} s in all")
    return lines


def _measure(root: Path, docs: int, added: float, repeat: int, kinds: set[str], median: int) -> tuple[list[tuple], list[str]]:
    """The table's rows for a corpus of `docs` documents of median length `median` grown by `added` of them,
    written under `root`, and notes."""
    _corpus(root / "old" / "old.parquet", docs, 0, median)
    added_tokens = _corpus(root / "new" / "new.parquet", int(docs * added), 1, median)
    prepack.build_store(root / "old", root / "store-0")
    if "store" not in kinds:  # only the store's rebuild reads the first file again
        (root / "old" / "old.parquet").unlink()
    tokens = open_store(root / "store-0").manifest.tokens
    size = sum(p.stat().st_size for p in (root / "store-0").rglob("*") if p.is_file())
    rows, notes = [], [f"the store copy: {tokens:,} tokens, {size / 1e9:.2f} GB ({size / tokens:.2f} bytes a token); "
                       f"the appended documents: {added_tokens:,} tokens"]
    if "store" in kinds:
        (root / "all").mkdir()  # the whole corpus, for the store tokenized at once (links: the same files)
        for name in ("old", "new"):
            os.link(root / name / f"{name}.parquet", root / "all" / f"{name}.parquet")
        seconds = _median_seconds(
            repeat, lambda: _copy(root / "store-0", root / "store"),
            lambda: prepack.build_store(root / "new", root / "store", append=True),
        )
        rebuild = _median_seconds(
            repeat, lambda: shutil.rmtree(root / "store-whole", ignore_errors=True),
            lambda: prepack.build_store(root / "all", root / "store-whole"),
        )
        old = _shards(root / "store-0")
        assert {name: data for name, data in _shards(root / "store").items() if name in old} == old, "an old store shard changed"
        rows.append(("store", *seconds, *rebuild, None, None))
        shutil.rmtree(root / "store-whole")
        shutil.rmtree(root / "store")
    for kind, index_only in (("full build", False), ("index build", True)):
        if kind.split()[0] not in kinds:
            continue
        # Each kind's own copy of the store, grown (untimed) after its first build (an index build lies beside it).
        store, first, grown_out, rebuilt_out = (root / f"{kind} {name}" for name in ("store", "0", "grown", "rebuilt"))
        _copy(root / "store-0", store, link=True)
        prepack.build(store, first, max_len=MAX_LEN, index_only=index_only)
        prepack.build_store(root / "new", store, append=True)
        seconds = _median_seconds(
            repeat, lambda: _copy(first, grown_out),
            lambda: prepack.build(store, grown_out, max_len=MAX_LEN, index_only=index_only, append=True),
        )
        rebuild = _median_seconds(
            repeat, lambda: shutil.rmtree(rebuilt_out, ignore_errors=True),
            lambda: prepack.build(store, rebuilt_out, max_len=MAX_LEN, index_only=index_only),
        )
        rows.append((kind, *seconds, *rebuild, *_checked_fills(first, grown_out, rebuilt_out)))
        if index_only:
            notes.extend(_count_costs(store))
            call = f"prepack.build({str(store)!r}, {{!r}}, max_len={MAX_LEN}, index_only=True{{}})"
            seconds = _own_process_seconds(repeat, lambda: _copy(first, grown_out), call.format(str(grown_out), ", append=True"))
            rebuild = _own_process_seconds(
                repeat, lambda: shutil.rmtree(rebuilt_out, ignore_errors=True), call.format(str(rebuilt_out), "")
            )
            # The outputs of the last own-process runs, checked as the in-process ones are.
            rows.append((f"{kind}, own process", *seconds, *rebuild, *_checked_fills(first, grown_out, rebuilt_out)))
        for path in (store, first, grown_out, rebuilt_out):
            shutil.rmtree(path)
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[100_000], help="The corpus's documents: one table for each.")
    parser.add_argument("--added", type=float, default=0.1, help="The append's documents, as a share of --docs.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kinds", default="store,full,index", help="What is grown and timed: of store, full, index.")
    parser.add_argument("--median-tokens", type=int, default=350,
                        help="The documents' median length (lognormal, sigma 1, 1..8192 tokens): 30 fits 10,000,000 documents "
                        "in about 4 GB of store.")
    args = parser.parse_args()
    if not 1 <= args.median_tokens <= 8192:
        parser.error(f"--median-tokens {args.median_tokens}: give a length in 1..8192")
    kinds = set(args.kinds.split(","))
    if not kinds or kinds - {"store", "full", "index"}:
        parser.error(f"--kinds {args.kinds!r}: give some of store, full, index, separated by commas")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # numba's kernels and the readers' first-call costs paid, untimed, by every kind of step timed below
        _corpus(root / "warm" / "warm.parquet", 2000, 9, args.median_tokens)
        _corpus(root / "warm-more" / "warm-more.parquet", 200, 8, args.median_tokens)
        prepack.build_store(root / "warm", root / "warm-store")
        for index_only in (False, True):
            prepack.build(root / "warm-store", root / f"warm-{index_only}", max_len=MAX_LEN, index_only=index_only)
        prepack.build_store(root / "warm-more", root / "warm-store", append=True)
        for index_only in (False, True):
            prepack.build(root / "warm-store", root / f"warm-{index_only}", max_len=MAX_LEN, index_only=index_only, append=True)
        for docs in args.docs:
            rows, notes = _measure(root / f"docs-{docs}", docs, args.added, args.repeat, kinds, args.median_tokens)
            shutil.rmtree(root / f"docs-{docs}")
            added = int(docs * args.added)
            print(f"{docs:,} documents + {added:,} appended ({args.added:.0%}), median length {args.median_tokens}, "
                  f"max-len {MAX_LEN}; {platform.machine()}, "
                  f"median of {args.repeat}, load {os.getloadavg()[0]:.1f}\n")
            print("| output | append s | rebuild s | append / rebuild | append CPU s | rebuild CPU s | CPU append / rebuild "
                  "| fill appended | fill rebuilt | gap (points) |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for kind, seconds, cpu, rebuild, rebuild_cpu, fill, rebuilt_fill in rows:
                fills = ("", "", "") if fill is None else (f"{fill:.3%}", f"{rebuilt_fill:.3%}", f"{100 * (rebuilt_fill - fill):.3f}")
                print(f"| {kind} | {seconds:.2f} | {rebuild:.2f} | {seconds / rebuild:.1%} | {cpu:.2f} | {rebuild_cpu:.2f} "
                      f"| {cpu / rebuild_cpu:.1%} | {' | '.join(fills)} |")
            print("", *notes, sep="\n", end="\n\n", flush=True)


if __name__ == "__main__":
    main()
