"""Loading throughput: tokens per second delivered as ready torch batches (B=8, L=8192) from one build.

    python benchmarks/bench_load.py                # builds a corpus of --docs documents first
    python benchmarks/bench_load.py --data packed/ # or reads an existing build (max_len 8192)

Both contenders read the same shard files, in the same pack order, into batches of the same packs:

- `prepack`: `PackedDataset` (memory-mapped rows) + `PackedCollator` + `DataLoader`;
- `hf`: `datasets.Dataset.from_file` on each shard (memory-mapped too) + transformers
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` + `DataLoader`, each pack handed to it
  as its documents (split at `cu_seqlens`), so that its batch carries the same document boundaries.

Each runs one full pass per repeat with `num_workers` 0 and 2; the median of the repeats is reported
as a markdown table, with the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

MAX_LEN = 8192
BATCH_SIZE = 8


def write_corpus(path: Path, n: int) -> None:
    """Lognormal "SFT" lengths (median ~350, p99 ~4k, clipped at 32k), random GPT-2-sized ids."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mean=np.log(350), sigma=1.04, size=n), 1, 32_768).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}), path)


def prepack_loader(data: Path, order: list[int], workers: int) -> DataLoader:
    from prepack.collate import PackedCollator
    from prepack.load import PackedDataset

    dataset = PackedDataset(data)
    return DataLoader(
        dataset, batch_size=BATCH_SIZE, sampler=order, collate_fn=PackedCollator(max_len=MAX_LEN), num_workers=workers
    )


class SplitIntoDocuments:
    """HF's flattening collator numbers positions per feature, so it gets each pack's documents."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")

    def __call__(self, packs: list[dict]) -> dict:
        documents = []
        for pack in packs:
            ids, bounds = pack["input_ids"], pack["cu_seqlens"]
            documents.extend({"input_ids": ids[a:b]} for a, b in zip(bounds[:-1], bounds[1:]))
        return self.flatten(documents)


def hf_loader(data: Path, order: list[int], workers: int) -> DataLoader:
    from datasets import Dataset, concatenate_datasets

    shards = sorted(data.glob("shard-*.arrow"))
    dataset = concatenate_datasets([Dataset.from_file(str(shard)) for shard in shards])
    dataset = dataset.select_columns(["input_ids", "cu_seqlens"])  # Python lists: datasets' default format
    return DataLoader(
        dataset, batch_size=BATCH_SIZE, sampler=order, collate_fn=SplitIntoDocuments(), num_workers=workers
    )


LOADERS = {"prepack": prepack_loader, "hf": hf_loader}


def seconds_per_pass(loader: DataLoader) -> float:
    """Time to draw every batch once, ready as torch tensors."""
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.processor())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import datasets
    import transformers

    return (
        f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB RAM, {platform.system()} {platform.machine()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"datasets {datasets.__version__}, pyarrow {pa.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="an existing build with max_len 8192 (else one is built)")
    parser.add_argument("--docs", type=int, default=20_000, help="documents in the generated corpus")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            from prepack import build

            write_corpus(Path(tmp) / "corpus.parquet", args.docs)
            data = Path(tmp) / "packed"
            build(Path(tmp) / "corpus.parquet", data, max_len=MAX_LEN)
        report(data, args.repeats)


def report(data: Path, repeats: int) -> None:
    from prepack.load import PackedDataset
    from prepack.sample import PackedSampler

    dataset = PackedDataset(data)
    if dataset.manifest.options.max_len != MAX_LEN:
        sys.exit(f"{data} was built with max_len {dataset.manifest.options.max_len}; this benchmark needs {MAX_LEN}.")
    order = list(PackedSampler(dataset, seed=0))
    tokens = dataset.manifest.totals.tokens
    print(f"{len(dataset)} packs, {tokens:,} tokens, batches of {BATCH_SIZE} x {MAX_LEN}\n")
    print(f"Machine: {machine()}\n")
    print("| num_workers | prepack tokens/s | HF datasets + DataCollatorWithFlattening tokens/s | speed-up |")
    print("|---:|---:|---:|---:|")
    for workers in (0, 2):
        # A full pass delivers every real token once, whichever way the batch lays them out.
        rates = {
            name: tokens / statistics.median(seconds_per_pass(make(data, order, workers)) for _ in range(repeats))
            for name, make in LOADERS.items()
        }
        print(f"| {workers} | {rates['prepack']:,.0f} | {rates['hf']:,.0f} | {rates['prepack'] / rates['hf']:.1f}x |")


if __name__ == "__main__":
    main()
