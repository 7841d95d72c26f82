"""Rollouts in memory: which micro-batch of which data-parallel rank every sequence of an RL step goes into.

An RL step (GRPO, PPO, RLOO) trains on sequences generated a moment ago, never written to disk. `plan_rollouts`
plans them from their lengths alone (numpy and numba: no file, no Arrow, no torch, and importing this module loads
neither pyarrow nor torch), and every rank given the same lengths computes the same plan without talking to the
others, so the old-policy, reference and new-policy forwards see identical micro-batches. Each micro-batch is one
pack: at most `max_len` tokens (a hard cap, never exceeded; a sequence longer is `SequenceTooLongError`) and at most
`max_documents` sequences; every rank gets the same number M of them (what FSDP and DDP with accumulation need),
none empty. `prepack.training.rollouts` collates them with `PackedCollator` and gives per-sequence results back in
the caller's order (`RolloutPlan.unpack`).

The plan has two stages, deterministic to the bit:

1. Micro-batches. M starts as the fewest the caps allow (all tokens over max_len, all sequences over
   max_documents, shared by R ranks), and the R·M micro-batches are filled longest-processing-time first under
   both caps: sequences by cost, heaviest first (ties by index), each into the micro-batch of least cost so far
   with room for it. If a sequence finds no room, M grows by one and the fill starts over (the R·M heaviest
   seed one micro-batch each), up to as many micro-batches as there are sequences.
2. Ranks. The R·M micro-batches are dealt as `PackedSampler(balance="attention")` deals one step of packs
   (`prepack.building.balance.balanced_order`, with batch size M): by cost, the heaviest R first, round after
   round, each round's heaviest to the rank lightest so far. Micro-batch m of every rank is then of similar
   cost (ranks that synchronise at every micro-batch wait little), and so is every rank's step.

The cost of a sequence of l tokens is `"tokens"`: l, or `"attention"`: l² + token_cost·l, the cost model of
`balance="attention"` (`prepack.building.balance`; `model_token_cost(config)` derives token_cost from a model
config). `group_sizes` keeps groups whole: consecutive sequences (a GRPO group's G completions of one prompt,
in the plain layout of G documents) go into one micro-batch, the group taking the sum of its costs.
`python benchmarks/bench_rollouts.py` measures the plan's time and its step-cost imbalance against verl's.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from prepack.building.balance import DEFAULT_TOKEN_COST, balanced_order, pack_costs, validated_token_cost
from prepack.building.kernels import kernel
from prepack.errors import SequenceTooLongError, UsageError

__all__ = ["Cost", "RolloutPlan", "plan_rollouts"]

Cost = Literal["tokens", "attention"]
_COSTS = ("tokens", "attention")


@dataclass(frozen=True)
class RolloutPlan:
    """Where every sequence goes. Micro-batch m of rank r is number k = r·M + m; it holds the sequences
    `sequences[offsets[k]:offsets[k + 1]]` (the caller's indices, ascending), collated in that order."""

    world_size: int  # R
    micro_batches: int  # M, the same on every rank
    max_len: int  # tokens a micro-batch holds at most
    max_documents: int | None  # sequences a micro-batch holds at most, when capped
    sequences: np.ndarray  # int64 [N]: caller indices, micro-batch after micro-batch, rank after rank
    offsets: np.ndarray  # int64 [R·M + 1]
    tokens: np.ndarray  # int64 [R, M]: each micro-batch's tokens
    costs: np.ndarray  # float64 [R, M]: each micro-batch's cost, in the plan's cost model

    def micro_batch(self, rank: int, number: int) -> np.ndarray:
        """The caller's indices of the sequences of micro-batch `number` of `rank`, in collated order."""
        k = self._number(rank, number)
        return self.sequences[self.offsets[k] : self.offsets[k + 1]]

    def rank_sequences(self, rank: int) -> np.ndarray:
        """The caller's indices of `rank`'s sequences, micro-batch after micro-batch."""
        first = self._number(rank, 0)
        return self.sequences[self.offsets[first] : self.offsets[first + self.micro_batches]]

    def restoring_index(self, rank: int | None = None, results: Sequence[object] | None = None) -> np.ndarray:
        """int64 positions that put per-sequence results back in the caller's order: with `values` the results
        of every micro-batch concatenated in plan order (all ranks' for `rank=None`, else `rank`'s own),
        `values[index]` is in the caller's order (for one rank: its sequences by ascending index). Given the
        `results` (one per micro-batch, a row per sequence), refuses them unless they are that many and rows."""
        held = self.sequences if rank is None else self.rank_sequences(rank)
        if results is not None:
            expected = self.world_size * self.micro_batches if rank is None else self.micro_batches
            rows = sum(len(result) for result in results)  # type: ignore[arg-type]
            if len(results) != expected or rows != len(held):
                raise UsageError(f"unpacking takes {expected} micro-batches' results with {len(held)} rows in all, got "
                                 f"{len(results)} with {rows}")
        return np.argsort(held, kind="stable")

    def unpack(self, values: Sequence[np.ndarray], rank: int | None = None) -> np.ndarray:
        """Per-sequence results (log-probabilities, values...) of the micro-batches, one array a micro-batch with
        a row per sequence in collated order, back in the caller's order: all R·M micro-batches for
        `rank=None`, else `rank`'s M, giving its sequences by ascending index (`np.sort(rank_sequences(rank))`).
        `prepack.training.rollouts.unpack_sequences` does the same for tensors."""
        return np.concatenate(values)[self.restoring_index(rank, values)]

    def _number(self, rank: int, number: int) -> int:
        if not (0 <= rank < self.world_size and 0 <= number < self.micro_batches):
            raise UsageError(f"no micro-batch {number} of rank {rank}: {self.world_size} ranks of {self.micro_batches}")
        return rank * self.micro_batches + number


def plan_rollouts(
    lengths: Sequence[int] | np.ndarray,
    max_len: int,
    *,
    world_size: int = 1,
    max_documents: int | None = None,
    cost: Cost = "tokens",
    token_cost: float = DEFAULT_TOKEN_COST,
    group_sizes: Sequence[int] | np.ndarray | None = None,
) -> RolloutPlan:
    """The `RolloutPlan` of sequences of `lengths` tokens (module docstring): micro-batches of at most `max_len`
    tokens and `max_documents` sequences, as many on each of `world_size` ranks, balanced by `cost`
    (`token_cost` for "attention"); `group_sizes` (summing to the sequences) keeps consecutive groups whole.

    A sequence (or group) over `max_len` tokens raises SequenceTooLongError; a group of more than
    `max_documents` sequences, an empty sequence, or fewer sequences (groups) than micro-batches, UsageError.
    """
    lengths = _lengths(lengths)
    max_len = _positive(max_len, "max_len")
    world_size = _positive(world_size, "world_size")
    max_documents = None if max_documents is None else _positive(max_documents, "max_documents")
    if cost not in _COSTS:
        raise UsageError(f"cost must be one of {_COSTS}, not {cost!r}")
    token_cost = validated_token_cost(token_cost)
    sizes = _group_sizes(group_sizes, len(lengths))
    item_starts = np.concatenate(([0], np.cumsum(sizes)))
    item_tokens = np.add.reduceat(lengths, item_starts[:-1])
    _refuse_over_caps(lengths, item_tokens, item_starts, sizes, max_len, max_documents, group_sizes is not None)
    items = len(sizes)
    if items < world_size:
        raise UsageError(f"{items} {'groups' if group_sizes is not None else 'sequences'} cannot give each of "
                         f"{world_size} ranks a micro-batch")
    item_costs = item_tokens.astype(np.float64) if cost == "tokens" else pack_costs(sizes, lengths, token_cost)
    # Heaviest first, ties by index. A cost that grows with the tokens sorts as they do, by a radix sort.
    order = _heaviest_first(item_costs if cost == "attention" and group_sizes is not None else item_tokens)
    cap = max_documents if max_documents is not None else len(lengths)
    # As many micro-batches as the caps need at least; while some item finds no room, R more, filled afresh.
    least = -(-max(-(-int(item_tokens.sum()) // max_len), -(-len(lengths) // cap)) // world_size) * world_size
    bins = least
    while bins <= items:
        bin_of_sorted = _fill(item_tokens[order], sizes[order], item_costs[order], bins, max_len, cap)
        if bin_of_sorted[-1] >= 0:
            break
        bins += world_size
    else:
        what = f"{items} {'groups' if group_sizes is not None else 'sequences'} of {int(lengths.sum())} tokens"
        caps = f"max_len={max_len}{'' if max_documents is None else f' and max_documents={max_documents}'}"
        if least > items:
            raise UsageError(f"{what} need at least {least // world_size} micro-batches on each of {world_size} "
                             f"ranks under {caps}, more than they can fill (no micro-batch may be empty)")
        tried = " to ".join(dict.fromkeys(str(count // world_size) for count in (least, items)))
        raise UsageError(f"{what} found no plan of {tried} micro-batches on "
                         f"each of {world_size} ranks under {caps} (filled heaviest first, each into the least "
                         "costly with room), and more would leave one empty")
    micro_batches = bins // world_size
    bin_of_item = np.empty(items, np.int64)
    bin_of_item[order] = bin_of_sorted
    bin_costs = np.bincount(bin_of_item, weights=item_costs, minlength=bins)
    bin_tokens = np.bincount(bin_of_item, weights=item_tokens, minlength=bins).astype(np.int64)
    # Position m·R + r of the deal is micro-batch m of rank r, whose number in the plan is r·M + m.
    dealt = balanced_order(np.arange(bins), bin_costs, world_size, micro_batches, [0])
    positions = np.arange(bins)
    number_of_bin = np.empty(bins, np.int64)
    number_of_bin[dealt] = (positions % world_size) * micro_batches + positions // world_size
    bin_of_number = np.empty(bins, np.int64)
    bin_of_number[number_of_bin] = positions
    sequences, offsets = _by_micro_batch(number_of_bin[bin_of_item], sizes, bins)
    return RolloutPlan(
        world_size=world_size,
        micro_batches=micro_batches,
        max_len=max_len,
        max_documents=max_documents,
        sequences=sequences,
        offsets=offsets,
        tokens=bin_tokens[bin_of_number].reshape(world_size, micro_batches),
        costs=bin_costs[bin_of_number].reshape(world_size, micro_batches),
    )


def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not (np.issubdtype(lengths.dtype, np.integer) or len(lengths) == 0):
        raise UsageError(f"lengths must be a 1-D sequence of integers, not {lengths.ndim}-D {lengths.dtype}")
    lengths = lengths.astype(np.int64)
    if len(lengths) == 0:
        raise UsageError("plan_rollouts needs at least one sequence")
    if lengths.min() < 1:
        raise UsageError(f"sequence {int(np.argmin(lengths))} has {int(lengths.min())} tokens: every sequence needs one")
    return lengths


def _positive(value: int, name: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise UsageError(f"{name} must be an int, not {value!r}") from None
    if not 1 <= value < 2**31:
        raise UsageError(f"{name} must be in [1, 2**31), got {value}")
    return value


def _group_sizes(group_sizes: Sequence[int] | np.ndarray | None, sequences: int) -> np.ndarray:
    if group_sizes is None:
        return np.ones(sequences, np.int64)
    sizes = np.asarray(group_sizes)
    if sizes.ndim != 1 or len(sizes) == 0 or not np.issubdtype(sizes.dtype, np.integer) or sizes.min() < 1:
        raise UsageError("group_sizes must be a 1-D sequence of positive integers")
    if int(sizes.sum()) != sequences:
        raise UsageError(f"group_sizes sum to {int(sizes.sum())}, not to the {sequences} sequences")
    return sizes.astype(np.int64)


def _refuse_over_caps(lengths, item_tokens, item_starts, sizes, max_len, max_documents, grouped) -> None:
    if lengths.max() > max_len:
        at = int(np.argmax(lengths))
        raise SequenceTooLongError(f"sequence {at} has {int(lengths[at])} tokens, more than a micro-batch's "
                                   f"max_len={max_len}")
    if grouped and item_tokens.max() > max_len:
        group = int(np.argmax(item_tokens))
        raise SequenceTooLongError(
            f"group {group} (sequences {int(item_starts[group])}..{int(item_starts[group + 1]) - 1}) has "
            f"{int(item_tokens[group])} tokens, more than a micro-batch's max_len={max_len}, and is kept whole"
        )
    if grouped and max_documents is not None and sizes.max() > max_documents:
        group = int(np.argmax(sizes))
        raise UsageError(f"group {group} has {int(sizes[group])} sequences, more than max_documents={max_documents}, "
                         "and is kept whole")


def _heaviest_first(keys: np.ndarray) -> np.ndarray:
    """Indices of `keys` by decreasing key, equal keys by index (integer keys below 2**16 by a radix sort)."""
    if keys.dtype.kind == "f" or keys.max() >= 2**16:
        return np.argsort(-keys, kind="stable")
    return np.argsort((keys.max() - keys).astype(np.uint16), kind="stable")


@kernel(cache=True)
def _by_micro_batch(number_of_item, sizes, bins):
    """(sequences, offsets) of `RolloutPlan`: each item's sequences (consecutive, `sizes[i]` from the end of the
    previous item's) under its micro-batch number, in index order within one."""
    offsets = np.zeros(bins + 1, np.int64)
    for item in range(len(sizes)):
        offsets[number_of_item[item] + 1] += sizes[item]
    for number in range(bins):
        offsets[number + 1] += offsets[number]
    fill = offsets[:-1].copy()
    sequences = np.empty(offsets[-1], np.int64)
    first = 0
    for item in range(len(sizes)):
        at = fill[number_of_item[item]]
        for j in range(sizes[item]):
            sequences[at + j] = first + j
        fill[number_of_item[item]] = at + sizes[item]
        first += sizes[item]
    return sequences, offsets


@kernel(cache=True)
def _fill(tokens, sizes, costs, bins, max_len, cap):
    """The bin of every item: the items (given heaviest first, at least `bins` of them) filled
    longest-processing-time first under both caps into `bins` bins, the first `bins` items one in each (an empty
    bin costs least); from the first item that finds no bin with room, the rest keep bin -1.

    Three trees over the bins (leaves size..size+bins-1; a leaf not open never fits): the most tokens and
    documents any bin below a node has room for, and its least cost. The bin of least cost with room is found
    by a depth-first search that skips a node without room or whose least cost is no better than the best
    bin found, the cheaper child first (the left one on a tie)."""
    size = 1
    while size < len(tokens):
        size *= 2
    room = np.full(2 * size, -1, np.int64)
    documents = np.full(2 * size, -1, np.int64)
    least = np.full(2 * size, np.inf)
    room[size : size + bins] = max_len
    documents[size : size + bins] = cap
    least[size : size + bins] = 0.0
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
        documents[node] = max(documents[2 * node], documents[2 * node + 1])
        least[node] = min(least[2 * node], least[2 * node + 1])
    out = np.full(len(tokens), -1, np.int64)
    stack = np.empty(2 * 64, np.int64)  # a depth-first search holds at most two nodes a level
    for item in range(len(tokens)):
        need, held = tokens[item], sizes[item]
        best, best_cost = -1, np.inf
        stack[0], depth = 1, 1
        while depth > 0:
            depth -= 1
            node = stack[depth]
            if room[node] < need or documents[node] < held or least[node] >= best_cost:
                continue
            if node >= size:
                best, best_cost = node, least[node]
                continue
            left, right = 2 * node, 2 * node + 1
            if least[right] < least[left]:  # the cheaper child is searched first: pushed last
                left, right = right, left
            stack[depth], stack[depth + 1] = right, left
            depth += 2
        if best < 0:  # no bin has room: the caller tries more bins
            return out
        out[item] = best - size
        room[best] -= need
        documents[best] -= held
        least[best] += costs[item]
        _update_above(room, documents, least, best)
    return out


@kernel(cache=True)
def _update_above(room, documents, least, leaf):
    node = leaf // 2
    while node >= 1:
        room[node] = max(room[2 * node], room[2 * node + 1])
        documents[node] = max(documents[2 * node], documents[2 * node + 1])
        least[node] = min(least[2 * node], least[2 * node + 1])
        node //= 2
