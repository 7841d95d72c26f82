"""How fast this machine writes new files: into the page cache, or synced and dropped from it.

    python benchmarks/bench_writes.py --gib 1

The numbers behind `prepack.building.write_shards.SyncedFile`, which writes every shard. Each way writes `--gib` GiB
of int32 tokens into new files in `--dir`, in 1 MiB pieces, from one thread and from two (half each),
after a `--settle` pause (see bench_build.py: on a VM whose balloon reports freed memory to the host,
a run right after another one's frees gets warm pages):

- `page cache`: plain writes; the kernel writes the pages back later;
- `synced`: through `SyncedFile`: every 64 MiB `fdatasync` and `posix_fadvise(DONTNEED)`.

Prints a markdown table: wall seconds, GB/s, and the process's user and system CPU seconds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from prepack.storage.files import SyncedFile

PIECE = 2**20


def write_file(path: Path, nbytes: int, synced: bool) -> None:
    piece = np.full(PIECE // 4, 7, dtype=np.int32).data
    with open(path, "wb") as file:
        out = SyncedFile(file) if synced else file
        for _ in range(nbytes // PIECE):
            out.write(piece)
        if synced:
            out.sync()


def measure(directory: Path, nbytes: int, synced: bool, threads: int) -> tuple[float, float, float]:
    paths = [directory / f"write-{i}.bin" for i in range(threads)]
    before, start = os.times(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda path: write_file(path, nbytes // threads, synced), paths))
    wall, after = time.perf_counter() - start, os.times()
    for path in paths:
        path.unlink()
    os.sync()
    return wall, after.user - before.user, after.system - before.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each way (all shown)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait before each run")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // PIECE * PIECE
    print("| way | threads | wall s | GB/s | user s | system s |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(args.repeat):  # interleaved, so a disturbance hits every way alike
            for synced in (False, True):
                for threads in (1, 2):
                    time.sleep(args.settle)
                    wall, user, system = measure(Path(tmp), nbytes, synced, threads)
                    way = "synced" if synced else "page cache"
                    print(f"| {way} | {threads} | {wall:.2f} | {nbytes / wall / 1e9:.2f} | {user:.2f} | {system:.2f} |")


if __name__ == "__main__":
    main()
