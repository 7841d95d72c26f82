"""Export throughput: `prepack export` per format, against a plain pyarrow copy of the same shards.

    python benchmarks/bench_export.py --docs 200000

For each `--docs` size, builds the corpus of `bench_build.py` (lognormal "SFT" lengths, median ~350, random ids) with `max_len` 8192, once in full and once as an index build of its document store, then runs,
each in a fresh subprocess so that its peak memory is its own, `--repeat` times interleaved (fastest shown,
highest peak RSS):

- `copy`: every shard memory-mapped and written again as an Arrow IPC stream with pyarrow, nothing else:
  the floor of any tool that reads and writes these bytes;
- `copy parquet`: every shard's table written with `pyarrow.parquet.write_table` (zstd): the floor of a
  Parquet writer;
- `export FORMAT` for every format `prepack.exports.FORMATS` lists (parquet, lance, megatron, olmo-core; or
  `--formats`), from the full build and (`index`) from the index build, whose packs are gathered from the
  store (or `--builds`).

Prints a markdown table per size: wall seconds, tokens/s, peak RSS (VmHWM, which counts the build's and
store's memory-mapped pages), the peak anonymous memory the method added (RssAnon, sampled every 5 ms: what
it holds itself), the peak of pyarrow's memory pool (what pyarrow itself allocated: Parquet writing,
Arrow copies; not numpy's arrays nor Lance's Rust writer), output bytes and the throughput as a share of `copy`'s (and of `copy parquet`'s). Two
sizes show whether memory grows with the build.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_build import MAX_LEN, machine, write_corpus  # noqa: E402  (the same workload)

IMPORTS = ["pyarrow", "pyarrow.parquet", "prepack.exports", "prepack.exports.common", "prepack.check.report"]


def run_copy(build: str, out: str, parquet: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out)
    manifest = json.loads((Path(build) / "manifest.json").read_text())
    for shard in manifest["shards"]:
        with pa.memory_map(str(Path(build) / shard["name"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        target = Path(out) / shard["name"]
        if parquet:
            pq.write_table(table, target.with_suffix(".parquet"), compression="zstd")
        else:
            with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:")))


def child(method: str, build: str, out: str) -> None:
    start = time.perf_counter()
    for module in IMPORTS:
        importlib.import_module(module)
    if method.startswith("export "):
        importlib.import_module(importlib.import_module("prepack.exports").FORMATS[method.split()[1]].module)
    imports = time.perf_counter() - start
    # Anonymous memory, sampled every 5 ms: VmHWM also counts the build's (and store's) memory-mapped pages,
    # which the kernel drops when it needs them; what the method itself holds is anonymous.
    before, peak_anon, running = _status_kib("RssAnon"), [0], [True]

    def sample() -> None:
        while running[0]:
            peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if method.startswith("export "):
        from prepack.exports import export_build

        export_build(build, method.split()[1], out)
    else:
        run_copy(build, out, parquet=method == "copy parquet")
    wall = time.perf_counter() - start
    running[0] = False
    sampler.join()
    peak_kib = _status_kib("VmHWM")  # not ru_maxrss, which carries over from the parent
    import pyarrow as pa

    arrow_kib = pa.default_memory_pool().max_memory() // 1024  # pyarrow's own allocations (not numpy's, not Lance's)
    size = sum(path.stat().st_size for path in Path(out).rglob("*") if path.is_file())
    print(json.dumps({"wall": wall, "imports": imports, "peak_kib": peak_kib, "anon_kib": peak_anon[0] - before,
                      "arrow_kib": arrow_kib, "bytes": size}))


def measure(method: str, build: Path, scratch: Path) -> dict:
    out = scratch / "out"
    command = [sys.executable, __file__, "--child", method, str(build), str(out)]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[200_000])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each method, interleaved (fastest shown)")
    parser.add_argument("--formats", nargs="+", help="the export formats to run (default: every one in FORMATS)")
    parser.add_argument("--builds", nargs="+", choices=["full", "index"], default=["full", "index"],
                        help="export from the full build, the index build or both")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "BUILD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    from prepack.exports import FORMATS

    print(f"machine: {machine()}\n")
    formats = args.formats or list(FORMATS)
    if unknown := sorted(set(formats) - set(FORMATS)):
        parser.error(f"--formats: {', '.join(unknown)} not in {', '.join(FORMATS)}")
    for docs in args.docs:
        run_size(docs, args.repeat, formats, args.builds)


def run_size(docs: int, repeat: int, formats: list[str], builds: list[str]) -> None:
    """Build a corpus of `docs` documents, run every method `repeat` times, print its table."""
    import prepack

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        root = Path(tmp)
        tokens = write_corpus(root / "corpus.parquet", docs)
        prepack.build(root / "corpus.parquet", root / "full", max_len=MAX_LEN)
        if "index" in builds:
            prepack.build_store(root / "corpus.parquet", root / "store")
            prepack.build(root / "store", root / "index", max_len=MAX_LEN, index_only=True)
        runs = [("copy", "full"), ("copy parquet", "full")]
        runs += [(f"export {name}", build) for name in formats for build in builds]
        results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
        for _ in range(repeat):
            for method, build in runs:
                results[method, build].append(measure(method, root / build, root))
    best = {run: min(found, key=lambda r: r["wall"]) | {key: max(r[key] for r in found) for key in ("peak_kib", "anon_kib", "arrow_kib")}
            for run, found in results.items()}
    copy, copy_parquet = best["copy", "full"]["wall"], best["copy parquet", "full"]["wall"]
    print(f"{docs:,} documents, {tokens:,} tokens, max_len {MAX_LEN}; fastest of {repeat}\n")
    print("| method | build | time (s) | tokens/s | peak RSS (MiB) | anonymous memory added (MiB) | pyarrow pool peak (MiB) "
          "| output (MiB) | vs copy | vs copy parquet |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (method, build), r in best.items():
        print(f"| {method} | {build} | {r['wall']:.2f} | {tokens / r['wall'] / 1e6:.1f} M | {r['peak_kib'] / 1024:,.0f} | "
              f"{r['anon_kib'] / 1024:,.0f} | {r['arrow_kib'] / 1024:,.0f} | "
              f"{r['bytes'] / 2**20:,.0f} | {copy / r['wall']:.2f}× | {copy_parquet / r['wall']:.2f}× |")
    print()


if __name__ == "__main__":
    main()
