"""Build throughput: a tokenized Parquet corpus → shards, against the practical limit and a peer.

    python benchmarks/bench_build.py --docs 250000 1000000

For each corpus size it writes one Parquet corpus (lognormal "SFT" lengths, median ~350, p99 ~4k,
clipped at 32k; random ids) and runs, each in a fresh subprocess so peak memory is its own:

- `prepack`: `prepack.build(corpus, out, max_len=8192)` (FFD, overflow split);
- `copy`: a plain pyarrow read of the token column and an Arrow IPC stream write of it: no packing
  at all, the most any tool that reads and writes these bytes can do;
- `trl`: `datasets.Dataset.from_parquet` + TRL `pack_dataset(strategy="bfd")` + `save_to_disk`.

Prints a markdown table: wall seconds, documents/s, tokens/s, peak RSS, and prepack's throughput as
a share of the copy's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MAX_LEN = 8192


def sft_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(350), sigma=1.04, size=n)  # p99 ≈ 350·e^(2.33·1.04) ≈ 4k
    return np.clip(lengths, 1, 32_768).astype(np.int64)


def write_corpus(path: Path, n: int) -> int:
    lengths = sft_lengths(n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.random.default_rng(1).integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
    pq.write_table(pa.table({"input_ids": column}), path, row_group_size=65_536)
    return int(offsets[-1])


def run_prepack(corpus: str, out: str) -> None:
    import prepack

    prepack.build(corpus, out, max_len=MAX_LEN)


def run_copy(corpus: str, out: str) -> None:
    os.makedirs(out)
    source = pq.ParquetFile(corpus)
    schema = source.schema_arrow
    with pa.OSFile(os.path.join(out, "copy.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in source.iter_batches(batch_size=65_536, columns=["input_ids"]):
            writer.write_batch(batch)


def run_trl(corpus: str, out: str) -> None:
    import datasets
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_parquet(corpus, cache_dir=os.path.join(out + ".cache"))
    pack_dataset(dataset, seq_length=MAX_LEN, strategy="bfd").save_to_disk(out)


METHODS = {"prepack": run_prepack, "copy": run_copy, "trl": run_trl}


def measure(method: str, corpus: Path, scratch: Path) -> dict:
    """Run one method in a fresh interpreter, which reports its own wall time and peak RSS."""
    out = scratch / f"out-{method}"
    command = [sys.executable, __file__, "--child", method, str(corpus), str(out)]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(str(out) + ".cache", ignore_errors=True)
    return result


def child(method: str, corpus: str, out: str) -> None:
    start = time.perf_counter()
    METHODS[method](corpus, out)
    wall = time.perf_counter() - start
    print(json.dumps({"wall": wall, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--trl-max-docs", type=int, default=1_000_000, help="skip TRL above this size")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "CORPUS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    print(f"machine: {machine()}\n")
    print("| documents | tokens | method | wall s | docs/s | tokens/s | peak RSS | vs copy |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for n in args.docs:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            corpus = Path(tmp) / "corpus.parquet"
            tokens = write_corpus(corpus, n)
            results = {
                method: measure(method, corpus, Path(tmp))
                for method in args.methods
                if not (method == "trl" and n > args.trl_max_docs)
            }
            for method, r in results.items():
                share = results["copy"]["wall"] / r["wall"] if "copy" in results else float("nan")
                print(
                    f"| {n:,} | {tokens:,} | {method} | {r['wall']:.2f} | {n / r['wall']:,.0f} | "
                    f"{tokens / r['wall'] / 1e6:,.1f}M | {r['peak_kib'] / 2**20:.2f} GiB | {share:.0%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
