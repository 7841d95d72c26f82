"""Speed and pack count of prepack's planner against TRL's `pack_dataset`.

    python benchmarks/bench_plan.py --docs 1000000 10000000

Lengths are lognormal like an SFT corpus (median ~350 tokens, p99 ~4k, clipped at 32k) from a
fixed seed, then truncated to --max-len so that every method packs exactly the same lengths.
`prepack ffd`/`bfd` time `assign_packs` (a pack number per document); `plan_packs` times the whole
plan of a build (overflow, FFD, shuffle, the compact pack slots) on lengths held as a build holds
them (`compact_lengths`). Each method runs in its own subprocess; "RSS before → peak" is the process's resident memory when
its timed calls start (inputs loaded, code compiled) and the peak during them. Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

import numpy as np

MEDIAN, P99, CLIP = 350, 4000, 32768
Z99 = 2.3263  # standard normal 99th percentile


def make_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    sigma = math.log(P99 / MEDIAN) / Z99
    raw = np.random.default_rng(seed).lognormal(math.log(MEDIAN), sigma, n)
    return np.minimum(np.clip(raw, 1, CLIP).astype(np.int64), max_len)


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def start_rss_window() -> float:
    """Reset the peak RSS so it covers only what follows, and return the current RSS.

    Building the TRL dataset peaks far higher than packing it (datasets touches every token
    once), so the lifetime peak that getrusage reports would say nothing about the method.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
    return rss_mib()[0]


def run_prepack(lengths: np.ndarray, max_len: int, algorithm: str, repeats: int) -> dict:
    from prepack.building.plan import assign_packs, compact_lengths, plan_packs

    whole = algorithm == "plan"  # the whole plan of a build: segments, FFD, shuffle, pack slots
    if whole:
        lengths = compact_lengths(lengths)  # as a build holds them

    def run(lengths: np.ndarray) -> int:
        if whole:
            return plan_packs(lengths, max_len).packs
        return int(assign_packs(lengths, max_len, algorithm).max()) + 1

    start = time.perf_counter()
    run(lengths[:100])  # JIT compile, or load from numba's cache
    warmup = time.perf_counter() - start
    baseline = start_rss_window()
    times, packs = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        packs = run(lengths)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "packs": packs, "warmup": warmup, "baseline": baseline}


def run_trl(lengths: np.ndarray, max_len: int, batch_size: int | None, repeats: int) -> dict:
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    # input_ids as one list<int32> column built straight from offsets, no Python lists; token
    # values do not matter to packing, so they are zeros.
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    list_array = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    column = list_array.from_arrays(offsets.astype(np.int32 if list_array is pa.ListArray else np.int64),
                                    np.zeros(int(offsets[-1]), np.int32))
    dataset = datasets.Dataset(pa.table({"input_ids": column}))
    baseline = start_rss_window()
    times, packs = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        packed = pack_dataset(dataset, seq_length=max_len, strategy="bfd", map_kwargs={"batch_size": batch_size})
        times.append(time.perf_counter() - start)
        packs = len(packed)  # one row per pack
        del packed
    return {"seconds": statistics.median(times), "packs": packs, "warmup": 0.0, "baseline": baseline}


def worker(args: argparse.Namespace) -> None:
    lengths = np.load(args.lengths)
    if args.worker == "trl":
        result = run_trl(lengths, args.max_len, args.trl_batch_size, args.trl_repeats)
    else:
        result = run_prepack(lengths, args.max_len, args.worker, args.repeats)
    result["peak_rss"] = rss_mib()[1]
    print(json.dumps(result))


def measure(method: str, path: str, args: argparse.Namespace, trl_batch_size: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--lengths", path, "--max-len", str(args.max_len)]
    cmd += ["--repeats", str(args.repeats), "--trl-repeats", str(args.trl_repeats)]
    if trl_batch_size is not None:
        cmd += ["--trl-batch-size", str(trl_batch_size)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0))
    versions = ", ".join(f"{p} {version(p)}" for p in ("numpy", "numba", "trl", "datasets", "pyarrow"))
    return f"{model}, {cores} cores; {platform.system()} {platform.machine()}; Python {platform.python_version()}, {versions}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="prepack calls per method (median reported)")
    parser.add_argument("--trl-docs", type=int, default=1_000_000, help="run TRL only up to this many documents")
    parser.add_argument("--trl-repeats", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", help=argparse.SUPPRESS)
    parser.add_argument("--trl-batch-size", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    print(f"Machine: {machine()}\n")
    print(f"Lengths: lognormal, median {MEDIAN}, p99 ~{P99}, clipped at {CLIP}, truncated to max_len {args.max_len}, seed {args.seed}.\n")
    print("| docs | method | tokens | time (s) | docs/s | packs | packs vs ⌈tokens/max_len⌉ | RSS before → peak (MiB) | docs/s vs TRL (default) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.docs:
            lengths = make_lengths(n, args.max_len, args.seed)
            path = os.path.join(tmp, f"lengths-{n}.npy")
            np.save(path, lengths)
            tokens = int(lengths.sum())
            lower = -(-tokens // args.max_len)
            runs = {
                "prepack ffd": measure("ffd", path, args),
                "prepack bfd": measure("bfd", path, args),
                "prepack plan_packs (ffd, whole plan)": measure("plan", path, args),
            }
            if n <= args.trl_docs:
                runs["TRL bfd (default: map batches of 1000 docs)"] = measure("trl", path, args, 1000)
                runs["TRL bfd (one batch: whole dataset)"] = measure("trl", path, args, -1)
            trl = runs.get("TRL bfd (default: map batches of 1000 docs)")
            for name, r in runs.items():
                rate = n / r["seconds"]
                ratio = f"{rate / (n / trl['seconds']):.3g}×" if trl else "–"
                print(
                    f"| {n:,} | {name} | {tokens:,} | {r['seconds']:.3f} | {rate / 1e6:.2f} M | {r['packs']:,} "
                    f"| +{100 * (r['packs'] / lower - 1):.3f} % | {r['baseline']:,.0f} → {r['peak_rss']:,.0f} | {ratio} |"
                )
                if r["warmup"]:
                    notes.append(f"{name} at {n:,}: first call on 100 docs took {r['warmup']:.2f} s (JIT or cache load)")
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
