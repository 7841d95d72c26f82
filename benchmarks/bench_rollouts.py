"""Planning an RL step's rollouts in memory: `prepack.building.rollouts.plan_rollouts` against verl's
Karmarkar-Karp balancing and a plain first-fit, at the same micro-batch token cap.

    python benchmarks/bench_rollouts.py

Rollout lengths (prompt + response, at most 32,768 tokens) of one optimizer step, N ∈ {4,096, 65,536}, two shapes:
uniform in [1, 32,768], and long-tailed (lognormal, median 2,000, p99 ≈ 20,000, clipped at 32,768, as responses cut
at a maximum length are). R = 8 data-parallel ranks, micro-batches of at most 65,536 tokens (`--cap`). Every method's
step cost is measured in one cost model: verl's `calculate_workload`, 24,576·l + l² a sequence (prepack's
`balance="attention"` model with token_cost 24,576), which prepack plans with too.

- prepack: `plan_rollouts(lengths, cap, world_size=R, cost="attention", token_cost=24576)`.
- verl: what its PPO trainer and actor do with `balance_batch` and `use_dynamic_bsz` (verl/trainer/ppo/ray_trainer.py
  `_balance_batch`; verl/utils/seqlen_balancing.py `rearrange_micro_batches`, at commit
  b178a3cd56f58b2d502255daba591e92833930a7 of github.com/volcengine/verl): Karmarkar-Karp (largest differencing)
  partitions the step's workloads into R equal-count parts; each rank takes min(its sequences, ⌈its tokens / cap⌉)
  micro-batches, the most of any rank (`same_micro_num_in_dp`), and partitions its workloads into that many by
  Karmarkar-Karp again (`equal_size=False`), heaviest in the middle. `karmarkar_karp` below is that algorithm,
  re-implemented on arrays (verl's keeps a Python object per set: at N = 65,536 that is 8,192 states of about
  2,000 sets on each rank); ties of equal sums and counts fall to creation order where verl compares item lists.
  Nothing in it enforces the cap: "over the cap" counts its micro-batches above it.
- first-fit: each sequence in arrival order into the first micro-batch with room, micro-batch i to rank i mod R.

Columns: plan time (CPU of one thread, median of repeats; prepack's only: verl's is Python of another shape);
micro-batches per rank (the most of any rank); micro-batches over the cap (and their share of all); step: slowest rank's step cost / mean
rank's (ranks that meet once a step, DDP with accumulation); micro-batch: the same for micro-batch m of every rank,
the mean over m (ranks that meet at every micro-batch, FSDP), and the share of step time lost waiting then.
These are cost-model figures, not measured step times. Prints markdown.
"""

from __future__ import annotations

import argparse
import heapq
import math
import platform
import time

import numba
import numpy as np

from prepack.building.balance import imbalance
from prepack.building.rollouts import plan_rollouts

TOKEN_COST = 24_576  # verl's calculate_workload: 24576 * seqlen + seqlen**2
LONGEST = 32_768
Z99 = 2.3263  # standard normal 99th percentile


def rollout_lengths(shape: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if shape == "uniform":
        return rng.integers(1, LONGEST + 1, n)
    raw = rng.lognormal(math.log(2_000), math.log(20_000 / 2_000) / Z99, n)
    return np.clip(raw, 1, LONGEST).astype(np.int64)


def workloads(lengths: np.ndarray) -> np.ndarray:
    return TOKEN_COST * lengths.astype(np.float64) + lengths.astype(np.float64) ** 2


def karmarkar_karp(values: np.ndarray, k: int, equal_size: bool) -> list[np.ndarray]:
    """verl's `karmarkar_karp(seqlen_list, k_partitions, equal_size)`: the indices of each of k parts.

    States start from the values in ascending (value, index) order: k at a time, one to each set (equal_size), or
    one each. The state of largest spread (then of largest first set) merges with the next: the i-th largest set
    of one with the i-th smallest of the other, sets re-sorted by (sum, count) descending. A set is an array slot
    holding its sum, its count and one item standing for it; merged items are linked so the parts are found at the end."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    parent = np.arange(len(values))
    heap, created = [], 0

    def push(sums, counts, items):
        nonlocal created
        rank = np.lexsort((-counts, -sums))  # descending sum, then count
        sums, counts, items = sums[rank], counts[rank], items[rank]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], -counts[0], created, sums, counts, items))
        created += 1

    groups = [order[i : i + k] for i in range(0, len(order), k)] if equal_size else [[i] for i in order]
    for group in groups:
        sums, counts, items = np.zeros(k), np.zeros(k, np.int64), np.full(k, -1)
        sums[: len(group)], counts[: len(group)], items[: len(group)] = values[group], 1, group
        push(sums, counts, items)
    while len(heap) > 1:
        *_, sums0, counts0, items0 = heapq.heappop(heap)
        *_, sums1, counts1, items1 = heapq.heappop(heap)
        sums1, counts1, items1 = sums1[::-1], counts1[::-1], items1[::-1]
        both = (items0 >= 0) & (items1 >= 0)
        parent[items1[both]] = items0[both]
        push(sums0 + sums1, counts0 + counts1, np.where(items0 >= 0, items0, items1))
    *_, items = heap[0]
    roots = np.arange(len(values))
    while not np.array_equal(parent[roots], roots):
        roots = parent[roots]
    return [np.flatnonzero(roots == item) for item in items if item >= 0]


def verl_plan(lengths: np.ndarray, world_size: int, cap: int) -> list[list[np.ndarray]]:
    """Each rank's micro-batches as verl forms them (module docstring)."""
    work = workloads(lengths).round().astype(np.int64).astype(np.float64)  # verl's workloads are integers
    ranks = [np.sort(part) for part in karmarkar_karp(work, world_size, equal_size=True)]
    micro = max(min(len(part), -(-int(lengths[part].sum()) // cap)) for part in ranks)
    plan = []
    for part in ranks:
        parts = [part[np.sort(p)] for p in karmarkar_karp(work[part], micro, equal_size=False)]
        parts.sort(key=lambda p: (work[p].sum(), p[0]), reverse=True)
        plan.append(parts[::2][::-1] + parts[1::2])  # use_dynamic_bsz_balance: the lightest at both ends
    return plan


@numba.njit(cache=True)
def _first_fit(lengths, cap):
    size = 1
    while size < len(lengths):
        size *= 2
    room = np.full(2 * size, cap, np.int64)  # max room below each node; a leaf is a micro-batch
    out = np.empty(len(lengths), np.int64)
    for i in range(len(lengths)):
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= lengths[i] else 2 * node + 1
        out[i] = node - size
        room[node] -= lengths[i]
        node //= 2
        while node >= 1:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return out


def first_fit_plan(lengths: np.ndarray, world_size: int, cap: int) -> list[list[np.ndarray]]:
    bins = _first_fit(lengths, cap)
    members = [np.flatnonzero(bins == b) for b in range(bins.max() + 1)]
    return [members[rank::world_size] for rank in range(world_size)]


def prepack_plan(lengths: np.ndarray, world_size: int, cap: int) -> list[list[np.ndarray]]:
    plan = plan_rollouts(lengths, cap, world_size=world_size, cost="attention", token_cost=TOKEN_COST)
    return [[plan.micro_batch(r, m) for m in range(plan.micro_batches)] for r in range(world_size)]


def cpu_ms(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        function()
        times.append(time.thread_time() - start)
    return 1e3 * float(np.median(times))


def measured(plan: list[list[np.ndarray]], lengths: np.ndarray, cap: int) -> dict[str, float]:
    work = workloads(lengths)
    micro = max(len(rank) for rank in plan)
    costs = np.zeros((len(plan), micro))  # a rank with fewer micro-batches waits for the others' last
    over = 0
    for r, rank in enumerate(plan):
        for m, part in enumerate(rank):
            costs[r, m] = work[part].sum()
            over += int(lengths[part].sum() > cap)
    assert sorted(np.concatenate([p for rank in plan for p in rank]).tolist()) == list(range(len(lengths)))
    step = imbalance(costs.sum(axis=1)[None])
    per_micro = imbalance(costs.T)
    return {"micro": micro, "over": over, "over_share": over / sum(len(rank) for rank in plan), "step": step.max_over_mean, "micro_ratio": per_micro.max_over_mean,
            "waiting": per_micro.waiting_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--cap", type=int, default=65_536)
    args = parser.parse_args()
    print(f"<!-- {platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__} -->")
    print("| lengths | sequences | method | plan time (ms) | micro-batches per rank | over the cap | step: slowest/mean "
          "| micro-batch: slowest/mean | time lost waiting (per micro-batch) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for shape in ("uniform", "long-tailed"):
        for n in args.sequences:
            lengths = rollout_lengths(shape, n, seed=n)
            bound = -(-int(lengths.sum()) // args.cap)
            prepack_plan(lengths[:64], args.world_size, args.cap)  # numba's kernels loaded, as in a running job
            timed = cpu_ms(lambda: plan_rollouts(lengths, args.cap, world_size=args.world_size, cost="attention",
                                                 token_cost=TOKEN_COST), 21 if n <= 4096 else 5)
            for name, plan in (("prepack", prepack_plan), ("verl (Karmarkar-Karp)", verl_plan), ("first-fit", first_fit_plan)):
                row = measured(plan(lengths, args.world_size, args.cap), lengths, args.cap)
                time_cell = f"{timed:.2f}" if name == "prepack" else "—"
                print(f"| {shape} | {n:,} | {name} | {time_cell} | {row['micro']} (bound {-(-bound // args.world_size)}) "
                      f"| {row['over']} ({100 * row['over_share']:.1f} %) | {row['step']:.4f} | {row['micro_ratio']:.4f} | {100 * row['waiting']:.2f}% |",
                      flush=True)


if __name__ == "__main__":
    main()
