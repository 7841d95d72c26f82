"""What the `prepack` command costs before it does anything, and an index build end to end through it.

    python benchmarks/bench_startup.py                  # 200,000 documents, about a minute
    python benchmarks/bench_startup.py --docs 1000000 --runs 5
    python benchmarks/bench_startup.py --workload chitchat   # real conversation lengths, with labels

Two comparisons, each printed as a table, every command a fresh subprocess of this interpreter's
`prepack` (the console script beside `sys.executable`) as a user types it:

- start-up: `prepack --help` against `python -c pass`, the interpreter alone; the median of --runs
  runs of each, taking turns, and their difference (the time prepack itself adds) and ratio.
- index build: `prepack build STORE --index-only` against `prepack build STORE` (a materialized build
  of the same document store) at max-len 4096, the median of --runs runs of each, taking turns, and
  the index build's time as a share of the materialized one's. The store is written once, untimed,
  with `prepack tokenize` from a synthetic Parquet corpus (seed 0) of --workload:
  "uniform" (the default): lengths uniform in 1..--longest, no labels;
  "chitchat": lengths drawn from real conversations' (benchmarks/data/chitchat_lengths.json, ChatML
  tokenized with GPT-2's BPE: median 71, mean 516, longest 28,086 tokens), with labels as assistant-only
  chat training leaves them: -100 over a prompt of each conversation (of a length uniform in
  0..its length), the rest trained.

Each time is printed as wall seconds and as CPU seconds (user + system, all threads), the median of
each: on a machine shared with other work, CPU time varies less than wall time. The load average
printed is the one at the end.

Before the clocks start, one small build of each kind runs untimed, so that numba's compiled kernels
are in its cache and no timed run pays for compiling them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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

PREPACK = str(Path(sys.executable).with_name("prepack"))


CHITCHAT = Path(__file__).resolve().parent / "data" / "chitchat_lengths.json"


def _corpus(path: Path, docs: int, workload: str, longest: int) -> None:
    rng = np.random.default_rng(0)
    if workload == "uniform":
        lengths = rng.integers(1, longest + 1, docs)
    else:
        lengths = rng.choice(np.array(json.loads(CHITCHAT.read_text())["lengths"]), docs)
    offsets = np.zeros(docs + 1, np.int32)  # Arrow's list offsets: under 2**31 tokens
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    columns = {"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}
    if workload == "chitchat":
        prompt = (rng.random(docs) * lengths).astype(np.int64)  # tokens of each conversation not trained
        position = np.arange(len(ids)) - np.repeat(offsets[:-1], lengths)  # of every token in its conversation
        labels = np.where(position >= np.repeat(prompt, lengths), ids, -100).astype(np.int32)
        columns["labels"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels))
    pq.write_table(pa.table(columns), path)


def _seconds(command: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of `command`, its CPU time user + system of all its threads."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime


def _medians(commands: dict[str, list[str]], runs: int, before=lambda: None) -> dict[str, tuple[float, float]]:
    """The median (wall, CPU) seconds of each command over `runs` runs, the commands taking turns
    (`before` runs untimed ahead of each)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            before()
            times[name].append(_seconds(command))
    return {name: tuple(statistics.median(column) for column in zip(*runs_)) for name, runs_ in times.items()}


def _builds(store: Path, out: Path, max_len: int) -> dict[str, list[str]]:
    build = [PREPACK, "build", str(store), "--out", str(out), "--max-len", str(max_len), "--quiet"]
    return {"materialized": build, "index-only": [*build, "--index-only"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=200_000)
    parser.add_argument("--workload", choices=("uniform", "chitchat"), default="uniform", help="document lengths (and labels)")
    parser.add_argument("--longest", type=int, default=600, help="--workload uniform: the longest document")
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=7, help="runs of each command; the median is reported")
    args = parser.parse_args()

    startup = _medians({"python -c pass": [sys.executable, "-c", "pass"], "prepack --help": [PREPACK, "--help"]}, args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, docs in (("warm", 1000), ("corpus", args.docs)):
            _corpus(root / f"{name}.parquet", docs, args.workload, args.longest)
            subprocess.run([PREPACK, "tokenize", str(root / f"{name}.parquet"), "--out", str(root / f"{name}-store"), "--quiet"], check=True)
        out = root / "packed"
        for command in _builds(root / "warm-store", out, 512).values():
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(command, check=True)
        builds = _medians(_builds(root / "corpus-store", out, args.max_len), args.runs, before=lambda: shutil.rmtree(out, ignore_errors=True))

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"median of {args.runs} runs; {platform.machine()}, Python {sys.version.split()[0]}, load average {load}\n")
    (python, python_cpu), (prepack, prepack_cpu) = startup["python -c pass"], startup["prepack --help"]
    print("| command | wall s | CPU s |\n|---|---:|---:|")
    print(f"| python -c pass | {python:.3f} | {python_cpu:.3f} |\n| prepack --help | {prepack:.3f} | {prepack_cpu:.3f} |")
    print(f"\nprepack --help adds {prepack - python:.3f} s to the interpreter's start ({prepack / python:.1f}x); "
          f"{prepack_cpu - python_cpu:.3f} s of CPU.\n")
    print(f"| {args.docs:,} documents ({args.workload}), max-len {args.max_len}, through the CLI | wall s | CPU s |\n|---|---:|---:|")
    for name, (seconds, cpu) in builds.items():
        print(f"| prepack build STORE{' --index-only' if name == 'index-only' else ''} | {seconds:.3f} | {cpu:.3f} |")
    (index, index_cpu), (full, full_cpu) = builds["index-only"], builds["materialized"]
    print(f"\nthe index-only build takes {index / full:.1%} of the materialized build's wall time, "
          f"{index_cpu / full_cpu:.1%} of its CPU time.")


if __name__ == "__main__":
    main()
