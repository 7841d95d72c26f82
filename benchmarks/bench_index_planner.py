"""What an index build's planning costs with numba's kernels and in numpy (`prepack.building.plan_vectorized`).

    python benchmarks/bench_index_planner.py                     # 200,000 and 1,000,000 documents
    python benchmarks/bench_index_planner.py --docs 2000000

For each workload (lengths uniform in 1..600; lengths drawn from real conversations',
benchmarks/data/chitchat_lengths.json, with labels as bench_startup.py writes them), max-len and
number of documents: the CPU seconds of what an index build runs between reading a store's offsets
and writing its shards, both ways: finding the untrained documents from the labels, planning, and
slicing the whole plan into one shard's arrays, as an index build chooses between them. Each is the
median of --runs runs, after one untimed run. numba's own start-up (importing it, then loading the planner's cached kernels: what the first
plan of a process pays) is measured first, in a fresh process, and printed beside them: the numpy
path is worth taking where its time is below the kernels' plus that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from prepack.building import plan_vectorized
from prepack.building.plan import plan_packs, untrained_documents

CHITCHAT = Path(__file__).resolve().parent / "data" / "chitchat_lengths.json"
STARTUP = """
import time
start = time.process_time()
import numpy as np
from prepack.building.plan import plan_packs, untrained_documents
ready = time.process_time()
plan = plan_packs(np.array([3, 5, 9]), 8)
plan.slice(0, plan.packs)
untrained_documents(np.array([0, 2]), np.array([-100, 1], np.int32))
print(time.process_time() - ready)
"""


def _workload(name: str, docs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """(lengths, offsets of labels or None) of `docs` documents."""
    if name == "uniform":
        return rng.integers(1, 601, docs), None
    lengths = rng.choice(np.array(json.loads(CHITCHAT.read_text())["lengths"]), docs)
    return lengths, lengths


def _labels(lengths: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and labels: -100 over a prompt of each document (uniform in 0..its length), the rest trained."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    prompt = (rng.random(len(lengths)) * lengths).astype(np.int64)
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    return offsets, np.where(position >= np.repeat(prompt, lengths), 1, -100).astype(np.int32)


def _seconds(step, runs: int) -> float:
    step()
    times = []
    for _ in range(runs):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--max-len", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    startups = [float(subprocess.run([sys.executable, "-c", STARTUP], capture_output=True, text=True, check=True).stdout) for _ in range(3)]
    print(f"numba's start-up (import, then the planner's cached kernels), median of 3 fresh processes: {statistics.median(startups):.3f} CPU s\n")
    print("| workload | documents | max-len | kernels, CPU s | numpy, CPU s | numpy planned |\n|---|---:|---:|---:|---:|---|")
    rng = np.random.default_rng(0)
    for workload in ("uniform", "chitchat"):
        for docs in args.docs:
            lengths, labelled = _workload(workload, docs, rng)
            offsets, labels = _labels(labelled, rng) if labelled is not None else (None, None)
            for max_len in args.max_len:
                row = []
                for without_numba in (False, True):

                    def index_steps() -> bool:
                        # As an index build decides (`prepack.building.build.build_packs`): labels past
                        # `scans` are read by the kernel, and then numba is loaded for the plan too.
                        numpy = without_numba and (labels is None or plan_vectorized.scans(len(labels)))
                        untrained = None if labels is None else untrained_documents(offsets, labels, numpy)
                        plan = plan_packs(lengths, max_len, untrained=untrained, without_numba=numpy)
                        plan.slice(0, plan.packs)
                        return plan.documents.vectorized

                    row.append(_seconds(index_steps, args.runs))
                print(f"| {workload} | {docs:,} | {max_len} | {row[0]:.3f} | {row[1]:.3f} | {'yes' if index_steps() else 'no: kernels'} |")


if __name__ == "__main__":
    main()
