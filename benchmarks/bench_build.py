"""Build throughput: a tokenized Parquet corpus → shards, against the practical limit and a peer.

    python benchmarks/bench_build.py --docs 250000 1000000

For each corpus size it writes one Parquet corpus (lognormal "SFT" lengths, median ~350, p99 ~4k,
clipped at 32k; random ids) and runs, each in a fresh subprocess so peak memory is its own:

- `prepack`: `prepack.build(corpus, out, max_len=8192)` (FFD, overflow split);
- `copy`: a plain pyarrow read of the token column and an Arrow IPC stream write of it: no packing,
  no hashing, the most any tool that reads and writes these bytes can do;
- `copy_synced`: the same copy writing the way prepack writes its shards: synced and dropped from
  the page cache every 64 MiB (`prepack.building.write_shards.SyncedFile`), which on some machines is much faster;
- `trl`: `datasets.Dataset.from_parquet` + TRL `pack_dataset(strategy="bfd")` + `save_to_disk`.

Each child imports its libraries before its clock starts (the import time is printed apart), and
the outputs are synced and removed between runs, so no run pays for the last one's dirty pages.
Every run then starts after a `--settle` pause: on a VM whose balloon reports free pages to the host
(this one), memory freed by the previous run stays quick to touch for a second or two and afterwards
costs ~2 ns a byte to touch again (the host backs it afresh), so without the pause a run's time
depends on how much the run before it freed.
prepack and the copies run `--repeat` times, interleaved, and their fastest run is reported (with the
highest peak RSS of the runs); TRL, which takes minutes, runs once.

numba compiles prepack's kernels on the first build after an install and caches them. The script
points NUMBA_CACHE_DIR at an empty directory and first builds a 1,000-document corpus twice, to
print that one-time compile apart from the cache load that every later build pays.

Prints a markdown table: wall seconds, documents/s, tokens/s, peak RSS, and the method's throughput
as a share of each copy's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
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
    # prepack's reader settings, the fastest found here: pyarrow's defaults (pre_buffer, 64k-row
    # batches) took 1.5 to 5 times as long on this machine.
    source = pq.ParquetFile(corpus, pre_buffer=False, buffer_size=2**20)
    schema = source.schema_arrow
    with pa.OSFile(os.path.join(out, "copy.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in source.iter_batches(batch_size=8_192, columns=["input_ids"]):
            writer.write_batch(batch)


def run_copy_synced(corpus: str, out: str) -> None:
    from prepack.storage.files import SyncedFile

    os.makedirs(out)
    source = pq.ParquetFile(corpus, pre_buffer=False, buffer_size=2**20)
    with open(os.path.join(out, "copy.arrow"), "wb") as file:
        synced = SyncedFile(file)
        with pa.ipc.new_stream(pa.PythonFile(synced, mode="w"), source.schema_arrow) as writer:
            for batch in source.iter_batches(batch_size=8_192, columns=["input_ids"]):
                writer.write_batch(batch)
        synced.sync()


def run_trl(corpus: str, out: str) -> None:
    import datasets
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_parquet(corpus, cache_dir=os.path.join(out + ".cache"))
    pack_dataset(dataset, seq_length=MAX_LEN, strategy="bfd").save_to_disk(out)


METHODS = {"prepack": run_prepack, "copy": run_copy, "copy_synced": run_copy_synced, "trl": run_trl}
IMPORTS = {
    "prepack": ["prepack"],
    "copy": [],
    "copy_synced": ["prepack.building.write_shards"],
    "trl": ["datasets", "trl.data_utils"],
}


def measure(method: str, corpus: Path, scratch: Path, settle: float) -> dict:
    """Run one method in a fresh interpreter, which reports its own wall time and peak RSS."""
    time.sleep(settle)
    out = scratch / f"out-{method}"
    command = [sys.executable, __file__, "--child", method, str(corpus), str(out)]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(str(out) + ".cache", ignore_errors=True)
    os.sync()
    return result


def child(method: str, corpus: str, out: str) -> None:
    start = time.perf_counter()
    for module in IMPORTS[method]:
        importlib.import_module(module)
    imports = time.perf_counter() - start
    start = time.perf_counter()
    METHODS[method](corpus, out)
    wall = time.perf_counter() - start
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec.
    status = Path("/proc/self/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    print(json.dumps({"wall": wall, "imports": imports, "peak_kib": peak_kib}))


def make_corpus(path: Path, n: int) -> int:
    """`write_corpus` in a child, so this process stays small and its pages cannot disturb the runs."""
    command = [sys.executable, __file__, "--write-corpus", str(n), str(path)]
    tokens = int(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    os.sync()
    return tokens


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--trl-max-docs", type=int, default=1_000_000, help="skip TRL above this size")
    parser.add_argument("--repeat", type=int, default=3, help="runs of prepack and the copies (fastest shown)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait before each run")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "CORPUS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--write-corpus", nargs=2, metavar=("DOCS", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if args.write_corpus:
        return print(write_corpus(Path(args.write_corpus[1]), int(args.write_corpus[0])))
    print(f"machine: {machine()}\n")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        os.environ["NUMBA_CACHE_DIR"] = str(Path(tmp) / "numba-cache")
        corpus = Path(tmp) / "small.parquet"
        make_corpus(corpus, 1_000)
        cold, warm = (measure("prepack", corpus, Path(tmp), args.settle) for _ in range(2))
        print(
            f"prepack, 1,000 documents: {cold['wall']:.2f} s compiling its kernels into an empty numba "
            f"cache, {warm['wall']:.2f} s loading them from it (imports: {warm['imports']:.2f} s)\n"
        )
        columns = "documents | tokens | method | wall s | docs/s | tokens/s | peak RSS | vs copy | vs copy_synced"
        print(f"| {columns} | imports s |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for n in args.docs:
            corpus = Path(tmp) / "corpus.parquet"
            tokens = make_corpus(corpus, n)
            methods = [m for m in args.methods if not (m == "trl" and n > args.trl_max_docs)]
            runs = {m: [] for m in methods}
            for _ in range(args.repeat):  # interleaved, so a disturbance hits every method alike
                for method in methods:
                    if method != "trl" or not runs[method]:
                        runs[method].append(measure(method, corpus, Path(tmp), args.settle))
            results = {
                method: {**min(rs, key=lambda r: r["wall"]), "peak_kib": max(r["peak_kib"] for r in rs)}
                for method, rs in runs.items()
            }
            for method, r in results.items():
                shares = [results[c]["wall"] / r["wall"] if c in results else np.nan for c in ("copy", "copy_synced")]
                print(
                    f"| {n:,} | {tokens:,} | {method} | {r['wall']:.2f} | {n / r['wall']:,.0f} | "
                    f"{tokens / r['wall'] / 1e6:,.1f}M | {r['peak_kib'] / 2**20:.2f} GiB | {shares[0]:.0%} | "
                    f"{shares[1]:.0%} | {r['imports']:.2f} |",
                    flush=True,
                )
            corpus.unlink()


if __name__ == "__main__":
    main()
