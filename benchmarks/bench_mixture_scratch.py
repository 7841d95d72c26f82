"""Mixtures: scratch disk and peak memory against the sources' size, when the mixture takes a small
part of them.

    python benchmarks/bench_mixture_scratch.py --tokens 4000000 --share 0.05

Two sources, each a Parquet corpus of token ids (`--tokens` tokens, lognormal document lengths, median
~350, as bench_plan.py draws them) and the second also as a document store, mixed 50/50 into a budget
of `--share` of their tokens (both downsampled), max-len 4096; the Parquet files in row groups of 4,096
documents. Each build runs in a fresh process; a thread there samples the bytes under the build's
staging `scratch/` and the process's anonymous memory (`RssAnon`: what is not file pages, which the
kernel can drop) every 10 ms, keeping the peaks, and the process reports its peak RSS (`VmHWM`, file
pages mapped included: a store shard is mapped whole while it is hashed), and the peak of Arrow's
default memory pool (`max_memory`: what the Parquet reader allocates). Compares the tree on `PYTHONPATH` against another given with
`--peer PATH` (a checkout, e.g. before mixtures streamed their sources). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, os, sys, threading, time
from pathlib import Path
import pyarrow as pa
import prepack

mixture, out = sys.argv[1], Path(sys.argv[2])
peak, anon, done = [0], [0], threading.Event()

def sample():
    while not done.is_set():
        anon[0] = max(anon[0], next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon")))
        for staging in out.parent.glob(f".{out.name}*"):
            size = sum(f.stat().st_size for f in (staging / "scratch").rglob("*") if f.is_file()) if (staging / "scratch").exists() else 0
            peak[0] = max(peak[0], size)
        time.sleep(0.01)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
manifest = prepack.build(mixture, out, max_len=4096)
seconds = time.perf_counter() - start
done.set(); thread.join()
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
arrow = pa.default_memory_pool().max_memory()
print(json.dumps({"seconds": seconds, "scratch": peak[0], "rss": rss, "anon": anon[0], "arrow": arrow, "tokens": manifest.totals.tokens, "prepack": prepack.__file__}))
"""


def _sources(root: Path, tokens: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        lengths = np.clip(rng.lognormal(np.log(350), 1.0, size=int(tokens / 500) + 1).astype(np.int64), 1, 8192)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
        ids = rng.integers(0, 50000, size=int(lengths.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}), root / f"{name}.parquet", row_group_size=4096)
    import prepack

    prepack.build_store(root / "b.parquet", root / "b-store")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4_000_000, help="tokens of each source")
    parser.add_argument("--share", type=float, default=0.05, help="the budget, as a share of the sources' tokens")
    parser.add_argument("--peer", type=Path, help="another prepack checkout to run the same builds with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mixture-scratch-") as directory:
        root = Path(directory)
        _sources(root, args.tokens)
        budget = int(2 * args.tokens * args.share)
        cases = {"two corpora": ("a.parquet", "b.parquet"), "a corpus and a store": ("a.parquet", "b-store")}
        trees = [("this tree", os.environ.get("PYTHONPATH", ""))] + ([("peer", str(args.peer))] if args.peer else [])
        source_bytes = 2 * 4 * args.tokens
        print(f"Two sources of {args.tokens:,} tokens each ({source_bytes:,} bytes as int32), a budget of {budget:,} tokens, max-len 4096.\n")
        print("| tree | sources | scratch peak (bytes) | scratch / sources' int32 bytes | peak RSS (MiB) | peak RssAnon (MiB) | Arrow pool peak (MiB) | seconds |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for tree, path in trees:
            for case, (first, second) in cases.items():
                mixture = root / "mix.yaml"
                mixture.write_text(f"tokens: {budget}\nsources:\n  - {{name: a, path: {first}, weight: 1}}\n  - {{name: b, path: {second}, weight: 1}}\n")
                out = root / f"out-{len(list(root.glob('out-*')))}"
                env = {**os.environ, "PYTHONPATH": path}
                result = subprocess.run([sys.executable, "-c", _CHILD, str(mixture), str(out)], capture_output=True, text=True, env=env, check=True, cwd=root)
                r = json.loads(result.stdout.strip().splitlines()[-1])
                print(f"| {tree} | {case} | {r['scratch']:,} | {r['scratch'] / source_bytes:.3f} | {r['rss'] / 2**20:.0f} | {r['anon'] / 2**20:.0f} | {r['arrow'] / 2**20:.0f} | {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
