"""Memory per document of planning and of a whole build, and planning a billion documents.

    python benchmarks/bench_memory.py --docs 2000000 8000000 32000000
    python benchmarks/bench_memory.py --docs --billion 1000000000

`--docs`: for each count, a Parquet corpus of tiny documents (1 to 8 random ids each, 64k-row row
groups; tiny, so that the token volume stays small and what grows is the per-document memory), and
two fresh processes: `plan` (`prepack.building.plan.plan_packs` of the corpus's lengths, held as the build
holds them: `compact_lengths` and one untrained flag a document) and `build`
(`prepack.build(corpus, out, max_len=8192)`). Each reports its peak resident memory (`VmHWM`, which
counts the pages of mapped files it touched too) and its time. The slope between two sizes is the
memory a document costs beyond the fixed working set, once that is whole: a build's shard pass holds
the shards its two writers are writing, and at 2M of these documents the corpus makes fewer than two
full shards. Run against an older prepack (PYTHONPATH pointing at its checkout) the plan child keeps
int64 lengths, as builds then did.

`--billion N`: N lognormal lengths (median ~350, p99 ~4k, truncated to max_len 8192, as
bench_plan.py), written 16M at a time from a seeded generator into a uint16 file (2 bytes a
document), then one process maps that file and plans it with `plan_packs` (FFD, split, seed 0). It
reports the planning time (wall and the process's CPU time, which depends less on what else the
machine runs), its resident memory before planning (the imports and kernels) and the
peak, which counts the mapped input (2 bytes a document) as well as the plan.

Prints markdown, with the load average at the start and end of each part.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MAX_LEN = 8192
CHUNK = 2**24


def status_kib(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def write_tiny_corpus(path: Path, n: int) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=n, dtype=np.int32)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
    pq.write_table(pa.table({"input_ids": column}), path, row_group_size=65_536)
    return lengths


def write_billion(path: Path, n: int) -> None:
    """n lognormal lengths as bench_plan.py draws them, truncated to MAX_LEN, into a uint16 file."""
    sigma = math.log(4000 / 350) / 2.3263
    rng = np.random.default_rng(0)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(n,))
    for start in range(0, n, CHUNK):
        raw = rng.lognormal(math.log(350), sigma, min(CHUNK, n - start))
        out[start : start + len(raw)] = np.minimum(np.clip(raw, 1, 32768), MAX_LEN).astype(np.uint16)
    out.flush()
    del out


def child_plan(lengths_path: str) -> dict:
    from prepack.building import plan

    plan.plan_packs(np.array([3, 5]), MAX_LEN)  # load the kernels from numba's cache
    lengths = np.load(lengths_path)  # uint16
    if hasattr(plan, "compact_lengths"):
        lengths = plan.compact_lengths(lengths)
    else:  # prepack before compact lengths: builds held them as int64
        lengths = lengths.astype(np.int64)
    untrained = np.zeros(len(lengths), dtype=bool)  # builds always pass their untrained flags
    before = status_kib("VmRSS")
    start = time.perf_counter()
    result = plan.plan_packs(lengths, MAX_LEN, untrained=untrained)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "before_kib": before, "peak_kib": status_kib("VmHWM"), "packs": result.packs}


def child_build(corpus: str, out: str) -> dict:
    import prepack

    start = time.perf_counter()
    manifest = prepack.build(corpus, out, max_len=MAX_LEN)
    return {"seconds": time.perf_counter() - start, "peak_kib": status_kib("VmHWM"), "packs": manifest.totals.packs}


def child_billion(lengths_path: str) -> dict:
    from prepack.building.plan import plan_packs

    plan_packs(np.array([3, 5], dtype=np.uint16), MAX_LEN)  # load the kernels from numba's cache
    lengths = np.load(lengths_path, mmap_mode="r")
    before, cpu = status_kib("VmRSS"), os.times()
    start = time.perf_counter()
    plan = plan_packs(lengths, MAX_LEN)
    seconds = time.perf_counter() - start
    cpu_seconds = sum(os.times()[:2]) - sum(cpu[:2])
    totals = plan.totals()
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "before_kib": before,
        "peak_kib": status_kib("VmHWM"),
        "packs": totals["packs"],
        "over_lower_bound": totals["packs"] / totals["lower_bound"] - 1,
    }


CHILDREN = {"plan": child_plan, "build": child_build, "billion": child_billion}


def run_child(*args: str) -> dict:
    command = [sys.executable, __file__, "--child", *args]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def gib(kib: int) -> str:
    return f"{kib / 2**20:.3f}"


def per_document(results: list[tuple[int, dict]]) -> list[str]:
    """Slope of the peak between consecutive sizes, bytes a document."""
    slopes = ["–"]
    for (n0, r0), (n1, r1) in zip(results, results[1:]):
        slopes.append(f"{(r1['peak_kib'] - r0['peak_kib']) * 1024 / (n1 - n0):.1f}")
    return slopes


def docs_table(sizes: list[int], scratch: Path) -> None:
    print(f"Load average (1/5/15 min) at the start: {load()}\n")
    results: dict[str, list[tuple[int, dict]]] = {"plan": [], "build": []}
    for n in sizes:
        corpus, lengths_path = scratch / f"tiny-{n}.parquet", scratch / f"lengths-{n}.npy"
        np.save(lengths_path, write_tiny_corpus(corpus, n).astype(np.uint16))
        results["plan"].append((n, run_child("plan", str(lengths_path))))
        out = scratch / f"out-{n}"
        results["build"].append((n, run_child("build", str(corpus), str(out))))
        subprocess.run(["rm", "-rf", str(out), str(corpus), str(lengths_path)], check=True)
    print("| what | documents | seconds | peak RSS (GiB) | slope from the previous size (bytes/document) |")
    print("|---|---:|---:|---:|---:|")
    for what, rows in results.items():
        for (n, r), slope in zip(rows, per_document(rows)):
            print(f"| {what} | {n:,} | {r['seconds']:.2f} | {gib(r['peak_kib'])} | {slope} |")
    for what, rows in results.items():
        (n0, r0), (n1, r1) = rows[0], rows[-1]
        slope = (r1["peak_kib"] - r0["peak_kib"]) * 1024 / (n1 - n0)
        print(f"\n{what}: {slope:.1f} bytes a document from {n0:,} to {n1:,} documents.", end="")
    print(f"\n\nLoad average at the end: {load()}")


def billion(n: int, scratch: Path) -> None:
    path = scratch / "lengths.npy"
    start = time.perf_counter()
    write_billion(path, n)
    seconds = time.perf_counter() - start
    print(f"{n:,} uint16 lengths written in {seconds:.0f} s. Load average before planning: {load()}\n")
    r = run_child("billion", str(path))
    columns = ["documents", "plan seconds", "CPU seconds", "documents/s", "RSS before (GiB)", "peak RSS (GiB)", "packs"]
    print(f"| {' | '.join(columns)} | over ⌈tokens/max_len⌉ |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {n:,} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {n / r['seconds'] / 1e6:.1f} M | "
        f"{gib(r['before_kib'])} | "
        f"{gib(r['peak_kib'])} | {r['packs']:,} | +{100 * r['over_lower_bound']:.4f} % |"
    )
    print(f"\nLoad average after planning: {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="*", default=[2_000_000, 8_000_000, 32_000_000])
    parser.add_argument("--billion", type=int, default=0, help="plan this many synthetic lengths (0: skip)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](*args.child[1:])))
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        if args.docs:
            docs_table(args.docs, Path(tmp))
        if args.billion:
            billion(args.billion, Path(tmp))


if __name__ == "__main__":
    main()
