"""Loading throughput: tokens per second delivered as ready torch batches (B=8, L=8192) from a
materialized (full) build and from an index build of the same store with the same options.

    python benchmarks/bench_load.py                  # a corpus of --docs documents made a store first
    python benchmarks/bench_load.py --labels         # the corpus with a labels column (-100 on 20 %)
    python benchmarks/bench_load.py --store store/   # or an existing document store

The store is built into a full build and an index build (`index_only`), max_len 8192, otherwise the
default options, so both hold the same packs (their rows are identical). Three contenders draw the same
packs in the same order into batches of the same packs:

- `materialized`: `PackedDataset` over the full build (memory-mapped rows) + `PackedCollator` + `DataLoader`;
- `index`: the same over the index build, each pack gathered from the store's shards by one kernel call;
- `hf`: `datasets.Dataset.from_file` on each full shard (memory-mapped too) + transformers
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` + `DataLoader`, each pack handed to it
  as its documents (split at `cu_seqlens`), so that its batch carries the same document boundaries.

Each runs one full pass per repeat with `num_workers` 0 and 2, the contenders taking turns; the best
of the repeats is reported (the machine may be shared), as a markdown table with the ratios
index / materialized and index / hf, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
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


def write_corpus(path: Path, n: int, labels: bool = False) -> None:
    """Lognormal "SFT" lengths (median ~350, p99 ~4k, clipped at 32k), random GPT-2-sized ids; with
    `labels`, a labels column: the ids with 20 % of them -100."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mean=np.log(350), sigma=1.04, size=n), 1, 32_768).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    columns = {"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}
    if labels:
        masked = np.where(rng.random(len(ids)) < 0.2, -100, ids).astype(np.int32)
        columns["labels"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(masked))
    pq.write_table(pa.table(columns), path)


def prepack_loader(data: Path, order: list[int], workers: int) -> DataLoader:
    from prepack.training.collate import PackedCollator
    from prepack.training.dataset import PackedDataset

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
            bounds = pack["cu_seqlens"]
            columns = [name for name in ("input_ids", "labels") if name in pack]
            documents.extend({name: pack[name][a:b] for name in columns} for a, b in zip(bounds[:-1], bounds[1:]))
        return self.flatten(documents)


def hf_loader(data: Path, order: list[int], workers: int) -> DataLoader:
    from datasets import Dataset, concatenate_datasets

    shards = sorted(data.glob("shard-*.arrow"))
    dataset = concatenate_datasets([Dataset.from_file(str(shard)) for shard in shards])
    columns = ["input_ids", "cu_seqlens", *(["labels"] if "labels" in dataset.column_names else [])]
    dataset = dataset.select_columns(columns)  # Python lists: datasets' default format
    return DataLoader(
        dataset, batch_size=BATCH_SIZE, sampler=order, collate_fn=SplitIntoDocuments(), num_workers=workers
    )


# Contender → (the build it reads, how it loads it).
LOADERS = {"materialized": ("full", prepack_loader), "index": ("index", prepack_loader), "hf": ("full", hf_loader)}


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
    parser.add_argument("--store", type=Path, help="an existing document store (else one is made)")
    parser.add_argument("--docs", type=int, default=20_000, help="documents in the generated corpus")
    parser.add_argument("--labels", action="store_true", help="give the generated corpus a labels column")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from prepack import build, build_store

    with tempfile.TemporaryDirectory() as tmp:
        store = args.store
        if store is None:
            write_corpus(Path(tmp) / "corpus.parquet", args.docs, args.labels)
            store = Path(tmp) / "store"
            build_store(Path(tmp) / "corpus.parquet", store)
        builds = {kind: Path(tmp) / kind for kind in ("full", "index")}
        for kind, path in builds.items():
            build(store, path, max_len=MAX_LEN, index_only=kind == "index")
        report(builds, args.repeats)


def report(builds: dict[str, Path], repeats: int) -> None:
    from prepack.training.dataset import PackedDataset
    from prepack.training.sampler import PackedSampler

    dataset = PackedDataset(builds["full"])
    order = list(PackedSampler(dataset, seed=0))
    tokens = dataset.manifest.totals.tokens
    labels = "with labels" if dataset.manifest.has_labels else "no labels"
    print(f"{len(dataset)} packs, {tokens:,} tokens ({labels}), batches of {BATCH_SIZE} x {MAX_LEN}\n")
    print(f"Machine: {machine()}\n")
    print("| num_workers | materialized tokens/s | index tokens/s | HF datasets + DataCollatorWithFlattening "
          "tokens/s | index / materialized | index / HF |")
    print("|---:|---:|---:|---:|---:|---:|")
    for workers in (0, 2):
        best = dict.fromkeys(LOADERS, float("inf"))
        for _ in range(repeats):  # taking turns, so that a busy moment of the machine hits each alike
            for name, (kind, make) in LOADERS.items():
                best[name] = min(best[name], seconds_per_pass(make(builds[kind], order, workers)))
        # A full pass delivers every real token once, whichever way the batch lays them out.
        rates = {name: tokens / seconds for name, seconds in best.items()}
        print(f"| {workers} | {rates['materialized']:,.0f} | {rates['index']:,.0f} | {rates['hf']:,.0f} "
              f"| {rates['index'] / rates['materialized']:.0%} | {rates['index'] / rates['hf']:.1f}x |")


if __name__ == "__main__":
    main()
