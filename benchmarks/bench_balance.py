"""Step imbalance across data-parallel ranks, with and without `PackedSampler(balance="attention")`,
and what the balanced sampler costs at start-up.

    python benchmarks/bench_balance.py --documents 2000000 --packs 10000000

Two corpora of synthetic lengths, packed to --max-len with prepack's planner (FFD):
- SFT-like: lognormal, median 350, p99 ~4k (as bench_plan.py), truncated to max_len;
- pretraining-like: lognormal, median 2,000, p99 ~40k, longer documents split into max_len pieces
  (`--overflow split`).
For R ∈ {8, 64} ranks and B ∈ {1, 4} packs per rank per step (and R=8, B=2, the issue's setting), epoch 0
of the sampler's shuffled order and of its balanced order: the mean over steps of slowest rank /
mean rank cost, and the share of step time lost to waiting, step time taken proportional to cost
(`prepack.building.balance.epoch_imbalance`, what `prepack inspect --world-size` prints). token_cost 0 (attention
alone) and the default (a 7-8B model).

Sampler cost: a `PackedSampler` over --packs packs (the SFT packs' cu_seqlens repeated, in shards of
100k packs, decoded by `PackedDataset.document_lengths`): building it (every pack's cost from
cu_seqlens) and its first index (the epoch's
order, balanced), against the unbalanced sampler's first index. Prints markdown.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from types import SimpleNamespace

import numpy as np

from prepack.building.balance import DEFAULT_TOKEN_COST, epoch_imbalance, pack_costs
from prepack.training.dataset import PackedDataset
from prepack.building.plan import assign_packs
from prepack.training.sampler import PackedSampler

Z99 = 2.3263  # standard normal 99th percentile
SHARD_PACKS = 100_000


def lognormal(n: int, median: float, p99: float, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).lognormal(math.log(median), math.log(p99 / median) / Z99, n)
    return np.clip(raw, 1, 10**6).astype(np.int64)


def split(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Each document cut into max_len pieces and a remainder, as `--overflow split`."""
    full, rest = np.divmod(lengths, max_len)
    pieces = np.repeat(np.full(len(lengths), max_len), full)
    return np.concatenate([pieces, rest[rest > 0]])


def cu_seqlens_column(lengths: np.ndarray, pack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (offsets, values) list column of cu_seqlens of a plan, documents in pack order."""
    by_pack = np.argsort(pack, kind="stable")
    lengths, pack = lengths[by_pack], pack[by_pack]
    docs = np.bincount(pack)
    offsets = np.append(0, np.cumsum(docs + 1))
    values = np.zeros(offsets[-1], dtype=np.int64)
    first_doc = np.append(0, np.cumsum(docs))[:-1]
    within = np.cumsum(lengths) - np.repeat(np.cumsum(lengths)[first_doc] - lengths[first_doc], docs)
    values[np.arange(len(lengths)) + np.repeat(np.arange(len(docs)) + 1, docs)] = within
    return offsets.astype(np.int32), values.astype(np.int32)


class Shards:
    """A PackedDataset reduced to what the balanced sampler reads: its length and each shard's cu_seqlens
    column (the given one's packs repeated), decoded by `PackedDataset.document_lengths` itself."""

    document_lengths = PackedDataset.document_lengths

    def __init__(self, column: tuple[np.ndarray, np.ndarray], packs: int):
        offsets, values = column
        self.packs, self.columns = packs, []
        base = len(offsets) - 1
        for start in range(0, packs, SHARD_PACKS):
            rows = (np.arange(start, min(packs, start + SHARD_PACKS)) % base).astype(np.int64)
            counts = offsets[rows + 1] - offsets[rows]
            new_offsets = np.append(0, np.cumsum(counts)).astype(np.int32)
            gather = np.repeat(offsets[rows] - new_offsets[:-1], counts) + np.arange(new_offsets[-1])
            self.columns.append({"cu_seqlens": (new_offsets, values[gather])})
        self.manifest = SimpleNamespace(shards=self.columns)

    def __len__(self) -> int:
        return self.packs

    def _columns(self, shard: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return self.columns[shard]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=2_000_000)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--packs", type=int, default=10_000_000, help="packs for the sampler's cost")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    corpora = {
        "SFT-like": np.minimum(lognormal(args.documents, 350, 4000, args.seed), args.max_len),
        "pretraining-like": split(lognormal(args.documents // 4, 2000, 40000, args.seed), args.max_len),
    }
    print(f"max_len {args.max_len}, seed {args.seed}; {platform.processor() or platform.machine()}, numpy {np.__version__}\n")
    print("| corpus | packs | token_cost | R | B | shuffled: slowest/mean | balanced | shuffled: time lost waiting | balanced |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    columns = {}
    for name, lengths in corpora.items():
        pack = assign_packs(lengths, args.max_len)
        columns[name] = cu_seqlens_column(lengths, pack)
        for token_cost in (0.0, float(DEFAULT_TOKEN_COST)):
            documents = np.diff(columns[name][0]) - 1
            costs = pack_costs(documents, lengths[np.argsort(pack, kind="stable")], token_cost)
            for world, batch in ((8, 1), (8, 2), (8, 4), (64, 1), (64, 4)):
                shuffled, balanced = epoch_imbalance(costs, world, batch, args.seed)
                print(
                    f"| {name} | {len(costs):,} | {token_cost:,.0f} | {world} | {batch} | {shuffled.max_over_mean:.3f} | "
                    f"{balanced.max_over_mean:.3f} | {shuffled.waiting_share:.1%} | {balanced.waiting_share:.1%} |"
                )

    dataset = Shards(columns["SFT-like"], args.packs)
    print(f"\nSampler over {args.packs:,} packs ({len(dataset.columns)} shards), rank 0:\n")
    print("| world size | batch size | balance | build (s) | first index (s) |")
    print("|---:|---:|---|---:|---:|")
    for world, batch in ((8, 2), (64, 4)):
        for balance in (None, "attention"):
            start = time.perf_counter()
            sampler = PackedSampler(dataset, rank=0, world_size=world, batch_size=batch, balance=balance, drop_last=True)
            built = time.perf_counter() - start
            start = time.perf_counter()
            next(iter(sampler))
            first = time.perf_counter() - start
            print(f"| {world} | {batch} | {balance} | {built:.2f} | {first:.2f} |")


if __name__ == "__main__":
    main()
