"""Loading a build from object storage: tokens per second of one full pass of ready torch batches
(B=8, L=8192) through `PackedDataset(uri, cache_dir=...)`, with a cold and a warm cache, against the
same build read from local disk.

    python benchmarks/bench_s3_load.py --docs 20000

The S3 server is moto's (`moto[server]`), started by this script in a process of its own on loopback
and reached over HTTP by s3fs, configured as a real deployment is (`AWS_ENDPOINT_URL`, credentials in
the environment). Loopback has no network latency or bandwidth limit, so the cold figure measures
prepack's side (a GET per shard through s3fs, the sha256 check, the write into the cache) plus the
server's, not what a real object store would take to deliver the bytes.

- `local`: `PackedDataset(build directory)`, the peer;
- `s3 cold`: a new, empty cache directory: every shard downloaded, hashed and renamed into place;
- `s3 warm`: a new `PackedDataset` on the cache the cold pass filled: no download, each shard hashed
  once when first opened (that is what a new process pays).

Each contender makes a new `PackedDataset` per repeat (so every shard is opened, checked and mapped
again) and draws every batch once with `num_workers=0`; the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from bench_load import BATCH_SIZE, MAX_LEN, machine, write_corpus  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, dict[str, str]]:
    """moto's S3 server in its own process; returns it and the environment that points clients at it."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        server.kill()
        sys.exit("moto's server did not start")
    return server, {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "benchmark",
        "AWS_SECRET_ACCESS_KEY": "benchmark",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def seconds_per_pass(data: str | Path, order: list[int], cache_dir: Path | None) -> float:
    """A new dataset, then every batch drawn once, ready as torch tensors."""
    from prepack import PackedCollator, PackedDataset

    start = time.perf_counter()
    dataset = PackedDataset(data) if cache_dir is None else PackedDataset(data, cache_dir=cache_dir)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=order, collate_fn=PackedCollator(max_len=MAX_LEN))
    for _ in loader:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000, help="documents in the generated corpus")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    server, environment = start_server()
    os.environ.update(environment)
    try:
        import boto3

        from prepack import PackedDataset, build
        from prepack.training.sampler import PackedSampler

        boto3.client("s3").create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            write_corpus(root / "corpus.parquet", args.docs)
            manifest = build(root / "corpus.parquet", root / "packed", max_len=MAX_LEN)
            build(root / "corpus.parquet", "s3://bench/packed", max_len=MAX_LEN)
            order = list(PackedSampler(PackedDataset(root / "packed"), seed=0))
            size = sum(shard.bytes for shard in manifest.shards)
            times = {"local": [], "s3 cold": [], "s3 warm": []}
            for repeat in range(args.repeats):
                cache = root / f"cache-{repeat}"
                times["local"].append(seconds_per_pass(root / "packed", order, None))
                times["s3 cold"].append(seconds_per_pass("s3://bench/packed", order, cache))
                times["s3 warm"].append(seconds_per_pass("s3://bench/packed", order, cache))
    finally:
        server.terminate()
        server.wait()
    tokens = manifest.totals.tokens
    print(f"{len(order)} packs, {tokens:,} tokens in {len(manifest.shards)} shards ({size / 2**20:.0f} MiB), "
          f"batches of {BATCH_SIZE} x {MAX_LEN}, num_workers 0, median of {args.repeats}\n")
    print(f"Machine: {machine()}\n")
    print("| source | seconds per pass | tokens/s | time / local |")
    print("|---|---:|---:|---:|")
    local = statistics.median(times["local"])
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds:.2f} | {tokens / seconds:,.0f} | {seconds / local:.1f}x |")


if __name__ == "__main__":
    main()
