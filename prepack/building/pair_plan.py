"""Plan a preference-pair build: pairs are the units packed, never split. A group of G completions of one
prompt is planned the same way, G documents a unit (`size`); a pair is the group of 2.

Pair r is documents 2r (prompt + chosen) and 2r + 1 (prompt + rejected), back to back in the token
store. The planner (`prepack.building.plan.plan_packs`, first- or best-fit-decreasing) packs each pair as one
item of its two documents' lengths together, so both land in the same pack, next to each other, in
every shard, micro-batch, rank and resume. A pair longer than `max_len` follows `overflow`:

- "error": refused (the caller names its file and row, `first_overlong_pair`);
- "drop": left out, both documents counted as dropped;
- "truncate": each document keeps its prompt and the first tokens of its completion, the completions
  cut as evenly as the room left allows (the shorter kept whole when it fits in half); a pair whose
  prompt leaves no room for one completion token each is refused (`overlong_prompts`), as no
  truncation of completions can fit it.

`PairPlan` answers what the engines ask of a `PackingPlan` (`packs`, `max_len`, `pack_sizes`, `slice`,
`totals`), in documents: its `slice` gives each pair as its two documents, with their `pair_roles`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prepack.building.plan import DocumentPieces, PackingPlan, ShardPacks, plan_packs

__all__ = ["PairPlan", "first_overlong_pair", "kept_lengths", "overlong_prompts", "pair_pieces", "plan_pairs"]


def _group_lengths(lengths: np.ndarray, size: int) -> np.ndarray:
    """[units, size]: each unit's documents' lengths."""
    lengths = np.asarray(lengths, np.int64)
    if size < 2 or len(lengths) % size:
        raise ValueError(f"a build of groups of {size} has {size} documents a group, not {len(lengths)} documents")
    return lengths.reshape(-1, size)


def first_overlong_pair(lengths: np.ndarray, max_len: int, size: int = 2) -> int | None:
    """The first pair (or group of `size` documents) whose documents together are longer than `max_len`, or None."""
    over = np.flatnonzero(_group_lengths(lengths, size).sum(1) > max_len)
    return int(over[0]) if len(over) else None


def overlong_prompts(lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int, size: int = 2) -> np.ndarray:
    """The pairs (groups) too long for `max_len` whose prompt, once a document, leaves less than one
    completion token each."""
    over = _group_lengths(lengths, size).sum(1) > max_len
    return np.flatnonzero(over & (size * np.asarray(prompt_lengths, np.int64) + size > max_len))


def kept_lengths(lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int, size: int = 2) -> tuple[np.ndarray, ...]:
    """Tokens each document of each pair (group of `size`) keeps under "truncate", one array a member (a pair:
    chosen, rejected): all of a unit that fits; else its prompt and completions cut to share the room left,
    `max_len` - size x prompt, by water-filling: the shortest completions kept whole while the others can have
    as many tokens, the rest cut to one level, the tokens the level leaves over going one each to the first
    members cut. A pair's shorter completion is so kept whole when it takes at most half of the room;
    otherwise each gets half, the chosen one the odd token. Units refused by `overlong_prompts` keep
    everything (the caller refuses them)."""
    full = _group_lengths(lengths, size)
    prompt = np.asarray(prompt_lengths, np.int64)
    room = max_len - size * prompt
    completions = full - prompt[:, None]
    ordered = np.sort(completions, axis=1)
    before = np.cumsum(ordered, axis=1) - ordered  # the completions shorter than each, kept whole
    # A sorted completion is kept whole when the level at its length fits the room; `whole` of them are.
    whole = ((before + (size - np.arange(size)) * ordered) <= room[:, None]).sum(1)
    kept_sum = np.take_along_axis(np.append(before, ordered.sum(1, keepdims=True), 1), whole[:, None], 1)[:, 0]
    level = (room - kept_sum) // np.maximum(size - whole, 1)
    kept = np.minimum(completions, level[:, None])
    cut = completions > level[:, None]
    spare = room - kept.sum(1)
    kept += cut & (np.cumsum(cut, axis=1) <= spare[:, None])
    truncate = (full.sum(1) > max_len) & (room >= size)
    result = np.where(truncate[:, None], prompt[:, None] + kept, full)
    return tuple(result[:, member] for member in range(size))


@dataclass(frozen=True)
class PairPlan:
    """A `PackingPlan` of pairs, seen as documents: pair u is documents 2u, 2u + 1 of `kept` tokens each,
    starting at `starts` in the token store."""

    units: PackingPlan  # the plan of pairs (one item of kept chosen + kept rejected tokens each)
    starts: np.ndarray  # int64 [documents]: each document's first token in the token store
    kept: np.ndarray  # int64 [documents]: tokens each document keeps in its pack
    counts: dict[str, int]  # Totals' overflow and untrained fields, in documents
    pair_counts: dict[str, int]  # `PairTotals`' fields
    size: int = 2  # documents a unit: 2 a pair, G a group
    scores: np.ndarray | None = None  # float64 [documents]: a group build's scores, written as `group_scores`
    ranks: np.ndarray | None = None  # uint8 [documents]: a group build's ranks, written as `group_ranks`
    desirable: np.ndarray | None = None  # bool [units]: an unpaired build's labels, one an example

    @property
    def packs(self) -> int:
        return self.units.packs

    @property
    def max_len(self) -> int:
        return self.units.max_len

    def pack_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        pairs, tokens = self.units.pack_sizes()
        return self.size * pairs, tokens

    def slice(self, first: int, end: int) -> ShardPacks:
        """Written packs first..end-1, each pair as its chosen document and then its rejected one (each group
        as its documents in order, roles 0 … G - 1)."""
        units = self.units.slice(first, end)
        documents = (self.size * units.rows[:, None] + np.arange(self.size)).reshape(-1)
        roles = np.tile(np.arange(self.size, dtype=np.uint8), len(units.rows))
        return ShardPacks(
            max_len=units.max_len,
            pack_offsets=self.size * units.pack_offsets,
            starts=self.starts[documents],
            lengths=self.kept[documents],
            rows=documents,
            pieces=np.zeros(len(documents), np.int32),
            pair_roles=roles,
            group_scores=None if self.scores is None else self.scores[documents],
            group_ranks=None if self.ranks is None else self.ranks[documents],
            desirable=None if self.desirable is None else self.desirable[units.rows],
        )

    def totals(self) -> dict[str, int]:
        unit_totals = self.units.totals()
        return {
            **self.counts,
            "tokens": unit_totals["tokens"],
            "segments": self.size * unit_totals["segments"],
            "packs": unit_totals["packs"],
            "padding_tokens": unit_totals["padding_tokens"],
            "lower_bound": unit_totals["lower_bound"],
        }


def _overflowed(
    lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int, overflow: str, untrained: np.ndarray | None, size: int
) -> tuple[np.ndarray, np.ndarray, dict[str, int], dict[str, int]]:
    """What `overflow` makes of the pairs (groups of `size`): tokens each document keeps (int64, one a document),
    which units are dropped (bool, one a unit), Totals' overflow and untrained counts (in documents) and
    PairTotals'."""
    if overflow not in ("truncate", "drop", "error"):
        raise ValueError(f"pairs are never split: overflow must be truncate, drop or error, not {overflow!r}")
    lengths = np.asarray(lengths, np.int64)
    full = _group_lengths(lengths, size)
    prompt_lengths = np.asarray(prompt_lengths, np.int64)
    if len(prompt_lengths) != len(full):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(full)} units")
    if overflow == "truncate":
        kept = np.stack(kept_lengths(lengths, prompt_lengths, max_len, size), 1)
    else:
        kept = full
    # Still longer than max_len: every such unit under "drop" (and "error", refused by the caller), none
    # under "truncate" once the caller refused `overlong_prompts`.
    dropped = kept.sum(1) > max_len
    cut = ~dropped[:, None] & (kept < full)
    flags = np.zeros(len(lengths), bool) if untrained is None else np.asarray(untrained, bool)
    counts = {
        "input_tokens": int(lengths.sum()),
        "empty": 0,
        "split": 0,
        "split_pieces": 0,
        "truncated": int(cut.sum()),
        "truncated_tokens": int((full - kept)[~dropped].sum()),
        "dropped": size * int(dropped.sum()),
        "dropped_tokens": int(full[dropped].sum()),
        "untrained": int(flags.sum()),
        "untrained_tokens": int(lengths[flags].sum()),
    }
    prompt_tokens = int(size * prompt_lengths[~dropped].sum())
    pair_counts = {
        "pairs": len(full),
        "truncated": int(cut.any(1).sum()),
        "dropped": int(dropped.sum()),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": int(kept[~dropped].sum()) - prompt_tokens,
    }
    return kept.reshape(-1), dropped, counts, pair_counts


def pair_pieces(
    lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int, overflow: str, untrained: np.ndarray | None = None,
    size: int = 2,
) -> tuple[DocumentPieces, dict[str, int]]:
    """The segments that pairs' (groups') documents become (`prepack.building.plan.document_pieces` for a pair
    build, which `verify` holds it to): each kept document one piece of its first `kept_lengths` tokens; and
    `PairTotals`' fields."""
    lengths = np.asarray(lengths, np.int64)
    kept, dropped, counts, pair_counts = _overflowed(lengths, prompt_lengths, max_len, overflow, untrained, size)
    rows = np.flatnonzero(~np.repeat(dropped, size))
    starts = np.cumsum(lengths) - lengths
    return DocumentPieces(rows, np.zeros(len(rows), np.int64), starts[rows], kept[rows], counts), pair_counts


def plan_pairs(
    lengths: np.ndarray,
    prompt_lengths: np.ndarray,
    max_len: int,
    *,
    algorithm: str = "ffd",
    overflow: str = "truncate",
    seed: int = 0,
    untrained: np.ndarray | None = None,
    max_pairs: int | None = None,
    size: int = 2,
    desirable: np.ndarray | None = None,
    scores: np.ndarray | None = None,
    ranks: np.ndarray | None = None,
) -> PairPlan:
    """Plan the pairs of documents `lengths` (`size` a unit: two a pair, G a group) with their `prompt_lengths`
    (one a unit): each unit one item for `plan_packs`, after `overflow` ("truncate", "drop"; "error" is the
    caller's, as is refusing `overlong_prompts` under "truncate"), at most `max_pairs` units a pack when given.
    `untrained` (one flag a document) is counted only. `desirable` (an unpaired build's labels, one an example
    of 2 documents) goes with each example into its pack, and `PairTotals`' desirable and undesirable count the
    packed ones. `scores` and `ranks` (a group build's, one a document) go with their documents likewise."""
    lengths = np.asarray(lengths, np.int64)
    kept, dropped, counts, pair_counts = _overflowed(lengths, prompt_lengths, max_len, overflow, untrained, size)
    if desirable is not None:
        desirable = np.asarray(desirable, bool)
        pair_counts |= {"desirable": int(desirable[~dropped].sum()), "undesirable": int((~desirable[~dropped]).sum())}
    # The planner drops what is still longer than max_len, as `_overflowed` counted.
    units = plan_packs(
        kept.reshape(-1, size).sum(1), max_len, algorithm=algorithm, overflow="drop", seed=seed, max_documents=max_pairs
    )
    starts = np.cumsum(lengths) - lengths
    return PairPlan(units=units, starts=starts, kept=kept, counts=counts, pair_counts=pair_counts, size=size, desirable=desirable,
                    scores=scores, ranks=ranks)
